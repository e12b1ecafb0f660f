"""A closed-loop load generator: N clients, each sending one chat request after another, for a bounded time.

    python -m tests.reliability.loadgen --url http://127.0.0.1:8000 --clients 11000 --seconds 60

Each client opens its own keep-alive connection and re-sends as soon as its answer arrives, so N requests are
outstanding at every moment (queued in the gateway or running on an engine). Clients start in batches (a
connection storm is not the point), stop sending after `--seconds` or on SIGUSR1, whichever comes first, and
the last answers are awaited. An
answer counts as good only if it is HTTP 200 with a whole chat completion of `--max-tokens` tokens; anything
else (status, transport error, short answer) is an error, counted by kind. Prints one JSON summary.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import signal
import sys
from typing import Any

import aiohttp
import orjson

__all__ = ("run",)


async def run(url: str, clients: int, seconds: float, max_tokens: int, ramp_per_s: float) -> dict[str, Any]:
    body = orjson.dumps(
        {
            "model": "sim-model",
            "messages": [{"role": "user", "content": "load"}],
            "max_tokens": max_tokens,
            "ignore_eos": True,
        }
    )
    headers = {"Content-Type": "application/json"}
    errors: collections.Counter[str] = collections.Counter()
    examples: dict[str, str] = {}  # one message per error kind
    latencies: list[float] = []
    sent = good = 0
    outstanding = max_outstanding = 0
    loop = asyncio.get_running_loop()
    started = loop.time()
    stop_at = started + seconds
    stopped = asyncio.Event()
    loop.add_signal_handler(signal.SIGUSR1, stopped.set)

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal sent, good, outstanding, max_outstanding
        while loop.time() < stop_at and not stopped.is_set():
            sent += 1
            outstanding += 1
            max_outstanding = max(max_outstanding, outstanding)
            begin = loop.time()
            try:
                async with session.post(url + "/v1/chat/completions", data=body, headers=headers) as response:
                    raw = await response.read()
                    if response.status != 200:
                        errors[f"status_{response.status}"] += 1
                        continue
                answer = orjson.loads(raw)
                if answer.get("usage", {}).get("completion_tokens") != max_tokens or not answer.get(
                    "choices"
                ):
                    errors["short_answer"] += 1
                    continue
                good += 1
                latencies.append(loop.time() - begin)
            except (aiohttp.ClientError, OSError, orjson.JSONDecodeError) as exc:
                errors[type(exc).__name__] += 1
                examples.setdefault(type(exc).__name__, str(exc)[:300])
                await asyncio.sleep(0.1)
            finally:
                outstanding -= 1

    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks = []
        batch = max(1, int(ramp_per_s / 10))
        while len(tasks) < clients:
            tasks += [asyncio.create_task(client(session)) for _ in range(min(batch, clients - len(tasks)))]
            await asyncio.sleep(0.1)
        ramped_s = loop.time() - started
        print(json.dumps({"ramped": len(tasks), "ramp_s": round(ramped_s, 1)}), flush=True)
        await asyncio.gather(*tasks)
    elapsed = loop.time() - started
    latencies.sort()

    def quantile(q: float) -> float | None:
        return round(latencies[int(q * (len(latencies) - 1))], 3) if latencies else None

    return {
        "clients": clients,
        "seconds": seconds,
        "ramp_s": round(ramped_s, 1),
        "elapsed_s": round(elapsed, 1),
        "sent": sent,
        "good": good,
        "errors": dict(errors),
        "error_examples": examples,
        "error_count": sum(errors.values()),
        "max_outstanding": max_outstanding,
        "answers_per_s": round(good / elapsed, 1),
        "latency_p50_s": quantile(0.5),
        "latency_p99_s": quantile(0.99),
        "latency_max_s": quantile(1.0),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--clients", type=int, default=11_000)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--ramp-per-s", type=float, default=5000.0, help="clients started per second")
    args = parser.parse_args()
    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:
        runner = asyncio.Runner()
    with runner:
        summary = runner.run(run(args.url, args.clients, args.seconds, args.max_tokens, args.ramp_per_s))
    print(json.dumps(summary), flush=True)
    return 0 if summary["error_count"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
