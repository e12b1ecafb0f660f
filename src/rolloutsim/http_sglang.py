"""SGLang's HTTP API (0.5.23 shapes, reference/engines.md section A) over a simulated engine."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import deque
from collections.abc import Callable
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from aiohttp import web

from rolloutsim import metrics
from rolloutsim.faults import UPDATE_FAILED_MESSAGE
from rolloutsim.http_common import (
    DONE,
    WRITE_ERRORS,
    DisconnectWatcher,
    Frame,
    StreamCursor,
    StreamWriter,
    add_admin_routes,
    emit_body,
    json_response,
    read_json,
    sse,
    sse_headers,
    wait_change,
)
from rolloutsim.http_openai import OpenAIRoutes
from rolloutsim.output import TokenView, generate_item
from rolloutsim.output_path import token_ready_at
from rolloutsim.params import BadRequest, GenParams, parse_generate
from rolloutsim.request import ONLY_AT_END, SimRequest

if TYPE_CHECKING:
    from rolloutsim.engine import SimEngine

__all__ = ("build_app",)

VERSION = "0.5.23"
_FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)
_PAUSE_MODES = ("abort", "retract", "in_place")


def _later_by(item: dict[str, Any]) -> Callable[[float], None]:
    """`retime` for a final /generate item: SGLang stamps e2e_latency when its tokenizer manager gets to the
    finished output, so a late output path shows in it."""
    meta = item["meta_info"]
    base = meta["e2e_latency"]

    def retime(delay: float) -> None:
        meta["e2e_latency"] = base + delay

    return retime


def _sse_later_by(item: dict[str, Any]) -> Callable[[float], bytes]:
    """`Frame.retime` for a final streamed /generate item (see `_later_by`)."""
    retime = _later_by(item)

    def again(delay: float) -> bytes:
        retime(delay)
        return sse(item)

    return again


def _rebuilder(
    req: SimRequest,
    view: TokenView,
    params: GenParams,
    count: int,
    version: str,
    index: int,
    batch: bool,
    since: int,
) -> Callable[[], bytes]:
    """`Frame.rebuild` for a non-final /generate chunk: the same bytes, built again."""

    def rebuild() -> bytes:
        item = generate_item(req, view, params, count, final=False, weight_version=version, since=since)
        if batch:
            item["index"] = index
        return sse(item)

    return rebuild


def _error(message: str, status: int = 400) -> web.Response:
    return json_response({"error": {"message": message}}, status=status)


def openai_error(message: str, status: int = 400, param: str | None = None) -> web.Response:
    """SGLang's OpenAI-route error: a flat object."""
    phrase = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else "Error"
    body = {"object": "error", "message": message, "type": phrase, "param": param, "code": status}
    return json_response(body, status=status)


