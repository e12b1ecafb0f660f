"""The health watch of each joined engine: its pause flag, its health check, and what each says to the core.

Theory of operation: every engine the pool joins is `watch`ed by a loop for its whole life: each round reads its
readiness, then checks its `/health` every `health_interval`, and reports each transition (and every success
while the core holds the engine quarantined) as `EngineHealthChecked`.

A pause nobody told the gateway of. miles' trainer pauses, updates and continues each engine directly. Before
each health check the loop reads the engine's readiness (`EngineClient.readiness`: SGLang `/ready` and `/ping`,
vLLM `/is_paused`, flags that never block on a pause); an engine that says it is paused is reported
`EnginePaused` (the core then charges nothing on it, does not judge its liveness and places nothing there)
and is not health-checked: SGLang's `/health` generates a token, which blocks behind the pause, and when it
times out SGLang marks itself unhealthy. While it is paused the loop looks every `PAUSED_POLL_S`; once it is
ready again it is reported `EngineResumed`. If a health check fails, the readiness is read once more (the
pause may have begun during the check). If SGLang did mark itself unhealthy during the pause (a check that
was under way), `/ping` answers 503 too and readiness is NOT_READY: the engine stays paused and is
health-checked, since only a passing check clears SGLang's mark; it passes once generation continues.

An engine without a pause flag (SGLang 0.5.9: no `/ready`, readiness None) is recognised as paused from what
its scheduler shows (`scheduler_snapshot`: `/get_load`, its requests and tokens): while the gateway has work on
it, each round takes two snapshots `FROZEN_S` apart; both answered at once, with requests held and nothing
changed, it is paused (between batches or prefill chunks its tokens move; inside a forward pass, a compile or
a wedge, it does not answer at once). The pause lasts while the snapshot stays the same, read every
`PAUSED_POLL_S`. Not its `/health`: 0.5.9's passes on any reply of its scheduler, another gateway's or a
monitor's `/get_load` too (CI, 2026-12-06: with the e2e suite's other gateways polling, a 30 s pause went
unseen). An idle engine (nothing held) is seen paused as before: its health check hangs while its scheduler
answers at once. Such a pause is reported `EnginePaused` like a flagged one and is never a failed check.

Busy is not dead. A health check that gets no answer within `health_timeout` says nothing of an engine the
core holds work on: SGLang's `/health` generates a token, which waits behind whatever keeps the engine's
forward pass from returning (a compile on its first request takes minutes, rllm#926), and the core judges such
an engine by its progress (core/liveness.py, with its warm-up for a first request). So a check that hung is
not counted as a failure while the engine has calls in flight (`engine_in_flight`); an engine that answers
an error, refuses the connection, or hangs with nothing to do is counted as before. Under `--clock wallclock`
nothing judges progress (the mode of today's proxies), so there every check that hangs counts, busy or not:
otherwise a frozen engine holding work would never be found (the replay's wallclock mode, docs/replay.md).

Dead is not alive either. An engine the core caught hung (quarantined: work on it made no progress for its
stall window) comes back only by generating: its health check is then a one-token generation
(`EngineClient.generates`), not `/health`, which a wedged vLLM answers 200 for hours while it generates
nothing (vLLM#46811); otherwise each passing check would put it back in service and every call placed there
would wait a stall window again.

Every pause learned here is `unannounced`: the core counts it from the engine's last progress, not from
when it was seen (core/charge_meter.py `backdate_pause`), so the health loop's delay charges nobody.

Before the core judges a silent engine hung it asks for its pause flag (`CheckEngine`, core/liveness.py):
`read_pause` reads it at once, so a pause the health loop has not seen yet (its loop sleeping, or inside a
health check that waits behind the pause) is reported within `hang_check_timeout` and nothing is quarantined.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from rolloutgate.config import GatewaySettings
from rolloutgate.core.events import EngineHealthChecked, EnginePaused, EngineResumed, Event
from rolloutgate.engines.base import Readiness, SchedulerSnapshot, UpstreamError
from rolloutgate.server.engine_handle import HEALTHY, QUARANTINED, EngineHandle

__all__ = ("FROZEN_S", "PAUSED_POLL_S", "PROBE_SHARE", "EngineHealth", "WatchedPool")

log = logging.getLogger("rolloutgate.pool")

PAUSED_POLL_S = 0.25  # gateway seconds between readiness reads of an engine paused by someone else
PROBE_SHARE = 0.6  # of hang_check_timeout: the health probe of a pause check on an engine without a flag
FROZEN_S = 1.0  # gateway seconds between the two scheduler snapshots that show a pause without a flag


class WatchedPool(Protocol):
    """What the watch reads of the pool (server/pool.py): its settings, the core's intake and view, its engines."""

    @property
    def settings(self) -> GatewaySettings: ...
    @property
    def emit(self) -> Callable[[Event], None]: ...
    @property
    def real_seconds(self) -> Callable[[float], float]: ...
    @property
    def engine_state(self) -> Callable[[str], str | None]: ...
    @property
    def engine_in_flight(self) -> Callable[[str], int]: ...
    @property
    def output_at(self) -> Callable[[str], Awaitable[float | None]]: ...
    @property
    def engines(self) -> dict[str, EngineHandle]: ...

    async def renew_info(self, handle: EngineHandle) -> bool: ...


