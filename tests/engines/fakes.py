"""Small fake upstreams over real loopback HTTP, serving the shapes recorded in reference/engines.md.

`FakeEngine` records every request and answers from handlers the test installs with `on(method, path, ...)`.
The shape builders render what SGLang 0.5.23 and vLLM 0.33 send (field sets and order from their protocol
models): SGLang `/generate` cumulative chunks, SGLang and vLLM chat and completion chunks, usage frames.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web
from multidict import CIMultiDict

from tests.sim.helpers import wait_until

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class Recorded:
    method: str
    path: str
    query: dict[str, str]
    headers: Mapping[str, str]  # case-insensitive, as HTTP headers are
    body: Any


@dataclass
class FakeEngine:
    """An aiohttp server on 127.0.0.1:<ephemeral> answering from installed handlers (otherwise 405 for a path
    with a handler for another method, else 404)."""

    handlers: dict[tuple[str, str], Handler] = field(default_factory=dict)
    requests: list[Recorded] = field(default_factory=list)
    disconnects: list[str] = field(default_factory=list)  # paths whose client went away mid-answer
    url: str = ""
    _runner: web.AppRunner | None = None

    def on(self, method: str, path: str, handler: Handler) -> None:
        self.handlers[(method, path)] = handler

    def on_json(self, method: str, path: str, payload: Any, status: int = 200) -> None:
        async def handler(_: web.Request) -> web.StreamResponse:
            return json_reply(payload, status)

        self.on(method, path, handler)

    def on_sse(self, method: str, path: str, events: Sequence[bytes], **options: Any) -> None:
        async def handler(request: web.Request) -> web.StreamResponse:
            return await sse_reply(request, events, **options)

        self.on(method, path, handler)

    def last(self, path: str) -> Recorded:
        return [r for r in self.requests if r.path == path][-1]

    async def start(self, port: int = 0) -> str:
        """Listen on `port` (a `tests.ports.reserved_port` handed over: bound beside the reservation), else
        on a port the OS gives."""
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._dispatch)
        self._runner = web.AppRunner(app, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port, reuse_port=bool(port))
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError:
            body = raw
        self.requests.append(
            Recorded(request.method, request.path, dict(request.query), CIMultiDict(request.headers), body)
        )
        handler = self.handlers.get((request.method, request.path))
        if handler is None:
            if any(path == request.path for _, path in self.handlers):  # as every web framework answers
                return web.json_response({"detail": "Method Not Allowed"}, status=405)
            return web.json_response({"detail": "Not Found"}, status=404)
        try:
            return await handler(request)
        except (ConnectionResetError, asyncio.CancelledError):
            self.disconnects.append(request.path)
            raise


def json_reply(payload: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(payload), status=status, content_type="application/json")


async def sse_reply(
    request: web.Request,
    events: Sequence[bytes],
    *,
    done: bool = True,
    crlf: bool = False,
    pieces: int = 1,
    gap_s: float = 0.0,
    reset_after: int | None = None,
    comments: bool = False,
    hold: bool = False,
) -> web.StreamResponse:
    """Stream `events` as SSE. `pieces`: split the whole body into that many TCP writes (splitting events
    and line ends anywhere), `gap_s` seconds of the loop's time apart (a test that sets it runs on a
    fake-time loop); `reset_after`: drop the connection after that many events, once they are all handed to
    the kernel (so the client reads them before the drop); `hold`: after the last event, wait for the client
    to leave mid-stream, then write `[DONE]` (the write fails: the engine saw its client go)."""
    end = b"\r\n" if crlf else b"\n"
    frames = [b"data: " + e + end + end for e in events]
    if comments:
        frames = [b": keep-alive" + end + end + f for f in frames]
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    if reset_after is not None:
        for frame in frames[:reset_after]:
            await response.write(frame)
        transport = request.transport
        assert transport is not None
        # what is still in the transport's buffer when it is aborted is lost: drop it only once all is sent
        await wait_until(lambda: transport.get_write_buffer_size() == 0, "the events sent before the reset")
        transport.abort()
        return response
    body = b"".join(frames) + (b"data: [DONE]" + end + end if done and not hold else b"")
    size = max(1, -(-len(body) // pieces))
    for start in range(0, len(body), size):
        await response.write(body[start : start + size])
        if gap_s:
            await asyncio.sleep(gap_s)
    if hold:
        await wait_until(
            lambda: request.transport is None or request.transport.is_closing(), "the client left"
        )
        if done:
            await response.write(b"data: [DONE]" + end + end)
    await response.write_eof()
    return response


# -- recorded shapes ----------------------------------------------------------------------------------------


def sglang_generate_chunks(
    rid: str, tokens: Sequence[str], *, per_chunk: int = 1, index: int | None = None, finish: str = "length"
) -> list[bytes]:
    """Cumulative `/generate` chunks: the full text and ids so far, plus meta_info (reference A.1)."""
    chunks = []
    for end in [*range(per_chunk, len(tokens), per_chunk), len(tokens)]:
        done = end == len(tokens)
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": ({"type": finish, "length": end} if finish == "length" else {"type": finish})
            if done
            else None,
            "prompt_tokens": 7,
            "weight_version": "default",
            "num_retractions": 0,
            "reasoning_tokens": 0,
            "completion_tokens": end,
            "cached_tokens": 0,
        }
        if done:
            meta["e2e_latency"] = 0.5
        chunk: dict[str, Any] = {
            "text": "".join(tokens[:end]),
            "output_ids": list(range(100, 100 + end)),
            "meta_info": meta,
        }
        if index is not None:
            chunk["index"] = index
        chunks.append(orjson.dumps(chunk))
    return chunks


def sglang_chat_chunk(
    rid: str, delta: dict[str, Any], *, finish: str | None = None, index: int = 0, logprobs: Any = None
) -> bytes:
    full_delta = {"role": None, "content": None, "reasoning_content": None, "tool_calls": None, **delta}
    return orjson.dumps(
        {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": 1700000000,
            "model": "qwen",
            "choices": [
                {
                    "index": index,
                    "delta": full_delta,
                    "logprobs": logprobs,
                    "finish_reason": finish,
                    "matched_stop": None if finish is None else 151645,
                }
            ],
            "usage": None,
        }
    )


def usage_frame(
    rid: str, completion_tokens: int, *, obj: str = "chat.completion.chunk", prompt_tokens: int = 7
) -> bytes:
    return orjson.dumps(
        {
            "id": rid,
            "object": obj,
            "created": 1700000000,
            "model": "qwen",
            "choices": [],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "completion_tokens": completion_tokens,
            },
        }
    )


def sglang_chat_stream(rid: str, words: Sequence[str]) -> list[bytes]:
    """Role chunk, one chunk per word, a finish chunk, a usage frame (reference A.2)."""
    chunks = [sglang_chat_chunk(rid, {"role": "assistant", "content": ""})]
    chunks += [sglang_chat_chunk(rid, {"content": w}) for w in words]
    chunks.append(sglang_chat_chunk(rid, {}, finish="stop"))
    chunks.append(usage_frame(rid, len(words)))
    return chunks


def vllm_chat_chunk(
    rid: str, delta: dict[str, Any], *, finish: str | None = None, index: int = 0, **extra: Any
) -> bytes:
    choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
    if finish is not None:
        choice["stop_reason"] = None
    choice.update(extra)
    return orjson.dumps(
        {
            "id": f"chatcmpl-{rid}",
            "object": "chat.completion.chunk",
            "created": 1700000000,
            "model": "qwen",
            "choices": [choice],
        }
    )


def vllm_chat_stream(rid: str, words: Sequence[str], *, merged: int = 1) -> list[bytes]:
    """vLLM's stream: role chunk, content chunks (`merged` words per chunk, as when the reader lags), the
    last one with finish_reason, then the usage frame (reference C)."""
    chunks = [vllm_chat_chunk(rid, {"role": "assistant", "content": ""})]
    groups = ["".join(words[i : i + merged]) for i in range(0, len(words), merged)]
    for position, text in enumerate(groups):
        last = position == len(groups) - 1
        chunks.append(vllm_chat_chunk(rid, {"content": text}, finish="stop" if last else None))
    chunks.append(orjson.dumps({**orjson.loads(usage_frame(rid, len(words))), "id": f"chatcmpl-{rid}"}))
    return chunks


def completion_chunk(
    rid: str, text: str, *, finish: str | None = None, logprobs: Any = None, **extra: Any
) -> bytes:
    choice: dict[str, Any] = {
        "index": 0,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish,
        **extra,
    }
    return orjson.dumps(
        {
            "id": rid,
            "object": "text_completion",
            "created": 1700000000,
            "model": "qwen",
            "choices": [choice],
            "usage": None,
        }
    )


def sglang_server_info(*, per_dp: Sequence[int] = (48,), max_running: int | None = None) -> dict[str, Any]:
    return {
        "model_path": "Qwen/Qwen3-8B",
        "tp_size": 1,
        "dp_size": len(per_dp),
        "max_running_requests": max_running,
        "chunked_prefill_size": 8192,
        "weight_version": "v7",
        "incremental_streaming_output": False,
        "status": "ready",
        "max_total_num_tokens": 500000,
        "internal_states": [
            {"effective_max_running_requests_per_dp": n, "last_gen_throughput": 0.0} for n in per_dp
        ],
        "version": "0.5.23",
    }


def models_answer(owner: str = "sglang", max_model_len: int = 32768) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {
                "id": "qwen",
                "object": "model",
                "created": 1700000000,
                "owned_by": owner,
                "root": "qwen",
                "parent": None,
                "max_model_len": max_model_len,
            }
        ],
    }


def serve_like_miles_mock(fake: FakeEngine, text: str = "4") -> FakeEngine:
    """`fake` answering as miles' `MockSGLangServer` does (miles/utils/test_utils/mock_sglang_server.py): POST
    `/generate` and `/v1/chat/completions`, each one whole JSON body whatever `stream` says, and GET `/health`;
    nothing else (no `/server_info`, `/get_server_info`, `/v1/models`, `/metrics` or `/v1/loads`). Its chat
    `meta_info` has no `prompt_tokens`, and its answers no `usage`."""

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        output_ids = [7] * len(text)
        meta = {
            "finish_reason": {"type": "stop"},
            "prompt_tokens": len(body.get("input_ids") or []),
            "cached_tokens": 0,
            "completion_tokens": len(output_ids),
            "output_token_logprobs": [[-i / 128, t] for i, t in enumerate(output_ids)],
        }
        return json_reply({"text": text, "meta_info": meta})

    async def chat(_: web.Request) -> web.StreamResponse:
        output_ids = [7] * len(text)
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text, "tool_calls": None},
            "logprobs": {"content": [{"token": "x", "token_id": t, "logprob": 0.0} for t in output_ids]},
            "finish_reason": "stop",
            "meta_info": {
                "output_token_logprobs": [[-i / 128, t] for i, t in enumerate(output_ids)],
                "completion_tokens": len(output_ids),
            },
        }
        return json_reply(
            {
                "id": "chatcmpl-1",
                "object": "chat.completion",
                "created": 0,
                "model": "mock-model",
                "choices": [choice],
            }
        )

    fake.on("POST", "/generate", generate)
    fake.on("POST", "/v1/chat/completions", chat)
    fake.on_json("GET", "/health", {"status": "ok"})
    return fake
