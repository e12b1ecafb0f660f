"""What a fan-out through the RL control plane costs over the slowest engine: rolloutgate and the SGLang Model
Gateway (the `smg` package's router, `--enable-rl`) side by side, in one run (docs/rl.md).

    python -m benchmarks.rl_fanout [--engines 8] [--rounds 300] [--path flush_cache]

Eight simulated SGLang engines (`rolloutgate sim`, one process), rolloutgate and SMG each in its own process,
every one of them in front of all eight. Each round makes the same call three ways, in turn: to the eight
engines directly and at once (the slowest of them is the round's baseline), through rolloutgate's
`/v1/rl/engine/{path}?selector=engine=sglang`, and through SMG's. A fan-out's overhead is its wall time less
the direct round's next to it. Printed: p50 and p90 of each gateway's overhead in ms, and the direct p50.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from benchmarks.kit.servers import ManagedProcess, free_port, start_gateway, start_sim, wait_http_ok

SELECTOR = "engine=sglang"


def start_smg(engine_urls: list[str]) -> ManagedProcess | None:
    """SMG's router from the `smg` package beside this Python (a test dependency), `--enable-rl`."""
    binary = Path(sys.executable).parent / "smg"
    if not binary.exists() and shutil.which("smg") is None:
        print("smg is not installed: its column is left out")
        return None
    port, prometheus_port = free_port(), free_port()
    command = [
        str(binary if binary.exists() else "smg"),
        "launch",
        "--host", "127.0.0.1",
        "--port", str(port),
        "--worker-urls", *engine_urls,
        "--enable-rl",
        "--disable-health-check",
        "--disable-circuit-breaker",
        "--prometheus-host", "127.0.0.1",
        "--prometheus-port", str(prometheus_port),
        "--log-level", "warn",
    ]  # fmt: skip
    popen = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)
    url = f"http://127.0.0.1:{port}"
    wait_http_ok(url + "/readiness", timeout_s=90, process=popen)
    return ManagedProcess("smg", popen, url)


async def timed(session: aiohttp.ClientSession, url: str, path: str) -> float:
    started = time.perf_counter()
    async with session.post(url, params={"selector": SELECTOR}, json={}) as resp:
        await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{url}: {resp.status}")
    return time.perf_counter() - started


async def direct(session: aiohttp.ClientSession, engine_urls: list[str], path: str) -> float:
    started = time.perf_counter()

    async def one(url: str) -> None:
        async with session.post(f"{url}/{path}", json={}) as resp:
            await resp.read()

    await asyncio.gather(*(one(u) for u in engine_urls))
    return time.perf_counter() - started


async def measure(engine_urls: list[str], gateways: dict[str, str], path: str, rounds: int) -> None:
    overheads: dict[str, list[float]] = {name: [] for name in gateways}
    baseline: list[float] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        for _ in range(10):  # warm every connection pool
            await direct(session, engine_urls, path)
            for url in gateways.values():
                await timed(session, f"{url}/v1/rl/engine/{path}", path)
        for _ in range(rounds):
            for name, url in gateways.items():
                before = await direct(session, engine_urls, path)
                through = await timed(session, f"{url}/v1/rl/engine/{path}", path)
                baseline.append(before)
                overheads[name].append(through - before)
    print(f"{len(engine_urls)} engines, {rounds} rounds of POST /{path}")
    print(f"  direct to every engine at once: p50 {statistics.median(baseline) * 1000:.2f} ms")
    for name, values in overheads.items():
        values.sort()
        p50, p90 = values[len(values) // 2], values[int(len(values) * 0.9)]
        print(
            f"  {name:12s} fan-out overhead over the slowest engine: p50 {p50 * 1000:.2f} ms, p90 {p90 * 1000:.2f} ms"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--path", default="flush_cache")
    args = parser.parse_args()
    processes: list[ManagedProcess] = []
    try:
        sim = start_sim(None, engines=args.engines)
        processes.append(sim)
        urls = sim.extra_urls
        gateway = start_gateway(None, urls)
        processes.append(gateway)
        gateways = {"rolloutgate": gateway.url}
        smg = start_smg(urls)
        if smg is not None:
            processes.append(smg)
            gateways["smg"] = smg.url
        asyncio.run(measure(urls, gateways, args.path, args.rounds))
    finally:
        for process in reversed(processes):
            process.stop()


if __name__ == "__main__":
    main()
