"""An engine killed under load (SIGKILL: the process and its children gone, as when a bad input takes an SGLang
scheduler down): the stream it was running is continued on the engine left and its client reads one whole
answer, nothing hangs, the gateway stops sending work there, and the next calls are served by the engine left.

The killed engine is the test's own (harness.start_extra_engine: a real SGLang launched as
scripts/e2e_sglang_run.sh launches its engines, or a one-engine simulator), so the session's engines live on.
Real vLLM is left out: a third vLLM engine needs ~3 GB and a minute to start on this machine."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from tests.e2e.harness import EngineSet, scrape, start_extra_engine, start_gateway, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.backend("sglang", "sim", "sim-sglang")]

TOKENS = 1500  # a few seconds: the call on the killed engine is well under way, the survivor's ends soon
END_WITHIN_S = 30.0


async def stream_chat(base: str, engines: EngineSet, started: asyncio.Event) -> dict[str, Any]:
    """A streamed chat call: its status, engine, chunks, whether `[DONE]` ended it, and any error event."""
    payload = {
        "model": engines.model,
        "messages": [{"role": "user", "content": "Tell me about the sea."}],
        "max_tokens": TOKENS,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    out: dict[str, Any] = {"chunks": 0, "done": False, "error": None, "usage": None, "finish": None}
    try:
        async with (
            httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as client,
            client.stream("POST", base + "/v1/chat/completions", json=payload) as response,
        ):
            out["status"] = response.status_code
            out["engine"] = response.headers.get("x-rolloutgate-engine")
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    out["done"] = True
                elif line.startswith("data: "):
                    chunk = orjson.loads(line[len("data: ") :])
                    if "error" in chunk:
                        out["error"] = chunk["error"]
                        continue
                    out["chunks"] += 1
                    out["usage"] = chunk.get("usage") or out["usage"]
                    for choice in chunk.get("choices") or []:
                        out["finish"] = choice.get("finish_reason") or out["finish"]
                    started.set()
    except httpx.HTTPError as error:  # the client sees the connection end: a clean end, not a hang
        out["transport_error"] = repr(error)
    return out


@pytest.mark.timeout(300)  # it starts its own engine (25-45 s for a real SGLang) and runs five long calls
async def test_a_killed_engine_loses_only_its_call_and_the_other_serves_on(
    engines: EngineSet, log_dir: Path
) -> None:
    process, doomed = start_extra_engine(engines, log_dir, "engine-killed")
    gateway = None
    try:
        pair = dataclasses.replace(engines, urls=(doomed, engines.urls[0]))
        gateway = start_gateway(pair, log_dir, {"health_interval": 1})
        before = await scrape(engines.urls[0])
        # Two long calls at once: the gateway puts one on each idle engine.
        events = [asyncio.Event() for _ in range(2)]
        calls = [asyncio.create_task(stream_chat(gateway.url, engines, e)) for e in events]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 60.0)
        await wait_for(
            "the doomed engine running a call", lambda: scrape(doomed), lambda m: m.running > 0, 30.0
        )
        os.killpg(process.pid, signal.SIGKILL)  # the whole engine: server, scheduler, detokenizer
        killed_at = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*calls), END_WITHIN_S + 60.0)
        ended_s = time.monotonic() - killed_at
        print(f"after the kill: {results}, all ended {ended_s:.1f} s later")

        on_doomed = [r for r in results if r.get("engine") == doomed]
        survived = [r for r in results if r.get("engine") == engines.urls[0]]
        assert len(on_doomed) == len(survived) == 1, results
        # the survivor's own call is untouched
        assert survived[0]["usage"]["completion_tokens"] == TOKENS and survived[0]["done"], survived
        # the killed engine's stream had delivered tokens: the gateway continues it on the engine left
        # (server/continuation.py: the partial answer becomes the assistant's message, the rest is asked
        # for), so its client reads one whole answer, no error; its usage frame counts the continuation only
        lost = on_doomed[0]
        assert lost["status"] == 200 and lost["done"] and lost["error"] is None, lost
        assert lost["finish"] == "length", lost
        # the continuation's prompt carries the partial answer, and it asked only for the rest (SGLang's OpenAI
        # stream merges tokens into fewer chunks: chunks count no tokens)
        assert lost["usage"]["prompt_tokens"] > survived[0]["usage"]["prompt_tokens"], (lost, survived)
        assert lost["usage"]["completion_tokens"] < TOKENS, lost
        after = await scrape(engines.urls[0])
        assert after.generated - before.generated == TOKENS + lost["usage"]["completion_tokens"]

        async with httpx.AsyncClient(timeout=30.0) as client:
            workers = await wait_for(
                "the gateway marks the killed engine unhealthy",
                lambda: client.get(gateway.url + "/workers"),
                lambda r: any(w["url"] == doomed and not w["healthy"] for w in r.json()["workers"]),
                20.0,
            )
        print(f"workers: {workers.json()}")
        # the next calls all go to the engine left, and all succeed
        nexts = await asyncio.gather(*(stream_chat(gateway.url, engines, asyncio.Event()) for _ in range(3)))
        for r in nexts:
            assert r["status"] == 200 and r["done"] and r["error"] is None, r
            assert r["engine"] == engines.urls[0], r
            assert r["usage"]["completion_tokens"] == TOKENS
    finally:
        if gateway is not None:
            gateway.process.stop()
        process.stop()