class SGLangRoutes:
    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine
        self.config = engine.config
        self.watcher = DisconnectWatcher(engine)
        self.started_at = time.time()
        # SGLang's server_status: a /health that times out marks the server unhealthy (then /ping and /ready
        # answer 503) until a /health passes (http_server.py health_generate)
        self._status_up = True
        self._status_restarts = 0  # the engine's restarts when `_status_up` was set (a new process is up)
        self.scheduler_replies = 0  # control requests the scheduler answered (they pass a /health under way)

    @property
    def status_up(self) -> bool:
        if self._status_restarts != self.engine.restarts:
            return True  # a restarted process starts with its flag up
        return self._status_up

    @status_up.setter
    def status_up(self, value: bool) -> None:
        self._status_up = value
        self._status_restarts = self.engine.restarts

    # ----------------------------------------------------------------------------- generation

    def new_request(self, params: GenParams, rid: str | None, listener: asyncio.Event) -> SimRequest:
        req = SimRequest(
            rid or uuid.uuid4().hex,
            params.prompt_ids,
            max_new_tokens=params.max_new_tokens,
            seed=self.engine.seed,
            ignore_eos=params.ignore_eos,
            stop_fraction=self.config.stop_fraction,
            wants_logprobs=params.logprobs,
            vocab_size=self.config.vocab_size,
            # SGLang keeps a HEALTH_CHECK rid out of its statistics, as its own probe's (a gateway's canary)
            internal=bool(rid) and str(rid).startswith("HEALTH_CHECK"),
        )
        req.listener = listener
        return req

    def submit_all(self, request: web.Request, reqs: list[SimRequest]) -> None:
        """Queue the requests; raises BadRequest on a duplicate rid (none is queued then)."""
        seen: set[str] = set()
        for req in reqs:
            if req.rid in seen or self.engine.model.is_live(req.rid):
                raise BadRequest(f"Duplicate request ID detected: {req.rid}")
            seen.add(req.rid)
        for req in reqs:
            self.engine.submit(req)
            self.watcher.watch(request, req)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            items, batch = parse_generate(await read_json(request), self.config)
        except BadRequest as exc:
            return _error(exc.message, exc.status)
        refusal = self.engine.refusal_status()
        if refusal is not None:
            return _error("The server is refusing new requests (simulated fault).", refusal)
        with self.engine.track_handler():
            arrived_at = self.engine.now()
            await self.engine.wait_open()
            listener = asyncio.Event()
            reqs = [self.new_request(p, p.rid, listener) for p in items]
            for req in reqs:
                req.arrived_at = arrived_at
                if items[0].stream:
                    req.emit_log = deque()  # when each streamed token was produced (sim/output_path.py)
                else:
                    req.notify_from = ONLY_AT_END
            try:
                self.submit_all(request, reqs)
            except BadRequest as exc:
                return _error(exc.message, exc.status)
            if items[0].stream:
                return await self._stream_generate(request, reqs, items, batch, listener)
            while not all(r.is_finished for r in reqs):
                await wait_change(listener)
            for req in reqs:
                if req.finish is not None and req.finish.status_code is not None:
                    return _error(req.finish.message or "aborted", req.finish.status_code)
            version = self.engine.weight_version
            results = [
                generate_item(r, TokenView(r), p, r.completion_tokens, final=True, weight_version=version)
                for r, p in zip(reqs, items, strict=True)
            ]
            retimers = [_later_by(item) for item in results]

            def retime(delay: float) -> None:
                for one in retimers:
                    one(delay)

            return await emit_body(self.engine, reqs, results if batch else results[0], retime=retime)

    async def _stream_generate(
        self,
        request: web.Request,
        reqs: list[SimRequest],
        items: list[GenParams],
        batch: bool,
        listener: asyncio.Event,
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers=sse_headers())
        await response.prepare(request)  # SGLang /generate sends its headers at once
        views = [TokenView(r) for r in reqs]
        cursors = [StreamCursor(p.stream_interval) for p in items]
        incremental = self.config.incremental_streaming_output
        engine = self.engine
        writer = StreamWriter(engine, response)  # chunks leave when the output path has served them
        try:
            while True:
                frames: list[Frame] = []
                for index, (req, view, params, cursor) in enumerate(
                    zip(reqs, views, items, cursors, strict=True)
                ):
                    finish = req.finish
                    if req.is_finished and finish is not None and finish.status_code is not None:
                        if not cursor.done:
                            cursor.done = True
                            error = {"message": finish.message, "code": finish.status_code, "retryable": True}
                            data = sse({"error": error | {"type": "invalid_request_error"}})
                            frames.append(Frame(req.finished_at or engine.now(), data, answers=(req,)))
                        continue
                    since = cursor.sent if incremental else 0
                    for count, final in cursor.marks(req.completion_tokens, req.is_finished):
                        item = generate_item(
                            req,
                            view,
                            params,
                            count,
                            final=final,
                            weight_version=engine.weight_version,
                            since=since,
                        )
                        if batch:
                            item["index"] = index
                        if final:
                            ready = req.finished_at if req.finished_at is not None else engine.now()
                            frames.append(Frame(ready, sse(item), _sse_later_by(item), (req,)))
                        else:
                            ready_at = token_ready_at(req, count)
                            ready = engine.now() if ready_at is None else ready_at
                            rebuild = _rebuilder(
                                req, view, params, count, engine.weight_version, index, batch, since
                            )
                            frames.append(Frame(ready, sse(item), rebuild=rebuild))
                        if incremental:
                            since = count
                    req.notify_from = cursor.next_mark()
                finished = all(c.done for c in cursors)
                if frames or finished:
                    await writer.send(frames, DONE if finished else b"")
                if finished:
                    await writer.close()
                    if engine.model.ledger is not None:
                        for req in reqs:
                            engine.model.ledger.written(req.rid)
                    return response
                await wait_change(listener)
        except WRITE_ERRORS:
            return response  # the client is gone; the watcher aborts what is still running
        finally:
            writer.cancel()
            for req in reqs:
                req.emit_log = None  # nothing reads it any more

    async def abort_request(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request)
        except BadRequest as exc:
            return _error(exc.message)
        rid = str(body.get("rid") or "")
        if body.get("abort_all"):
            self.engine.abort_all()
        elif rid and (body.get("prefix") is True or self.engine.model.is_live(rid)):
            # like SGLang: the exact rid must exist, then the scheduler aborts every rid it prefixes; with
            # `"prefix": true` (miles' multi-LoRA aborts, `{"rid": "<adapter>::"}`) no rid need match exactly
            self.engine.abort(rid, prefix=True, message=body.get("abort_message"))
        return web.Response(status=200)

    # ----------------------------------------------------------------------------- control plane

    async def pause_generation(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request)
        except BadRequest as exc:
            return _error(exc.message)
        mode = body.get("mode", "abort")
        if mode not in _PAUSE_MODES:
            return _error(f"mode must be one of {', '.join(_PAUSE_MODES)}")
        self.engine.pause(mode)
        if mode == "abort":
            await self.engine.wait_idle()  # returns once every in-flight request has been answered
        return json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, _request: web.Request) -> web.Response:
        self.engine.resume()
        return json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request)
        except BadRequest as exc:
            return _error(exc.message)
        held = self.engine.model.live_count if self.engine.paused else 0
        version = body.get("weight_version")
        ok = await self.engine.update_weights(
            version=None if version is None else str(version),
            abort_all=bool(body.get("abort_all_requests", False)),
            flush_cache=bool(body.get("flush_cache", True)),
        )
        if not ok:  # SGLang answers a failed update 400 with its message
            body = {"success": False, "message": UPDATE_FAILED_MESSAGE, "num_paused_requests": held}
            return json_response(body, status=400)
        return json_response(
            {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": held}
        )

    async def update_weight_version(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request)
        except BadRequest as exc:
            return _error(exc.message)
        if body.get("new_version") is None:
            return _error("new_version is required")
        if self.engine.update_fails:
            return json_response({"success": False, "message": UPDATE_FAILED_MESSAGE}, status=400)
        if body.get("abort_all_requests", True):
            self.engine.abort_all()
        version = str(body["new_version"])
        self.engine.set_weight_version(version)
        # the answer names the new version (0.5.9 measured: `{"success", "message", "new_version"}`)
        return json_response(
            {"success": True, "message": f"Weight version updated to {version}", "new_version": version}
        )

    async def flush_cache(self, request: web.Request) -> web.Response:
        timeout = float(request.query.get("timeout", 0) or 0)
        if timeout > 0 and self.engine.model.live_count:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.engine.wait_idle(), self.engine.clock.real_seconds(timeout))
        if self.engine.flush_cache():
            return web.Response(text=_FLUSHED)
        return web.Response(text="Flush cache failed.\n", status=400)

    async def health(self, _request: web.Request) -> web.Response:
        """Submit a one-token request and poll every `health_poll_s` for any scheduler output, up to
        `health_timeout_s` (503). Requests blocked by a pause block the probe too, as in SGLang. Any output
        counts, as SGLang's `last_receive_tstamp` does: a reply to anyone's control request (`/get_load`)
        during the check passes it, paused or not (0.5.9 measured, with several gateways in front)."""
        engine, model = self.engine, self.engine.model
        if engine.is_starting:
            return web.Response(status=503)  # SGLang's server_status Starting: loading after a restart
        if "wedge" in model.faults:
            return web.Response(status=200)  # wedged past what the check sees (vLLM#46811's shape)
        start_events, start_at, restarts = model.stats.progress_events, engine.now(), engine.restarts
        start_replies = self.scheduler_replies
        probe = SimRequest(f"HEALTH_CHECK_{uuid.uuid4().hex}", [0], max_new_tokens=1, internal=True)
        probe.listener = asyncio.Event()

        async def run_probe() -> None:
            await engine.wait_open()
            engine.submit(probe)

        task = asyncio.get_running_loop().create_task(run_probe())
        poll_s = max(0.005, engine.clock.real_seconds(self.config.health_poll_s))
        try:
            while True:
                await asyncio.sleep(poll_s)  # SGLang sleeps a poll period before each look
                engine.sync()
                if engine.restarts != restarts:
                    return web.Response(status=503)  # its process died under the check: no verdict on the new
                replied = self.scheduler_replies > start_replies
                if model.stats.progress_events > start_events or probe.completion_tokens or replied:
                    self.status_up = True
                    return web.Response(status=200)
                if engine.now() - start_at >= self.config.health_timeout_s:
                    self.status_up = False
                    return web.Response(status=503)
        finally:
            task.cancel()
            if model.is_live(probe.rid):
                engine.abort(probe.rid)

    # ----------------------------------------------------------------------------- info

    async def ready(self, _request: web.Request) -> web.Response:
        """SGLang's /ready: 503 while generation is paused or the server is marked unhealthy (is_ready).
        0.5.9 has none (`sglang_ready_route` False): 404."""
        if not self.config.sglang_ready_route:
            return web.Response(status=404)
        is_up = self.status_up and not self.engine.is_starting
        return web.Response(status=503 if self.engine.paused or not is_up else 200)

    async def ping(self, _request: web.Request) -> web.Response:
        """SGLang's /ping: the server's health flag, whatever the pause (so /ready 503 with /ping 200 is a
        pause)."""
        return web.Response(status=200 if self.status_up and not self.engine.is_starting else 503)

    def server_args(self) -> dict[str, Any]:
        config = self.config
        return {
            "model_path": config.model_path or config.served_model_name,
            "tokenizer_path": config.model_path or config.served_model_name,
            "served_model_name": config.served_model_name,
            "context_length": config.context_len,
            "max_running_requests": config.max_running_requests,
            "max_queued_requests": config.max_queued_requests,
            "chunked_prefill_size": config.chunked_prefill_size,
            "max_prefill_tokens": 16384,
            "schedule_policy": "fcfs",
            "schedule_conservativeness": 1.0,
            "enable_mixed_chunk": self.engine.model.mode == "mixed",
            "prefill_decode_interval": config.prefill_decode_interval,
            "disable_radix_cache": not config.enable_prefix_cache,
            "page_size": 1,
            "tp_size": 1,
            "dp_size": 1,
            "stream_interval": 1,
            "incremental_streaming_output": config.incremental_streaming_output,
            "enable_metrics": True,
            "weight_version": self.engine.weight_version,
        }

    async def server_info(self, _request: web.Request) -> web.Response:
        model = self.engine.model
        config = self.config
        info = self.server_args() | {
            "launch_command": f"rolloutgate sim --api sglang --profile {config.profile}",
            "status": "ready",
            "max_total_num_tokens": config.kv_capacity_tokens,
            "max_req_input_len": config.context_len - 1,
            "startup_time": self.started_at,
            "internal_states": [
                {
                    "effective_max_running_requests_per_dp": config.max_running_requests,
                    "last_gen_throughput": model.stats.gen_throughput(self.engine.now()),
                    "memory_usage": {
                        "weight": 0.0,
                        "kvcache": 0.0,
                        "token_capacity": config.kv_capacity_tokens,
                    },
                }
            ],
            "version": VERSION,
            # no real SGLang states its vocabulary (0.5.9: the gateway reads `model_path`'s config.json); the
            # simulator does, so the gateway learns it from a simulator without a model folder too
            "vocab_size": config.vocab_size,
            "simulator": {"profile": config.profile, "time_scale": self.engine.clock.scale},
        }
        return json_response(info)

    async def model_info(self, _request: web.Request) -> web.Response:
        config = self.config
        path = config.model_path or config.served_model_name
        return json_response(
            {
                "model_path": path,
                "tokenizer_path": path,
                "served_model_name": config.served_model_name,
                "is_generation": True,
                "weight_version": self.engine.weight_version,
                "vocab_size": config.vocab_size,  # the simulator's own, as in /server_info
            }
        )

    def _load_snapshot(self) -> dict[str, Any]:
        self.engine.sync()
        model, config = self.engine.model, self.config
        queries = model.cache.queries_tokens
        return {
            "dp_rank": 0,
            "num_running_reqs": model.running_count,
            "num_waiting_reqs": model.waiting_count,
            "num_waiting_uncached_tokens": sum(
                r.prompt_tokens for r in model.requests() if r.state.value == "waiting"
            ),
            "num_used_tokens": model.kv_used_tokens,
            "num_total_tokens": model.kv_used_tokens + model.cache.size_tokens,
            "max_total_num_tokens": config.kv_capacity_tokens,
            "max_running_requests": config.max_running_requests,
            "token_usage": model.kv_used_tokens / config.kv_capacity_tokens,
            "gen_throughput": model.stats.gen_throughput(self.engine.now()),
            "cache_hit_rate": model.cache.hits_tokens / queries if queries else 0.0,
            "utilization": min(1.0, model.running_count / config.max_running_requests),
        }

    async def loads(self, _request: web.Request) -> web.Response:
        snapshot = self._load_snapshot()
        return json_response(
            {
                "timestamp": time.time(),
                "version": VERSION,
                "accelerator": "sim",
                "num_accelerators": 1,
                "loads": [snapshot],
            }
        )

    async def get_load(self, _request: web.Request) -> web.Response:
        """A round trip to the scheduler: served between forward passes and while paused, so it waits while
        the scheduler is stuck in one (a compile, a hung GPU: reference/real-sglang.md)."""
        await self.engine.wait_scheduler()
        self.scheduler_replies += 1
        s = self._load_snapshot()
        return json_response(
            [
                {
                    "dp_rank": 0,
                    "num_reqs": s["num_running_reqs"] + s["num_waiting_reqs"],
                    "num_waiting_reqs": s["num_waiting_reqs"],
                    # as SGLang's: KV in use as computed so far (chunk by chunk in a prefill), and what waits
                    "num_tokens": self.engine.model.kv_filled_tokens + s["num_waiting_uncached_tokens"],
                    "num_pending_tokens": s["num_waiting_uncached_tokens"],
                    "ts_tic": time.time(),
                }
            ]
        )

    def _model_card(self) -> dict[str, Any]:
        name = self.config.served_model_name
        return {
            "id": name,
            "object": "model",
            "created": int(self.started_at),
            "owned_by": "sglang",
            "root": name,
            "parent": None,
            "max_model_len": self.config.context_len,
        }

    async def models(self, _request: web.Request) -> web.Response:
        return json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        if request.match_info["model"] != self.config.served_model_name:
            return openai_error(f"The model '{request.match_info['model']}' does not exist", 404)
        return json_response(self._model_card())

    async def metrics(self, _request: web.Request) -> web.Response:
        self.engine.sync()
        text = metrics.render_sglang(self.engine.model, self.engine.now())
        return web.Response(text=text, content_type="text/plain", charset="utf-8")


