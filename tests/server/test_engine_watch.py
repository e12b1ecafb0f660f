"""The engine-level poller (server/engine_watch.py) on a fake-time event loop (looptime): one reading per poll
while an engine has watched calls, the tokens between readings, and silence when a reading fails."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rolloutgate.core.events import Event, ProgressReported
from rolloutgate.engines.base import EngineLoad, UpstreamError
from rolloutgate.server.engine_watch import EngineWatcher, tokens_between


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


@pytest.mark.looptime
async def test_one_reading_per_poll_while_watched_and_progress_when_tokens_came() -> None:
    emitted: list[tuple[float, Event]] = []
    loop = asyncio.get_running_loop()
    watcher = EngineWatcher(lambda e: emitted.append((loop.time(), e)), loop.time, poll_s=2.0)
    engine = ScriptedEngine([counter(100), counter(100), counter(170), counter(240)])
    start = loop.time()
    watcher.add("e1", engine, "a", 1, 1_000)  # type: ignore[arg-type]
    await asyncio.sleep(8.5)
    assert [t - start for t in engine.read_at] == pytest.approx([0.0, 2.0, 4.0, 6.0, 8.0])
    # the baseline at once (the next reading's tokens count from the call's start), nothing new at 2 s, then
    # 70 tokens at 4 s and at 6 s
    assert [(t - start, e) for t, e in emitted] == [
        (pytest.approx(4.0), ProgressReported(request_id="a", tokens=0, attempt=1, engine_level=True)),
        (pytest.approx(6.0), ProgressReported(request_id="a", tokens=0, attempt=1, engine_level=True)),
    ]
    watcher.remove("a")
    await asyncio.sleep(4.0)
    assert len(engine.read_at) == 5  # the reading before the call ended was the last
    await watcher.close()


@pytest.mark.looptime
async def test_a_failed_reading_is_no_progress_and_the_next_one_counts_from_the_last_good_one() -> None:
    emitted: list[Any] = []
    loop = asyncio.get_running_loop()
    watcher = EngineWatcher(emitted.append, loop.time, poll_s=1.0)
    engine = ScriptedEngine(
        [
            counter(0),
            UpstreamError("frozen", retryable=True),
            UpstreamError("frozen", retryable=True),
            counter(5),
        ]
    )
    watcher.add("e1", engine, "a", 3, None)  # type: ignore[arg-type]
    await asyncio.sleep(2.5)
    assert emitted == []
    await asyncio.sleep(1.0)
    assert emitted == [ProgressReported(request_id="a", tokens=0, attempt=3, engine_level=True)]
    await watcher.close()


@pytest.mark.looptime
async def test_each_engine_is_polled_once_however_many_calls_it_holds() -> None:
    loop = asyncio.get_running_loop()
    emitted: list[Any] = []
    watcher = EngineWatcher(emitted.append, loop.time, poll_s=1.0)
    e1 = ScriptedEngine([counter(0, running=3), counter(30, running=3)])
    e2 = ScriptedEngine([counter(0), counter(0)])
    for rid in ("a", "b", "c"):
        watcher.add("e1", e1, rid, 1, None)  # type: ignore[arg-type]
    watcher.add("e2", e2, "d", 1, None)  # type: ignore[arg-type]
    await asyncio.sleep(1.5)
    assert len(e1.read_at) == len(e2.read_at) == 2
    assert sorted(e.request_id for e in emitted) == ["a", "b", "c"]  # e2 generated nothing
    await watcher.close()


@pytest.mark.looptime
async def test_a_pause_read_at_once_places_the_cut_short_intervals_tokens_at_its_start() -> None:
    """100 tokens/s for two polls, then the engine pauses 0.5 s into the third: a reading taken when the pause
    is learned shows 50 tokens, which at the rate before took 0.5 s: the last one came at 4.5, not at the
    reading (5.2) nor at the last poll (4.0)."""
    loop = asyncio.get_running_loop()
    watcher = EngineWatcher(lambda _e: None, loop.time, poll_s=2.0)
    engine = ScriptedEngine([counter(0), counter(200), counter(400), counter(450), counter(450)])
    start = loop.time()
    watcher.add("e1", engine, "a", 1, 10_000)  # type: ignore[arg-type]
    await asyncio.sleep(5.2)
    assert await watcher.output_at("e1") == pytest.approx(start + 4.5)
    await asyncio.sleep(1.0)  # the next poll (6.0) shows nothing new: the estimate stands
    assert await watcher.output_at("e1") == pytest.approx(start + 4.5)
    assert await watcher.output_at("e9") is None  # nothing watched there
    await watcher.close()


@pytest.mark.looptime
async def test_in_the_first_interval_the_engines_own_rate_places_the_tokens() -> None:
    """A pause 0.8 s into a call, before a second reading could measure a rate: SGLang's `gen_throughput`
    (its last decode log's rate, kept while paused) places the 80 tokens of the cut-short interval."""
    loop = asyncio.get_running_loop()
    watcher = EngineWatcher(lambda _e: None, loop.time, poll_s=2.0)
    engine = ScriptedEngine(
        [
            EngineLoad(running=1, waiting=0, generated_tokens_total=0.0, gen_throughput=0.0),
            EngineLoad(running=1, waiting=0, generated_tokens_total=80.0, gen_throughput=100.0),
        ]
    )
    start = loop.time()
    watcher.add("e1", engine, "a", 1, 10_000)  # type: ignore[arg-type]
    await asyncio.sleep(1.5)
    assert await watcher.output_at("e1") == pytest.approx(start + 0.8)
    await watcher.close()
