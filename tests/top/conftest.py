"""Fixtures for `rolloutgate top` tests: in-process gateways over simulated engines (tests/server) and
`rolloutgate` subprocesses (tests/reliability), reused as they are."""

from __future__ import annotations

from tests.reliability.conftest import procs  # noqa: F401  (fixtures reused here)
from tests.server.conftest import http, make_cluster, make_gateway  # noqa: F401  (fixtures reused here)
