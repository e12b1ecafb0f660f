"""SGLang adapter: native `/generate` and the OpenAI routes, abort by `rid`, pause/continue, weight updates.

Theory of operation (facts from reference/engines.md, section A):

- The engine does no more output work for a call than for the same call sent directly. `/generate` is sent
  with `rid` = the gateway's request id and `stream: true`; its chunks are cumulative, counted by
  `meta_info.completion_tokens` deltas (engines/progress.py). A streaming client gets the chunks it asked
  for; for any other client the gateway asks for `stream_interval` FIRST_AND_LAST, so the engine sends the
  first token (the prefill is over) and the end (the whole answer), and engine-level load stands in for
  progress in between (server/engine_watch.py). With `--checkpoint-tokens N` it asks for N instead: the output
  so far every N tokens, what a new attempt continues from (server/continuation.py), at a price in bytes.
- Chat and completions stream (with `rid` and `stream_options.include_usage`) only when the client streams:
  OpenAI chunks carry ~200 bytes of envelope per token, so a non-streaming client's call is sent as it came
  and answered as one whole body, watched at engine level. SGLang refuses to stream a chat request with
  `return_meta_info`, `return_token_ids` or `return_prompt_token_ids`: such a request is sent as the client
  sent it. SGLang's OpenAI streams send their HTTP headers only at the first token; the call simply waits.
- `abort` posts `/abort_request {"rid"}`. SGLang matches rids by prefix in its scheduler but ignores a rid its
  tokenizer does not know, and n>1 samples get fresh rids, so an n>1 or batch `/generate` cannot be aborted
  by rid: closing the connection (which SGLang notices within 0-4 s) is the fallback.
- `pause` maps `abort`, `retract`, `in_place` (and `keep`) to `/pause_generation` modes. SGLang has no drain
  mode: for `drain`/`wait` the gateway drains itself (it stops dispatching and waits for in-flight requests),
  so the adapter sends nothing. While paused, SGLang holds new requests open rather than refusing them.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Mapping
from typing import Any

import aiohttp
import orjson

from rolloutgate.engines.adapter import EngineAdapter
from rolloutgate.engines.base import (
    SNAPSHOT_ANSWER_S,
    AssemblyHint,
    EngineFamily,
    EngineInfo,
    EngineLoad,
    Readiness,
    Route,
    SchedulerSnapshot,
    UpstreamCall,
    UpstreamError,
)
from rolloutgate.engines.generation import (
    EndSink,
    EventDecoder,
    EventSink,
    GenerateDecoder,
    OpenAIDecoder,
    UpstreamHandle,
    refuse,
)
from rolloutgate.engines.http import (
    ControlTimeouts,
    ServedModels,
    fetch_models,
    generates_one,
    get_json,
    get_text,
    has_route,
    is_ok,
    parse_prometheus,
    positive_int,
    status_of,
    vocab_size_of,
)
from rolloutgate.engines.openai_stream import client_wants_usage, route_unsupported, upstream_body
from rolloutgate.engines.push_call import start_generation

__all__ = ("SglangClient", "decode_tokens")

log = logging.getLogger(__name__)
# SGLang's own health probe's rid prefix: requests whose rid starts with it are kept out of its statistics
HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK_"

# chat options SGLang refuses to stream (serving_chat.py L1310-1325)
_CHAT_NON_STREAMABLE = ("return_meta_info", "return_token_ids", "return_prompt_token_ids")
_PAUSE_MODES = {"abort": "abort", "retract": "retract", "in_place": "in_place", "keep": "in_place"}
_GATEWAY_DRAINS = frozenset({"drain", "wait"})
_METRICS = frozenset(
    {
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:generation_tokens_total",
        "sglang:gen_throughput",
    }
)
# SGLang counts a request's tokens in `sglang:generation_tokens_total` only when the request finishes (0.5.9
# measured; 0.5.23's TokenizerMetricsCollector alike): a lone long call shows no progress there until its end.
# Its scheduler bumps `sglang:realtime_tokens_total{mode="decode"}` every decode step: the live counter.
_DECODE_TOKENS = re.compile(
    rb'^sglang:realtime_tokens_total\{[^}]*\bmode="decode"[^}]*\}\s+(\S+)', re.MULTILINE
)


class SglangClient(EngineAdapter):
    """One SGLang engine. Holds no request state; `probe()` refreshes the facts assembly needs."""

    family = EngineFamily.SGLANG
    reports_load = True  # /metrics' token counter or /v1/loads: engine-level progress
    ends_aborted_calls = True  # `/abort_request` by rid: the call ends with finish reason abort

    def __init__(
        self, url: str, session: aiohttp.ClientSession, *, timeouts: ControlTimeouts | None = None
    ) -> None:
        super().__init__(url, session, timeouts=timeouts)
        self._counter_in_metrics: bool | None = None  # unknown until the first load reading

    # -- generation ------------------------------------------------------------------------------------

    def start(self, call: UpstreamCall, on_events: EventSink, on_end: EndSink) -> UpstreamHandle:
        if call.route is Route.TOKENS:
            return refuse(route_unsupported("SGLang", call.route.value), on_end)
        if call.route is Route.GENERATE:
            decoder: EventDecoder = GenerateDecoder(self._hint)
            first_and_last = self.reports_load  # else every chunk: the events are the only progress
            make_body = lambda: orjson.dumps(generate_body(call, first_and_last))  # noqa: E731 - when sent
        else:
            decoder = OpenAIDecoder(self._hint, wants_usage=client_wants_usage(call.body))
            make_body = lambda: orjson.dumps(self._openai_body(call))  # noqa: E731
        return start_generation(
            self._upstream,
            call.route.value,
            make_body,
            headers=call.headers,
            connect_s=self._timeouts.connect_s,
            decoder=decoder,
            on_events=on_events,
            on_end=on_end,
        )

    def _openai_body(self, call: UpstreamCall) -> dict[str, Any]:
        body = dict(call.body)
        body["rid"] = call.request_id
        if (not body.get("stream") and self.reports_load) or (
            call.route is Route.CHAT and any(body.get(flag) for flag in _CHAT_NON_STREAMABLE)
        ):
            return body  # sent as the client sent it: non-streamed, or refused with the engine's own 400
        return upstream_body(body, stream=True)  # a streaming client, or an engine that reports no load

    async def abort(self, request_id: str) -> None:
        try:
            await self.control(
                "/abort_request", {"rid": request_id}, timeout_s=self._timeouts.abort_s, what="abort"
            )
        except UpstreamError as error:
            log.info("abort of %s on %s failed: %s", request_id, self.url, error.message)

    # -- facts and load --------------------------------------------------------------------------------

    async def probe(self) -> EngineInfo:
        """The engine's facts from `/server_info` and `/v1/models`. An SGLang-speaking server that lacks them
        (a 404: a stand-in such as miles' `MockSGLangServer`) joins with defaults, named in `missing`: no
        capacity (the gateway's `--default-capacity`), models, context length or weight version. One without
        `/server_info` must have `/generate` or `/v1/chat/completions` (it speaks SGLang), and when it reports
        no load either (`/metrics`, `/v1/loads`) every call it can stream is streamed: its events are then the
        only progress there is."""
        limits = self._timeouts.control(self._timeouts.probe_s)
        missing: list[str] = []
        info = await self._server_info(limits)
        if info is None:
            if not await self._speaks_sglang(limits):
                raise UpstreamError(
                    f"{self.url} has none of /server_info, /get_server_info, /generate and "
                    "/v1/chat/completions: it does not speak SGLang",
                    retryable=True,
                    status=404,
                )
            missing.append("/server_info")
            info = {}
        try:
            served = await fetch_models(self._session, self.url, limits=limits)
        except UpstreamError as error:
            if error.status != 404:
                raise
            missing.append("/v1/models")
            served = ServedModels((), None, None)
        if missing:
            self.reports_load = await self._reports_load()
            if not self.reports_load:
                missing.append("load (/metrics, /v1/loads)")
        weight_version = info.get("weight_version")
        if not isinstance(weight_version, str):
            weight_version = None
        incremental = bool(info.get("incremental_streaming_output"))
        self._hint = AssemblyHint(
            family=EngineFamily.SGLANG,
            weight_version=weight_version,
            is_incremental_generate=incremental,
            are_generate_ids_incremental=not incremental and bool(info.get("stream_output")),
        )
        chunk = info.get("chunked_prefill_size")
        return EngineInfo(
            family=EngineFamily.SGLANG,
            capacity=sglang_capacity(info),
            models=served.names,
            max_model_len=served.max_model_len or positive_int(info.get("context_length")),
            chunked_prefill_size=chunk if isinstance(chunk, int) and chunk > 0 else None,
            weight_version=weight_version,
            # the model folder from its server args: its card's `root` is the served name, not always a path
            vocab_size=vocab_size_of(info.get("vocab_size"), info.get("model_path")) or served.vocab_size,
            missing=tuple(missing),
        )

    async def _server_info(self, limits: aiohttp.ClientTimeout) -> dict[str, Any] | None:
        """`/server_info` (older SGLang: `/get_server_info`); None when the engine has neither (404s)."""
        try:
            info = await get_json(self._session, self.url + "/server_info", limits=limits, what="server_info")
        except UpstreamError as error:
            if error.status != 404:
                raise
            try:
                info = await get_json(
                    self._session, self.url + "/get_server_info", limits=limits, what="get_server_info"
                )
            except UpstreamError as old_error:
                if old_error.status != 404:
                    raise
                return None
        if not isinstance(info, dict):
            raise UpstreamError("server_info is not a JSON object", retryable=True)
        return info

    async def _speaks_sglang(self, limits: aiohttp.ClientTimeout) -> bool:
        """It has SGLang's native `/generate`, or at least the chat route (a stand-in named `sglang+` that
        serves chat only, as miles' scripted chat backend); asked with GETs, which neither route runs."""
        for path in ("/generate", "/v1/chat/completions"):
            if await has_route(self._session, self.url + path, limits=limits):
                return True
        return False

    async def _reports_load(self) -> bool:
        """False when the engine has no load route at all (`load()` meets a 4xx); a reading that fails
        otherwise (a timeout, a 5xx) says nothing, and the engine is taken to report load."""
        try:
            await self.load()
        except UpstreamError as error:
            return error.status is None or not 400 <= error.status < 500
        return True

    async def health(self) -> bool:
        return await is_ok(
            self._session, self.url + "/health", limits=self._timeouts.control(self._timeouts.health_s)
        )

    async def generates(self, model: str | None) -> bool:
        """`/generate` of one token from token id 0 (every vocabulary has it). Its rid starts with
        `HEALTH_CHECK`, as SGLang's own health probe's does: SGLang keeps such requests out of its statistics
        (`is_health_check_generate_req`), so the engine's counters stay the clients' alone."""
        body = {
            "input_ids": [0],
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "rid": f"{HEALTH_CHECK_RID_PREFIX}rolloutgate_{uuid.uuid4().hex}",
        }
        limits = self._timeouts.control(self._timeouts.health_s)
        return await generates_one(self._session, self.url + "/generate", body, limits=limits)

    async def readiness(self) -> Readiness | None:
        """SGLang 0.5: `/ready` answers 503 while generation is paused or the server is marked unhealthy;
        `/ping` gives the health flag alone, whatever the pause (http_server.py `is_ready`, `ping`). Neither
        waits on the scheduler, where `/health` generates a token and blocks behind a pause. No flag is
        stated anywhere else: `num_paused_reqs` stays 0 and the load snapshots freeze in a pause as in a
        hang."""
        limits = self._timeouts.control(self._timeouts.load_s)
        ready = await status_of(self._session, self.url + "/ready", limits=limits)
        if ready is None or ready == 404:
            return None  # no answer, or a version without the route
        if 200 <= ready < 300:
            return Readiness.READY
        ping = await status_of(self._session, self.url + "/ping", limits=limits)
        return Readiness.PAUSED if ping is not None and 200 <= ping < 300 else Readiness.NOT_READY

    async def scheduler_snapshot(self) -> SchedulerSnapshot | None:
        """`/get_load`: a round trip to the scheduler, which it serves between batches and at once while
        generation is paused, and not while it is inside a forward pass; per data-parallel rank its requests
        (`num_reqs`) and tokens (`num_tokens`: in use, and the waiting requests' lengths). SGLang 0.5.9 has no
        `/ready`: a snapshot that stays the same while requests are held is how its pause is seen (its
        `/health` cannot tell: any scheduler reply passes it, another gateway's `/get_load` too)."""
        limits = self._timeouts.control(SNAPSHOT_ANSWER_S)
        try:
            ranks = await get_json(self._session, self.url + "/get_load", limits=limits, what="get_load")
        except UpstreamError:
            return None
        ranks = ranks if isinstance(ranks, list) else [ranks]
        try:
            return SchedulerSnapshot(
                requests=sum(int(r["num_reqs"]) for r in ranks),
                tokens=sum(int(r["num_tokens"]) for r in ranks),
            )
        except (KeyError, TypeError, ValueError):
            return None  # not SGLang's answer: no snapshot

    async def load(self) -> EngineLoad:
        """Running and waiting requests and the generated-token counter from `/metrics` (SGLang with
        `--enable-metrics`), else `/v1/loads` (whose `gen_throughput` counts only while its snapshot moves: a
        frozen SGLang keeps the rate of its last decode log). The first reading learns which one answers."""
        limits = self._timeouts.control(self._timeouts.load_s)
        if self._counter_in_metrics is not False:
            try:
                text = await get_text(self._session, self.url + "/metrics", limits=limits, what="metrics")
            except UpstreamError as error:
                if self._counter_in_metrics or error.status is None or error.status >= 500:
                    raise  # no reading this time; a 404 (no --enable-metrics) means never
            else:
                values = parse_prometheus(text, _METRICS)
                if "sglang:generation_tokens_total" in values and "sglang:num_running_reqs" in values:
                    self._counter_in_metrics = True
                    decoded = decode_tokens(text)
                    return EngineLoad(
                        running=int(values["sglang:num_running_reqs"]),
                        waiting=int(values.get("sglang:num_queue_reqs", 0.0)),
                        generated_tokens_total=(
                            decoded if decoded is not None else values["sglang:generation_tokens_total"]
                        ),
                        gen_throughput=values.get("sglang:gen_throughput"),
                    )
            self._counter_in_metrics = False
        answer = await get_json(self._session, self.url + "/v1/loads", limits=limits, what="v1/loads")
        if not isinstance(answer, dict) or not isinstance(answer.get("loads"), list):
            raise UpstreamError("the engine reports no load (/metrics or /v1/loads)", retryable=True)
        loads = [item for item in answer["loads"] if isinstance(item, dict)]
        stamp = answer.get("timestamp")
        return EngineLoad(
            running=sum(int(item.get("num_running_reqs") or 0) for item in loads),
            waiting=sum(int(item.get("num_waiting_reqs") or 0) for item in loads),
            gen_throughput=sum(float(item.get("gen_throughput") or 0.0) for item in loads),
            snapshot_at=stamp if isinstance(stamp, float | int | str) else None,
        )

    # -- gate and weights ------------------------------------------------------------------------------

    async def pause(self, mode: str) -> None:
        if mode in _GATEWAY_DRAINS:
            return  # SGLang cannot drain: the gateway stops dispatching and waits for in-flight work
        if mode not in _PAUSE_MODES:
            raise ValueError(f"unknown pause mode {mode!r}; expected abort, drain, retract or in_place")
        await self.control(
            "/pause_generation", {"mode": _PAUSE_MODES[mode]}, timeout_s=self._timeouts.pause_s
        )

    async def resume(self) -> None:
        await self.control("/continue_generation", {}, timeout_s=self._timeouts.pause_s)


# A non-streaming client's `/generate` is streamed at this interval: SGLang then emits the first token (which
# tells the gateway the prefill is over) and the end, whose cumulative chunk is the answer the engine would have
# sent whole. Its output work is the direct call's plus one small chunk (scheduler `stream_interval` rule:
# `len(output_ids) % interval == 1` for interval > 1, and always at the finish; docs/gateway.md).
FIRST_AND_LAST = 1 << 30


def generate_body(call: UpstreamCall, first_and_last: bool = True) -> dict[str, Any]:
    """The `/generate` body: the client's, with the gateway's `rid`, streaming, and the chunk cadence.

    A streaming client keeps its own `stream_interval` (it reads every chunk). For a client that does not
    stream, the engine sends the first token, then the output so far every `call.checkpoint_tokens` tokens
    (what a new attempt continues from when the engine dies, server/continuation.py), and the end; with no
    checkpoints two chunks (FIRST_AND_LAST): progress costs it nothing beyond one small chunk. Not for an
    engine that reports no load (`first_and_last` False): its chunks are the only progress.
    """
    body = dict(call.body)
    client_streams = bool(body.get("stream"))
    body["rid"] = call.request_id
    body["stream"] = True
    if not client_streams and first_and_last:
        interval = call.checkpoint_tokens or FIRST_AND_LAST
        params = body.get("sampling_params")
        if isinstance(params, list):
            body["sampling_params"] = [_with_interval(p, interval) for p in params]
        else:
            body["sampling_params"] = _with_interval(params, interval)
    return body


def _with_interval(params: Any, interval: int) -> Any:
    if params is None:
        return {"stream_interval": interval}
    if not isinstance(params, dict):
        return params  # not ours to fix: the engine answers 400
    return {**params, "stream_interval": interval}


def decode_tokens(text: str) -> float | None:
    """`sglang:realtime_tokens_total{mode="decode"}` summed over its label sets, else None (not exposed)."""
    found = [float(m.group(1)) for m in _DECODE_TOKENS.finditer(text.encode())]
    return sum(found) if found else None


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
