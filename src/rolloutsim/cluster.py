"""`SimCluster`: N simulated engines in this process, each on its own port serving its HTTP face (sim/http_*.py),
sharing one scaled clock."""

from __future__ import annotations

from collections.abc import Iterable
from types import TracebackType
from typing import Any

from aiohttp import web

from rolloutgate.runtime_clock import LoopClock
from rolloutsim import http_sglang, http_vllm
from rolloutsim.engine import SimEngine
from rolloutsim.faults import Fault
from rolloutsim.http_admin import build_admin_app
from rolloutsim.profiles import SimEngineConfig, make_config

__all__ = ("SimCluster",)

FaultSpec = Fault | tuple[str | int, Fault]


class SimCluster:
    """Start with `async with SimCluster(...) as cluster:`; `cluster.urls[i]` serves `cluster.engines[i]`.

    `base_port=0` gives ephemeral ports; otherwise engine i listens on base_port + i. `admin_port` (0 for an
    ephemeral one) adds a cluster-wide admin server (`admin_url`). `faults`: faults to inject at start-up,
    each a `Fault` (every engine) or `(engine index or "all", Fault)`. `overrides` replace profile fields.
    """

    def __init__(
        self,
        engines: int = 1,
        api: str = "sglang",
        profile: str | SimEngineConfig = "default",
        time_scale: float = 1.0,
        host: str = "127.0.0.1",
        base_port: int = 0,
        seed: int = 0,
        *,
        admin_port: int | None = None,
        faults: Iterable[FaultSpec] = (),
        **overrides: Any,
    ) -> None:
        if engines < 1:
            raise ValueError(f"engines must be >= 1, got {engines!r}")
        if api not in ("sglang", "vllm"):
            raise ValueError(f"api must be 'sglang' or 'vllm', got {api!r}")
        if not time_scale > 0:
            raise ValueError(f"time_scale must be > 0, got {time_scale!r}")
        self.config = make_config(profile, **overrides)
        self.api = api
        self.time_scale = float(time_scale)
        self.host = host
        self.base_port = base_port
        self.seed = seed
        self.admin_port = admin_port
        self.clock = LoopClock(self.time_scale, start_at=0.0)
        self._count = engines
        self._faults = list(faults)
        self.engines: list[SimEngine] = []
        self._admin: web.AppRunner | None = None
        self.admin_url: str | None = None

    @property
    def urls(self) -> list[str]:
        return [engine.url for engine in self.engines]

    async def start(self) -> None:
        self.clock = LoopClock(self.time_scale, start_at=0.0)  # simulated time 0 = start-up
        for index in range(self._count):
            engine = SimEngine(
                index=index,
                api=self.api,
                config=self.config,
                clock=self.clock,
                seed=self.seed,
                host=self.host,
                port=self.base_port + index if self.base_port else 0,
            )
            self.engines.append(engine)
            await engine.start((http_vllm if self.api == "vllm" else http_sglang).build_app(engine))
        for spec in self._faults:
            selector, fault = ("all", spec) if isinstance(spec, Fault) else spec
            targets = self.engines if selector == "all" else [self.engines[int(selector)]]
            for engine in targets:
                engine.set_fault(fault)
        if self.admin_port is not None:
            self._admin = web.AppRunner(build_admin_app(self.engines), access_log=None, shutdown_timeout=0.5)
            await self._admin.setup()
            site = web.TCPSite(self._admin, self.host, self.admin_port)
            await site.start()
            port = self._admin.addresses[0][1]
            self.admin_url = f"http://{self.host}:{port}"

    async def stop(self) -> None:
        if self._admin is not None:
            await self._admin.cleanup()
            self._admin = None
        for engine in self.engines:
            await engine.stop()

    async def __aenter__(self) -> SimCluster:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    def __repr__(self) -> str:
        return f"<SimCluster {self.api} {self.config.profile} x{self.time_scale:g} {self.urls}>"
