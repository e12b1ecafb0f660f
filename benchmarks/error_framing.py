"""Which body makes each real client see an error once keep-alive has committed a 200?

`python -m benchmarks.error_framing` serves four candidate framings after one keep-alive space and
calls each with httpx, the OpenAI SDK (0 and 2 retries) and LiteLLM, printing what each client did and how
many times it hit the server. The gateway uses the framing where every client raises once (docs/clients.md).
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import httpx
import litellm
import openai
from aiohttp import web
from openai.types.chat import ChatCompletionMessageParam

from rolloutgate.framing import ERROR_TRAILER

ERR = json.dumps(
    {
        "error": {
            "message": "charged engine time passed the timeout",
            "type": "timeout_error",
            "param": None,
            "code": "timeout",
        }
    }
).encode()
hits = {"n": 0}


async def handler(request: web.Request) -> web.StreamResponse:
    hits["n"] += 1
    variant = request.app["variant"]
    resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
    await resp.prepare(request)
    await resp.write(b" ")
    await asyncio.sleep(0.05)
    if variant == "clean":
        await resp.write(ERR)
        await resp.write_eof()
        return resp
    if variant == "cut":
        await resp.write(ERR)
        assert request.transport is not None
        request.transport.abort()
        return resp
    if variant == "trailer":  # what the gateway sends
        await resp.write(ERR + ERROR_TRAILER)
        await resp.write_eof()
        return resp
    if variant == "errobj":
        await resp.write(
            json.dumps(
                {
                    "object": "error",
                    "message": "timeout",
                    "type": "timeout_error",
                    "code": 504,
                    "error": {"message": "timeout", "type": "timeout_error", "code": "timeout"},
                }
            ).encode()
        )
        await resp.write_eof()
        return resp
    raise ValueError(f"unknown variant {variant!r}")


async def run(variant: str) -> None:
    app = web.Application()
    app["variant"] = variant
    app.router.add_post("/v1/chat/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    base = f"http://127.0.0.1:{port}/v1"
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "x"}]
    body: dict[str, Any] = {"model": "m", "messages": messages}
    out: dict[str, str] = {}
    hits["n"] = 0
    try:
        async with httpx.AsyncClient() as c:
            r = await c.post(base + "/chat/completions", json=body)
            try:
                j = r.json()
                out["httpx"] = f"status {r.status_code} json keys {list(j)}"
            except Exception as e:
                out["httpx"] = f"status {r.status_code} json error {type(e).__name__}"
    except Exception as e:
        out["httpx"] = f"RAISED {type(e).__name__}"
    for retries in (0, 2):
        hits["n"] = 0
        try:
            sdk = openai.AsyncOpenAI(base_url=base, api_key="x", max_retries=retries)
            completion = await sdk.chat.completions.create(model="m", messages=messages)
            out[f"sdk r={retries}"] = f"RETURNED choices={completion.choices} hits={hits['n']}"
        except Exception as e:
            out[f"sdk r={retries}"] = f"RAISED {type(e).__name__} hits={hits['n']}"
    hits["n"] = 0
    try:
        answer = await litellm.acompletion(
            model="openai/m", api_base=base, api_key="x", messages=messages, timeout=5
        )
        out["litellm"] = f"RETURNED {answer} hits={hits['n']}"
    except Exception as e:
        out["litellm"] = f"RAISED {type(e).__name__} hits={hits['n']}"
    await runner.cleanup()
    print(variant, json.dumps(out, indent=1))


async def main() -> None:
    for v in ("clean", "cut", "trailer", "errobj"):
        await run(v)


if __name__ == "__main__":
    asyncio.run(main())
