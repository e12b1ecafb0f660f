"""The fleet's weight version and the engines behind it (`--version-policy latest-only`).

Theory of operation: each engine states its weight version (SGLang `weight_version` in `/server_info`; the
pool reads it at join, after a pause nobody announced, after each update and control call that passes
through). Labels are the trainer's and are never parsed: their order is the order in which the gateway first
saw each one. The fleet's version is the newest label an engine of the pool holds now, so an engine that
restarts with its checkpoint's weights, or whose update failed, holds an older one: under `latest-only` it is
behind, and takes no new work until it holds the fleet's version (core EngineBehindFleet). An engine that
states no version is never behind. With `any` nobody is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

__all__ = ("VERSION_POLICIES", "FleetVersions", "VersionPolicy")

VersionPolicy = Literal["any", "latest-only"]
VERSION_POLICIES: tuple[VersionPolicy, ...] = ("any", "latest-only")


class FleetVersions:
    __slots__ = ("_first_seen", "behind", "policy")

    def __init__(self, policy: VersionPolicy = "any") -> None:
        self.policy = policy
        self._first_seen: dict[str, int] = {}  # label -> its place in the order seen
        self.behind: set[str] = set()

    def fleet_version(self, held: Mapping[str, str | None]) -> str | None:
        """The newest label among those the engines hold now (None: none states one)."""
        labels = [label for label in held.values() if label is not None]
        for label in labels:
            self._first_seen.setdefault(label, len(self._first_seen))
        return max(labels, key=self._first_seen.__getitem__, default=None)

    def judge(self, held: Mapping[str, str | None]) -> list[tuple[str, bool]]:
        """The engines whose place changed, with whether each is behind now; `held`: every engine's label."""
        fleet = self.fleet_version(held)
        behind = (
            {e for e, label in held.items() if label is not None and label != fleet}
            if self.policy == "latest-only"
            else set()
        )
        changed = [(e, True) for e in sorted(behind - self.behind)]
        changed += [(e, False) for e in sorted(self.behind - behind) if e in held]
        self.behind = behind
        return changed
