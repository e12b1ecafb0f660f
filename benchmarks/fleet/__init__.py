"""What the fleet costs: the one hop, a session record's replication, the fleet as it grows (docs/fleet.md; Ray)."""
