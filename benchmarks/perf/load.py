"""Load generators: `wrk` (POST bodies from a Lua script, latency percentiles), else a Python one.

Theory of operation: a cell of the benchmark is a closed loop of C connections sending the same POST for D
seconds. `wrk` reads every response to its end, chunked SSE streams included (its HTTP parser completes a
response at the chunked terminator), so streaming requests are counted when the whole stream has arrived.
When `wrk` is not installed (`make bench-tools` installs it where it can; the bench never does), loadgen.py
(aiohttp, uvloop) runs in a subprocess on the load generator's CPU instead; it is slower, and the report says
which one ran.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks.kit.servers import child_env, module_command, pin_prefix

__all__ = ("LoadResult", "parse_wrk", "run_load", "wrk_installed")

_UNITS_MS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3}


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadResult:
    requests: int  # complete 2xx responses
    seconds: float
    failures: int  # non-2xx answers, socket errors and timeouts
    p50_ms: float
    p99_ms: float
    generator: str

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"rps": round(self.rps, 1)}


def wrk_installed() -> bool:
    return shutil.which("wrk") is not None


def run_load(
    url: str,
    body: dict[str, Any],
    *,
    connections: int,
    duration_s: float,
    cpus: str | None,
    use_wrk: bool,
    headers: Mapping[str, str] | None = None,
) -> LoadResult:
    if use_wrk:
        return _run_wrk(url, body, connections, duration_s, cpus, headers or {})
    if headers:
        raise ValueError("extra request headers need wrk (`make bench-tools`)")
    return _run_python(url, body, connections, duration_s, cpus)


_LUA = """wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = [==[%s]==]
"""


def _run_wrk(
    url: str,
    body: dict[str, Any],
    connections: int,
    duration_s: float,
    cpus: str | None,
    headers: Mapping[str, str],
) -> LoadResult:
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(_LUA % json.dumps(body, separators=(",", ":")))
        f.writelines(f"wrk.headers[{json.dumps(k)}] = {json.dumps(v)}\n" for k, v in headers.items())
    try:
        command = [
            *pin_prefix(cpus),
            "wrk",
            "-t1",
            f"-c{connections}",
            f"-d{max(1, round(duration_s))}s",
            "--timeout",
            "10s",
            "--latency",
            "-s",
            f.name,
            url,
        ]
        output = subprocess.run(command, capture_output=True, text=True, check=True, timeout=duration_s + 60)
    finally:
        os.unlink(f.name)
    return parse_wrk(output.stdout)


def parse_wrk(text: str) -> LoadResult:
    """The figures of one `wrk --latency` report."""
    done = re.search(r"(\d+) requests in ([\d.]+)(us|ms|s|m)", text)
    if done is None:
        raise RuntimeError(f"unreadable wrk output:\n{text}")
    seconds = float(done.group(2)) * _UNITS_MS[done.group(3)] / 1e3
    bad = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", text)
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    non_2xx = int(bad.group(1)) if bad else 0
    failures = non_2xx + (sum(int(g) for g in errors.groups()) if errors else 0)
    return LoadResult(
        requests=max(0, int(done.group(1)) - non_2xx),
        seconds=seconds,
        failures=failures,
        p50_ms=_wrk_latency_ms(text, "50"),
        p99_ms=_wrk_latency_ms(text, "99"),
        generator="wrk",
    )


def _wrk_latency_ms(text: str, which: str) -> float:
    """The `which`% latency of wrk's `--latency` table, in ms; NaN where it is missing."""
    match = re.search(rf"^\s+{which}(?:\.0+)?%\s+([\d.]+)(us|ms|s|m)\s*$", text, re.MULTILINE)
    return float(match.group(1)) * _UNITS_MS[match.group(2)] if match else float("nan")


def _run_python(
    url: str, body: dict[str, Any], connections: int, duration_s: float, cpus: str | None
) -> LoadResult:
    command = [
        *module_command("benchmarks.perf.loadgen", cpus=cpus),
        "closed",
        "--url",
        url,
        "--body",
        json.dumps(body),
        "--connections",
        str(connections),
        "--duration",
        str(duration_s),
    ]
    output = subprocess.run(
        command, capture_output=True, text=True, check=True, timeout=duration_s + 120, env=child_env()
    )
    figures = json.loads(output.stdout.strip().splitlines()[-1])
    return LoadResult(
        requests=figures["requests"],
        seconds=figures["seconds"],
        failures=figures["failures"],
        p50_ms=figures["p50_ms"],
        p99_ms=figures["p99_ms"],
        generator="python-aiohttp",
    )
