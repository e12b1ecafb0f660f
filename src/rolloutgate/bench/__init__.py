"""Benchmarks, by purpose: `perf/` (the gateway's performance: `rolloutgate bench`, `make bench`, `make
bench-rl`, `make sim-bench`), `replay/` (the incident replayed side by side: `rolloutgate replay`, `make demo`),
`prefill/` (prefill-aware admission off and on: `make prefill-compare`, `make prefill-exact`), and
`error_framing.py` (which error body real clients read after keep-alive, docs/clients.md).

They use the gateway as `rolloutgate serve` runs it, through its public interfaces only (server/app.py
`GatewayServer` and `core_config`, the driver's observers); the tools they drive (wrk, the SGLang Model Gateway)
are installed by `make bench-tools` (mk/bench.mk), never by the package.
"""
