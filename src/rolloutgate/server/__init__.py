"""The gateway's HTTP edge: the front server, the driver between it and the core, the engine pool, admin."""
