"""The benchmarks: beside the package, never in it (the wheel holds src/rolloutgate only, and nothing there
imports this folder). Run them from the repository's root, with the `bench` extra installed
(`pip install -e '.[bench]'`; `make bench` does it):

- `perf/`: the gateway's performance (`python -m benchmarks.perf`: `make bench`, `make bench-rl`;
  `python -m benchmarks.perf.sim_throughput`: `make sim-bench`; docs/benchmarks.md);
- `prefill/`: prefill-aware admission off and on (`make prefill-compare`, `make prefill-exact`; docs/prefill.md);
- `grpo/`: group placement and cache-warm placement in virtual time (docs/rl.md);
- `replay/round_trip.py`: the incident recorded and replayed from its trace (docs/replay.md);
- `fleet/`: what the fleet's hop, its replication and its growth cost (`make fleet-*`; docs/fleet.md);
- `error_framing.py`: which error body real clients read after keep-alive (docs/clients.md);
- `kit/`: what they share (one percentile, the /proc probes, Prometheus text, the processes they start, the
  virtual-time world).

They use the gateway as `rolloutgate serve` runs it, through its public interfaces (server/app.py
`GatewayServer` and `core_config`, the driver's observers, the core's events and commands); the incident replay
they build on is the product's own (`rolloutgate replay`, src/rolloutreplay/). The tools they drive (wrk,
the SGLang Model Gateway) are installed by `make bench-tools` (mk/bench.mk), never by the package.
"""
