"""The engine-level poller (server/engine_watch.py) on a fake-time event loop (looptime): one reading per poll
while an engine has watched calls, the tokens between readings, and silence when a reading fails."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest

from rolloutgate.core.events import Event, ProgressReported
from rolloutgate.engines.base import EngineLoad, UpstreamError
from rolloutgate.server.engine_watch import FIRST_READINGS_SPEEDUP, EngineWatcher, tokens_between


def test_tokens_between_prefers_the_counter_and_trusts_a_rate_only_while_the_snapshot_moves() -> None:
    earlier = EngineLoad(running=2, waiting=0, generated_tokens_total=1_000.0)
    assert tokens_between(None, earlier, 1.0) == 0.0  # the first reading is the baseline
    assert (
        tokens_between(earlier, EngineLoad(running=2, waiting=0, generated_tokens_total=1_350.0), 5.0)
        == 350.0
    )
    restarted = EngineLoad(running=1, waiting=0, generated_tokens_total=40.0)
    assert tokens_between(earlier, restarted, 5.0) == 40.0  # the counter went back: counted from zero
    old = EngineLoad(running=2, waiting=0, gen_throughput=70.0, snapshot_at=1.0)
    moved = EngineLoad(running=2, waiting=0, gen_throughput=70.0, snapshot_at=2.0)
    stale = EngineLoad(running=2, waiting=0, gen_throughput=70.0, snapshot_at=1.0)
    assert tokens_between(old, moved, 3.0) == 210.0
    assert tokens_between(old, stale, 3.0) == 0.0  # a frozen SGLang repeats its last decode log's rate
    assert (
        tokens_between(old, EngineLoad(running=2, waiting=0, gen_throughput=0.0, snapshot_at=2.0), 3.0) == 0
    )


class ScriptedEngine:
    """An engine client whose `load()` answers from a list (an exception instance is raised)."""

    url = "http://engine"

    def __init__(self, readings: list[EngineLoad | Exception]) -> None:
        self.readings = readings
        self.read_at: list[float] = []

    async def load(self) -> EngineLoad:
        self.read_at.append(asyncio.get_running_loop().time())
        reading = self.readings.pop(0) if self.readings else self.readings_exhausted()
        if isinstance(reading, Exception):
            raise reading
        return reading

    @staticmethod
    def readings_exhausted() -> EngineLoad:
        return EngineLoad(running=1, waiting=0, generated_tokens_total=0.0)


def counter(total: float, running: int = 1) -> EngineLoad:
    return EngineLoad(running=running, waiting=0, generated_tokens_total=total)


class DecodingEngine:
    """An engine decoding `rate` tokens/s from the loop's start, paused over [pause_at, resume_at); its counter
    (and, with `reports_rate`, SGLang's `gen_throughput` gauge, which keeps its value while paused) as read."""

    url = "http://engine"

    def __init__(
        self,
        rate: float,
        pause_at: float = math.inf,
        resume_at: float = math.inf,
        *,
        reports_rate: bool = False,
    ) -> None:
        self.start = asyncio.get_running_loop().time()
        self.rate, self.pause_at, self.resume_at, self.reports_rate = rate, pause_at, resume_at, reports_rate
        self.read_at: list[float] = []

    async def load(self) -> EngineLoad:
        now = asyncio.get_running_loop().time()
        self.read_at.append(now - self.start)
        t = now - self.start
        decoding = min(t, self.pause_at) + max(0.0, t - self.resume_at)
        return EngineLoad(
            running=1,
            waiting=0,
            generated_tokens_total=self.rate * decoding,
            gen_throughput=self.rate if self.reports_rate else None,
        )


def engine_level(request_id: str, attempt: int = 1) -> ProgressReported:
    return ProgressReported(request_id=request_id, tokens=0, attempt=attempt, engine_level=True)


@pytest.mark.looptime
async def test_readings_come_fast_until_the_rate_is_known_then_one_per_poll_while_watched() -> None:
    """The baseline a fast interval (poll / 6) after the call came; then every poll / 6 until a whole interval
    of decoding (one that began with the engine decoding) gave the rate; then one per poll, each with tokens
    reported as engine-level progress; none once the call ended."""
    emitted: list[tuple[float, Event]] = []
    loop = asyncio.get_running_loop()
    watcher = EngineWatcher(lambda e: emitted.append((loop.time(), e)), loop.time, poll_s=2.0)
    engine = DecodingEngine(rate=60.0)
    watcher.add("e1", engine, "a", 1, 100_000)  # type: ignore[arg-type]
    await asyncio.sleep(5.5)
    fast = 2.0 / FIRST_READINGS_SPEEDUP
    assert engine.read_at == pytest.approx(
        [fast, 2 * fast, 3 * fast, 3 * fast + 2.0, 3 * fast + 4.0], abs=1e-5
    )
    assert [(t - engine.start, e) for t, e in emitted] == [
        (pytest.approx(t, abs=1e-5), engine_level("a")) for t in engine.read_at[1:]
    ]
    watcher.remove("a")
    await asyncio.sleep(4.0)
    assert len(engine.read_at) == 5  # the reading before the call ended was the last
    await watcher.close()


@pytest.mark.looptime
async def test_calls_answered_within_the_first_fast_interval_cost_the_engine_no_reading() -> None:
    """One client's short calls in turn: each starts the engine's watch and ends before its baseline is due,
    so the engine's /metrics is never read (it was read once per call when the baseline came at once)."""
    emitted: list[Any] = []
    loop = asyncio.get_running_loop()
    watcher = EngineWatcher(emitted.append, loop.time, poll_s=3.0)
    engine = DecodingEngine(rate=60.0)
    fast = 3.0 / FIRST_READINGS_SPEEDUP
    for i in range(20):
        watcher.add("e1", engine, f"call-{i}", 1, 16)  # type: ignore[arg-type]
        await asyncio.sleep(fast * 0.9)
        watcher.remove(f"call-{i}")
        await asyncio.sleep(fast * 0.2)  # the watch's task sees no call left and ends
    assert engine.read_at == []
    assert emitted == []
    watcher.add("e1", engine, "long", 1, 100_000)  # type: ignore[arg-type]
    await asyncio.sleep(fast * 2.5)
    assert len(engine.read_at) == 2  # a longer call is watched as before: its baseline, then its first tokens
    assert emitted == [engine_level("long")]
    await watcher.close()


@pytest.mark.looptime
async def test_a_failed_reading_is_no_progress_and_the_next_one_counts_from_the_last_good_one() -> None:
    emitted: list[Any] = []
    loop = asyncio.get_running_loop()
    watcher = EngineWatcher(emitted.append, loop.time, poll_s=0.6)  # readings every 0.1 s (the rate unknown)
    engine = ScriptedEngine(
        [
            counter(0),
            UpstreamError("frozen", retryable=True),
            UpstreamError("frozen", retryable=True),
            counter(5),
        ]
    )
    watcher.add("e1", engine, "a", 3, None)  # type: ignore[arg-type]
    await asyncio.sleep(0.35)  # readings at 0.1 (the baseline), 0.2 and 0.3 (failed)
    assert emitted == []
    await asyncio.sleep(0.1)  # at 0.4: 5 tokens since the baseline
    assert emitted == [engine_level("a", attempt=3)]
    await watcher.close()


@pytest.mark.looptime
async def test_each_engine_is_polled_once_however_many_calls_it_holds() -> None:
    loop = asyncio.get_running_loop()
    emitted: list[Any] = []
    watcher = EngineWatcher(emitted.append, loop.time, poll_s=0.6)
    e1 = ScriptedEngine([counter(0, running=3), counter(30, running=3)])
    e2 = ScriptedEngine([counter(0), counter(0)])
    for rid in ("a", "b", "c"):
        watcher.add("e1", e1, rid, 1, None)  # type: ignore[arg-type]
    watcher.add("e2", e2, "d", 1, None)  # type: ignore[arg-type]
    await asyncio.sleep(0.25)  # readings at 0.1 (the baselines) and 0.2
    assert len(e1.read_at) == len(e2.read_at) == 2
    assert sorted(e.request_id for e in emitted) == ["a", "b", "c"]  # e2 generated nothing
    await watcher.close()


@pytest.mark.looptime
async def test_a_pause_read_at_once_places_the_cut_short_intervals_tokens_at_its_start() -> None:
    """100 tokens/s, paused at 4.5 s, between two polls (2.67 and 4.67): the poll after it shows the
    interval's 183 tokens, which at the rate before took 1.83 s: the last one came at 4.5, not at that poll.
    Read again when the pause is learned (5.2), and at the next poll, the estimate stands."""
    loop = asyncio.get_running_loop()
    watcher = EngineWatcher(lambda _e: None, loop.time, poll_s=2.0)
    engine = DecodingEngine(rate=100.0, pause_at=4.5)
    watcher.add("e1", engine, "a", 1, 10_000)  # type: ignore[arg-type]
    await asyncio.sleep(5.2)
    assert await watcher.output_at("e1") == pytest.approx(engine.start + 4.5)
    await asyncio.sleep(2.0)
    assert await watcher.output_at("e1") == pytest.approx(engine.start + 4.5)
    assert await watcher.output_at("e9") is None  # nothing watched there
    await watcher.close()


@pytest.mark.looptime
async def test_before_a_whole_interval_the_engines_own_rate_places_the_tokens() -> None:
    """Paused 0.5 s into the call, after the baseline (0.33 s) and before a whole interval of decoding could
    give a rate: SGLang's `gen_throughput` (its last decode log's rate, kept while paused) places the cut-short
    interval's tokens. Paused before the baseline, the counter cannot say when the last token came (None: the
    core counts the pause from the call's own last progress, its first token at the latest)."""
    loop = asyncio.get_running_loop()
    for pause_at, last_token_at in ((0.5, 0.5), (0.2, None)):
        watcher = EngineWatcher(lambda _e: None, loop.time, poll_s=2.0)
        engine = DecodingEngine(rate=100.0, pause_at=pause_at, reports_rate=True)
        watcher.add("e1", engine, "a", 1, 10_000)  # type: ignore[arg-type]
        await asyncio.sleep(1.0)
        expected = None if last_token_at is None else pytest.approx(engine.start + last_token_at)
        assert await watcher.output_at("e1") == expected
        await watcher.close()
