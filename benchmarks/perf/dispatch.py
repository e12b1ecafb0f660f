"""The cost of one dispatch decision with n requests queued, measured on the sans-IO core alone.

Theory of operation: engines join with a small capacity and are filled; n more requests wait in the queue.
Then, `samples` times: one in-flight request finishes (`UpstreamFinished`), which frees its slot, and the core
answers `Complete` + `Dispatch` of the queue's head: that call is the dispatch decision (with its completion,
placement and the re-arming of the dispatched request's timers). A new request then arrives (`RequestArrived`,
enqueued, no dispatch), so the queue stays at n. Both calls are timed with the thread CPU clock (`thread_time_ns`, immune to preemption by other processes); the medians are
reported. Measured for several n, so the growth with n is visible: O(log n) shows as a flat or slowly rising
line, O(n) as a factor of 10 per decade.

Two shapes: `fifo` (no routing keys, least-outstanding placement) and `sessions` (every request carries one of
1,000 routing keys, so placement consults the session table).
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass
from typing import Any

from rolloutgate.core.commands import Dispatch
from rolloutgate.core.events import EngineJoined, RequestArrived, UpstreamFinished
from rolloutgate.core.gateway import Gateway, GatewayCoreConfig

__all__ = ("DispatchCost", "measure_dispatch", "run_dispatch_bench")


@dataclass(frozen=True, slots=True, kw_only=True)
class DispatchCost:
    shape: str
    queued: int
    engines: int
    dispatch_us: float  # median of UpstreamFinished -> Complete + Dispatch
    dispatch_p99_us: float
    enqueue_us: float  # median of RequestArrived while every slot is full

    def as_dict(self) -> dict[str, Any]:
        return {
            "shape": self.shape,
            "queued": self.queued,
            "engines": self.engines,
            "dispatch_us": round(self.dispatch_us, 2),
            "dispatch_p99_us": round(self.dispatch_p99_us, 2),
            "enqueue_us": round(self.enqueue_us, 2),
        }


def measure_dispatch(
    queued: int, *, engines: int = 8, capacity: int = 4, samples: int = 2000, sessions: bool = False
) -> DispatchCost:
    core = Gateway(GatewayCoreConfig(max_queue=max(100_000, queued + samples + engines * capacity + 1)))
    now = 1e4
    for i in range(engines):
        core.handle(EngineJoined(engine_id=f"engine-{i}", capacity=capacity), now)
    in_flight: list[str] = []
    serial = 0

    def arrive() -> list[Any]:
        nonlocal serial
        serial += 1
        key = f"session-{serial % 1000}" if sessions else None
        return core.handle(
            RequestArrived(request_id=f"r{serial:09d}", routing_key=key, prompt_tokens=64), now
        )

    for _ in range(engines * capacity + queued):
        for command in arrive():
            if isinstance(command, Dispatch):
                in_flight.append(command.request_id)
    assert len(in_flight) == engines * capacity, "every slot should be full before measuring"
    dispatch_ns: list[int] = []
    enqueue_ns: list[int] = []
    gc.collect()
    gc.disable()
    try:
        for _ in range(samples):
            finished = in_flight.pop(0)
            event = UpstreamFinished(request_id=finished)
            began = time.thread_time_ns()
            commands = core.handle(event, now)
            dispatch_ns.append(time.thread_time_ns() - began)
            in_flight += [c.request_id for c in commands if isinstance(c, Dispatch)]
            serial += 1
            key = f"session-{serial % 1000}" if sessions else None
            arrived = RequestArrived(request_id=f"r{serial:09d}", routing_key=key, prompt_tokens=64)
            began = time.thread_time_ns()
            core.handle(arrived, now)
            enqueue_ns.append(time.thread_time_ns() - began)
            now += 1e-4
    finally:
        gc.enable()
    dispatch_ns.sort()
    return DispatchCost(
        shape="sessions" if sessions else "fifo",
        queued=queued,
        engines=engines,
        dispatch_us=statistics.median(dispatch_ns) / 1e3,
        dispatch_p99_us=dispatch_ns[int(0.99 * (len(dispatch_ns) - 1))] / 1e3,
        enqueue_us=statistics.median(enqueue_ns) / 1e3,
    )


def run_dispatch_bench(
    sizes: tuple[int, ...] = (100, 1_000, 10_000, 100_000), *, samples: int = 2000
) -> list[DispatchCost]:
    return [
        measure_dispatch(n, samples=samples, sessions=sessions) for sessions in (False, True) for n in sizes
    ]
