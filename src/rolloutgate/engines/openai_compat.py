"""Generic OpenAI-compatible adapter: any server speaking `/v1/chat/completions` and `/v1/completions`.

Theory of operation: every call streams with `stream_options.include_usage`, a non-streaming client's too (its
answer is assembled from the stream): such a server has no load endpoint, so its own events are the only
progress the gateway can see (the other families answer a non-streaming client's call whole and report
their token counters instead). There is no
abort API (closing the upstream connection is the abort, which the server does by closing the iterator), no
pause API (`pause`/`resume` fail clearly; the gateway can still pause by not dispatching), no capacity fact
(the server falls back to its configured capacity) and no load endpoint.
"""

from __future__ import annotations

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
from rolloutgate.engines.http import fetch_models, generates_one, is_ok
from rolloutgate.engines.openai_stream import client_wants_usage, route_unsupported, upstream_body
from rolloutgate.engines.push_call import start_generation

__all__ = ("OpenAICompatClient",)


class OpenAICompatClient(EngineAdapter):
    """One generic OpenAI-compatible server. Holds no request state."""

    family = EngineFamily.OPENAI
    reports_load = False  # no load endpoint: every call streams, its events are its progress

    def start(self, call: UpstreamCall, on_events: EventSink, on_end: EndSink) -> UpstreamHandle:
        if call.route in (Route.GENERATE, Route.TOKENS):
            return refuse(route_unsupported("this OpenAI-compatible engine", call.route.value), on_end)
        return start_generation(
            self._upstream,
            call.route.value,
            # no load endpoint, so no engine-level progress: every call streams (its events are the signal)
            lambda: orjson.dumps(upstream_body(call.body, stream=True)),
            headers=call.headers,
            connect_s=self._timeouts.connect_s,
            decoder=OpenAIDecoder(self._hint, wants_usage=client_wants_usage(call.body)),
            on_events=on_events,
            on_end=on_end,
        )

    async def abort(self, request_id: str) -> None:
        """Nothing to send: the server aborts by closing the upstream connection."""

    async def probe(self) -> EngineInfo:
        limits = self._timeouts.control(self._timeouts.probe_s)
        served = await fetch_models(self._session, self.url, limits=limits)
        return EngineInfo(
            family=EngineFamily.OPENAI,
            models=served.names,
            max_model_len=served.max_model_len,
            vocab_size=served.vocab_size,
        )

    async def health(self) -> bool:
        limits = self._timeouts.control(self._timeouts.health_s)
        if await is_ok(self._session, self.url + "/health", limits=limits):
            return True
        return await is_ok(self._session, self.url + "/v1/models", limits=limits)

    async def generates(self, model: str | None) -> bool:
        """A completion of one token (text: not every OpenAI-compatible server takes token ids)."""
        body: dict[str, Any] = {"prompt": "ping", "max_tokens": 1, "temperature": 0.0}
        if model is not None:
            body["model"] = model
        limits = self._timeouts.control(self._timeouts.health_s)
        return await generates_one(self._session, self.url + "/v1/completions", body, limits=limits)

    async def readiness(self) -> Readiness | None:
        return None  # an OpenAI-compatible server has no pause

    async def scheduler_snapshot(self) -> SchedulerSnapshot | None:
        return None  # nothing to ask

    async def load(self) -> EngineLoad:
        raise UpstreamError("a generic OpenAI-compatible engine reports no load", retryable=False)

    async def pause(self, mode: str) -> None:
        raise UpstreamError(
            "a generic OpenAI-compatible engine has no pause API; the gateway pauses by not dispatching",
            retryable=False,
            status=501,
        )

    async def resume(self) -> None:
        raise UpstreamError(
            "a generic OpenAI-compatible engine has no pause API", retryable=False, status=501
        )
