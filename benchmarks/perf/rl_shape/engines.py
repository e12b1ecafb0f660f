"""The RL shape's simulated engines: their flags (decode 70 tok/s at any batch, prefill cheap), their counters
read from /metrics (prometheus_client's parser) or /sim/state, waiting for them to idle, flushing their caches,
and warming a gateway in front of them."""

from __future__ import annotations

import contextlib
import json
import time
import urllib.request

import orjson

from benchmarks.kit.prometheus import histogram_buckets, sample_totals
from benchmarks.perf.rl_shape.plan import FIRST_ID, ROUTING_HEADER, TOKENS_PER_S, ShapeOptions, request_body

__all__ = (
    "COUNTERS",
    "LOOP_LAG",
    "engine_counters",
    "engine_flags",
    "flush",
    "loop_lag_buckets",
    "wait_idle",
    "warm",
)


COUNTERS = {
    "output_bytes": "sim:output_bytes_total",
    "output_chunks": "sim:output_chunks_total",
    "output_busy_s": "sim:output_busy_seconds_total",  # simulated seconds the engine's output path worked
    "generated_tokens": "sglang:generation_tokens_total",
    "requests": "sglang:num_requests_total",
    "prompt_tokens": "sglang:prompt_tokens_total",
    "cached_tokens": "sglang:cached_tokens_total",
}


def _get(url: str, timeout_s: float = 30.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        data: bytes = response.read()
        return data


_STATE_FALLBACK = {"output_bytes": "output_bytes_total", "output_chunks": "output_chunks_total"}


LOOP_LAG = "rolloutgate_event_loop_lag_seconds"  # server/loop_lag.py


def loop_lag_buckets(gateway_url: str) -> dict[float, float]:
    """rolloutgate's event-loop lag histogram from its /metrics (empty for a gateway without it); with
    `--processes N`, every process's (`scope=fleet`: each one's samples, summed here)."""
    with contextlib.suppress(OSError):
        return histogram_buckets(_get(gateway_url + "/metrics?scope=fleet").decode(), LOOP_LAG)
    return {}


def engine_counters(urls: list[str]) -> list[dict[str, float]]:
    """Each engine's counters from its /metrics; where the simulator has no `sim:output_*` counters, the
    same figures from /sim/state when it has them (marked `from_state`)."""
    per_engine = []
    for url in urls:
        metrics = sample_totals(_get(url + "/metrics").decode())
        counters = {key: metrics[name] for key, name in COUNTERS.items() if name in metrics}
        if "output_bytes" not in counters:
            with contextlib.suppress(OSError, ValueError):
                state = json.loads(_get(url + "/sim/state?requests=0"))
                for key, name in _STATE_FALLBACK.items():
                    if isinstance(state.get(name), int | float):
                        counters[key] = float(state[name])
                        counters["from_state"] = 1.0
        per_engine.append(counters)
    return per_engine


def wait_idle(urls: list[str], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        busy = 0
        for url in urls:
            with contextlib.suppress(OSError, ValueError, KeyError):
                state = json.loads(_get(url + "/sim/state?requests=0"))
                busy += int(state["running"]) + int(state["waiting"])
        if busy == 0:
            return True
        time.sleep(0.25)
    return False


def flush(urls: list[str]) -> None:
    for url in urls:
        request = urllib.request.Request(url + "/flush_cache", data=b"", method="POST")
        with contextlib.suppress(OSError), urllib.request.urlopen(request, timeout=30) as response:
            response.read()


def engine_flags(options: ShapeOptions) -> list[str]:
    """The simulated engines: decode 70 tok/s at any batch, a prefill that is cheap (cached prefixes free),
    a whole prompt per prefill batch, KV and context for every client's 100K + 32K tokens."""
    return [
        "--max-running-requests",
        str(options.engine_slots),
        "--decode-base-ms",
        f"{1000 / TOKENS_PER_S:.4f}",
        "--decode-per-request-ms",
        "0",
        "--decode-per-ktoken-ms",
        "0",
        "--prefill-rate",
        f"{options.prefill_rate:g}",
        "--chunked-prefill-size",
        str(1 << 17),
        "--kv-capacity",
        str(1 << 26),
        "--context-len",
        str(1 << 18),
        "--time-scale",
        f"{options.time_scale:g}",
    ]


def warm(url: str, count: int = 4) -> None:
    """A few tiny calls, so a gateway's idle RSS is taken after its first-request imports and buffers."""
    body = orjson.dumps(request_body(list(range(FIRST_ID, FIRST_ID + 32)), 4))
    for i in range(count):
        request = urllib.request.Request(
            url + "/generate",
            data=body,
            method="POST",
            headers={"Content-Type": "application/json", ROUTING_HEADER: f"warm-{i}"},
        )
        with contextlib.suppress(OSError), urllib.request.urlopen(request, timeout=60) as response:
            response.read()
