"""How many small non-streaming requests per second one simulated engine (`fast` profile) serves on one core.

    python -m rolloutgate.bench.sim_throughput            # make sim-bench
    python -m rolloutgate.bench.sim_throughput --api vllm --route chat --duration 10

The engine runs in its own process (`rolloutgate sim --profile fast`), pinned to one CPU with `taskset` when
there are two or more; the load comes from another process on another CPU: `wrk` when installed, else
aiohttp clients. Prints requests/s, the server's CPU use and requests per server CPU-second.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

__all__ = ("main",)

_ROUTES: dict[str, tuple[str, dict[str, Any]]] = {
    "generate": ("/generate", {"input_ids": list(range(11, 27)), "sampling_params": {"max_new_tokens": 16}}),
    "chat": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 16},
    ),
    "completions": ("/v1/completions", {"prompt": "hello there", "max_tokens": 16}),
}


def _pin(cpu: int | None) -> list[str]:
    if cpu is None or shutil.which("taskset") is None or (os.cpu_count() or 1) < 2:
        return []
    return ["taskset", "-c", str(cpu)]


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _start_server(args: argparse.Namespace) -> tuple[subprocess.Popen[str], str]:
    command = [
        *_pin(args.server_cpu),
        sys.executable,
        "-m",
        "rolloutgate",
        "sim",
        "--profile",
        "fast",
        "--api",
        args.api,
        "--engines",
        "1",
        "--base-port",
        "0",
    ]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = server.stdout.readline()
        if not line:
            break
        match = re.match(r"engine 0 \w+ (http://\S+)", line)
        if match:
            return server, match.group(1)
    server.kill()
    raise RuntimeError("the simulated engine did not start")


def _post(url: str, body: dict[str, Any]) -> None:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        response.read()


def _run_wrk(args: argparse.Namespace, url: str, body: dict[str, Any]) -> tuple[float, int]:
    script = 'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\nwrk.body = [[%s]]\n'
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(script % json.dumps(body))
    try:
        command = [
            *_pin(args.client_cpu),
            "wrk",
            "-t1",
            f"-c{args.connections}",
            f"-d{int(args.duration)}s",
            "-s",
            f.name,
            url,
        ]
        output = subprocess.run(
            command, capture_output=True, text=True, check=True, timeout=args.duration + 60
        )
    finally:
        os.unlink(f.name)
    rate = float(re.search(r"Requests/sec:\s+([\d.]+)", output.stdout).group(1))  # type: ignore[union-attr]
    bad = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", output.stdout)
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", output.stdout)
    failures = (int(bad.group(1)) if bad else 0) + (sum(int(g) for g in errors.groups()) if errors else 0)
    return rate, failures


async def _client_worker(
    url: str, body: dict[str, Any], connections: int, duration: float
) -> tuple[int, int]:
    import aiohttp

    done = failed = 0
    deadline = time.monotonic() + duration
    payload = json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    connector = aiohttp.TCPConnector(limit=connections)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def loop() -> None:
            nonlocal done, failed
            while time.monotonic() < deadline:
                async with session.post(url, data=payload, headers=headers) as response:
                    await response.read()
                    if response.status == 200:
                        done += 1
                    else:
                        failed += 1

        await asyncio.gather(*(loop() for _ in range(connections)))
    return done, failed


def _run_aiohttp(args: argparse.Namespace, url: str) -> tuple[float, int]:
    command = [
        *_pin(args.client_cpu),
        sys.executable,
        "-m",
        "rolloutgate.bench.sim_throughput",
        "--worker",
        url,
        "--route",
        args.route,
        "--connections",
        str(args.connections),
        "--duration",
        str(args.duration),
    ]
    began = time.monotonic()
    output = subprocess.run(command, capture_output=True, text=True, check=True, timeout=args.duration + 60)
    elapsed = time.monotonic() - began
    done, failed = (int(x) for x in output.stdout.split())
    return done / min(elapsed, float(args.duration)), failed


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m rolloutgate.bench.sim_throughput", description=__doc__)
    parser.add_argument("--api", choices=("sglang", "vllm"), default="sglang")
    parser.add_argument("--route", choices=sorted(_ROUTES), default="generate")
    parser.add_argument("--duration", type=int, default=10, help="seconds of load (default 10)")
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--client", choices=("auto", "wrk", "aiohttp"), default="auto")
    parser.add_argument("--server-cpu", type=int, default=0)
    parser.add_argument("--client-cpu", type=int, default=1)
    parser.add_argument("--target", type=float, default=2000.0, help="requests/s to reach (default 2000)")
    parser.add_argument("--check", action="store_true", help="exit 1 below the target")
    parser.add_argument("--worker", metavar="URL", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.api == "vllm" and args.route == "generate":
        parser.error("vLLM has no /generate: use --route chat or completions")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    path, body = _ROUTES[args.route]
    if args.worker:
        done, failed = asyncio.run(_client_worker(args.worker, body, args.connections, args.duration))
        print(done, failed)
        return 0
    client = args.client
    if client == "auto":
        client = "wrk" if shutil.which("wrk") else "aiohttp"
    server, base = _start_server(args)
    try:
        url = base + path
        for _ in range(50):  # warm up
            _post(url, body)
        cpu_before, began = _cpu_seconds(server.pid), time.monotonic()
        rate, failures = _run_wrk(args, url, body) if client == "wrk" else _run_aiohttp(args, url)
        cpu_used, elapsed = _cpu_seconds(server.pid) - cpu_before, time.monotonic() - began
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
    pinned = f"pinned to CPU {args.server_cpu}" if _pin(args.server_cpu) else "not pinned"
    per_cpu_s = rate * elapsed / cpu_used if cpu_used > 0 else float("nan")
    print(
        f"simulated {args.api} engine, profile fast, POST {path} (16 tokens, non-streaming), server {pinned}"
    )
    print(f"load: {client}, {args.connections} connections, {args.duration:g} s")
    print(f"throughput: {rate:,.0f} requests/s ({failures} failed)")
    print(f"server CPU: {cpu_used / elapsed:.2f} cores busy, {per_cpu_s:,.0f} requests per CPU-second")
    verdict = "meets" if rate >= args.target and failures == 0 else "BELOW"
    print(f"{verdict} the target of {args.target:,.0f} requests/s")
    return 1 if args.check and verdict == "BELOW" else 0


if __name__ == "__main__":
    raise SystemExit(main())
