"""One simulated engine: the model, its driver, its HTTP server, its faults and its control plane. Its HTTP
face (sim/http_*.py) depends on it, not it on its face: whoever starts it (sim/cluster.py) builds the app.

This is the object tests and the gateway's tests hold (`cluster.engines[i]`). Its properties read the model
as of now (the model is first advanced to the current simulated time). Commands (`set_fault`, `pause`,
`abort`, ...) are synchronous; the few that need the event loop (restarting after a crash, a weight update)
are coroutines or schedule a task.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Iterator
from typing import Any

from aiohttp import web

from rolloutgate.runtime_clock import LoopClock
from rolloutsim.driver import SimDriver
from rolloutsim.engine_model import EngineModel
from rolloutsim.faults import SELF_ENDING, Fault
from rolloutsim.output_path import OutputQueue
from rolloutsim.profiles import SimEngineConfig
from rolloutsim.request import SimRequest

__all__ = ("SimEngine",)


class SimEngine:
    def __init__(
        self,
        *,
        index: int,
        api: str,
        config: SimEngineConfig,
        clock: LoopClock,
        seed: int = 0,
        host: str = "127.0.0.1",
        port: int = 0,
        launch_version: str = "default",
    ) -> None:
        if api not in ("sglang", "vllm"):
            raise ValueError(f"api must be 'sglang' or 'vllm', got {api!r}")
        self.index = index
        self.api = api
        self.config = config
        self.clock = clock
        self.seed = seed
        self.host = host
        self.port = port
        # the weights of the checkpoint it was launched with (SGLang: `default` unless `--weight-version`); a
        # restart comes back holding them, whatever updates the process before it took
        self.launch_version = launch_version
        self.weight_version = launch_version
        self.model = EngineModel(config, api=api)
        self.output = OutputQueue(self.model.output, clock)  # the tokenizer manager (sim/output_path.py)
        self._driver: SimDriver | None = None
        self._runner: web.AppRunner | None = None
        self._server: asyncio.AbstractServer | None = None
        self._listening = asyncio.Event()
        self._open = asyncio.Event()  # SGLang: new requests wait while this is clear (pause, weight update)
        self._open.set()
        self._updating = False
        self._update_lock = asyncio.Lock()
        self._idle_waiters: list[asyncio.Future[None]] = []
        self._scheduler_waiters: list[asyncio.Future[None]] = []  # control requests behind a stuck pass
        self._fault_timers: dict[str, asyncio.TimerHandle] = {}
        self._relisten: asyncio.Task[None] | None = None  # opening the port again after a crash
        self.restarts = 0  # restart faults so far: a new process each time (its HTTP face's flags reset)
        self._handlers: set[asyncio.Task[Any]] = set()
        self._background: set[asyncio.Task[Any]] = set()

    # ----------------------------------------------------------------------------- lifecycle

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def driver(self) -> SimDriver:
        if self._driver is None:
            raise RuntimeError("engine not started")
        return self._driver

    async def start(self, app: web.Application) -> None:
        """Serve `app`, this engine's HTTP face (built on it by sim/http_sglang.py or http_vllm.py)."""
        self._driver = SimDriver(self.model, self.clock, after_wake=self._after_wake)
        self._runner = web.AppRunner(
            app,
            handle_signals=False,
            access_log=None,
            shutdown_timeout=0.5,
            handler_cancellation=self.api == "vllm",  # vLLM aborts at once on disconnect
        )
        await self._runner.setup()
        await self._listen()

    async def stop(self) -> None:
        for timer in self._fault_timers.values():
            timer.cancel()
        self._fault_timers.clear()
        self._drop_connections()
        for task in list(self._background):
            task.cancel()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._driver is not None:
            self._driver.close()

    async def wait_listening(self) -> None:
        """Return once the port accepts connections (after start, or after a crash is cleared)."""
        await self._listening.wait()

    async def _listen(self) -> None:
        assert self._runner is not None and self._runner.server is not None
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self._runner.server, self.host, self.port, reuse_address=True, backlog=2048
        )
        sockets = self._server.sockets
        if sockets:
            self.port = sockets[0].getsockname()[1]
        self._listening.set()

    def _drop_connections(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        self._listening.clear()
        for task in list(self._handlers):
            task.cancel()
        if self._runner is not None and self._runner.server is not None:
            for connection in self._runner.server.connections:
                transport = connection.transport
                if transport is not None:
                    transport.abort()

    @contextlib.contextmanager
    def track_handler(self) -> Iterator[None]:
        """Mark the current handler task as one a crash must cut off."""
        task = asyncio.current_task()
        if task is None:
            yield
            return
        self._handlers.add(task)
        try:
            yield
        finally:
            self._handlers.discard(task)

    # ----------------------------------------------------------------------------- state

    def now(self) -> float:
        return self.clock.now()

    def sync(self) -> None:
        """Bring the model to the current simulated time and deliver its changes."""
        if self._driver is not None:
            self._driver._wake()

    @property
    def running_count(self) -> int:
        self.sync()
        return self.model.running_count

    @property
    def waiting_count(self) -> int:
        self.sync()
        return self.model.waiting_count

    @property
    def generated_tokens_total(self) -> int:
        self.sync()
        return self.model.stats.generated_tokens_total

    @property
    def paused(self) -> bool:
        return self.model.paused

    @property
    def faults(self) -> list[Fault]:
        return list(self.model.faults.values())

    @property
    def is_crashed(self) -> bool:
        return "crash" in self.model.faults

    @property
    def is_starting(self) -> bool:
        """Restarted and not serving yet (the restart fault): health and generation answer 503."""
        return "restart" in self.model.faults

    @property
    def is_scheduler_stuck(self) -> bool:
        """In a forward pass that does not return (freeze, wedge) or has not yet (compile): SGLang's
        scheduler answers no control request (`/get_load`) meanwhile."""
        self.sync()
        return self.model.is_scheduler_stuck

    async def wait_scheduler(self) -> None:
        """Return once the scheduler is out of its forward pass (at once when it is not in one): the driver's
        wake-up at the step's end, or after the fault is cleared, lets it go."""
        if not self.is_scheduler_stuck:
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._scheduler_waiters.append(future)
        await future

    def request(self, rid: str) -> SimRequest | None:
        self.sync()
        return self.model.request(rid)

    def requests(self) -> dict[str, SimRequest]:
        self.sync()
        return {r.rid: r for r in self.model.requests()}

    def refusal_status(self) -> int | None:
        if self.is_starting:
            return 503  # loading its weights after a restart
        fault = self.model.faults.get("refuse")
        return None if fault is None else fault.status

    def state(self, *, rid: str | None = None, include_requests: bool = True) -> dict[str, Any]:
        """The JSON of GET /sim/state."""
        self.sync()
        model = self.model
        out: dict[str, Any] = {
            "engine": self.index,
            "api": self.api,
            "url": self.url,
            "profile": self.config.profile,
            "now": self.now(),
            "time_scale": self.clock.scale,
            "running": model.running_count,
            "waiting": model.waiting_count,
            "generated_tokens_total": model.stats.generated_tokens_total,
            "prompt_tokens_total": model.stats.prompt_tokens_total,
            "cached_tokens_total": model.stats.cached_tokens_total,
            "requests_total": model.stats.requests_total,
            "aborted_total": model.stats.aborted_total,
            "preempted_total": model.stats.preempted_total,
            "kv_used_tokens": model.kv_used_tokens,
            "prefix_cache_tokens": model.cache.size_tokens,
            "max_running_requests": self.config.max_running_requests,
            "paused": model.paused,
            "pause_mode": model.pause_mode,
            "frozen": model.is_frozen,
            "updating_weights": self._updating,
            "weight_version": self.weight_version,
            "faults": [f.to_json() for f in model.faults.values()],
            "output_bytes_total": model.output.bytes_total,
            "output_chunks_total": model.output.chunks_total,
            "output_busy_s": model.output.busy_s(self.now()),
            "output_backlog_s": model.output.backlog_s(self.now()),
        }
        if rid is not None:
            req = model.request(rid)
            out["request"] = None if req is None else req.snapshot()
        elif include_requests:
            out["requests"] = {r.rid: r.snapshot() for r in model.requests()}
        return out

    # ----------------------------------------------------------------------------- generation

    async def wait_open(self) -> None:
        """SGLang: a new request waits here while generation is paused or weights are updating."""
        await self._open.wait()

    def submit(self, req: SimRequest) -> None:
        """Queue `req` on the model. Raises ValueError for a duplicate live rid."""
        self.model.submit(req, self.now())
        self.driver.poke()

    def abort(self, rid: str, *, prefix: bool = False, message: str | None = None) -> int:
        count = self.model.abort(rid, self.now(), prefix=prefix, message=message)
        self.driver.poke()
        return count

    def abort_all(self) -> int:
        count = self.model.abort_all(self.now())
        self.driver.poke()
        return count

    def pause(self, mode: str) -> None:
        self.model.pause(mode, self.now())
        self._refresh_gate()
        self.driver.poke()

    def resume(self) -> None:
        self.model.resume(self.now())
        self._refresh_gate()
        self.driver.poke()

    def flush_cache(self) -> bool:
        return self.model.flush_cache(self.now())

    async def wait_idle(self) -> None:
        """Return once no (non-health) request is queued or running."""
        self.sync()
        if self.model.live_count == 0:
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._idle_waiters.append(future)
        await future

    async def sleep_sim(self, seconds: float) -> None:
        await asyncio.sleep(self.clock.real_seconds(seconds))

    @property
    def update_fails(self) -> bool:
        """Under the update_fails fault: every weight update fails and the old weights stay."""
        return "update_fails" in self.model.faults

    async def update_weights(
        self, *, version: str | None, abort_all: bool = False, flush_cache: bool = True
    ) -> bool:
        """SGLang's model-update writer lock: unless paused, wait for in-flight work (new requests wait
        behind the update), then take `weight_update_s`, then adopt `version`. False when it failed (the
        update_fails fault, as the update ended): the engine keeps the weights it held."""
        async with self._update_lock:
            if abort_all:
                self.abort_all()
            self._updating = True
            self._refresh_gate()
            ledger = self.model.ledger
            if ledger is not None:
                ledger.update_begun(self.now(), version)
            ok = False
            try:
                if not self.model.paused:
                    await self.wait_idle()
                await self.sleep_sim(self.config.weight_update_s)
                ok = not self.update_fails
                if ok and version:
                    self.set_weight_version(version)
                if ok and flush_cache:
                    self.flush_cache()
            finally:
                self._updating = False
                self._refresh_gate()
                if ledger is not None:
                    ledger.update_ended(self.now(), ok)
            return ok

    def set_weight_version(self, version: str) -> None:
        """Adopt `version`: the requests it holds (paused in place, or running) generate under it from here
        on, and their answers list both spans (`meta_info.weight_versions`)."""
        self.sync()
        old, self.weight_version = self.weight_version, version
        if old != version:
            for req in self.model.requests():
                if not req.is_finished:
                    req.note_weight_version(old, version)
            if self.model.ledger is not None:
                self.model.ledger.version_changed(self.now(), version, "update")

    def _load_launch_weights(self, at: float) -> None:
        """A new process (a restart at `at`) holds the checkpoint it was launched with; it holds no request."""
        if self.weight_version != self.launch_version:
            self.weight_version = self.launch_version
            if self.model.ledger is not None:
                self.model.ledger.version_changed(at, self.launch_version, "restart")

    def _refresh_gate(self) -> None:
        closed = self._updating or (self.api == "sglang" and self.model.paused)
        if closed:
            self._open.clear()
        else:
            self._open.set()

    def _after_wake(self) -> None:
        if self._scheduler_waiters and not self.model.is_scheduler_stuck:
            waiters, self._scheduler_waiters = self._scheduler_waiters, []
            for future in waiters:
                if not future.done():
                    future.set_result(None)
        if self._idle_waiters and self.model.live_count == 0:
            waiters, self._idle_waiters = self._idle_waiters, []
            for future in waiters:
                if not future.done():
                    future.set_result(None)

    # ----------------------------------------------------------------------------- faults

    def set_fault(self, fault: Fault | str, **params: Any) -> Fault:
        """Inject a fault (a `Fault`, or its kind and fields: `set_fault("slow", factor=4)`)."""
        if isinstance(fault, str):
            fault = Fault(kind=fault, **params)
        now = self.now()
        self.model.set_fault(fault, now)
        if fault.kind in ("crash", "restart"):
            self.model.crash(now)
            self._drop_connections()
            self.restarts += fault.kind == "restart"
        if fault.kind == "restart":
            self._load_launch_weights(now)
        self.driver.poke()
        for key in (fault.key, f"{fault.key}:listen"):
            timer = self._fault_timers.pop(key, None)
            if timer is not None:
                timer.cancel()
        loop = asyncio.get_running_loop()
        if fault.kind == "restart":  # back on its port after down_s, serving after duration_s more
            self._fault_timers["restart:listen"] = loop.call_later(
                self.clock.real_seconds(fault.down_s), self._listen_again
            )
            self._fault_timers["restart"] = loop.call_later(
                self.clock.real_seconds(fault.down_s + fault.duration_s), self.clear_faults, "restart"
            )
        elif math.isfinite(fault.duration_s) and fault.kind not in SELF_ENDING:
            delay = self.clock.real_seconds(fault.duration_s)
            self._fault_timers[fault.key] = loop.call_later(delay, self.clear_faults, fault.key)
        return fault

    def _listen_again(self) -> None:
        """Open the port again (after a crash or the down time of a restart), unless it is open."""
        self._fault_timers.pop("restart:listen", None)
        if self._server is not None or (self._relisten is not None and not self._relisten.done()):
            return
        task = self._relisten = asyncio.get_running_loop().create_task(self._listen())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def clear_faults(self, kind: str | None = None) -> None:
        """Clear every fault, or those of one kind (`stall` clears all stalls), or one key (`stall:<rid>`)."""
        now = self.now()
        keys = [
            key
            for key, fault in self.model.faults.items()
            if kind is None or key == kind or fault.kind == kind
        ]
        for key in keys:
            for timer_key in (key, f"{key}:listen"):
                timer = self._fault_timers.pop(timer_key, None)
                if timer is not None:
                    timer.cancel()
            self.model.clear_fault(key, now)
            if key in ("crash", "restart"):
                self._listen_again()
        self.driver.poke()

    def __repr__(self) -> str:
        return f"<SimEngine {self.index} {self.api} {self.url} {self.model!r}>"
