"""tests/fleet: the sans-IO rules and the in-process fleet run in the default suite; the tests on Ray need the
`fleet` extra (`make test-fleet` installs it) and are left out where Ray is not installed."""

from __future__ import annotations

import importlib.util
from collections.abc import AsyncIterator

import pytest

from tests.fleet.local_fleet import LocalFleet, local_fleet

collect_ignore = (
    []
    if importlib.util.find_spec("ray")
    else ["on_ray.py", "test_on_ray.py", "test_replica_death.py", "test_migration_on_ray.py"]
)


@pytest.fixture
async def fleet() -> AsyncIterator[LocalFleet]:
    async with local_fleet() as running:
        yield running
