"""`/v1/chat/completions` and `/v1/completions` for both flavours, and vLLM's `/inference/v1/generate`.

Differences that matter to a gateway, all kept: SGLang takes the rid from the body (`rid`) and answers with
`id` = rid; vLLM takes it from `X-Request-Id` (or `request_id`) and answers `chatcmpl-<id>` / `cmpl-<id>`.
SGLang sends streaming headers only once the first token exists (it awaits the first chunk to be able to
answer errors with a status); vLLM sends them at once. SGLang lets new requests wait while paused; vLLM
holds new requests during any pause, as vLLM 0.32 was measured to (docs/e2e.md); `vllm_reject_while_paused` gives
0.33's documented 503 in `abort`/`wait` pause instead. SGLang notices a disconnect within `disconnect_lag_s`; vLLM at once.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from rolloutsim.http_common import (
    DONE,
    WRITE_ERRORS,
    Frame,
    StreamCursor,
    StreamWriter,
    emit_body,
    read_json,
    sse,
    sse_headers,
    wait_change,
)
from rolloutsim.output import OpenAIFormatter, TokensFormatter
from rolloutsim.output_path import token_ready_at
from rolloutsim.params import BadRequest, GenParams, parse_chat, parse_completion, parse_tokens
from rolloutsim.request import ONLY_AT_END, SimRequest

if TYPE_CHECKING:
    from rolloutsim.engine import SimEngine

__all__ = ("OpenAIRoutes",)

ErrorFactory = Callable[..., web.Response]
Submitter = Callable[[web.Request, list[SimRequest]], None]


def _later_by(meta: dict[str, Any]) -> Callable[[float], None]:
    """`retime` for a chat body with `meta_info` (SGLang, return_meta_info): e2e_latency is stamped late."""
    base = meta["e2e_latency"]

    def retime(delay: float) -> None:
        meta["e2e_latency"] = base + delay

    return retime


class OpenAIRoutes:
    def __init__(self, engine: SimEngine, *, flavour: str, submit: Submitter, error: ErrorFactory) -> None:
        self.engine = engine
        self.flavour = flavour
        self.submit = submit
        self.error = error
        self.in_flight = 0  # HTTP generation requests being served (vLLM /load)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "completion")

    async def tokens(self, request: web.Request) -> web.StreamResponse:
        """vLLM's token-in/token-out route (`generate-tokens-<id>` names the request)."""
        return await self._serve(request, "tokens")

    def _rid(self, request: web.Request, body: dict[str, object]) -> str:
        if self.flavour == "vllm":
            given = request.headers.get("X-Request-Id") or body.get("request_id")
        else:
            given = body.get("rid")
        return str(given) if given else uuid.uuid4().hex

    def _refusal(self) -> web.Response | None:
        engine = self.engine
        status = engine.refusal_status()
        if status is not None:
            return self.error("The server is refusing new requests (simulated fault).", status)
        paused_to_reject = engine.model.pause_mode in ("abort", "drain", "wait")
        if self.flavour == "vllm" and engine.config.vllm_reject_while_paused and paused_to_reject:
            return self.error("The engine is paused; retry after it resumes.", 503)
        return None

    async def _serve(self, request: web.Request, kind: str) -> web.StreamResponse:
        engine = self.engine
        try:
            body = await read_json(request)
            parse = {"chat": parse_chat, "completion": parse_completion, "tokens": parse_tokens}[kind]
            params = parse(body, engine.config)
            asks_ids = params.return_meta_info or params.return_token_ids or params.return_prompt_token_ids
            if self.flavour == "sglang" and kind == "chat" and params.stream and asks_ids:
                raise BadRequest("return_meta_info / return_token_ids are not supported with streaming")
        except BadRequest as exc:
            return self.error(exc.message, exc.status, exc.param)
        name = engine.config.served_model_name
        if self.flavour == "vllm" and params.model not in (None, name):
            return self.error(f"The model `{params.model}` does not exist.", 404, "model")
        refused = self._refusal()
        if refused is not None:
            return refused
        self.in_flight += 1
        try:
            with engine.track_handler():
                arrived_at = engine.now()
                if self.flavour == "sglang":
                    await engine.wait_open()
                return await self._run(request, kind, params, self._rid(request, body), arrived_at)
        finally:
            self.in_flight -= 1

    async def _run(
        self, request: web.Request, kind: str, params: GenParams, rid: str, arrived_at: float
    ) -> web.StreamResponse:
        engine = self.engine
        listener = asyncio.Event()
        req = SimRequest(
            rid,
            params.prompt_ids,
            max_new_tokens=params.max_new_tokens,
            seed=engine.seed,
            ignore_eos=params.ignore_eos,
            stop_fraction=engine.config.stop_fraction,
            wants_logprobs=params.logprobs,
            vocab_size=engine.config.vocab_size,
        )
        req.listener = listener
        req.arrived_at = arrived_at
        if params.stream:
            req.emit_log = deque()  # when each streamed token was produced (sim/output_path.py)
        else:
            req.notify_from = ONLY_AT_END
        try:
            self.submit(request, [req])
        except BadRequest as exc:
            return self.error(exc.message, exc.status)
        model_name = (
            params.model if self.flavour == "sglang" and params.model else engine.config.served_model_name
        )
        fmt: OpenAIFormatter | TokensFormatter
        if kind == "tokens":
            fmt = TokensFormatter(
                req=req, params=params, model_name=str(model_name), weight_version=engine.weight_version
            )
        else:
            fmt = OpenAIFormatter(
                flavour=self.flavour,
                kind=kind,
                req=req,
                params=params,
                model_name=str(model_name),
                weight_version=engine.weight_version,
            )
        headers = {"X-Request-Id": rid} if self.flavour == "vllm" else None
        try:
            if not params.stream:
                while not req.is_finished:
                    await wait_change(listener)
                finish = req.finish
                if finish is not None and finish.status_code is not None:
                    return self.error(finish.message or "aborted", finish.status_code)
                fmt.weight_version = engine.weight_version  # as of the answer, like the engines
                body = fmt.whole()
                meta = body["choices"][0].get("meta_info") if self.flavour == "sglang" else None
                retime = None if meta is None else _later_by(meta)
                return await emit_body(engine, [req], body, retime=retime, headers=headers)
            return await self._stream(request, req, fmt, params, listener, headers)
        except asyncio.CancelledError:
            # vLLM's handlers are cancelled when the client goes away: abort the generation at once
            if not req.is_finished:
                engine.abort(req.rid)
            raise

    async def _stream(
        self,
        request: web.Request,
        req: SimRequest,
        fmt: OpenAIFormatter | TokensFormatter,
        params: GenParams,
        listener: asyncio.Event,
        headers: dict[str, str] | None,
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers=sse_headers() | (headers or {}))
        if self.flavour == "sglang":
            while req.completion_tokens == 0 and not req.is_finished:
                await wait_change(listener)
            finish = req.finish
            if finish is not None and finish.status_code is not None:
                return self.error(finish.message or "aborted", finish.status_code)
        await response.prepare(request)
        cursor = StreamCursor(params.stream_interval)
        sent_role = fmt.kind != "chat"
        sent = 0
        engine = self.engine
        writer = StreamWriter(engine, response)  # chunks leave when the output path has served them
        try:
            while True:
                frames: list[Frame] = []
                for count, final in cursor.marks(req.completion_tokens, req.is_finished):
                    ready_at = req.finished_at if final else token_ready_at(req, count)
                    ready = engine.now() if ready_at is None else ready_at
                    if not sent_role:
                        frames.append(Frame(ready, sse(fmt.role_chunk())))
                        sent_role = True
                    frames.append(Frame(ready, sse(fmt.delta_chunk(sent, count, final=final))))
                    sent = count
                req.notify_from = cursor.next_mark()
                if cursor.done:
                    if params.include_usage:
                        frames.append(
                            Frame(frames[-1].ready_at if frames else engine.now(), sse(fmt.usage_chunk()))
                        )
                    if frames:
                        frames[-1].answers = (req,)
                    await writer.send(frames, DONE)
                    await writer.close()
                    if engine.model.ledger is not None:
                        engine.model.ledger.written(req.rid)
                    return response
                if frames:
                    await writer.send(frames)
                await wait_change(listener)
        except WRITE_ERRORS:
            if self.flavour == "vllm" and not req.is_finished:
                self.engine.abort(req.rid)
            return response
        finally:
            writer.cancel()
            req.emit_log = None  # nothing reads it any more
