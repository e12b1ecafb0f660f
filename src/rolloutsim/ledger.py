"""An engine-side ledger: every generation a simulated engine ran, and every interval it was held.

Theory of operation: benchmarks (the incident replay) need to know, from the engine's side and in simulated
time, what each generation cost and how it ended, however many there were (`/sim/state` keeps only the last
4,096 finished requests). A `GenerationLedger` is attached to an engine's model (`GenerationLedger.attach`);
the model calls three hooks:

- `finished(req)` when a request ends (finished, stopped, aborted, lost in a crash): one `GenerationRecord`;
- `held(reason, at)` / `released(reason, at)` when the step clock stops and restarts (`pause` or `freeze`);

the HTTP layer calls `written(rid)` once a streamed answer has been written to its connection in full
(so a reader can tell "the engine finished" from "its client received it"), and the engine (sim/engine.py)
tells it of its weights:

- `version_changed(at, version, cause)`: the engine holds other weights from `at` (`update`, or `restart`: a
  new process holds its launch checkpoint); the ledger starts with the version the engine held when attached;
- `update_begun(at, target)` / `update_ended(at, ok)`: a weight update ran (`ok` False: it failed, the old
  weights stayed).

Weights per token. Each record carries the versions its tokens were generated under (`weight_spans`:
`[version, first output offset]` per version, from the engine's own in-place updates) and, when the ledgers of
a fleet are attached together (`GenerationLedger.attach_fleet`), `token_marks`: its token count at every
moment any engine of the fleet changed weights. Between two such moments the fleet's newest version and its
engine's version are both fixed, so a reader can say exactly how many of its tokens were generated while a
newer version was held somewhere (rolloutreplay/measure.py `version_figures`).

Health probes (`internal` requests) are not recorded. Nothing here changes the engine's behaviour; with no
ledger attached the hooks are never called.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rolloutsim.engine import SimEngine
    from rolloutsim.request import SimRequest

__all__ = ("GenerationLedger", "GenerationRecord", "HoldInterval", "UpdateAttempt", "VersionChange")


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerationRecord:
    """One generation as its engine saw it. Times are simulated seconds; None = did not happen (yet)."""

    engine: int
    rid: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    submitted_at: float
    started_at: float | None  # admitted to the batch (its prefill began)
    first_token_at: float | None
    finished_at: float | None  # None: still live when the record was taken
    finish: str | None  # "stop" | "length" | "abort" | None while live
    message: str | None = None  # abort message
    num_retractions: int = 0
    written: bool = False  # the full answer was written to its connection (streamed answers)
    arrived_at: float | None = None  # its call reached the engine (before a pause or update let it in)
    # (version, first output offset under it) per weight version its tokens were generated under
    weight_spans: tuple[tuple[str, int], ...] = ()
    # (time, output tokens so far) at each weight change of any engine of the fleet while it was live
    token_marks: tuple[tuple[float, int], ...] = ()

    @property
    def is_aborted(self) -> bool:
        return self.finish == "abort"

    @property
    def uncached_tokens(self) -> int:
        return max(0, self.prompt_tokens - self.cached_tokens)

    def to_json(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "rid": self.rid,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "submitted_at": self.submitted_at,
            "started_at": self.started_at,
            "first_token_at": self.first_token_at,
            "finished_at": self.finished_at,
            "finish": self.finish,
            "message": self.message,
            "num_retractions": self.num_retractions,
            "written": self.written,
            "arrived_at": self.submitted_at if self.arrived_at is None else self.arrived_at,
            "weight_spans": [list(span) for span in self.weight_spans],
            "token_marks": [list(mark) for mark in self.token_marks],
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class VersionChange:
    """From `at` the engine held weight `version`: `launch` (when the ledger was attached), `update`, or
    `restart` (a new process, holding the checkpoint it was launched with)."""

    engine: int
    at: float
    version: str
    cause: str

    def to_json(self) -> dict[str, Any]:
        return {"engine": self.engine, "at": self.at, "version": self.version, "cause": self.cause}


@dataclass(frozen=True, slots=True, kw_only=True)
class UpdateAttempt:
    """A weight update to `target` (None: no version named) from `begun_at` to `ended_at` (inf: still
    running); `ok` False: it failed and the engine kept its weights."""

    engine: int
    begun_at: float
    target: str | None
    ended_at: float = math.inf
    ok: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "begun_at": self.begun_at,
            "ended_at": None if math.isinf(self.ended_at) else self.ended_at,
            "target": self.target,
            "ok": self.ok,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class HoldInterval:
    """The engine's step clock was stopped for `reason` ("pause" or "freeze") from `start_at` to `end_at`."""

    engine: int
    reason: str
    start_at: float
    end_at: float = math.inf  # inf: still held

    def to_json(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "reason": self.reason,
            "start_at": self.start_at,
            "end_at": None if math.isinf(self.end_at) else self.end_at,
        }


