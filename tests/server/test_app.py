"""The gateway's assembly (server/app.py): the core it builds from its settings."""

from __future__ import annotations

from rolloutgate.config import GatewaySettings
from rolloutgate.core.config import GatewayCoreConfig
from rolloutgate.server.app import core_config


def test_the_default_settings_build_the_cores_default_config() -> None:
    """One place for the defaults: `GatewayCoreConfig()` is what `rolloutgate serve` runs."""
    assert core_config(GatewaySettings()) == GatewayCoreConfig()


def test_settings_reach_the_core() -> None:
    built = core_config(GatewaySettings(placement="session_affinity", prefill_rest_ratio=0.0, max_attempts=5))
    assert (built.placement, built.prefill_rest_ratio, built.max_attempts) == ("session_affinity", 0.0, 5)
