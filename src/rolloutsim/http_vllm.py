"""vLLM's OpenAI server (0.33 shapes, reference/engines.md section C) over a simulated engine, including the
token-in/token-out `/inference/v1/generate` with `/inference/v1/abort_requests` (always served), and the
dev-mode RL routes (`/pause`, `/resume`, `/is_paused`, `/abort_requests`, weight version)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from aiohttp import web

from rolloutsim import metrics
from rolloutsim.faults import UPDATE_FAILED_MESSAGE
from rolloutsim.http_common import add_admin_routes, json_response, read_json
from rolloutsim.http_openai import OpenAIRoutes
from rolloutsim.params import BadRequest
from rolloutsim.request import SimRequest

if TYPE_CHECKING:
    from rolloutsim.engine import SimEngine

__all__ = ("build_app", "vllm_error")

VERSION = "0.33.0"
_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}
_PAUSE_MODES = {"abort": "abort", "wait": "drain", "keep": "keep"}


def vllm_error(message: str, status: int = 400, param: str | None = None) -> web.Response:
    error = {"message": message, "type": _ERROR_TYPES.get(status, "Error"), "param": param, "code": status}
    return json_response({"error": error}, status=status)


class VLLMRoutes:
    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine
        self.config = engine.config
        self.started_at = int(time.time())

    def submit(self, _request: web.Request, reqs: list[SimRequest]) -> None:
        for req in reqs:
            if self.engine.model.is_live(req.rid):
                raise BadRequest(f"Request id {req.rid} is already running")
        for req in reqs:
            self.engine.submit(req)

    async def health(self, _request: web.Request) -> web.Response:
        """vLLM's: the engine process is alive (it generates nothing, so a wedged engine says 200);
        503 while loading after a restart."""
        return web.Response(status=503 if self.engine.is_starting else 200)

    async def version(self, _request: web.Request) -> web.Response:
        return json_response({"version": VERSION})

    async def models(self, _request: web.Request) -> web.Response:
        name = self.config.served_model_name
        card = {
            "id": name,
            "object": "model",
            "created": self.started_at,
            "owned_by": "vllm",
            "root": self.config.model_path or name,  # vLLM's: the model's path
            "parent": None,
            "max_model_len": self.config.context_len,
            "permission": [],
            # no real vLLM states its vocabulary (the gateway reads `root`'s config.json); the simulator does
            "vocab_size": self.config.vocab_size,
        }
        return json_response({"object": "list", "data": [card]})

    async def metrics(self, _request: web.Request) -> web.Response:
        self.engine.sync()
        text = metrics.render_vllm(self.engine.model, self.engine.now())
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    async def pause(self, request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")
        if mode not in _PAUSE_MODES:
            return vllm_error(f"mode must be one of {', '.join(_PAUSE_MODES)}")
        self.engine.pause(_PAUSE_MODES[mode])
        if mode == "wait":
            await self.engine.wait_idle()  # drain in-flight work before answering
        if request.query.get("clear_cache", "true").lower() != "false":
            self.engine.flush_cache()
        return json_response({"status": "paused"})

    async def resume(self, _request: web.Request) -> web.Response:
        self.engine.resume()
        return json_response({"status": "resumed"})

    async def is_paused(self, _request: web.Request) -> web.Response:
        return json_response({"is_paused": self.engine.paused})

    async def abort_requests(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request)
        except BadRequest as exc:
            return vllm_error(exc.message)
        ids = body.get("request_ids") or []
        if not isinstance(ids, list):
            return vllm_error("request_ids must be a list")
        if not ids:
            return json_response({"status": "aborted", "aborted": self.engine.abort_all()})
        aborted = 0
        for given in ids:
            rid = str(given)
            for prefix in (
                "chatcmpl-",
                "cmpl-",
                "generate-tokens-",
            ):  # external ids may carry the response id's prefix
                if not self.engine.model.is_live(rid) and rid.startswith(prefix):
                    rid = rid[len(prefix) :]
            aborted += self.engine.abort(rid)
        return json_response({"status": "aborted", "aborted": aborted})

    async def abort_requests_quietly(self, request: web.Request) -> web.Response:
        """`/inference/v1/abort_requests`: the same abort, answered 200 with no body (vLLM's)."""
        answer = await self.abort_requests(request)
        return answer if answer.status != 200 else web.Response(status=200)

    async def reset_prefix_cache(self, _request: web.Request) -> web.Response:
        return json_response({"success": self.engine.flush_cache()})

    async def update_weights(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request)
        except BadRequest as exc:
            return vllm_error(exc.message)
        version = body.get("weight_version", body.get("version"))
        if not await self.engine.update_weights(version=None if version is None else str(version)):
            return vllm_error(UPDATE_FAILED_MESSAGE, 500)
        return json_response({"status": "ok", "weight_version": self.engine.weight_version})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request)
        except BadRequest as exc:
            return vllm_error(exc.message)
        version = body.get("weight_version", body.get("version", body.get("new_version")))
        if version is None:
            return vllm_error("weight_version is required")
        if self.engine.update_fails:
            return vllm_error(UPDATE_FAILED_MESSAGE, 500)
        self.engine.set_weight_version(str(version))
        return json_response({"status": "ok", "weight_version": self.engine.weight_version})

    async def weight_info(self, _request: web.Request) -> web.Response:
        return json_response({"weight_version": self.engine.weight_version})

    async def server_info(self, _request: web.Request) -> web.Response:
        config = self.config
        info: dict[str, Any] = {
            "version": VERSION,
            "served_model_name": config.served_model_name,
            "max_num_seqs": config.max_running_requests,
            "max_num_batched_tokens": config.chunked_prefill_size,
            "max_model_len": config.context_len,
            "enable_chunked_prefill": True,
            "enable_prefix_caching": config.enable_prefix_cache,
            "weight_version": self.engine.weight_version,
            "simulator": {"profile": config.profile, "time_scale": self.engine.clock.scale},
        }
        return json_response(info)


def build_app(engine: SimEngine) -> web.Application:
    routes = VLLMRoutes(engine)
    openai = OpenAIRoutes(engine, flavour="vllm", submit=routes.submit, error=vllm_error)

    async def load(_request: web.Request) -> web.Response:
        return json_response({"server_load": openai.in_flight})

    async def ping(_request: web.Request) -> web.Response:
        return web.Response(status=200)

    app = web.Application(client_max_size=1 << 30)
    app.router.add_post("/v1/chat/completions", openai.chat)
    app.router.add_post("/v1/completions", openai.completions)
    app.router.add_post("/inference/v1/generate", openai.tokens)
    app.router.add_post("/inference/v1/abort_requests", routes.abort_requests_quietly)
    app.router.add_get("/health", routes.health)
    app.router.add_get("/ping", ping)
    app.router.add_post("/ping", ping)
    app.router.add_get("/version", routes.version)
    app.router.add_get("/v1/models", routes.models)
    app.router.add_get("/metrics", routes.metrics)
    app.router.add_get("/load", load)
    app.router.add_post("/pause", routes.pause)
    app.router.add_post("/resume", routes.resume)
    app.router.add_get("/is_paused", routes.is_paused)
    app.router.add_post("/abort_requests", routes.abort_requests)
    app.router.add_post("/reset_prefix_cache", routes.reset_prefix_cache)
    app.router.add_post("/update_weights", routes.update_weights)
    app.router.add_post("/update_weight_version", routes.update_weight_version)
    app.router.add_get("/weight_info", routes.weight_info)
    app.router.add_get("/server_info", routes.server_info)
    add_admin_routes(app, engine)
    return app
