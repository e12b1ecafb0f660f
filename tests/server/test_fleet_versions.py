"""How far each engine's weights lag, and version policies (server/fleet_versions.py)."""

from __future__ import annotations

import pytest

from rolloutgate.server.fleet_versions import FleetVersions, VersionPolicyError


def test_lag_counts_the_labels_between_an_engines_and_the_newest_held() -> None:
    versions = FleetVersions()
    assert versions.judge({"e0": "default", "e1": "default"}) == []
    assert versions.judge({"e0": "7", "e1": "default"}) == [("e1", 1)]  # e0 updated first
    assert versions.judge({"e0": "8", "e1": "default"}) == [("e1", 2)]
    assert versions.judge({"e0": "8", "e1": "8"}) == [("e1", 0)]
    # e1 restarts from its checkpoint: "default" was seen first, so it is the oldest
    assert versions.judge({"e0": "8", "e1": "default"}) == [("e1", 2)]
    assert versions.fleet_version({"e0": "8", "e1": "default"}) == "8"
    # the engine that held the newest leaves: the newest held now is the fleet's
    assert versions.judge({"e1": "default"}) == [("e1", 0)]


def test_other_labels_are_ordered_by_first_sight_after_default_and_the_numbers() -> None:
    versions = FleetVersions()
    versions.judge({"e0": "step-10"})
    assert versions.judge({"e0": "step-10", "e1": "step-9"}) == [("e0", 1)]  # step-9 seen later: newer
    assert versions.judge({"e0": "step-10", "e1": "step-9", "e2": None}) == []  # no version: never behind
    assert versions.judge({"e0": "step-10", "e1": "step-9", "e2": "default"}) == [("e2", 2)]


def test_a_gateway_started_mid_run_orders_default_and_step_numbers_whatever_it_probes_first() -> None:
    """Restarted mid-run, the gateway meets an engine on 41 before one restarted on `default`, and 40 after:
    numbers go by their value, `default` is the oldest."""
    versions = FleetVersions()
    assert versions.judge({"e0": "41"}) == []
    assert versions.judge({"e0": "41", "e1": "default"}) == [("e1", 1)]
    assert versions.judge({"e0": "41", "e1": "default", "e2": "40"}) == [("e1", 2), ("e2", 1)]
    assert versions.judge({"e0": "41", "e1": "41", "e2": "9"}) == [("e1", 0), ("e2", 2)]  # 9 < 40 < 41
    assert versions.max_lag("min-version:40") == 1  # default, 9, 40, 41: an engine on 40 lags the newest by 1


@pytest.mark.parametrize(
    ("policy", "lag"),
    [("any", None), ("latest-only", 0), ("max-staleness:0", 0), ("max-staleness:3", 3), ("min-version:7", 1),
     ("min-version:default", 2), ("min-version:8", 0)],
)  # fmt: skip
def test_smgs_policies_become_a_lag_bound(policy: str, lag: int | None) -> None:
    versions = FleetVersions()
    versions.judge({"e0": "default"})
    versions.judge({"e0": "7"})
    versions.judge({"e0": "8"})
    assert versions.max_lag(policy) == lag


@pytest.mark.parametrize(
    "policy",
    ["latest", "max-staleness:", "max-staleness:-1", "max-staleness:x", "min-version:", "min-version:9", ""],
)
def test_a_policy_that_does_not_parse_or_names_an_unseen_version_is_refused(policy: str) -> None:
    versions = FleetVersions()
    versions.judge({"e0": "8"})
    with pytest.raises(VersionPolicyError):
        versions.max_lag(policy)
