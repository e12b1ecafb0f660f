"""A Python load generator for the benchmark, run in a process of its own (aiohttp on uvloop).

    python -m benchmarks.perf.loadgen closed --url U --body JSON --connections C --duration D
    python -m benchmarks.perf.loadgen hold --url U --body JSON --count N --hold S

`closed`: C connections each send the body again as soon as the previous answer has been read to its end,
for D seconds; prints one JSON line: requests, failures, seconds, p50_ms, p99_ms (nearest rank), and the generated tokens
read from `meta_info.completion_tokens` with `--count-tokens`. `--max-new-tokens LO:HI` draws each request's
`sampling_params.max_new_tokens` uniformly (seeded), so a closed loop of long generations does not run in
lock-step. The wrk fallback and the RL load use it.

`hold`: opens N streaming requests at once (at most `--open-rate` new ones per second), prints
`open <n>` each second and `all-open` once every stream has delivered its first bytes, keeps reading every
stream (discarding the data) for `--hold` seconds after that, then closes them all and prints a JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from typing import Any

from benchmarks.kit.stats import percentile

__all__ = ("main",)


def _completion_tokens(raw: bytes) -> int:
    at = raw.rfind(b'"completion_tokens":')
    if at < 0:
        return 0
    digits = raw[at + 20 : at + 32].split(b",")[0].split(b"}")[0].strip()
    return int(digits) if digits.isdigit() else 0


async def _closed(args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp

    body: dict[str, Any] = json.loads(args.body)
    lo_hi = [int(x) for x in args.max_new_tokens.split(":")] if args.max_new_tokens else None
    rng = random.Random(args.seed)
    headers = {"Content-Type": "application/json"}
    latencies: list[float] = []
    failures = tokens = 0
    began = time.monotonic()
    deadline = began + args.duration
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=args.read_timeout)

    def payload() -> bytes:
        if lo_hi is None:
            return json.dumps(body).encode()
        params = dict(body.get("sampling_params") or {})
        params["max_new_tokens"] = rng.randint(lo_hi[0], lo_hi[1])
        return json.dumps(body | {"sampling_params": params}).encode()

    static = payload()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def loop() -> None:
            nonlocal failures, tokens
            while time.monotonic() < deadline:
                sent = time.monotonic()
                try:
                    data = payload() if lo_hi is not None else static
                    async with session.post(args.url, data=data, headers=headers) as response:
                        raw = await response.read()
                        ok = response.status == 200
                except (aiohttp.ClientError, OSError, TimeoutError):
                    ok, raw = False, b""
                if not ok:
                    failures += 1
                    continue
                if time.monotonic() <= deadline:
                    latencies.append((time.monotonic() - sent) * 1e3)
                    if args.count_tokens:
                        tokens += _completion_tokens(raw)

        tasks = [asyncio.create_task(loop()) for _ in range(args.connections)]
        # requests still running at the deadline get `--drain` seconds, then they are cut (not counted)
        await asyncio.wait(tasks, timeout=args.duration + args.drain)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    latencies.sort()
    return {
        "requests": len(latencies),
        "failures": failures,
        "seconds": args.duration,
        "p50_ms": percentile(latencies, 50),
        "p99_ms": percentile(latencies, 99),
        "tokens": tokens,
    }


async def _hold(args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp

    payload = args.body.encode()
    headers = {"Content-Type": "application/json"}
    connector = aiohttp.TCPConnector(limit=0)
    opened = failed = 0
    all_open = asyncio.Event()
    stop = asyncio.Event()
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one() -> None:
            nonlocal opened, failed
            try:
                async with session.post(args.url, data=payload, headers=headers) as response:
                    if response.status != 200 or not await response.content.readany():
                        failed += 1
                        return
                    opened += 1
                    if opened == args.count:
                        all_open.set()
                    while not stop.is_set() and await response.content.readany():
                        pass
            except (aiohttp.ClientError, OSError, TimeoutError):
                failed += 1

        tasks = []
        for i in range(args.count):
            tasks.append(asyncio.create_task(one()))
            if args.open_rate and (i + 1) % max(1, int(args.open_rate / 20)) == 0:
                await asyncio.sleep(0.05)
        began = time.monotonic()
        while not all_open.is_set() and time.monotonic() - began < args.open_timeout:
            print(f"open {opened} failed {failed}", flush=True)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(all_open.wait(), timeout=1.0)
        if all_open.is_set():
            print("all-open", flush=True)
        await asyncio.sleep(args.hold)
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return {"opened": opened, "failed": failed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.perf.loadgen")
    sub = parser.add_subparsers(dest="mode", required=True)
    closed = sub.add_parser("closed")
    closed.add_argument("--url", required=True)
    closed.add_argument("--body", required=True)
    closed.add_argument("--connections", type=int, default=32)
    closed.add_argument("--duration", type=float, default=5.0)
    closed.add_argument("--read-timeout", type=float, default=60.0)
    closed.add_argument("--drain", type=float, default=5.0, help="seconds to finish after the deadline")
    closed.add_argument("--count-tokens", action="store_true")
    closed.add_argument("--max-new-tokens", metavar="LO:HI")
    closed.add_argument("--seed", type=int, default=0)
    hold = sub.add_parser("hold")
    hold.add_argument("--url", required=True)
    hold.add_argument("--body", required=True)
    hold.add_argument("--count", type=int, default=10_000)
    hold.add_argument("--hold", type=float, default=5.0)
    hold.add_argument(
        "--open-rate", type=float, default=2000.0, help="new streams per second (0: all at once)"
    )
    hold.add_argument("--open-timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:  # pragma: no cover
        runner = asyncio.Runner()
    with runner:
        result = runner.run(_closed(args) if args.mode == "closed" else _hold(args))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
