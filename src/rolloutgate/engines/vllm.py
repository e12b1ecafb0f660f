"""vLLM adapter: the OpenAI routes with `X-Request-Id`, abort by id or by closing, pause/resume (dev mode).

Theory of operation (facts from reference/engines.md, section C):

- Chat and completions stream with `stream_options.include_usage`; the header `X-Request-Id` carries the
  gateway's id (vLLM names the request `chatcmpl-<id>` / `cmpl-<id>`). vLLM sends headers at once and its
  first data chunk at the first token. Per-chunk usage (`continuous_usage_stats`) is not requested: it would
  change every chunk the client sees; the final usage frame corrects the per-chunk count
  (engines/progress.py).
- Token-in/token-out `/inference/v1/generate` (SkyRL's and prime-rl's rollouts) goes as the OpenAI routes do
  (`X-Request-Id`; vLLM names it `generate-tokens-<id>`): its stream chunks carry `choices` as completions'
  do, with `token_ids` for text, and end with the usage frame.
- vLLM has no `/generate`: such a call fails with a non-retryable 400 before anything is sent.
- Abort: closing the upstream connection aborts the request in vLLM (the server cancels the generation
  task, which closes the stream). `abort()` also posts `/abort_requests` (only served with
  `VLLM_SERVER_DEV_MODE=1`, a 404 otherwise), naming the id in each form vLLM may hold it under.
- `pause` maps `abort`, `drain`/`wait`, `in_place`/`keep` (and `retract`, which vLLM lacks, to `keep`) to
  `POST /pause?mode=` (dev mode). In `abort`/`wait` vLLM answers new requests with 503 until `/resume`.
- Capacity: `max_num_seqs` from `/server_info?config_format=json` (dev mode), else None (the server falls
  back to its configured capacity). Load: `vllm:num_requests_running/waiting` from `/metrics`.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import orjson

from rolloutgate.engines.adapter import EngineAdapter
from rolloutgate.engines.base import (
    EngineFamily,
    EngineInfo,
    EngineLoad,
    Readiness,
    Route,
    SchedulerSnapshot,
    UpstreamCall,
    UpstreamError,
)
from rolloutgate.engines.generation import EndSink, EventSink, OpenAIDecoder, UpstreamHandle, refuse
from rolloutgate.engines.http import (
    fetch_models,
    generates_one,
    get_json,
    get_text,
    is_ok,
    parse_prometheus,
    positive_int,
)
from rolloutgate.engines.openai_stream import client_wants_usage, route_unsupported, upstream_body
from rolloutgate.engines.push_call import start_generation

__all__ = ("VllmClient", "vllm_capacity")

log = logging.getLogger(__name__)

_PAUSE_MODES = {
    "abort": "abort",
    "drain": "wait",
    "wait": "wait",
    "in_place": "keep",
    "keep": "keep",
    "retract": "keep",
}
_METRICS = frozenset(
    {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:generation_tokens_total"}
)
_MAX_NUM_SEQS = re.compile(r"max_num_seqs['\"]?\s*[=:]\s*(\d+)")


class VllmClient(EngineAdapter):
    """One vLLM engine. Holds no request state."""

    family = EngineFamily.VLLM
    reports_load = True  # /metrics' token counter: engine-level progress

    def start(self, call: UpstreamCall, on_events: EventSink, on_end: EndSink) -> UpstreamHandle:
        if call.route is Route.GENERATE:
            return refuse(route_unsupported("vLLM", call.route.value), on_end)
        return start_generation(
            self._upstream,
            call.route.value,
            lambda: orjson.dumps(upstream_body(call.body)),
            headers={**call.headers, "X-Request-Id": call.request_id},
            connect_s=self._timeouts.connect_s,
            decoder=OpenAIDecoder(self._hint, wants_usage=client_wants_usage(call.body)),
            on_events=on_events,
            on_end=on_end,
        )

    async def abort(self, request_id: str) -> None:
        ids = [request_id, f"chatcmpl-{request_id}", f"cmpl-{request_id}", f"generate-tokens-{request_id}"]
        try:
            await self.control("/abort_requests", {"request_ids": ids}, timeout_s=self._timeouts.abort_s)
        except UpstreamError as error:
            # without dev mode there is no such route; the closed connection has aborted the request
            log.debug("abort of %s on %s: %s", request_id, self.url, error.message)

    async def probe(self) -> EngineInfo:
        limits = self._timeouts.control(self._timeouts.probe_s)
        served = await fetch_models(self._session, self.url, limits=limits)
        try:
            info = await get_json(
                self._session,
                self.url + "/server_info?config_format=json",
                limits=limits,
                what="server_info",
            )
        except UpstreamError as error:
            if error.status is None:
                raise
            info = None  # not in dev mode: capacity unknown
        return EngineInfo(
            family=EngineFamily.VLLM,
            capacity=vllm_capacity(info),
            models=served.names,
            max_model_len=served.max_model_len,
            vocab_size=served.vocab_size,  # the card's `root`: vLLM's model path
        )

    async def health(self) -> bool:
        """`/health`: the engine process answers; it generates nothing (a wedged engine says 200)."""
        return await is_ok(
            self._session, self.url + "/health", limits=self._timeouts.control(self._timeouts.health_s)
        )

    async def generates(self, model: str | None) -> bool:
        """A completion of one token from token id 0 (every vocabulary has it)."""
        body: dict[str, Any] = {"prompt": [0], "max_tokens": 1, "temperature": 0.0}
        if model is not None:
            body["model"] = model
        limits = self._timeouts.control(self._timeouts.health_s)
        return await generates_one(self._session, self.url + "/v1/completions", body, limits=limits)

    async def readiness(self) -> Readiness | None:
        """vLLM's `GET /is_paused` (`{"is_paused": bool}`, with VLLM_SERVER_DEV_MODE=1 only; its `/health`
        answers 200 while paused). A round trip to the engine core: on a hung engine it times out (None)."""
        limits = self._timeouts.control(self._timeouts.load_s)
        try:
            answer = await get_json(self._session, self.url + "/is_paused", limits=limits, what="is_paused")
        except UpstreamError:
            return None
        if not isinstance(answer, dict) or not isinstance(answer.get("is_paused"), bool):
            return None
        return Readiness.PAUSED if answer["is_paused"] else Readiness.READY

    async def scheduler_snapshot(self) -> SchedulerSnapshot | None:
        return None  # vLLM states its pause (`/is_paused`), and its `/health` does not wait on one

    async def load(self) -> EngineLoad:
        limits = self._timeouts.control(self._timeouts.load_s)
        text = await get_text(self._session, self.url + "/metrics", limits=limits, what="metrics")
        values = parse_prometheus(text, _METRICS)
        if "vllm:num_requests_running" not in values:
            raise UpstreamError("the engine's /metrics has no vllm:num_requests_running", retryable=True)
        return EngineLoad(
            running=int(values["vllm:num_requests_running"]),
            waiting=int(values.get("vllm:num_requests_waiting", 0.0)),
            generated_tokens_total=values.get("vllm:generation_tokens_total"),
        )

    async def pause(self, mode: str) -> None:
        if mode not in _PAUSE_MODES:
            raise ValueError(f"unknown pause mode {mode!r}; expected abort, drain, retract or in_place")
        await self.control(
            "/pause", None, timeout_s=self._timeouts.pause_s, params={"mode": _PAUSE_MODES[mode]}
        )

    async def resume(self) -> None:
        await self.control("/resume", None, timeout_s=self._timeouts.pause_s)


def vllm_capacity(info: Any) -> int | None:
    """`max_num_seqs` from a `/server_info` answer (JSON config, vLLM's text rendering, or a flat answer
    with a top-level `max_num_seqs`, as the simulator renders it), else None."""
    if not isinstance(info, dict):
        return None
    if "max_num_seqs" in info:
        return positive_int(info["max_num_seqs"])
    config = info.get("vllm_config")
    if isinstance(config, dict):
        scheduler = config.get("scheduler_config")
        if isinstance(scheduler, dict):
            return positive_int(scheduler.get("max_num_seqs"))
        return None
    if isinstance(config, str):
        match = _MAX_NUM_SEQS.search(config)
        return int(match.group(1)) if match else None
    return None
