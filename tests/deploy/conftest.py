"""The gateway fixtures of tests/server, for the dashboard's existence test."""

from tests.server.conftest import http, make_cluster, make_gateway  # noqa: F401  (fixtures reused here)
