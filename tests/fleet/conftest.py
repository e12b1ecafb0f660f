"""tests/fleet: the sans-IO rules and the in-process fleet run in the default suite; the tests on Ray need the
`fleet` extra (`make test-fleet` installs it) and are left out where Ray is not installed."""

from __future__ import annotations

import importlib.util

collect_ignore = (
    [] if importlib.util.find_spec("ray") else ["on_ray.py", "test_on_ray.py", "test_replica_death.py"]
)
