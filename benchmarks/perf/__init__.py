"""The gateway's performance benchmarks: `python -m benchmarks.perf` (cli.py, docs/benchmarks.md)."""
