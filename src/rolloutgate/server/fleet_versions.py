"""The pool's weight versions: how far each engine's weights are behind the newest, and version policies.

Theory of operation: each engine states its weight version (SGLang `weight_version` in `/server_info`; the
pool reads it at join, after a pause nobody announced, after each update and control call that passes
through). Labels are the trainer's. Their order: SGLang's `default` (its label before any update) is the
oldest; labels that are whole numbers (miles and most trainers count steps) go by their number, after it;
any other label goes after those, in the order the gateway first saw it. So a gateway that starts (or
restarts) in the middle of a run, meeting a restarted engine on `default` and the others on `41`, orders them
right whatever it probes first. The fleet's version is the newest label an engine of the pool holds now; an engine's lag is how
many labels it is behind it (0: it holds the newest; an engine that states no version is never behind). The
core learns each engine's lag (EngineVersionLag) and starts a request only where its policy allows the lag.

Version policies are SMG's (`x-smg-version-policy`, smg#2529), per request, the gateway's
`--version-policy` when a request names none:

    any               every engine (the default)
    latest-only       lag 0: only engines holding the newest weights in the pool
    max-staleness:K   lag <= K
    min-version:V     the engine holds V or a newer label: turned into a lag bound when the request arrives
                      (V must be a label the gateway has seen; not as the gateway's default)

So an engine that restarts with its checkpoint's weights, or whose update failed, serves no request whose
policy forbids its lag until it is updated; what runs on it goes on, under the staleness bound (core/weights.py).
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ("VERSION_POLICY_HEADER", "FleetVersions", "VersionPolicyError")

VERSION_POLICY_HEADER = "x-smg-version-policy"
INITIAL_LABEL = "default"  # SGLang's weight_version before any update


class VersionPolicyError(ValueError):
    pass


class FleetVersions:
    __slots__ = ("_first_seen", "_newest", "_rank", "lags")

    def __init__(self) -> None:
        self._first_seen: dict[str, int] = {}  # label -> its place in the order seen
        self._rank: dict[str, int] = {}  # label -> its place among the labels seen, oldest first
        self._newest = -1  # the rank of the newest label held at the last judgement
        self.lags: dict[str, int] = {}  # engine id -> weight versions behind the newest held

    def _order(self, label: str) -> tuple[int, int]:
        if label == INITIAL_LABEL:
            return (0, 0)
        if label.isascii() and label.isdigit():
            return (1, int(label))
        return (2, self._first_seen[label])

    def fleet_version(self, held: Mapping[str, str | None]) -> str | None:
        """The newest label among those the engines hold now (None: none states one)."""
        labels = [label for label in held.values() if label is not None]
        fresh = False
        for label in labels:
            if label not in self._first_seen:
                self._first_seen[label], fresh = len(self._first_seen), True
        if fresh:
            self._rank = {label: i for i, label in enumerate(sorted(self._first_seen, key=self._order))}
        return max(labels, key=self._rank.__getitem__, default=None)

    def judge(self, held: Mapping[str, str | None]) -> list[tuple[str, int]]:
        """The engines whose lag changed, with their lag now; `held`: every engine's label now."""
        fleet = self.fleet_version(held)
        newest = self._newest = -1 if fleet is None else self._rank[fleet]
        lags = {e: 0 if label is None else newest - self._rank[label] for e, label in held.items()}
        changed = sorted((e, lag) for e, lag in lags.items() if self.lags.get(e, 0) != lag)
        self.lags = lags
        return changed

    def max_lag(self, policy: str) -> int | None:
        """The lag a policy allows (None: any). Raises VersionPolicyError for one that does not parse."""
        if policy == "any":
            return None
        if policy == "latest-only":
            return 0
        kind, sep, value = policy.partition(":")
        if sep and kind == "max-staleness" and value.isdigit():
            return int(value)
        if sep and kind == "min-version" and value:
            seen = self._rank.get(value)
            if seen is None:
                raise VersionPolicyError(f"min-version names a weight version no engine has held: {value!r}")
            return max(0, self._newest - seen)
        raise VersionPolicyError(
            f"version policy must be any, latest-only, max-staleness:K or min-version:V, not {policy!r}"
        )
