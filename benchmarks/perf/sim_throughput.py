"""How many small non-streaming requests per second one simulated engine (`fast` profile) serves on one core.

    python -m benchmarks.perf.sim_throughput            # make sim-bench
    python -m benchmarks.perf.sim_throughput --api vllm --route chat --duration 10

The engine runs in its own process (`rolloutgate sim --profile fast`, benchmarks/kit/servers.py), pinned to one CPU with
`taskset` when there are two or more; the load comes from another process on another CPU (load.py): `wrk` when
installed (`make bench-tools`), else the Python load generator. Prints requests/s, the server's CPU use and
requests per server CPU-second.
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from typing import Any

from benchmarks.kit.proc import cpu_seconds
from benchmarks.kit.servers import pin_prefix, start_sim
from benchmarks.perf.load import run_load, wrk_installed

__all__ = ("main",)

_ROUTES: dict[str, tuple[str, dict[str, Any]]] = {
    "generate": ("/generate", {"input_ids": list(range(11, 27)), "sampling_params": {"max_new_tokens": 16}}),
    "chat": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 16},
    ),
    "completions": ("/v1/completions", {"prompt": "hello there", "max_tokens": 16}),
}


def _post(url: str, body: dict[str, Any]) -> None:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        response.read()


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.perf.sim_throughput", description=__doc__)
    parser.add_argument("--api", choices=("sglang", "vllm"), default="sglang")
    parser.add_argument("--route", choices=sorted(_ROUTES), default="generate")
    parser.add_argument("--duration", type=int, default=10, help="seconds of load (default 10)")
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--client", choices=("auto", "wrk", "python"), default="auto")
    parser.add_argument("--server-cpu", default="0")
    parser.add_argument("--client-cpu", default="1")
    parser.add_argument("--target", type=float, default=2000.0, help="requests/s to reach (default 2000)")
    parser.add_argument("--check", action="store_true", help="exit 1 below the target")
    args = parser.parse_args(argv)
    if args.api == "vllm" and args.route == "generate":
        parser.error("vLLM has no /generate: use --route chat or completions")
    if args.client == "wrk" and not wrk_installed():
        parser.error("wrk is not installed: `make bench-tools` installs it (or --client python)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    path, body = _ROUTES[args.route]
    use_wrk = args.client != "python" and wrk_installed()
    sim = start_sim(args.server_cpu, api=args.api)
    try:
        url = sim.url + path
        for _ in range(50):  # warm up
            _post(url, body)
        cpu_before, began = cpu_seconds(sim.pid), time.monotonic()
        load = run_load(
            url,
            body,
            connections=args.connections,
            duration_s=args.duration,
            cpus=args.client_cpu,
            use_wrk=use_wrk,
        )
        cpu_used, elapsed = cpu_seconds(sim.pid) - cpu_before, time.monotonic() - began
    finally:
        sim.stop()
    pinned = f"pinned to CPU {args.server_cpu}" if pin_prefix(args.server_cpu) else "not pinned"
    per_cpu_s = load.requests / cpu_used if cpu_used > 0 else float("nan")
    print(
        f"simulated {args.api} engine, profile fast, POST {path} (16 tokens, non-streaming), server {pinned}"
    )
    print(f"load: {load.generator}, {args.connections} connections, {args.duration:g} s")
    print(f"throughput: {load.rps:,.0f} requests/s ({load.failures} failed)")
    print(f"server CPU: {cpu_used / elapsed:.2f} cores busy, {per_cpu_s:,.0f} requests per CPU-second")
    verdict = "meets" if load.rps >= args.target and load.failures == 0 else "BELOW"
    print(f"{verdict} the target of {args.target:,.0f} requests/s")
    return 1 if args.check and verdict == "BELOW" else 0


if __name__ == "__main__":
    raise SystemExit(main())
