"""The shared wait deadlines (server/deadlines.py) and the outbox waits built on them (server/exchange.py)."""

from __future__ import annotations

import asyncio

import pytest

from rolloutgate.core.timing import TimingBreakdown
from rolloutgate.server.deadlines import WaitDeadlines, deadlines_of
from rolloutgate.server.exchange import Finished, Outbox

# the waits' deadlines are loop timers: on a fake-time loop they fire in order, with no real time spent
pytestmark = pytest.mark.looptime


async def test_waits_time_out_in_deadline_order_and_one_that_got_its_item_does_not() -> None:
    loop = asyncio.get_running_loop()
    deadlines = WaitDeadlines()
    late, early, served = (loop.create_future() for _ in range(3))
    order: list[str] = []
    for name, future in (("late", late), ("early", early)):
        future.add_done_callback(lambda _f, name=name: order.append(name))
    deadlines.add(0.2, late)
    deadlines.add(0.05, early)  # added later, due sooner: the timer moves forward
    deadlines.add(0.01, served)
    served.set_result(False)  # its item came first
    deadlines.settled()
    assert await early is True and await late is True
    assert order == ["early", "late"]
    assert served.result() is False
    deadlines.settled()
    deadlines.settled()
    assert len(deadlines) == 0


async def test_entries_of_settled_waits_are_dropped_so_the_heap_stays_small() -> None:
    loop = asyncio.get_running_loop()
    deadlines = WaitDeadlines()
    for _ in range(10_000):  # a fast stream: every wait ends with an item, long before its deadline
        waiter: asyncio.Future[bool] = loop.create_future()
        deadlines.add(60.0, waiter)
        waiter.set_result(False)
        deadlines.settled()
    assert len(deadlines) == 0
    assert len(deadlines._heap) <= 64 + 1  # compacted as stale entries outnumber the live ones


async def test_outbox_get_times_out_and_an_item_in_time_wins() -> None:
    outbox = Outbox()
    with pytest.raises(TimeoutError):
        await outbox.get(0.01)
    loop = asyncio.get_running_loop()
    loop.call_later(0.01, outbox.put_nowait, b"event")
    assert await outbox.get(30.0) == b"event"
    assert len(deadlines_of(loop)) == 0  # every wait settled


async def test_a_cancelled_wait_settles_its_deadline() -> None:
    outbox = Outbox()
    task = asyncio.create_task(outbox.get(30.0))
    await asyncio.sleep(0)
    loop = asyncio.get_running_loop()
    assert len(deadlines_of(loop)) == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(deadlines_of(loop)) == 0


async def test_a_stream_event_wakes_its_reader_after_what_the_same_step_completes() -> None:
    """A read of the engine's socket puts the stream's last events in the outbox and settles the upstream
    task, which puts the end one loop step later: the reader, woken a step later, finds both and writes
    them together. A terminal item alone wakes the reader at once."""
    loop = asyncio.get_running_loop()
    timing = TimingBreakdown(
        wall_s=1.0, queue_s=0.0, paused_s=0.0, contention_s=0.0, charged_s=1.0, stall_s=0.0, dispatched_s=1.0,
        attempts=1,
    )  # fmt: skip
    finished = Finished(timing=timing)

    async def read(outbox: Outbox) -> tuple[object, list[object]]:
        """The first item, and what else was queued at the moment the reader got it."""
        first = await outbox.get()
        rest = []
        while not outbox.empty():
            rest.append(outbox.get_nowait())
        return first, rest

    events = Outbox()
    reader = asyncio.create_task(read(events))
    await asyncio.sleep(0)  # the reader waits
    events.put_nowait(b"event")
    loop.call_soon(events.put_nowait, finished)  # the upstream task's step, queued by the same read
    assert await reader == (b"event", [finished])

    ends = Outbox()
    reader = asyncio.create_task(read(ends))
    await asyncio.sleep(0)
    ends.put_nowait(finished)
    loop.call_soon(ends.put_nowait, b"late")
    assert await reader == (finished, [])  # a terminal item does not wait for the next step
