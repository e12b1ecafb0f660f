"""The fleet's weight version and who is behind it (server/fleet_versions.py)."""

from __future__ import annotations

from rolloutgate.server.fleet_versions import FleetVersions


def test_latest_only_puts_behind_whoever_holds_an_older_label_than_the_newest_held() -> None:
    versions = FleetVersions("latest-only")
    assert versions.judge({"e0": "default", "e1": "default"}) == []
    assert versions.judge({"e0": "7", "e1": "default"}) == [("e1", True)]  # e0 updated first
    assert versions.judge({"e0": "7", "e1": "7"}) == [("e1", False)]
    # e1 restarts from its checkpoint: "default" was seen before "7", so it is older
    assert versions.judge({"e0": "7", "e1": "default"}) == [("e1", True)]
    assert versions.fleet_version({"e0": "7", "e1": "default"}) == "7"
    # the engine that held the newest leaves: the newest held now is the fleet's
    assert versions.judge({"e1": "default"}) == [("e1", False)]


def test_labels_are_never_parsed_only_ordered_by_first_sight() -> None:
    versions = FleetVersions("latest-only")
    versions.judge({"e0": "step-10"})
    assert versions.judge({"e0": "step-10", "e1": "step-9"}) == [("e0", True)]  # step-9 seen later: newer
    assert versions.judge({"e0": "step-10", "e1": "step-9", "e2": None}) == []  # no version: never behind


def test_any_puts_nobody_behind() -> None:
    versions = FleetVersions("any")
    assert versions.judge({"e0": "7", "e1": "default"}) == []
    assert versions.behind == set()
