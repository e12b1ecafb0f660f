"""Memory with many streaming requests in flight: the gateway's RSS while N streams are open through it.

Theory of operation: a simulated engine that admits everything at once and then decodes very slowly (one
token per `decode_s` for every running request, prefill free) holds the streams open; a `loadgen.py hold`
process opens them through the gateway (whose `--capacity` admits them all, so none waits in the gateway's
queue: every one has an upstream connection and an exchange, the expensive state), waits until every stream
has delivered its first bytes, and holds them. The gateway's RSS is sampled while they are held; the
engine's running count confirms they are in flight upstream.

File descriptors: each stream costs the gateway two sockets (client and upstream), so a process limit of
20,000 descriptors caps the count at about 9,900. The bench raises its limit first where it may (as root;
the servers and the load generator inherit it) and measures at the goal's count and half of it; where the
limit stays below, it measures at the largest count the limit allows (and half of it) and extrapolates
linearly to the goal's count.
"""

from __future__ import annotations

import json
import resource
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

from benchmarks.kit.proc import rss_bytes
from benchmarks.kit.servers import ManagedProcess, child_env, module_command

__all__ = (
    "SLOW_ENGINE_FLAGS",
    "InflightResult",
    "max_streams_for_fd_limit",
    "measure_inflight",
    "raise_fd_limit",
)

DECODE_S = 10.0  # one token per stream every 10 s: few events, below the gateway's health-check timeout

SLOW_ENGINE_FLAGS = [
    "--max-running-requests",
    "20000",
    "--kv-capacity",
    "1000000000",
    "--context-len",
    "1048576",
    "--chunked-prefill-size",
    "1048576",
    "--prefill-rate",
    "1e12",
    "--decode-base-ms",
    str(DECODE_S * 1000),
    "--decode-per-request-ms",
    "0",
    "--decode-per-ktoken-ms",
    "0",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class InflightResult:
    target: str
    streams: int  # streams the load generator held open (first bytes received)
    engine_running: int  # requests running on the engine at the sample
    rss_idle_bytes: int
    rss_bytes: int  # the largest RSS sampled while the streams were held

    @property
    def per_stream_bytes(self) -> float:
        return (self.rss_bytes - self.rss_idle_bytes) / self.streams if self.streams else float("nan")

    def as_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "streams": self.streams,
            "engine_running": self.engine_running,
            "rss_idle_mb": round(self.rss_idle_bytes / 1e6, 1),
            "rss_mb": round(self.rss_bytes / 1e6, 1),
            "per_stream_kb": round(self.per_stream_bytes / 1e3, 2),
        }


def raise_fd_limit(wanted: int) -> int:
    """Raise this process's descriptor limit (soft, and hard where permitted: root) to `wanted`, so the
    servers and load generator it starts (they inherit it) can hold that many sockets. Returns the soft
    limit now in force; unchanged where raising is not permitted."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= wanted:
        return soft
    for limits in ((wanted, max(hard, wanted)), (min(wanted, hard), hard)):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, limits)
            return limits[0]
        except (ValueError, OSError):
            continue
    return soft


def max_streams_for_fd_limit(reserve: int = 150) -> int:
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(1, (soft - reserve) // 2)


def stream_body() -> dict[str, Any]:
    return {
        "input_ids": list(range(11, 27)),
        "sampling_params": {"max_new_tokens": 100_000, "ignore_eos": True},
        "stream": True,
    }


def engine_running(engine_url: str) -> int:
    with urllib.request.urlopen(engine_url + "/sim/state?requests=0", timeout=30) as response:
        return int(json.loads(response.read())["running"])


def measure_inflight(
    target: ManagedProcess,
    engine_url: str,
    streams: int,
    *,
    client_cpu: str | None,
    hold_s: float = 4.0,
    log: Any = print,
) -> InflightResult:
    """Open `streams` streams through `target` and sample its RSS while they are held."""
    idle = rss_bytes(target.pid)
    command = [
        *module_command("benchmarks.perf.loadgen", cpus=client_cpu),
        "hold",
        "--url",
        target.url + "/generate",
        "--body",
        json.dumps(stream_body()),
        "--count",
        str(streams),
        "--hold",
        str(hold_s + 2),
        "--open-rate",
        "2000",
    ]
    loadgen = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=child_env())
    assert loadgen.stdout is not None
    peak = idle
    running = 0
    opened = 0
    try:
        for line in loadgen.stdout:
            if line.startswith("open "):
                opened = int(line.split()[1])
                peak = max(peak, rss_bytes(target.pid))
                continue
            if line.startswith("all-open"):
                opened = streams
                deadline = time.monotonic() + hold_s
                while time.monotonic() < deadline:
                    peak = max(peak, rss_bytes(target.pid))
                    time.sleep(0.25)
                running = engine_running(engine_url)
                peak = max(peak, rss_bytes(target.pid))
                break
            if line.startswith("{"):
                break
        loadgen.wait(timeout=120)
    finally:
        if loadgen.poll() is None:
            loadgen.kill()
            loadgen.wait()
    log(
        f"  {target.name}: {opened} streams open, {running} running on the engine, "
        f"RSS {idle / 1e6:.0f} MB idle -> {peak / 1e6:.0f} MB"
    )
    return InflightResult(
        target=target.name, streams=opened, engine_running=running, rss_idle_bytes=idle, rss_bytes=peak
    )


def extrapolate(low: InflightResult, high: InflightResult, streams: int) -> float:
    """RSS bytes at `streams`, on the line through two measurements."""
    if high.streams == low.streams:
        return float(high.rss_bytes)
    slope = (high.rss_bytes - low.rss_bytes) / (high.streams - low.streams)
    return high.rss_bytes + slope * (streams - high.streams)
