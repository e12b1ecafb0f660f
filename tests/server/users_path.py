"""The users' call and the incident's request A, shared by the default suite (x100, in-process cluster) and the
reliability suite (x20, `rolloutgate sim` and `rolloutgate serve` processes): miles' TITO `/generate`
(reference/miles.md), non-streaming, `input_ids`, `return_logprob`."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

A_TOKENS = 32_000  # request A: ~460 s of its own decode at ~70 tok/s
STORM_PROMPT_TOKENS = 100_000


def generate_body(prompt_tokens: int, new_tokens: int, *, first_id: int = 1) -> dict[str, Any]:
    return {
        "input_ids": list(range(first_id, first_id + prompt_tokens)),
        "sampling_params": {
            "max_new_tokens": new_tokens,
            "temperature": 1.0,
            "ignore_eos": True,
            "no_stop_trim": True,
            "skip_special_tokens": False,
            "spaces_between_special_tokens": False,
        },
        "return_logprob": True,
    }


async def run_request_a(
    http: httpx.AsyncClient, url: str, *, scale: float
) -> tuple[httpx.Response, list[httpx.Response]]:
    """Request A, and five other sessions' 100K-token histories arriving on its engine ~90 s apart."""
    a = asyncio.create_task(http.post(f"{url}/generate", json=generate_body(2_000, A_TOKENS), timeout=None))
    storms = []
    for i in range(5):
        await asyncio.sleep(90 / scale)
        body = {**generate_body(0, 8), "input_ids": [7 + i] * STORM_PROMPT_TOKENS}
        storms.append(asyncio.create_task(http.post(f"{url}/generate", json=body, timeout=None)))
    return await a, list(await asyncio.gather(*storms))


def metric_sum(text: str, name: str) -> float:
    """The sum of every sample of a Prometheus metric in an exposition text (0 when absent)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name)] in " {":
            total += float(line.rsplit(" ", 1)[1])
    return total


async def engine_output(http: httpx.AsyncClient, engine_url: str) -> dict[str, float]:
    """The simulated engine's output work so far: bytes it serialised and chunks it emitted."""
    text = (await http.get(f"{engine_url}/metrics")).text
    return {
        "bytes": metric_sum(text, "sim:output_bytes_total"),
        "chunks": metric_sum(text, "sim:output_chunks_total"),
    }


async def quarantines(http: httpx.AsyncClient, gateway_url: str) -> float:
    text = (await http.get(f"{gateway_url}/metrics")).text
    return metric_sum(text, "rolloutgate_engine_quarantines_total")


def gateway_error(response: httpx.Response) -> tuple[int, dict[str, Any]]:
    """The gateway's error and its status: the HTTP status, or 504-like verdicts written after keep-alive
    committed a 200 (the error object is then the body's first JSON value; docs/clients.md)."""
    text = response.text.lstrip()
    error, _ = json.JSONDecoder().raw_decode(text)
    assert "error" in error, text[:500]
    status = response.status_code
    if status == 200:  # committed by keep-alive: the status the error would have had
        status = {"timeout": 504}.get(error["error"]["code"], status)
    return status, error["error"]


def parse_timing(header: str) -> dict[str, float]:
    return {k: float(v) for k, v in (part.split("=") for part in header.split(";"))}


def final_timing(response: httpx.Response) -> dict[str, float]:
    """The final breakdown: in the body when keep-alive committed the headers early, else in the header."""
    in_body = response.json().get("rolloutgate_timing")
    if in_body is not None:
        return {k.removesuffix("_s"): v for k, v in in_body.items() if isinstance(v, int | float)}
    return parse_timing(response.headers["X-Rolloutgate-Timing"])
