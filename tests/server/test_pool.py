"""The pool's health loop against an engine paused by someone else (server/pool.py), on a fake-time event loop
(looptime): an SGLang-like engine whose `/health` blocks behind a pause and, timed out, marks the server
unhealthy, and one whose scheduler hangs. The pause is reported whenever it begins, a hang never is."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import aiohttp
import orjson
import pytest

from rolloutgate.config import EngineSpec, GatewaySettings
from rolloutgate.core.events import EngineHealthChecked, EnginePaused, EngineResumed, Event
from rolloutgate.engines.base import EngineFamily, EngineInfo, Readiness
from rolloutgate.server.engine_handle import EngineHandle
from rolloutgate.server.pool import EnginePool
from rolloutsim import SimCluster

SGLANG_HEALTH_TIMEOUT_S = 20.0  # SGLANG_HEALTH_CHECK_TIMEOUT


class FakeSGLang:
    """SGLang 0.5's health and readiness (reference: http_server.py `health_generate`, `is_ready`, `ping`): a
    probe passes a second after it starts when generation runs throughout; behind a pause or a hang it waits,
    up to 20 s, and then marks the server unhealthy, even if its client has gone (the handler is not
    cancelled), until a probe passes."""

    url = "http://engine"
    family = EngineFamily.SGLANG
    reports_load = True

    def __init__(self, *, paused: tuple[float, float] = (math.inf, math.inf), hung_from: float = math.inf):
        self.paused_between = paused
        self.hung_from = hung_from
        self.status_up = True
        self.marked_down = 0  # times a probe timed out and marked the server unhealthy
        self.info = EngineInfo(family=EngineFamily.SGLANG, models=("sim-model",))

    async def probe(self) -> EngineInfo:
        """Its facts (`/server_info`): the pool reads them again when the engine comes back from failing."""
        return self.info

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    def generating(self) -> bool:
        start, end = self.paused_between
        return not start <= self.now() < end and self.now() < self.hung_from

    def is_paused(self) -> bool:
        start, end = self.paused_between
        return start <= self.now() < end

    async def readiness(self) -> Readiness | None:
        if not self.is_paused() and self.status_up:
            return Readiness.READY
        return Readiness.PAUSED if self.status_up else Readiness.NOT_READY

    async def health(self) -> bool:
        probe = asyncio.get_running_loop().create_task(self._probe())
        return await asyncio.shield(probe)  # a client that gives up does not stop the server's handler

    async def _probe(self) -> bool:
        started = self.now()
        await asyncio.sleep(1.0)
        while not self.generating():
            if self.now() - started >= SGLANG_HEALTH_TIMEOUT_S:
                self.status_up = False
                self.marked_down += 1
                return False
            await asyncio.sleep(0.25)
        self.status_up = True
        return True


def joined(engine: FakeSGLang) -> tuple[list[tuple[float, Event]], EnginePool, EngineHandle]:
    events: list[tuple[float, Event]] = []
    loop = asyncio.get_running_loop()
    pool = EnginePool(
        GatewaySettings(), lambda e: events.append((loop.time(), e)), lambda s: s, lambda _engine: "healthy"
    )
    handle = EngineHandle(engine_id="engine-0", url=engine.url, client=engine, info=engine.info, capacity=8)  # type: ignore[arg-type]
    pool.engines[handle.engine_id] = handle
    return events, pool, handle


def start_loop(engine: FakeSGLang) -> tuple[list[tuple[float, Event]], asyncio.Task[None]]:
    events, pool, handle = joined(engine)
    return events, asyncio.get_running_loop().create_task(pool.health.loop(handle))


@pytest.mark.looptime
# checks start at 5, 11, 17... and take 1 s: a pause between two checks, and one during a check
@pytest.mark.parametrize("pause_at", [14.0, 11.5])
async def test_a_pause_is_reported_and_its_end_too_and_health_is_never_failed(pause_at: float) -> None:
    engine = FakeSGLang(paused=(pause_at, pause_at + 120.0))
    events, task = start_loop(engine)
    await asyncio.sleep(200)
    task.cancel()
    paused = [t for t, e in events if isinstance(e, EnginePaused)]
    resumed = [t for t, e in events if isinstance(e, EngineResumed)]
    assert paused and paused[0] <= pause_at + 15.5, events  # a check under way gives up at 15 s
    assert len(resumed) == 1 and pause_at + 120 <= resumed[0] <= pause_at + 123, events
    assert max(paused) < resumed[0]
    assert not [e for _, e in events if isinstance(e, EngineHealthChecked)], events  # never judged unhealthy
    # a check under way when the pause began made SGLang mark itself unhealthy; a check after it cleared that
    assert (engine.marked_down > 0) == (pause_at == 11.5)
    assert engine.status_up


@pytest.mark.looptime
async def test_a_hung_engine_is_never_taken_for_paused() -> None:
    engine = FakeSGLang(hung_from=12.0)
    events, task = start_loop(engine)
    await asyncio.sleep(200)
    task.cancel()
    assert not [e for _, e in events if isinstance(e, EnginePaused | EngineResumed)], events
    failed = [t for t, e in events if isinstance(e, EngineHealthChecked) and not e.healthy]
    assert len(failed) == 1 and failed[0] < 12 + 3 * (5 + 15) + 1, events  # three failed checks


@pytest.mark.looptime
async def test_the_cores_pause_check_reads_a_pause_the_health_loop_is_waiting_behind() -> None:
    """The pause begins during a health check (which waits behind it for 15 s): the core's CheckEngine, 3 s in,
    is answered at once, long before the loop would have seen it."""
    engine = FakeSGLang(paused=(11.5, 200.0))
    events, pool, handle = joined(engine)
    loop_task = asyncio.get_running_loop().create_task(pool.health.loop(handle))
    await asyncio.sleep(14.5)
    pool.health.read_pause("engine-0")
    await asyncio.sleep(0.1)
    assert [(t, type(e)) for t, e in events] == [(pytest.approx(14.5), EnginePaused)]
    loop_task.cancel()
    await pool.close()


class SilentEngine(FakeSGLang):
    """Hung so hard that even its pause flag does not answer."""

    async def readiness(self) -> Readiness | None:
        await asyncio.sleep(math.inf)
        raise AssertionError("unreachable")


@pytest.mark.looptime
@pytest.mark.parametrize("engine", [FakeSGLang(hung_from=0.0), SilentEngine(hung_from=0.0)])
async def test_the_pause_check_of_a_hung_engine_reports_nothing_and_gives_up_in_time(
    engine: FakeSGLang,
) -> None:
    events, pool, _handle = joined(engine)
    pool.health.read_pause("engine-0")
    await asyncio.sleep(GatewaySettings().hang_check_timeout + 0.01)
    assert (
        events == [] and pool.health.pause_reads_running() == 0
    )  # the core quarantines it when its check time is up
    await pool.close()


# -- the vocabulary prompt ids are checked against (server/validate.py) ----------------------------------


async def test_the_pool_checks_ids_against_the_smallest_vocabulary_its_engines_state() -> None:
    async with (
        SimCluster(engines=1, vocab_size=1000) as small,
        SimCluster(engines=1, vocab_size=5000) as large,
        aiohttp.ClientSession() as session,
    ):
        pool = EnginePool(GatewaySettings(), lambda _e: None, lambda s: s, lambda _engine: "healthy")
        pool.session = session
        assert pool.vocab_size is None  # no engine, no tokenizer: unknown
        await pool.add(EngineSpec(url=large.urls[0], family="sglang"))
        assert pool.vocab_size == 5000
        small_engine = await pool.add(EngineSpec(url=small.urls[0], family="sglang"))
        assert pool.vocab_size == 1000  # a pool of one model: engines that differ are named in the log
        pool.remove(small_engine.engine_id)
        assert pool.vocab_size == 5000
        await pool.close()


def test_without_engines_that_state_it_the_gateways_tokenizer_gives_the_vocabulary(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes(
        orjson.dumps({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1}}, "added_tokens": [{"id": 2}]})
    )
    pool = EnginePool(
        GatewaySettings(tokenizer=str(tmp_path)), lambda _e: None, lambda s: s, lambda _engine: "healthy"
    )
    assert pool.vocab_size == 3
    handle = EngineHandle(
        engine_id="engine-0",
        url="http://engine",
        client=FakeSGLang(),  # type: ignore[arg-type]
        info=EngineInfo(family=EngineFamily.SGLANG, vocab_size=None),
        capacity=8,
    )
    pool.engines[handle.engine_id] = handle
    pool.remove(handle.engine_id)  # an engine that does not say changes nothing
    assert pool.vocab_size == 3


# -- busy is not dead, dead is not alive (docs/reliability.md) ------------------------------------------------


def pool_with(
    engine: FakeSGLang, *, in_flight: list[int], state: list[str], clock: str = "engine"
) -> tuple[list[tuple[float, Event]], asyncio.Task[None]]:
    """The health loop of a pool whose core holds `in_flight[0]` calls on the engine, in state `state[0]`."""
    events: list[tuple[float, Event]] = []
    loop = asyncio.get_running_loop()
    pool = EnginePool(
        GatewaySettings(clock=clock),
        lambda e: events.append((loop.time(), e)),
        lambda s: s,
        lambda _engine: state[0],
        lambda _engine: in_flight[0],
    )
    handle = EngineHandle(engine_id="engine-0", url=engine.url, client=engine, info=engine.info, capacity=8)  # type: ignore[arg-type]
    pool.engines[handle.engine_id] = handle
    return events, loop.create_task(pool.health.loop(handle))


@pytest.mark.looptime
async def test_a_check_that_hangs_while_the_engine_holds_work_is_no_verdict() -> None:
    """A compile on the first request: SGLang's `/health` waits behind it. The core judges an engine with work
    by its progress (its warm-up, core/liveness.py); the check only counts once the engine has none."""
    engine = FakeSGLang(hung_from=12.0)
    in_flight = [1]
    events, task = pool_with(engine, in_flight=in_flight, state=["healthy"])
    await asyncio.sleep(300)
    assert not [e for _, e in events if isinstance(e, EngineHealthChecked)], events
    in_flight[0] = 0
    await asyncio.sleep(3 * (5 + 15) + 1)
    task.cancel()
    failed = [e for _, e in events if isinstance(e, EngineHealthChecked) and not e.healthy]
    assert len(failed) == 1, events  # three failed checks in a row once it holds nothing


@pytest.mark.looptime
async def test_under_the_wallclock_clock_a_check_that_hangs_counts_though_the_engine_holds_work() -> None:
    """Nothing judges progress under `--clock wallclock`: the health check is the only judge, so a frozen
    engine holding work is found by its checks (three hung in a row), as today's proxies find it."""
    engine = FakeSGLang(hung_from=12.0)
    events, task = pool_with(engine, in_flight=[1], state=["healthy"], clock="wallclock")
    await asyncio.sleep(12 + 3 * (5 + 15) + 1)
    task.cancel()
    failed = [e for _, e in events if isinstance(e, EngineHealthChecked) and not e.healthy]
    assert len(failed) == 1, events