def build_app(engine: SimEngine) -> web.Application:
    routes = SGLangRoutes(engine)
    openai = OpenAIRoutes(engine, flavour="sglang", submit=routes.submit_all, error=openai_error)
    app = web.Application(client_max_size=1 << 30)
    app.router.add_route("POST", "/generate", routes.generate)
    app.router.add_route("PUT", "/generate", routes.generate)
    app.router.add_post("/v1/chat/completions", openai.chat)
    app.router.add_post("/v1/completions", openai.completions)
    app.router.add_post("/abort_request", routes.abort_request)
    app.router.add_post("/pause_generation", routes.pause_generation)
    app.router.add_post("/continue_generation", routes.continue_generation)
    app.router.add_post("/update_weights_from_disk", routes.update_weights_from_disk)
    app.router.add_post("/update_weight_version", routes.update_weight_version)
    app.router.add_route("*", "/flush_cache", routes.flush_cache)
    app.router.add_get("/health", routes.health)
    app.router.add_get("/health_generate", routes.health)
    app.router.add_get("/ready", routes.ready)
    app.router.add_get("/ping", routes.ping)
    app.router.add_get("/server_info", routes.server_info)
    app.router.add_get("/get_server_info", routes.server_info)
    app.router.add_get("/model_info", routes.model_info)
    app.router.add_get("/get_model_info", routes.model_info)
    app.router.add_get("/v1/loads", routes.loads)
    app.router.add_get("/get_load", routes.get_load)
    app.router.add_get("/v1/models", routes.models)
    app.router.add_get("/v1/models/{model}", routes.model)
    app.router.add_get("/metrics", routes.metrics)
    add_admin_routes(app, engine)
    app.on_cleanup.append(routes.watcher.close)
    return app
