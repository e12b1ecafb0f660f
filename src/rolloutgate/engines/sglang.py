"""SGLang adapter: native `/generate` and the OpenAI routes, abort by `rid`, pause/continue, weight updates.

Theory of operation (facts from reference/engines.md, section A):

- Every generation streams, so the gateway sees progress. `/generate` is sent with `rid` = the gateway's
  request id and `stream: true`; its chunks are cumulative, counted by `meta_info.completion_tokens` deltas
  (engines/progress.py). Unless the client itself streams with its own `stream_interval`, the gateway asks
  for a chunk every `progress_every_tokens` tokens (`sampling_params.stream_interval`).
- Chat and completions are sent with `rid` and `stream: true` plus `stream_options.include_usage`, except a
  chat request with `return_meta_info`, `return_token_ids` or `return_prompt_token_ids`: SGLang rejects those
  when streaming, so such a request is sent as the client sent it and, non-streamed, yields one whole-body
  event (engine-level load then stands in for progress). SGLang's OpenAI streams send their HTTP headers only
  at the first token; the call simply waits for them.
- `abort` posts `/abort_request {"rid"}`. SGLang matches rids by prefix in its scheduler but ignores a rid its
  tokenizer does not know, and n>1 samples get fresh rids, so an n>1 or batch `/generate` cannot be aborted
  by rid: closing the connection (which SGLang notices within 0-4 s) is the fallback.
- `pause` maps `abort`, `retract`, `in_place` (and `keep`) to `/pause_generation` modes. SGLang has no drain
  mode: for `drain`/`wait` the gateway drains itself (it stops dispatching and waits for in-flight requests),
  so the adapter sends nothing. While paused, SGLang holds new requests open rather than refusing them.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Mapping
from typing import Any

import aiohttp
import orjson

from rolloutgate.engines.base import (
    AssemblyHint,
    EngineFamily,
    EngineInfo,
    EngineLoad,
    Route,
    UpstreamCall,
    UpstreamError,
    UpstreamEvent,
)
from rolloutgate.engines.generation import (
    EventSink,
    GenerateDecoder,
    pull_generation,
    push_generation,
)
from rolloutgate.engines.http import (
    ControlTimeouts,
    fetch_models,
    get_json,
    get_text,
    is_ok,
    parse_prometheus,
    positive_int,
    post_json,
    upstream_pool,
)
from rolloutgate.engines.openai_stream import (
    client_wants_usage,
    push_openai_call,
    run_openai_call,
    streaming_body,
)
from rolloutgate.engines.push_call import EndSink, PushedGeneration, start_push_generation

__all__ = ("SglangClient",)

log = logging.getLogger(__name__)

# chat options SGLang refuses to stream (serving_chat.py L1310-1325)
_CHAT_NON_STREAMABLE = ("return_meta_info", "return_token_ids", "return_prompt_token_ids")
_PAUSE_MODES = {"abort": "abort", "retract": "retract", "in_place": "in_place", "keep": "in_place"}
_GATEWAY_DRAINS = frozenset({"drain", "wait"})
_METRICS = frozenset({"sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:generation_tokens_total"})


class SglangClient:
    """One SGLang engine. Holds no request state; `probe()` refreshes the facts assembly needs."""

    family = EngineFamily.SGLANG

    def __init__(
        self, url: str, session: aiohttp.ClientSession, *, timeouts: ControlTimeouts | None = None
    ) -> None:
        self.url = url.rstrip("/")
        self._session = session
        self._upstream = upstream_pool(self.url)  # generations; everything else goes through `session`
        self._timeouts = timeouts or ControlTimeouts()
        self._hint = AssemblyHint(family=EngineFamily.SGLANG)

    def __repr__(self) -> str:
        return f"<SglangClient {self.url}>"

    # -- generation ------------------------------------------------------------------------------------

    def can_stream(self, call: UpstreamCall) -> bool:
        return not (call.route is Route.CHAT and any(call.body.get(k) for k in _CHAT_NON_STREAMABLE))

    def generate(self, call: UpstreamCall) -> AsyncIterator[UpstreamEvent]:
        if call.route is Route.GENERATE:
            return pull_generation(
                self._session,
                self._upstream,
                self.url + Route.GENERATE.value,
                orjson.dumps(generate_body(call)),
                headers=call.headers,
                timeouts=self._timeouts,
                decoder=GenerateDecoder(self._hint),
            )
        body = self._openai_body(call)
        return run_openai_call(
            self._session,
            self.url + call.route.value,
            body,
            headers=call.headers,
            timeouts=self._timeouts,
            hint=self._hint,
            wants_usage=client_wants_usage(call.body),
            upstream=self._upstream,
        )

    def start_stream(
        self, call: UpstreamCall, on_events: EventSink, on_end: EndSink
    ) -> PushedGeneration | None:
        """`stream_into` without a task, where the call can run on the connection's callbacks: `/generate` on
        an idle keep-alive connection (engines/push_call.py); None otherwise."""
        if call.route is not Route.GENERATE:
            return None
        return start_push_generation(
            self._upstream,
            self.url + Route.GENERATE.value,
            lambda: orjson.dumps(generate_body(call)),
            headers=call.headers,
            decoder=GenerateDecoder(self._hint),
            on_events=on_events,
            on_end=on_end,
        )

    def stream_into(self, call: UpstreamCall, on_events: EventSink) -> Awaitable[None]:
        """`generate`, its events handed to `on_events` a read at a time (engines/generation.py)."""
        if call.route is Route.GENERATE:
            return push_generation(
                self._session,
                self._upstream,
                self.url + Route.GENERATE.value,
                orjson.dumps(generate_body(call)),
                headers=call.headers,
                timeouts=self._timeouts,
                decoder=GenerateDecoder(self._hint),
                on_events=on_events,
            )
        body = self._openai_body(call)
        return push_openai_call(
            self._session,
            self.url + call.route.value,
            body,
            on_events,
            headers=call.headers,
            timeouts=self._timeouts,
            hint=self._hint,
            wants_usage=client_wants_usage(call.body),
            upstream=self._upstream,
        )

    def _openai_body(self, call: UpstreamCall) -> dict[str, Any]:
        body = dict(call.body)
        body["rid"] = call.request_id
        if call.route is Route.CHAT and any(body.get(flag) for flag in _CHAT_NON_STREAMABLE):
            return body  # sent as the client sent it: non-streamed, or refused with the engine's own 400
        return streaming_body(body)

    async def abort(self, request_id: str) -> None:
        try:
            await post_json(
                self._session,
                self.url + "/abort_request",
                {"rid": request_id},
                limits=self._timeouts.control(self._timeouts.abort_s),
                what="abort",
            )
        except UpstreamError as error:
            log.info("abort of %s on %s failed: %s", request_id, self.url, error.message)

    # -- facts and load --------------------------------------------------------------------------------

    async def probe(self) -> EngineInfo:
        limits = self._timeouts.control(self._timeouts.probe_s)
        info = await self._server_info(limits)
        models, max_model_len = await fetch_models(self._session, self.url, limits=limits)
        weight_version = info.get("weight_version")
        if not isinstance(weight_version, str):
            weight_version = None
        self._hint = AssemblyHint(
            family=EngineFamily.SGLANG,
            weight_version=weight_version,
            is_incremental_generate=bool(info.get("incremental_streaming_output")),
        )
        chunk = info.get("chunked_prefill_size")
        return EngineInfo(
            family=EngineFamily.SGLANG,
            capacity=sglang_capacity(info),
            models=models,
            max_model_len=max_model_len or positive_int(info.get("context_length")),
            chunked_prefill_size=chunk if isinstance(chunk, int) and chunk > 0 else None,
            weight_version=weight_version,
        )

    async def _server_info(self, limits: aiohttp.ClientTimeout) -> dict[str, Any]:
        try:
            info = await get_json(self._session, self.url + "/server_info", limits=limits, what="server_info")
        except UpstreamError as error:
            if error.status != 404:
                raise
            info = await get_json(
                self._session, self.url + "/get_server_info", limits=limits, what="get_server_info"
            )
        if not isinstance(info, dict):
            raise UpstreamError("server_info is not a JSON object", retryable=True)
        return info

    async def health(self) -> bool:
        return await is_ok(
            self._session, self.url + "/health", limits=self._timeouts.control(self._timeouts.health_s)
        )

    async def load(self) -> EngineLoad:
        limits = self._timeouts.control(self._timeouts.load_s)
        try:
            answer = await get_json(self._session, self.url + "/v1/loads", limits=limits, what="v1/loads")
        except UpstreamError as error:
            if error.status is None or error.status >= 500:
                raise
            answer = None  # older SGLang: no /v1/loads; /metrics (with --enable-metrics) instead
        if isinstance(answer, dict) and isinstance(answer.get("loads"), list):
            loads = [item for item in answer["loads"] if isinstance(item, dict)]
            return EngineLoad(
                running=sum(int(item.get("num_running_reqs") or 0) for item in loads),
                waiting=sum(int(item.get("num_waiting_reqs") or 0) for item in loads),
                gen_throughput=sum(float(item.get("gen_throughput") or 0.0) for item in loads),
            )
        text = await get_text(self._session, self.url + "/metrics", limits=limits, what="metrics")
        values = parse_prometheus(text, _METRICS)
        if "sglang:num_running_reqs" not in values:
            raise UpstreamError("the engine reports no load (/v1/loads or /metrics)", retryable=True)
        return EngineLoad(
            running=int(values["sglang:num_running_reqs"]),
            waiting=int(values.get("sglang:num_queue_reqs", 0.0)),
            generated_tokens_total=values.get("sglang:generation_tokens_total"),
        )

    # -- gate and weights ------------------------------------------------------------------------------

    async def pause(self, mode: str) -> None:
        if mode in _GATEWAY_DRAINS:
            return  # SGLang cannot drain: the gateway stops dispatching and waits for in-flight work
        if mode not in _PAUSE_MODES:
            raise ValueError(f"unknown pause mode {mode!r}; expected abort, drain, retract or in_place")
        await post_json(
            self._session,
            self.url + "/pause_generation",
            {"mode": _PAUSE_MODES[mode]},
            limits=self._timeouts.control(self._timeouts.pause_s),
            what="pause_generation",
        )

    async def resume(self) -> None:
        await post_json(
            self._session,
            self.url + "/continue_generation",
            {},
            limits=self._timeouts.control(self._timeouts.pause_s),
            what="continue_generation",
        )

    async def update_weights(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        answer = await post_json(
            self._session,
            self.url + "/" + path.lstrip("/"),
            body,
            limits=self._timeouts.control(self._timeouts.weights_s),
            what=path,
        )
        return answer if isinstance(answer, dict) else {"answer": answer}


def generate_body(call: UpstreamCall) -> dict[str, Any]:
    """The `/generate` body: the client's, with the gateway's `rid`, streaming, and the progress cadence.

    A streaming client that chose its own `stream_interval` keeps it (it sees every chunk); otherwise the
    gateway's `progress_every_tokens` applies when it is above 1.
    """
    body = dict(call.body)
    client_streams = bool(body.get("stream"))
    body["rid"] = call.request_id
    body["stream"] = True
    if call.progress_every_tokens > 1:
        params = body.get("sampling_params")
        if isinstance(params, list):
            body["sampling_params"] = [
                _with_interval(p, call.progress_every_tokens, client_streams) for p in params
            ]
        else:
            body["sampling_params"] = _with_interval(params, call.progress_every_tokens, client_streams)
    return body


def _with_interval(params: Any, every: int, client_streams: bool) -> Any:
    if params is None:
        return {"stream_interval": every}
    if not isinstance(params, dict):
        return params  # not ours to fix: the engine answers 400
    if client_streams and "stream_interval" in params:
        return params
    return {**params, "stream_interval": every}


def sglang_capacity(info: Mapping[str, Any]) -> int | None:
    """Requests the engine runs at once: the sum over DP ranks of `effective_max_running_requests_per_dp`,
    else the configured `max_running_requests`, else None."""
    states = info.get("internal_states")
    if isinstance(states, list):
        per_dp = [
            positive_int(s.get("effective_max_running_requests_per_dp"))
            for s in states
            if isinstance(s, dict)
        ]
        if per_dp and all(v is not None for v in per_dp):
            return sum(v for v in per_dp if v is not None)
    return positive_int(info.get("max_running_requests"))