def _record(
    engine: int, req: SimRequest, *, written: bool, version: str, marks: list[tuple[float, int]]
) -> GenerationRecord:
    """`version`: what the engine holds as the record is taken (the version of a request's output when it
    crossed no update)."""
    finish = req.finish
    spans = req.weight_spans if req.weight_spans is not None else [(version, 0)]
    return GenerationRecord(
        engine=engine,
        rid=req.rid,
        prompt_tokens=req.prompt_tokens,
        cached_tokens=req.cached_tokens,
        completion_tokens=req.completion_tokens,
        submitted_at=req.submitted_at,
        started_at=req.started_at,
        first_token_at=req.first_token_at,
        finished_at=req.finished_at,
        finish=None if finish is None else finish.kind,
        message=None if finish is None else finish.message,
        num_retractions=req.num_retractions,
        written=written,
        arrived_at=req.arrived_at,
        weight_spans=tuple(spans),
        token_marks=tuple(marks),
    )


@dataclass(eq=False)
class GenerationLedger:
    """The ledger of one engine (see the module docstring)."""

    engine: int
    records: list[GenerationRecord] = field(default_factory=list)
    holds: list[HoldInterval] = field(default_factory=list)
    _written: set[str] = field(default_factory=set)
    _index: dict[str, int] = field(default_factory=dict)  # rid -> position in `records`
    _open_holds: dict[str, float] = field(default_factory=dict)
    versions: list[VersionChange] = field(default_factory=list)
    updates: list[UpdateAttempt] = field(default_factory=list)
    _open_update: UpdateAttempt | None = None
    _marks: dict[str, list[tuple[float, int]]] = field(default_factory=dict)  # live rid -> token marks
    _source: SimEngine | None = None  # the engine it is attached to (its live requests, its version)
    _fleet: list[GenerationLedger] = field(default_factory=list)  # the ledgers marked at a weight change

    @classmethod
    def attach(cls, engine: SimEngine) -> GenerationLedger:
        """A new ledger, recording from now on what `engine` runs."""
        ledger = cls(engine=engine.index)
        ledger._source = engine
        ledger._fleet = [ledger]
        ledger.versions.append(
            VersionChange(engine=engine.index, at=engine.now(), version=engine.weight_version, cause="launch")
        )
        engine.model.ledger = ledger
        return ledger

    @classmethod
    def attach_fleet(cls, engines: Sequence[SimEngine]) -> list[GenerationLedger]:
        """A ledger on each engine, linked: a weight change on any engine marks the token counts of every
        engine's live generations (`token_marks`, module docstring)."""
        ledgers = [cls.attach(engine) for engine in engines]
        for ledger in ledgers:
            ledger._fleet = ledgers
        return ledgers

    # --- hooks (called by the engine) ------------------------------------------------------------------

    def finished(self, req: SimRequest) -> None:
        if not req.internal:
            self._index[req.rid] = len(self.records)
            marks = self._marks.pop(req.rid, [])
            record = _record(
                self.engine, req, written=req.rid in self._written, version=self._version(), marks=marks
            )
            self.records.append(record)

    def written(self, rid: str) -> None:
        """The answer of `rid` was written to its connection in full (it may finish just before or after)."""
        self._written.add(rid)
        index = self._index.get(rid)
        if index is not None:
            self.records[index] = replace(self.records[index], written=True)

    def held(self, reason: str, at: float) -> None:
        self._open_holds.setdefault(reason, at)

    def released(self, reason: str, at: float) -> None:
        start = self._open_holds.pop(reason, None)
        if start is not None:
            self.holds.append(HoldInterval(engine=self.engine, reason=reason, start_at=start, end_at=at))

    def version_changed(self, at: float, version: str, cause: str) -> None:
        self.versions.append(VersionChange(engine=self.engine, at=at, version=version, cause=cause))
        for ledger in self._fleet:
            ledger._mark(at)

    def update_begun(self, at: float, target: str | None) -> None:
        self._open_update = UpdateAttempt(engine=self.engine, begun_at=at, target=target)

    def update_ended(self, at: float, ok: bool) -> None:
        begun, self._open_update = self._open_update, None
        if begun is not None:
            self.updates.append(replace(begun, ended_at=at, ok=ok))

    def _mark(self, at: float) -> None:
        """Note the token count of each live generation of this ledger's engine at `at` (a weight change)."""
        if self._source is None:
            return
        self._source.sync()
        for req in self._source.model.requests():
            if not req.is_finished:
                self._marks.setdefault(req.rid, []).append((at, req.completion_tokens))

    def _version(self) -> str:
        if self._source is not None:
            return self._source.weight_version
        return self.versions[-1].version if self.versions else "default"

    # --- reading ---------------------------------------------------------------------------------------

    def snapshot(self, live: list[SimRequest]) -> tuple[list[GenerationRecord], list[HoldInterval]]:
        """Every record so far plus the `live` requests (unfinished), and every hold (open ones end at inf)."""
        records = list(self.records)
        version = self._version()
        records += [
            _record(self.engine, r, written=False, version=version, marks=self._marks.get(r.rid, []))
            for r in live
            if not r.internal
        ]
        holds = list(self.holds)
        holds += [HoldInterval(engine=self.engine, reason=k, start_at=v) for k, v in self._open_holds.items()]
        return records, holds

    def weights(self) -> dict[str, Any]:
        """The engine's weights over time: every version it held from when, and every update it ran."""
        updates = list(self.updates) + ([] if self._open_update is None else [self._open_update])
        return {
            "engine": self.engine,
            "versions": [v.to_json() for v in self.versions],
            "updates": [u.to_json() for u in updates],
        }

    def __repr__(self) -> str:
        return f"<GenerationLedger engine {self.engine}: {len(self.records)} generations, {len(self.holds)} holds>"
