"""The engine pool at the edge: adapters, probing, registration; the core learns of it through events.

Theory of operation: each engine has an id (`engine-N`), a URL, an adapter and a health watch. Joining probes
the engine (family, capacity, vocabulary, weight version) and starts its watch (server/engine_health.py: its
pause flag, its health check, what a busy or a hung engine is); leaving stops it. The pool keeps what follows
from the engines' facts: the vocabulary prompts are checked against, and each engine's weight lag.

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
from rolloutgate.core.events import EngineCacheFlushed, EngineJoined, EngineLeft, EngineVersionLag, Event
from rolloutgate.core.stats import EngineStats
from rolloutgate.engines.base import EngineFamily, EngineInfo, UpstreamError
from rolloutgate.engines.detect import detect_family, make_client
from rolloutgate.server.engine_handle import HEALTHY, EngineHandle, PendingEngine
from rolloutgate.server.engine_health import EngineHealth
from rolloutgate.server.fleet_versions import FleetVersions
from rolloutgate.vocabulary import folder_vocab_size

__all__ = ("EnginePool",)

log = logging.getLogger("rolloutgate.pool")


async def _unknown_output_at(_engine_id: str) -> float | None:
    return None


@dataclass(eq=False)
class EnginePool:
    settings: GatewaySettings
    emit: Callable[[Event], None]  # the driver's event intake
    real_seconds: Callable[[float], float]  # gateway seconds -> real seconds (time scale)
    engine_state: Callable[[str], str | None]  # the core's state of an engine: the one source of it
    # the calls the core has in flight on an engine (a check that hangs then is no verdict: server/engine_health.py)
    engine_in_flight: Callable[[str], int] = field(default=lambda _engine_id: 0)
    # when an engine's last token came, read from its counter at once (EngineWatcher.output_at); None: unknown
    output_at: Callable[[str], Awaitable[float | None]] = field(default=_unknown_output_at)
    session: aiohttp.ClientSession = field(init=False)  # set when the app starts
    engines: dict[str, EngineHandle] = field(default_factory=dict)
    pending: dict[str, PendingEngine] = field(default_factory=dict)  # by URL
    # the bound every prompt id must stay under (module docstring); None while unknown
    vocab_size: int | None = field(init=False, default=None)
    _ids: itertools.count[int] = field(default_factory=itertools.count)
    _tokenizer_vocab: int | None = field(init=False, default=None)
    _told_unknown_vocab: bool = field(init=False, default=False)
    versions: FleetVersions = field(default_factory=FleetVersions)  # how far each engine's weights lag
    peer_versions: dict[str, str | None] = field(default_factory=dict)  # a fleet's other engines (by URL)
    health: EngineHealth = field(init=False)  # each joined engine's watch (server/engine_health.py)

    def __post_init__(self) -> None:
        self.health = EngineHealth(self)
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
        self.health.watch(handle)
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
        self.health.forget(handle)
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
        tasks = [p.task for p in self.pending.values() if p.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(self.health.close(), *tasks, return_exceptions=True)
