"""The gateway's shared state at the edge, stored once on the aiohttp app (typed with `web.AppKey`)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from rolloutgate.config import GatewaySettings
from rolloutgate.server.attach import Attachments
from rolloutgate.server.driver import Driver
from rolloutgate.server.metrics import Metrics
from rolloutgate.server.pool import EnginePool

__all__ = ("CONTEXT", "GatewayContext")


@dataclass(eq=False)
class GatewayContext:
    settings: GatewaySettings
    metrics: Metrics
    driver: Driver
    pool: EnginePool
    attachments: Attachments
    session: aiohttp.ClientSession = field(init=False)  # created when the app starts (needs a loop)
    extras: dict[str, Any] = field(default_factory=dict)  # parts mounted later (sessions, sim cluster)
    # more top-level sections of `/admin/state`, each read when asked (a fleet replica's "fleet")
    state_sections: dict[str, Callable[[], Any]] = field(default_factory=dict)
    draining: bool = False  # shutting down: new requests get 503, in-flight ones finish (app.py)
    active_requests: int = 0  # handlers running now (counted by server/guard.py)
    # one per gateway process, in `/health` (miles' `session_server_instance_id`: a restart is a new instance);
    # `serve --processes N` gives its processes one, so the port they share has one identity
    instance_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def engine_clock(self) -> bool:
        return self.settings.clock == "engine"


CONTEXT: web.AppKey[GatewayContext] = web.AppKey("rolloutgate", GatewayContext)
