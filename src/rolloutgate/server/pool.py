"""The engine pool at the edge: adapters, probing, health checks; the core learns of it through events.

Theory of operation: each engine has an id (`engine-N`), a URL, an adapter and a health loop. Joining probes
the engine (family, capacity); the health loop checks `/health` every `health_interval` and reports each
transition (and every success while the core holds the engine quarantined) as `EngineHealthChecked`.

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
an error, refuses the connection, or hangs with nothing to do is counted as before.

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

Registration. An engine given at start (`--engine`) or registered through the worker API (`POST /workers`,
`/add_worker?url=`) is `register`ed: it joins at once when its probe succeeds; otherwise (not listening yet,
starting, or not answering as an engine) it is kept as pending, with its id already given and the reason of the
last failed probe, and is probed again every `health_interval` until it joins or is removed. A pending engine
is listed by the worker API (state `pending`) and in `/admin/state`, counts in `rolloutgate_engine_state`, and
takes no work: the core learns of an engine only when it joins. Registering a URL again, pending or joined,
answers what is there. An engine that joins with defaults (`EngineInfo.missing`: an SGLang-speaking stand-in
without `/server_info` or `/v1/models`) is named in the log once, with what stands in.

The vocabulary. Every prompt id is checked against `vocab_size` at the front, before the request is queued
(server/validate.py): the smallest vocabulary the pool's engines state (`EngineInfo.vocab_size`, learned at
each probe), else the gateway's own `--tokenizer` folder's, else none (unknown: ids are checked for type and
sign only, and the log says so once). The smallest, not the placed engine's: placement happens later, in the
core, and a pool serves one model, whose engines agree (a pool where they differ is named in the log).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import aiohttp

from rolloutgate.config import EngineSpec, GatewaySettings
from rolloutgate.core.admission import default_prefill_budget
from rolloutgate.core.engine_state import EngineState
from rolloutgate.core.events import (
    EngineCacheFlushed,
    EngineHealthChecked,
    EngineJoined,
    EngineLeft,
    EnginePaused,
    EngineResumed,
    EngineVersionLag,
    Event,
)
from rolloutgate.core.stats import EngineStats
from rolloutgate.engines.base import (
    EngineClient,
    EngineFamily,
    EngineInfo,
    Readiness,
    SchedulerSnapshot,
    UpstreamError,
)
from rolloutgate.engines.detect import detect_family, make_client
from rolloutgate.server.fleet_versions import FleetVersions
from rolloutgate.vocabulary import folder_vocab_size

__all__ = ("PENDING", "EngineHandle", "EnginePool", "PendingEngine")

log = logging.getLogger("rolloutgate.pool")

HEALTHY = EngineState.HEALTHY.value
QUARANTINED = EngineState.QUARANTINED.value
PENDING = "pending"  # registered, not joined yet: its probe has not succeeded (module docstring)
PAUSED_POLL_S = 0.25  # gateway seconds between readiness reads of an engine paused by someone else
PROBE_SHARE = 0.6  # of hang_check_timeout: the health probe of a pause check on an engine without a flag
FROZEN_S = 1.0  # gateway seconds between the two scheduler snapshots that show a pause without a flag


@dataclass(eq=False, slots=True)
class EngineHandle:
    engine_id: str
    url: str
    client: EngineClient
    info: EngineInfo
    capacity: int
    health_task: asyncio.Task[None] | None = None
    consecutive_failures: int = 0
    maintenance: int = 0  # > 0 while the admin API pauses or updates it: health checks are not judged
    paused_by_engine: bool = False  # it says it is paused, and not by the gateway (a trainer, directly)
    # what a trainer's calls through the RL control plane stopped on it ("pause", "sleep": server/rl_plane.py)
    control_holds: set[str] = field(default_factory=set)
    # an engine without a pause flag seen paused by its scheduler's frozen snapshot: that snapshot, until it moves
    paused_snapshot: SchedulerSnapshot | None = None

    def is_in_maintenance(self) -> bool:
        return self.maintenance > 0

    def describe(self, state: str | None) -> dict[str, object]:
        """The engine as the admin API shows it, with its state in the core (an EngineState value)."""
        return {
            "id": self.engine_id,
            "url": self.url,
            "family": self.info.family.value,
            "capacity": self.capacity,
            "healthy": state == HEALTHY,
            "state": state,
            "paused_by_engine": self.paused_by_engine,
            "models": list(self.info.models),
            "weight_version": self.info.weight_version,
            "missing": list(self.info.missing),
        }


@dataclass(eq=False, slots=True)
class PendingEngine:
    """An engine registered and not joined yet (module docstring): probed again until it answers."""

    engine_id: str  # the one it joins with
    spec: EngineSpec
    registered_at: float  # wall-clock seconds
    first_try: asyncio.Future[None]  # set once its first probe ended, whatever the outcome
    task: asyncio.Task[None] | None = None
    attempts: int = 0
    error: str | None = None  # why the last probe failed

    @property
    def url(self) -> str:
        return self.spec.url

    def describe(self) -> dict[str, object]:
        """As the worker API shows an engine (EngineHandle.describe), with what its probes met."""
        return {
            "id": self.engine_id,
            "url": self.spec.url,
            "family": self.spec.family,
            "capacity": self.spec.capacity,
            "healthy": False,
            "state": PENDING,
            "paused_by_engine": False,
            "models": [],
            "weight_version": None,
            "missing": [],
            "registered_at": self.registered_at,
            "attempts": self.attempts,
            "error": self.error,
        }


async def _unknown_output_at(_engine_id: str) -> float | None:
    return None


@dataclass(eq=False)
class EnginePool:
    settings: GatewaySettings
    emit: Callable[[Event], None]  # the driver's event intake
    real_seconds: Callable[[float], float]  # gateway seconds -> real seconds (time scale)
    engine_state: Callable[[str], str | None]  # the core's state of an engine: the one source of it
    # the calls the core has in flight on an engine (a check that hangs then is no verdict: docstring)
    engine_in_flight: Callable[[str], int] = field(default=lambda _engine_id: 0)
    # when an engine's last token came, read from its counter at once (EngineWatcher.output_at); None: unknown
    output_at: Callable[[str], Awaitable[float | None]] = field(default=_unknown_output_at)
    session: aiohttp.ClientSession = field(init=False)  # set when the app starts
    engines: dict[str, EngineHandle] = field(default_factory=dict)
    pending: dict[str, PendingEngine] = field(default_factory=dict)  # by URL
    # the bound every prompt id must stay under (module docstring); None while unknown
    vocab_size: int | None = field(init=False, default=None)
    _ids: itertools.count[int] = field(default_factory=itertools.count)
    _pause_reads: set[asyncio.Task[None]] = field(default_factory=set)
    _tokenizer_vocab: int | None = field(init=False, default=None)
    _told_unknown_vocab: bool = field(init=False, default=False)
    versions: FleetVersions = field(default_factory=FleetVersions)  # how far each engine's weights lag
    peer_versions: dict[str, str | None] = field(default_factory=dict)  # a fleet's other engines (by URL)

    def __post_init__(self) -> None:
        if self.settings.tokenizer:
            self._tokenizer_vocab = folder_vocab_size(self.settings.tokenizer)
        self._pool_changed()

    async def register(self, spec: EngineSpec) -> EngineHandle | PendingEngine:
        """Join the engine, or keep it pending while its probe fails (module docstring); returns once its
        first probe ended. The same URL again answers what is there: the engine, or its pending entry."""
        handle = self.by_url(spec.url)
        if handle is not None:
            return handle
        pending = self.pending.get(spec.url)
        if pending is None:
            pending = PendingEngine(
                engine_id=self._next_id(),
                spec=spec,
                registered_at=time.time(),
                first_try=asyncio.get_running_loop().create_future(),
            )
            self.pending[spec.url] = pending
            pending.task = asyncio.create_task(self._join_when_up(pending), name=f"join-{pending.engine_id}")
        await asyncio.wait([pending.first_try])  # a caller that goes away leaves it to its task
        return self.by_url(spec.url) or pending

    async def _join_when_up(self, pending: PendingEngine) -> None:
        retry_s = self.real_seconds(self.settings.health_interval)
        try:
            while True:
                try:
                    await self.add(pending.spec, engine_id=pending.engine_id)
                    return
                except UpstreamError as error:
                    pending.attempts += 1
                    if pending.attempts == 1 or error.message != pending.error:
                        log.warning(
                            "engine %s (%s) not reachable yet (%s); kept pending, probed every %.3g s",
                            pending.engine_id,
                            pending.url,
                            error.message,
                            retry_s,
                        )
                    pending.error = error.message
                finally:
                    if not pending.first_try.done():
                        pending.first_try.set_result(None)
                await asyncio.sleep(retry_s)
        finally:
            if self.pending.get(pending.url) is pending:  # joined (in the same step), removed or closed
                del self.pending[pending.url]
            if not pending.first_try.done():
                pending.first_try.set_result(None)

    def find_pending(self, key: str) -> PendingEngine | None:
        """The pending engine with this id or URL."""
        key = key.rstrip("/")
        return self.pending.get(key) or next((p for p in self.pending.values() if p.engine_id == key), None)

    def drop_pending(self, pending: PendingEngine) -> None:
        """Forget a registered engine that never joined: it is probed no more."""
        if self.pending.get(pending.url) is pending:
            del self.pending[pending.url]
        if pending.task is not None:
            pending.task.cancel()
        log.info("engine %s (%s) removed before it joined", pending.engine_id, pending.url)

    def _next_id(self) -> str:
        return f"engine-{next(self._ids)}"

    async def add(self, spec: EngineSpec, *, engine_id: str | None = None) -> EngineHandle:
        """Probe and join an engine. Raises UpstreamError if it cannot be reached."""
        for handle in self.engines.values():
            if handle.url == spec.url:
                return handle
        family = (
            EngineFamily(spec.family)
            if spec.family != "auto"
            else await detect_family(self.session, spec.url)
        )
        client = make_client(family, spec.url, self.session)
        info = await client.probe()
        capacity = spec.capacity or self.settings.capacity or info.capacity or self.settings.default_capacity
        handle = EngineHandle(
            engine_id=engine_id or self._next_id(),
            url=spec.url,
            client=client,
            info=info,
            capacity=capacity,
        )
        self.engines[handle.engine_id] = handle
        budget = self.prefill_budget(info, capacity)
        self.emit(EngineJoined(engine_id=handle.engine_id, capacity=capacity, prefill_token_budget=budget))
        self._pool_changed()  # after it joined: the core learns how far its weights lag
        handle.health_task = asyncio.create_task(self._health_loop(handle), name=f"health-{handle.engine_id}")
        log.info("engine joined", extra={"engine": handle.engine_id, "url": spec.url, "capacity": capacity})
        if info.missing:
            self._joined_with_defaults(handle, spec)
        return handle

    def _joined_with_defaults(self, handle: EngineHandle, spec: EngineSpec) -> None:
        """The one warning for an engine that joined with defaults (EngineInfo.missing)."""
        info = handle.info
        if spec.capacity or self.settings.capacity:
            capacity_from = "as configured"
        else:
            capacity_from = "its own" if info.capacity else "--default-capacity"
        log.warning(
            "%s (%s) has no %s: joined as %s with defaults: capacity %d (%s), models %s, context length %s, "
            "weight version %s%s",
            handle.engine_id,
            handle.url,
            ", ".join(info.missing),
            info.family.value,
            handle.capacity,
            capacity_from,
            ", ".join(info.models) or "none known",
            info.max_model_len or "not known",
            info.weight_version or "none",
            "; it reports no load, so each call it can stream is streamed (its events are its progress)"
            if not handle.client.reports_load
            else "",
        )

    def prefill_budget(self, info: EngineInfo, capacity: int) -> float:
        """The engine's prefill token budget: configured, derived from its chunk size and capacity, or none."""
        configured = self.settings.prefill_budget_tokens
        if configured is None:
            return default_prefill_budget(info.chunked_prefill_size, capacity)
        return math.inf if configured == 0 else configured

    def remove(self, engine_id: str) -> EngineHandle | None:
        handle = self.engines.pop(engine_id, None)
        if handle is None:
            return None
        if handle.health_task is not None:
            handle.health_task.cancel()
        self.emit(EngineLeft(engine_id=engine_id))
        self._pool_changed()
        return handle

    def learn_peer_versions(self, versions: Mapping[str, str | None]) -> None:
        """The weight versions of a fleet's engines (by URL), as their owners last reported them: this pool's
        engines' lags count from the newest any engine of the fleet holds (fleet/replica.py)."""
        own = {h.url for h in self.engines.values()}
        peers = {url: label for url, label in versions.items() if url not in own}
        if peers != self.peer_versions:
            self.peer_versions = peers
            self._pool_changed()

    def _pool_changed(self) -> None:
        """What follows from the engines and their facts: the vocabulary, and how many weight versions each
        engine is behind the newest in the pool, or in its fleet (server/fleet_versions.py)."""
        self._learn_vocab()
        held = {h.engine_id: h.info.weight_version for h in self.engines.values()}
        own = set(held)
        own_urls = {h.url for h in self.engines.values()}  # an engine handed here meanwhile counts as its own
        held.update({f"peer {u}": label for u, label in self.peer_versions.items() if u not in own_urls})
        for engine_id, lag in self.versions.judge(held):
            if engine_id not in own:
                continue
            log.warning(
                "%s holds weight version %s, %d behind the pool's newest (%s): requests whose version policy "
                "allows less do not start there",
                engine_id,
                held[engine_id],
                lag,
                self.versions.fleet_version(held),
            )
            self.emit(EngineVersionLag(engine_id=engine_id, lag=lag))

    async def renew_info(self, handle: EngineHandle) -> bool:
        """Probe the engine again for its facts (its weight version above all); True when the version changed:
        new weights, so its prefix cache counts as flushed (SGLang flushes it on an update) and placement
        prices its sessions' next turns as cold. Raises UpstreamError when it does not answer."""
        info = await handle.client.probe()  # also renews the adapter's weight version for its answers
        changed = info.weight_version != handle.info.weight_version
        if changed:
            log.warning(
                "%s weight version %s -> %s: its prefix cache counts as flushed",
                handle.engine_id,
                handle.info.weight_version,
                info.weight_version,
            )
        handle.info = info
        self._pool_changed()
        if changed:
            self.emit(EngineCacheFlushed(engine_id=handle.engine_id))
        return changed

    def _learn_vocab(self) -> None:
        """`vocab_size` from the engines and the tokenizer (module docstring), after the pool changed."""
        stated = {h.engine_id: h.info.vocab_size for h in self.engines.values() if h.info.vocab_size}
        if len(set(stated.values())) > 1:
            log.warning(
                "the engines state different vocabularies %s: prompt ids are checked against the smallest",
                stated,
            )
        vocab = min(stated.values()) if stated else self._tokenizer_vocab
        if vocab is None and self.engines and not self._told_unknown_vocab:
            self._told_unknown_vocab = True
            log.warning(
                "no engine states its vocabulary and its model folder cannot be read here, and no --tokenizer "
                "is given: prompt token ids are checked for type and sign only, and one past the vocabulary "
                "can take an SGLang engine down"
            )
        self.vocab_size = vocab

    def healthy(self) -> list[EngineHandle]:
        """The engines the core holds healthy."""
        return [h for h in self.engines.values() if self.engine_state(h.engine_id) == HEALTHY]

    def describe(self, handle: EngineHandle) -> dict[str, object]:
        return handle.describe(self.engine_state(handle.engine_id))

    def describe_live(
        self, handle: EngineHandle, engine: EngineStats | None, *, is_gate_open: bool, now: float
    ) -> dict[str, object]:
        """`describe` with what the core knows of the engine at `now` (its `stats()` entry, None if the core
        does not know it yet): its load, long prefills, pauses and liveness, as `/admin/state` shows them."""
        described = self.describe(handle)
        if engine is None:
            return described
        is_watched = engine.hung_at != math.inf  # it has work and nothing suspends its liveness
        described.update(
            running=engine.in_flight,
            queued=engine.waiting,
            prefilling=engine.large_prefills > 0,
            quarantined=engine.state == EngineState.QUARANTINED.value,
            # the gate is closed, or the gateway paused this one engine (a staggered update)
            paused_by_gate=not is_gate_open or (engine.is_paused and not handle.paused_by_engine),
            generated_tokens=engine.generated_tokens,
            silent_s=round(now - engine.silent_since_at, 3) if is_watched else None,
            hung_after_s=round(engine.hung_at - engine.silent_since_at, 3) if is_watched else None,
        )
        return described

    def by_url(self, url: str) -> EngineHandle | None:
        url = url.rstrip("/")
        return next((h for h in self.engines.values() if h.url == url), None)

    async def close(self) -> None:
        tasks = [h.health_task for h in self.engines.values() if h.health_task] + list(self._pause_reads)
        tasks += [p.task for p in self.pending.values() if p.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def read_pause(self, engine_id: str) -> None:
        """The core is about to judge the engine hung (CheckEngine): read now whether it is paused, rather
        than when its health loop next looks (a health check under way may take `health_timeout`). An engine
        without a flag gets a short health probe (`PROBE_SHARE` of `hang_check_timeout`): hanging while its
        scheduler answers, it is paused."""
        handle = self.engines.get(engine_id)
        if handle is None or handle.is_in_maintenance():
            return
        task = asyncio.create_task(self._read_pause(handle), name=f"pause-read-{engine_id}")
        self._pause_reads.add(task)
        task.add_done_callback(self._pause_reads.discard)

    async def _read_pause(self, handle: EngineHandle) -> None:
        check_s = self.settings.hang_check_timeout
        try:
            async with asyncio.timeout(self.real_seconds(check_s)):
                readiness = await handle.client.readiness()
                paused, frozen = readiness is Readiness.PAUSED, None
                if readiness is None:  # no flag: its scheduler's snapshot frozen, else a hung probe (idle)
                    frozen = await self._paused_without_flag(handle)
                    paused = frozen is not None
                    if not paused:
                        probe = await self._check_health(handle, check_s * PROBE_SHARE)
                        paused = probe is None and await self._scheduler_idle(handle)
        except TimeoutError:
            return  # no answer in time (hung, as a rule): the core judges it when its check time is up
        if paused and self.engines.get(handle.engine_id) is handle:
            await self._paused_by_engine(handle, frozen)

    async def _health_loop(self, handle: EngineHandle) -> None:
        """Each engine's watch, for its whole life: a round that raises is logged and the next one runs (a lost
        loop would leave the engine unwatched: a pause nobody announced charged, a resume never seen)."""
        interval = self.real_seconds(self.settings.health_interval)
        paused_interval = min(interval, self.real_seconds(PAUSED_POLL_S))
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
        if readiness is None and self.engine_in_flight(handle.engine_id) > 0:
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
            async with asyncio.timeout(self.real_seconds(limit_s or self.settings.health_timeout)):
                if self.engine_state(handle.engine_id) == QUARANTINED:
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
        await asyncio.sleep(self.real_seconds(FROZEN_S))
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
            output_at = await self.output_at(handle.engine_id)
            log.warning(
                "%s (%s) says its generation is paused, and not by the gateway: nothing on it is charged or "
                "judged hung until it continues",
                handle.engine_id,
                handle.url,
            )
        # every reading (the core ignores a repeat): an admin pause that ended meanwhile resumed it in the core
        self.emit(EnginePaused(engine_id=handle.engine_id, unannounced=True, last_output_at=output_at))

    async def _resumed_by_engine(self, handle: EngineHandle) -> None:
        handle.paused_by_engine, handle.paused_snapshot = False, None
        log.warning("%s (%s) continues generating", handle.engine_id, handle.url)
        self.emit(EngineResumed(engine_id=handle.engine_id))
        await self._read_weight_version(handle)

    async def _read_weight_version(self, handle: EngineHandle, after: str = "its pause") -> None:
        """After a pause nobody told the gateway of (a trainer's weight update, as a rule), or a restart: a
        new weight version means new weights, so the engine's prefix cache counts as flushed (SGLang flushes
        it on an update; miles' trainer flushes it too) and placement prices its sessions' next turns as
        cold."""
        try:
            await self.renew_info(handle)
        except UpstreamError as error:
            log.info("%s: no weight version after %s: %s", handle.engine_id, after, error.message)

    async def _record_check(self, handle: EngineHandle, outcome: bool | None) -> None:
        """A health check's outcome (`_check_health`); one that hung while the core holds work on the engine
        is no verdict: its liveness judges it by its progress (module docstring, "Busy is not dead")."""
        if outcome is None and self.engine_in_flight(handle.engine_id) > 0:
            log.debug(
                "%s: health check unanswered while it holds work; its progress judges it", handle.engine_id
            )
            return
        await self._record_health(handle, outcome is True)

    async def _record_health(self, handle: EngineHandle, ok: bool) -> None:
        if ok:
            recovers = self.engine_state(handle.engine_id) != HEALTHY  # unhealthy, or quarantined
            if handle.consecutive_failures or recovers:
                # back after failing: perhaps a new process, holding the weights it was launched with, not
                # the fleet's; its version is read before it may take work (a version policy sees the lag)
                await self._read_weight_version(handle, after="its failed health checks")
            handle.consecutive_failures = 0
            if recovers:
                self.emit(EngineHealthChecked(engine_id=handle.engine_id, healthy=True))
            return
        handle.consecutive_failures += 1
        if handle.consecutive_failures == self.settings.health_failures:  # once per run of failures
            self.emit(EngineHealthChecked(engine_id=handle.engine_id, healthy=False))
