"""What every benchmark shares: `stats` (the one percentile), `proc` (the /proc probes), `prometheus` (counters
read through prometheus_client's parser), `servers` (the processes a benchmark starts and stops by pid) and
`world` (the gateway's core and the simulator's engine model in one process, virtual time)."""
