"""Client calls through the gateway, as agent harnesses make them: the OpenAI SDK and LiteLLM, chat and
completions, streaming and not. Every call asks for `max_tokens` with `ignore_eos` (the tiny model almost never
samples EOS, and the simulator honours the same flag) and counts tokens from `usage`, never from chunks (some
tokens decode to empty deltas)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import httpx
import litellm
import openai
import orjson
from tests.e2e.harness import EngineSet, Gateway

__all__ = (
    "Answer",
    "cancel_all",
    "hold_stream",
    "litellm_call",
    "openai_call",
    "openai_client",
    "raw_stream",
    "started_streams",
)

PROMPT = "Tell me about the sea."
HOLD_STREAM_INTERVAL = 64  # tokens per chunk of a held stream


@dataclass(frozen=True, slots=True, kw_only=True)
class Answer:
    text: str
    tokens: int | None  # usage.completion_tokens
    finish_reason: str | None
    headers: dict[str, str] = field(default_factory=dict)  # lower-case names; LiteLLM hides them

    @property
    def engine(self) -> str | None:
        return self.headers.get("x-rolloutgate-engine")

    def timing(self) -> dict[str, float]:
        """`X-Rolloutgate-Timing` (`wall=1.2;queue=0.1;...`) as numbers."""
        raw = self.headers.get("x-rolloutgate-timing", "")
        return {k: float(v) for k, v in (item.split("=", 1) for item in raw.split(";") if "=" in item)}


def openai_client(gateway: Gateway, read_timeout: float = 120.0) -> openai.AsyncOpenAI:
    """An SDK client whose read timeout is `read_timeout` (what keep-alive answers). Connecting gets at least
    30 s: on this 2-core machine, with the engines decoding, the test process's own connect (name lookup in a
    worker thread, then the handshake) once took over 2 s, and that is no part of what the gateway controls."""
    timeout = openai.Timeout(read_timeout, connect=max(read_timeout, 30.0))
    # No retries: a retry would hide the very error a test looks for, and start a second generation.
    return openai.AsyncOpenAI(base_url=gateway.v1, api_key="unused", max_retries=0, timeout=timeout)


def _messages(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


async def openai_call(
    client: openai.AsyncOpenAI,
    engines: EngineSet,
    *,
    route: str = "chat",
    stream: bool = False,
    max_tokens: int = 16,
    headers: dict[str, str] | None = None,
    messages: list[dict[str, str]] | None = None,
) -> Answer:
    common: dict[str, Any] = {
        "model": engines.model,
        "max_tokens": max_tokens,
        "extra_body": {"ignore_eos": True},
        "extra_headers": headers or {},
    }
    if stream:
        common |= {"stream": True, "stream_options": {"include_usage": True}}
    if route == "chat":
        raw: Any = await client.chat.completions.with_raw_response.create(
            messages=messages or _messages(PROMPT), **common
        )
    else:
        raw = await client.completions.with_raw_response.create(prompt=PROMPT, **common)
    response_headers = {k.lower(): v for k, v in raw.headers.items()}
    parsed = raw.parse()  # with_raw_response gives the legacy response, whose parse() is synchronous
    if not stream:
        choice = parsed.choices[0]
        text = choice.message.content if route == "chat" else choice.text
        usage = parsed.usage.completion_tokens if parsed.usage else None
        return Answer(
            text=text or "", tokens=usage, finish_reason=choice.finish_reason, headers=response_headers
        )
    text, tokens, finish = "", None, None
    async for chunk in parsed:
        for choice in chunk.choices:
            text += (choice.delta.content if route == "chat" else choice.text) or ""
            finish = choice.finish_reason or finish
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    return Answer(text=text, tokens=tokens, finish_reason=finish, headers=response_headers)


async def litellm_call(
    gateway: Gateway,
    engines: EngineSet,
    *,
    route: str = "chat",
    stream: bool = False,
    max_tokens: int = 16,
    read_timeout_s: float = 120.0,
) -> Answer:
    common: dict[str, Any] = {
        "api_base": gateway.v1,
        "api_key": "unused",
        "max_tokens": max_tokens,
        "timeout": read_timeout_s,
        "num_retries": 0,
        "extra_body": {"ignore_eos": True},
    }
    if stream:
        common |= {"stream": True, "stream_options": {"include_usage": True}}
    if route == "chat":
        response: Any = await litellm.acompletion(
            model=f"openai/{engines.model}", messages=_messages(PROMPT), **common
        )
    else:
        response = await litellm.atext_completion(
            model=f"text-completion-openai/{engines.model}", prompt=PROMPT, **common
        )
    if not stream:
        choice = response.choices[0]
        text = choice.message.content if route == "chat" else choice.text
        return Answer(
            text=text or "", tokens=response.usage.completion_tokens, finish_reason=choice.finish_reason
        )
    text, tokens, finish = "", None, None
    async for chunk in response:
        for choice in chunk.choices:
            delta = getattr(choice, "delta", None)
            text += (delta.content if delta is not None else getattr(choice, "text", "")) or ""
            finish = choice.finish_reason or finish
        usage = getattr(chunk, "usage", None)
        if usage:
            tokens = usage.completion_tokens
    return Answer(text=text, tokens=tokens, finish_reason=finish)


async def raw_stream(
    base_url: str,
    engines: EngineSet,
    *,
    max_tokens: int,
    generating: asyncio.Event,
    headers: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """A streaming chat completion over plain HTTP that sets `generating` at its first data chunk, a
    client-side sign that an engine runs it; returns every data chunk. Cancel the task to disconnect."""
    payload = {
        "model": engines.model,
        "messages": _messages(PROMPT),
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks: list[dict[str, Any]] = []
    async with (
        httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client,
        client.stream("POST", base_url + "/v1/chat/completions", json=payload, headers=headers) as response,
    ):
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(orjson.loads(line[len("data: ") :]))
                generating.set()
    return chunks


async def hold_stream(
    base_url: str, engines: EngineSet, *, max_tokens: int, generating: asyncio.Event
) -> None:
    """Like `raw_stream`, but parses nothing and keeps nothing: a cheap way to occupy an engine slot (parsing
    thousands of chunks a second would starve the test's own event loop on this 2-core machine). Raises if
    the stream carries an error event or ends without `[DONE]`."""
    payload = {
        "model": engines.model,
        "messages": _messages(PROMPT),
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_interval": HOLD_STREAM_INTERVAL,  # vLLM >= 0.11 and the simulator: one chunk per N tokens
    }
    tail = b""  # the last bytes seen, to find an event split across reads
    async with (
        httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client,
        client.stream("POST", base_url + "/v1/chat/completions", json=payload) as response,
    ):
        response.raise_for_status()
        async for chunk in response.aiter_raw():
            seen = tail + chunk
            if b'data: {"error"' in seen:
                raise AssertionError(f"error event in a held stream: {seen[-500:]!r}")
            if b"data: {" in seen:
                generating.set()
            tail = seen[-64:]
            # Reads of a socket that always has data never suspend: without this the held streams would
            # keep the test's event loop to themselves (measured: 20 s without a timer firing).
            await asyncio.sleep(0)
    if b"data: [DONE]" not in tail:
        raise AssertionError("a held stream ended without [DONE]")


async def started_streams(
    base_url: str, engines: EngineSet, count: int, *, max_tokens: int, within_s: float = 60.0
) -> list[asyncio.Task[None]]:
    """`count` held streams, returned once each has produced its first chunk."""
    events = [asyncio.Event() for _ in range(count)]
    tasks = [
        asyncio.create_task(hold_stream(base_url, engines, max_tokens=max_tokens, generating=e))
        for e in events
    ]
    try:
        await asyncio.wait_for(
            asyncio.gather(*(_first_chunk(t, e) for t, e in zip(tasks, events, strict=True))), within_s
        )
    except BaseException:
        await cancel_all(tasks)
        raise
    return tasks


async def _first_chunk(task: asyncio.Task[None], generating: asyncio.Event) -> None:
    """Wait for the stream's first chunk; fail at once if the stream ends (or fails) before it."""
    waiter = asyncio.create_task(generating.wait())
    await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    if not generating.is_set():
        waiter.cancel()
        task.result()  # raises the stream's error, if it had one
        raise AssertionError("a held stream ended before its first chunk")


async def cancel_all(tasks: list[asyncio.Task[Any]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
