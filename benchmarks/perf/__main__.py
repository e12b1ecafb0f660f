"""`python -m benchmarks.perf`: the gateway's performance benchmark (cli.py; `make bench`, `make bench-rl`)."""

from benchmarks.perf.cli import main

raise SystemExit(main())