@dataclass(eq=False)
class EngineHealth:
    pool: WatchedPool
    _pause_reads: set[asyncio.Task[bool]] = field(default_factory=set)

    def watch(self, handle: EngineHandle) -> None:
        """Start the engine's loop; it runs until the engine leaves (`forget`) or the pool closes."""
        handle.health_task = asyncio.create_task(self.loop(handle), name=f"health-{handle.engine_id}")

    def forget(self, handle: EngineHandle) -> None:
        if handle.health_task is not None:
            handle.health_task.cancel()

    def pause_reads_running(self) -> int:
        """Pause reads the core asked for (`read_pause`) still under way."""
        return len(self._pause_reads)

    async def close(self) -> None:
        tasks = [h.health_task for h in self.pool.engines.values() if h.health_task] + list(self._pause_reads)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def read_pause(self, engine_id: str) -> None:
        """The core is about to judge the engine hung (CheckEngine): read now whether it is paused, rather
        than when its health loop next looks (a health check under way may take `health_timeout`). An engine
        without a flag gets a short health probe (`PROBE_SHARE` of `hang_check_timeout`): hanging while its
        scheduler answers, it is paused."""
        handle = self.pool.engines.get(engine_id)
        if handle is None or handle.is_in_maintenance():
            return
        task = asyncio.create_task(self._read_pause(handle), name=f"pause-read-{engine_id}")
        self._pause_reads.add(task)
        task.add_done_callback(self._pause_reads.discard)

    async def paused_now(self, engine_id: str) -> bool:
        """Whether the engine says (or shows) that its generation is paused, read now; reported to the core
        as `EnginePaused` when it is. False for an engine that is gone or does not answer in time."""
        handle = self.pool.engines.get(engine_id)
        if handle is None:
            return False
        return await self._read_pause(handle)

    async def _read_pause(self, handle: EngineHandle) -> bool:
        check_s = self.pool.settings.hang_check_timeout
        try:
            async with asyncio.timeout(self.pool.real_seconds(check_s)):
                readiness = await handle.client.readiness()
                paused, frozen = readiness is Readiness.PAUSED, None
                if readiness is None:  # no flag: its scheduler's snapshot frozen, else a hung probe (idle)
                    frozen = await self._paused_without_flag(handle)
                    paused = frozen is not None
                    if not paused:
                        probe = await self._check_health(handle, check_s * PROBE_SHARE)
                        paused = probe is None and await self._scheduler_idle(handle)
        except TimeoutError:
            return False  # no answer in time (hung, as a rule): the core judges it when its check time is up
        if paused and self.pool.engines.get(handle.engine_id) is handle:
            await self._paused_by_engine(handle, frozen)
        return paused

    async def loop(self, handle: EngineHandle) -> None:
        """Each engine's watch, for its whole life: a round that raises is logged and the next one runs (a lost
        loop would leave the engine unwatched: a pause nobody announced charged, a resume never seen)."""
        interval = self.pool.real_seconds(self.pool.settings.health_interval)
        paused_interval = min(interval, self.pool.real_seconds(PAUSED_POLL_S))
        while True:
            await asyncio.sleep(paused_interval if handle.paused_by_engine else interval)
            try:
                await self._health_round(handle)
            except Exception:  # a gateway bug: the loop goes on (cancellation is not an Exception)
                log.exception("%s: health check round failed", handle.engine_id)

    async def _health_round(self, handle: EngineHandle) -> None:
        """One look at the engine: its pause flag, then its health check (module docstring)."""
        client = handle.client
        if handle.is_in_maintenance():
            return  # the admin API pauses or updates it (server/admin.py): its pause is the gateway's
        readiness = await client.readiness()
        if readiness is Readiness.PAUSED:
            await self._paused_by_engine(handle)
            return
        if handle.paused_by_engine and readiness is None:  # a pause seen in what it shows (docstring)
            if handle.paused_snapshot is not None:  # seen frozen: paused while its snapshot stays so
                if await client.scheduler_snapshot() != handle.paused_snapshot:
                    await self._resumed_by_engine(handle)
                return
            outcome = await self._check_health(handle)  # seen idle, by a hung check
            if handle.is_in_maintenance() or (outcome is None and await self._scheduler_idle(handle)):
                return  # still paused (or the admin API's now)
            await self._resumed_by_engine(handle)
            await self._record_check(handle, outcome)
            return
        if handle.paused_by_engine and readiness is Readiness.NOT_READY:
            if await self._check_health(handle):  # clears SGLang's mark once generation continues
                await self._resumed_by_engine(handle)
                await self._record_health(handle, True)
            return
        if handle.paused_by_engine:
            await self._resumed_by_engine(handle)
        if readiness is None and self.pool.engine_in_flight(handle.engine_id) > 0:
            frozen = await self._paused_without_flag(handle)
            if frozen is not None and not handle.is_in_maintenance():
                await self._paused_by_engine(handle, frozen)
                return
        ok = await self._check_health(handle)
        if handle.is_in_maintenance():
            return  # a paused or updating engine may fail its health probe (SGLang's generates a token)
        if not ok:
            again = await client.readiness()  # the pause may have begun during the check
            if again is Readiness.PAUSED:
                await self._paused_by_engine(handle)
                return
            if again is None and ok is None:  # hung: paused if its scheduler is frozen, or idle
                frozen = await self._paused_without_flag(handle)
                if frozen is not None or await self._scheduler_idle(handle):
                    await self._paused_by_engine(handle, frozen)
                    return
        await self._record_check(handle, ok)

    async def _check_health(self, handle: EngineHandle, limit_s: float | None = None) -> bool | None:
        """True: the check passed; False: it failed; None: no answer within `limit_s` gateway seconds
        (`health_timeout` by default): it hangs. An engine the core holds quarantined (caught hung) must
        generate a token to pass (module docstring)."""
        try:
            async with asyncio.timeout(self.pool.real_seconds(limit_s or self.pool.settings.health_timeout)):
                if self.pool.engine_state(handle.engine_id) == QUARANTINED:
                    model = handle.info.models[0] if handle.info.models else None
                    return await handle.client.generates(model)
                return await handle.client.health()
        except TimeoutError:
            return None
        except UpstreamError:
            return False

    async def _paused_without_flag(self, handle: EngineHandle) -> SchedulerSnapshot | None:
        """An engine without a pause flag, paused: its scheduler answers at once, holds requests, and holds
        them unchanged `FROZEN_S` later (between batches or prefill chunks its tokens move; inside a forward
        pass it does not answer). The frozen snapshot; None when not so."""
        first = await handle.client.scheduler_snapshot()
        if first is None or first.requests == 0:
            return None
        await asyncio.sleep(self.pool.real_seconds(FROZEN_S))
        return first if await handle.client.scheduler_snapshot() == first else None

    async def _scheduler_idle(self, handle: EngineHandle) -> bool:
        """Its scheduler answers at once and holds nothing: with a hung health check, an idle pause (a busy one
        shows in `_paused_without_flag`; a scheduler inside a forward pass does not answer)."""
        snapshot = await handle.client.scheduler_snapshot()
        return snapshot is not None and snapshot.requests == 0

    async def _paused_by_engine(self, handle: EngineHandle, frozen: SchedulerSnapshot | None = None) -> None:
        handle.paused_snapshot = frozen
        output_at = None
        if not handle.paused_by_engine:
            handle.paused_by_engine = True
            output_at = await self.pool.output_at(handle.engine_id)
            log.warning(
                "%s (%s) says its generation is paused, and not by the gateway: nothing on it is charged or "
                "judged hung until it continues",
                handle.engine_id,
                handle.url,
            )
        # every reading (the core ignores a repeat): an admin pause that ended meanwhile resumed it in the core
        self.pool.emit(EnginePaused(engine_id=handle.engine_id, unannounced=True, last_output_at=output_at))

    async def _resumed_by_engine(self, handle: EngineHandle) -> None:
        handle.paused_by_engine, handle.paused_snapshot = False, None
        log.warning("%s (%s) continues generating", handle.engine_id, handle.url)
        self.pool.emit(EngineResumed(engine_id=handle.engine_id))
        await self._read_weight_version(handle)

    async def _read_weight_version(self, handle: EngineHandle, after: str = "its pause") -> None:
        """After a pause nobody told the gateway of (a trainer's weight update, as a rule), or a restart: a
        new weight version means new weights, so the engine's prefix cache counts as flushed (SGLang flushes
        it on an update; miles' trainer flushes it too) and placement prices its sessions' next turns as
        cold."""
        try:
            await self.pool.renew_info(handle)
        except UpstreamError as error:
            log.info("%s: no weight version after %s: %s", handle.engine_id, after, error.message)

    async def _record_check(self, handle: EngineHandle, outcome: bool | None) -> None:
        """A health check's outcome (`_check_health`); one that hung while the core holds work on the engine
        is no verdict: its liveness judges it by its progress (module docstring, "Busy is not dead")."""
        judged_by_progress = self.pool.settings.clock == "engine"
        if outcome is None and judged_by_progress and self.pool.engine_in_flight(handle.engine_id) > 0:
            log.debug(
                "%s: health check unanswered while it holds work; its progress judges it", handle.engine_id
            )
            return
        await self._record_health(handle, outcome is True)

    async def _record_health(self, handle: EngineHandle, ok: bool) -> None:
        if ok:
            recovers = self.pool.engine_state(handle.engine_id) != HEALTHY  # unhealthy, or quarantined
            if handle.consecutive_failures or recovers:
                # back after failing: perhaps a new process, holding the weights it was launched with, not
                # the fleet's; its version is read before it may take work (a version policy sees the lag)
                await self._read_weight_version(handle, after="its failed health checks")
            handle.consecutive_failures = 0
            if recovers:
                self.pool.emit(EngineHealthChecked(engine_id=handle.engine_id, healthy=True))
            return
        handle.consecutive_failures += 1
        if handle.consecutive_failures == self.pool.settings.health_failures:  # once per run of failures
            self.pool.emit(EngineHealthChecked(engine_id=handle.engine_id, healthy=False))
