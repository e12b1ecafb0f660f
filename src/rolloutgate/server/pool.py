"""The engine pool at the edge: adapters, probing, health checks; the core learns of it through events.

Theory of operation: each engine has an id (`engine-N`), a URL, an adapter and a health loop. Joining probes
the engine (family, capacity); the health loop checks `/health` every `health_interval` and reports each
transition (and every success while the core holds the engine quarantined) as `EngineHealthChecked`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from rolloutgate.config import EngineSpec, GatewaySettings
from rolloutgate.core.admission import default_prefill_budget
from rolloutgate.core.events import EngineHealthChecked, EngineJoined, EngineLeft, Event
from rolloutgate.engines.base import EngineClient, EngineFamily, EngineInfo, UpstreamError
from rolloutgate.engines.detect import detect_family, make_client

__all__ = ("EngineHandle", "EnginePool")

log = logging.getLogger("rolloutgate.pool")


@dataclass(eq=False, slots=True)
class EngineHandle:
    engine_id: str
    url: str
    client: EngineClient
    info: EngineInfo
    capacity: int
    healthy: bool = True
    state: str = "healthy"  # last MarkEngine state from the core
    health_task: asyncio.Task[None] | None = None
    consecutive_failures: int = 0
    maintenance: int = 0  # > 0 while the admin API pauses or updates it: health checks are not judged

    def describe(self) -> dict[str, object]:
        return {
            "id": self.engine_id,
            "url": self.url,
            "family": self.info.family.value,
            "capacity": self.capacity,
            "healthy": self.healthy,
            "state": self.state,
            "models": list(self.info.models),
            "weight_version": self.info.weight_version,
        }


@dataclass(eq=False)
class EnginePool:
    settings: GatewaySettings
    emit: Callable[[Event], None]  # the driver's event intake
    real_seconds: Callable[[float], float]  # gateway seconds -> real seconds (time scale)
    session: aiohttp.ClientSession = field(init=False)  # set when the app starts
    engines: dict[str, EngineHandle] = field(default_factory=dict)
    _ids: itertools.count[int] = field(default_factory=itertools.count)

    async def add(self, spec: EngineSpec) -> EngineHandle:
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
            engine_id=f"engine-{next(self._ids)}",
            url=spec.url,
            client=client,
            info=info,
            capacity=capacity,
        )
        self.engines[handle.engine_id] = handle
        budget = self.prefill_budget(info, capacity)
        self.emit(EngineJoined(engine_id=handle.engine_id, capacity=capacity, prefill_token_budget=budget))
        handle.health_task = asyncio.create_task(self._health_loop(handle), name=f"health-{handle.engine_id}")
        log.info("engine joined", extra={"engine": handle.engine_id, "url": spec.url, "capacity": capacity})
        return handle

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
        return handle

    def by_url(self, url: str) -> EngineHandle | None:
        url = url.rstrip("/")
        return next((h for h in self.engines.values() if h.url == url), None)

    async def close(self) -> None:
        for handle in self.engines.values():
            if handle.health_task is not None:
                handle.health_task.cancel()
        await asyncio.gather(
            *(h.health_task for h in self.engines.values() if h.health_task), return_exceptions=True
        )

    async def _health_loop(self, handle: EngineHandle) -> None:
        interval = self.real_seconds(self.settings.health_interval)
        timeout = self.real_seconds(self.settings.health_timeout)
        while True:
            await asyncio.sleep(interval)
            try:
                async with asyncio.timeout(timeout):
                    ok = await handle.client.health()
            except (TimeoutError, UpstreamError):
                ok = False
            if handle.maintenance:
                continue  # a paused or updating engine may fail its health probe (SGLang's generates a token)
            self._record_health(handle, ok)

    def _record_health(self, handle: EngineHandle, ok: bool) -> None:
        if ok:
            handle.consecutive_failures = 0
            if not handle.healthy or handle.state != "healthy":
                handle.healthy = True
                self.emit(EngineHealthChecked(engine_id=handle.engine_id, healthy=True))
            return
        handle.consecutive_failures += 1
        if handle.healthy and handle.consecutive_failures >= self.settings.health_failures:
            handle.healthy = False
            self.emit(EngineHealthChecked(engine_id=handle.engine_id, healthy=False))