class WedgedEngine(FakeSGLang):
    """`/health` says 200 throughout (vLLM#46811); it generates again from `generates_from` on."""

    def __init__(self, generates_from: float) -> None:
        super().__init__()
        self.generates_from = generates_from
        self.generations_asked: list[str | None] = []

    async def health(self) -> bool:
        return True

    async def generates(self, model: str | None) -> bool:
        self.generations_asked.append(model)
        if self.now() < self.generates_from:
            await asyncio.sleep(math.inf)  # wedged: the token never comes
        return True


@pytest.mark.looptime
async def test_a_quarantined_engine_comes_back_only_by_generating() -> None:
    engine = WedgedEngine(generates_from=100.0)
    state = ["quarantined"]
    events, task = pool_with(engine, in_flight=[0], state=state)
    await asyncio.sleep(99)
    assert not [e for _, e in events if isinstance(e, EngineHealthChecked) and e.healthy], events
    await asyncio.sleep(21)  # a check within a health interval and its timeout of the engine generating again
    task.cancel()
    healthy = [t for t, e in events if isinstance(e, EngineHealthChecked) and e.healthy]
    assert healthy and 100.0 <= healthy[0] <= 100.0 + 5 + 15, events
    assert set(engine.generations_asked) == {"sim-model"}  # the engine's model, as it named it
