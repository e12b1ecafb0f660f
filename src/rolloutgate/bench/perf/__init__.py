"""The gateway's performance benchmarks: `rolloutgate bench` (cli.py, docs/benchmarks.md)."""
