"""An engine-side ledger: every generation a simulated engine ran, and every interval it was held.

Theory of operation: benchmarks (the incident replay) need to know, from the engine's side and in simulated
time, what each generation cost and how it ended, however many there were (`/sim/state` keeps only the last
4,096 finished requests). A `GenerationLedger` is attached to an engine's model (`GenerationLedger.attach`);
the model calls three hooks:

- `finished(req)` when a request ends (finished, stopped, aborted, lost in a crash): one `GenerationRecord`;
- `held(reason, at)` / `released(reason, at)` when the step clock stops and restarts (`pause` or `freeze`);

and the HTTP layer calls `written(rid)` once a streamed answer has been written to its connection in full
(so a reader can tell "the engine finished" from "its client received it").

Health probes (`internal` requests) are not recorded. Nothing here changes the engine's behaviour; with no
ledger attached the hooks are never called.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rolloutsim.engine import SimEngine
    from rolloutsim.request import SimRequest

__all__ = ("GenerationLedger", "GenerationRecord", "HoldInterval")


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


def _record(engine: int, req: SimRequest, *, written: bool) -> GenerationRecord:
    finish = req.finish
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

    @classmethod
    def attach(cls, engine: SimEngine) -> GenerationLedger:
        """A new ledger, recording from now on what `engine` runs."""
        ledger = cls(engine=engine.index)
        engine.model.ledger = ledger
        return ledger

    # --- hooks (called by the engine) ------------------------------------------------------------------

    def finished(self, req: SimRequest) -> None:
        if not req.internal:
            self._index[req.rid] = len(self.records)
            self.records.append(_record(self.engine, req, written=req.rid in self._written))

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

    # --- reading ---------------------------------------------------------------------------------------

    def snapshot(self, live: list[SimRequest]) -> tuple[list[GenerationRecord], list[HoldInterval]]:
        """Every record so far plus the `live` requests (unfinished), and every hold (open ones end at inf)."""
        records = list(self.records)
        records += [_record(self.engine, r, written=False) for r in live if not r.internal]
        holds = list(self.holds)
        holds += [HoldInterval(engine=self.engine, reason=k, start_at=v) for k, v in self._open_holds.items()]
        return records, holds

    def __repr__(self) -> str:
        return f"<GenerationLedger engine {self.engine}: {len(self.records)} generations, {len(self.holds)} holds>"
