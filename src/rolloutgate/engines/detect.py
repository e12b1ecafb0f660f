"""Which engine family a URL serves, and the adapter for it.

Theory of operation: each family has an endpoint only it answers in its own way. SGLang's `/server_info`
(older: `/get_server_info`) returns its resolved server arguments; vLLM answers `/version` with
`{"version": ...}` and exposes `vllm:` metrics; anything else that serves the OpenAI routes is OPENAI.
vLLM (dev mode) also serves `/server_info`, but with a `vllm_config` object, so SGLang is recognised by its
arguments, not by the route.

An SGLang-speaking server without `/server_info` (a stand-in such as miles' `MockSGLangServer`, which serves
`/generate`, `/v1/chat/completions` and `/health` only) is recognised, after the vLLM checks, by its native
`/generate` route: a GET there is answered 405 (the route takes POST) and never generates. It joins as SGLang
with defaults (engines/sglang.py `probe`). An OpenAI-compatible server that has a `/generate` of its own
(TGI's) is taken for SGLang too: prefix its URL with `openai+` to say what it is.
"""

from __future__ import annotations

import aiohttp

from rolloutgate.engines.base import EngineClient, EngineFamily, UpstreamError
from rolloutgate.engines.http import ControlTimeouts, get_json, get_text, status_of
from rolloutgate.engines.openai_compat import OpenAICompatClient
from rolloutgate.engines.sglang import SglangClient
from rolloutgate.engines.vllm import VllmClient

__all__ = ("detect_family", "make_client")

_SGLANG_ARGS = ("chunked_prefill_size", "tp_size", "max_running_requests", "internal_states")


async def detect_family(
    session: aiohttp.ClientSession, url: str, *, timeouts: ControlTimeouts | None = None
) -> EngineFamily:
    """The family of the engine at `url`.

    Raises UpstreamError (retryable) when nothing answers at all (the engine is down or not yet up), so a
    caller never mistakes an unreachable SGLang or vLLM for a generic server.
    """
    timeouts = timeouts or ControlTimeouts()
    limits = timeouts.control(timeouts.probe_s)
    base = url.rstrip("/")
    answered = False
    for path in ("/server_info", "/get_server_info"):
        try:
            info = await get_json(session, base + path, limits=limits, what=path)
        except UpstreamError as error:
            answered = answered or error.status is not None
            continue
        answered = True
        if isinstance(info, dict) and "vllm_config" not in info and any(k in info for k in _SGLANG_ARGS):
            return EngineFamily.SGLANG
    try:
        version = await get_json(session, base + "/version", limits=limits, what="version")
        answered = True
        if isinstance(version, dict) and isinstance(version.get("version"), str):
            return EngineFamily.VLLM
    except UpstreamError as error:
        answered = answered or error.status is not None
    try:
        metrics = await get_text(session, base + "/metrics", limits=limits, what="metrics")
        answered = True
        if "vllm:" in metrics:
            return EngineFamily.VLLM
    except UpstreamError as error:
        answered = answered or error.status is not None
    if not answered:
        raise UpstreamError(f"no engine answers at {base}", retryable=True)
    generate = await status_of(session, base + "/generate", limits=limits)
    if generate is not None and generate != 404:
        return EngineFamily.SGLANG  # its native route, without /server_info (module docstring)
    return EngineFamily.OPENAI


def make_client(
    family: EngineFamily,
    url: str,
    session: aiohttp.ClientSession,
    *,
    timeouts: ControlTimeouts | None = None,
) -> EngineClient:
    """The adapter for `family` at `url`, sharing the gateway's session."""
    if family is EngineFamily.SGLANG:
        return SglangClient(url, session, timeouts=timeouts)
    if family is EngineFamily.VLLM:
        return VllmClient(url, session, timeouts=timeouts)
    return OpenAICompatClient(url, session, timeouts=timeouts)
