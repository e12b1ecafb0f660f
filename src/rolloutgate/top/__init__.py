"""`rolloutgate top`: a live terminal view of a gateway or a fleet, read from its own endpoints.

fetch.py reads `/admin/state` and `/metrics` over HTTP into snapshots; view.py turns two successive snapshots
into rows and rates (sans-IO); render.py draws them with rich; cli.py runs the loop.
"""
