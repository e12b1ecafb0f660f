"""Fixtures of the reliability suite: gateway and simulator subprocesses, RSS sampling, the figures report.

Every test here is marked `reliability` (excluded from `make test`; run by `make test-reliability`). Tests that
measure something put a figure into `figures` (a session-wide dict); the suite prints them at the end and,
with `RG_RELIABILITY_REPORT=path.json`, writes them to that file (docs/reliability.md quotes a real run).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.reliability.busy import BusyRow, render_table
from tests.server.conftest import http, make_cluster, make_gateway  # noqa: F401  (fixtures reused here)

FIGURES: dict[str, Any] = {}
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def figures() -> dict[str, Any]:
    return FIGURES


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not FIGURES:
        return
    busy_rows = FIGURES.get("busy_not_dead")
    if busy_rows:  # the table of docs/reliability.md, "Busy is not dead"
        terminalreporter.section("busy is not dead")
        for line in render_table(busy_rows):
            terminalreporter.write_line(line)
    terminalreporter.section("reliability figures")
    for name, value in sorted(FIGURES.items()):
        terminalreporter.write_line(f"{name}: {json.dumps(value, sort_keys=True)}")
    path = os.environ.get("RG_RELIABILITY_REPORT")
    if path:
        Path(path).write_text(json.dumps(FIGURES, indent=2, sort_keys=True) + "\n")
        terminalreporter.write_line(f"written to {path}")


def add_figure(name: str, value: Any) -> None:
    FIGURES[name] = value


def bump_figure(name: str, by: int = 1) -> None:
    FIGURES[name] = int(FIGURES.get(name, 0)) + by


def add_busy_row(row: BusyRow) -> None:
    """A measured row of the busy-is-not-dead table (tests/reliability/busy.py), in the order measured."""
    FIGURES.setdefault("busy_not_dead", {})[row.row] = row.to_json()


# --- processes -----------------------------------------------------------------------------------------------


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


@dataclass
class Proc:
    """A `rolloutgate` subprocess; its output goes to a log file (read with `log()`)."""

    popen: subprocess.Popen[bytes]
    log_path: Path
    urls: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def url(self) -> str:
        return self.urls[0]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def rss(self) -> int:
        return rss_bytes(self.pid)

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        """Send `sig` and wait for the exit code (SIGKILL after `timeout_s`)."""
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                return self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
        return self.popen.wait(10)


def spawn(
    args: Sequence[str],
    log_path: Path,
    url_pattern: str,
    count: int = 1,
    timeout_s: float = 60.0,
    env: dict[str, str] | None = None,
) -> Proc:
    """Start `python -m rolloutgate ARGS` and wait until its output names `count` URLs (`url_pattern`).
    `env`: extra environment (e.g. `ROLLOUTGATE_<SETTING>` for settings without a flag)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True", **(env or {})}
    out = log_path.open("wb")
    popen = subprocess.Popen(
        [sys.executable, "-m", "rolloutgate", *args], stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env
    )
    proc = Proc(popen=popen, log_path=log_path)
    pattern = re.compile(url_pattern)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = pattern.findall(proc.log())
        if len(found) >= count:
            proc.urls = found[:count]
            return proc
        if popen.poll() is not None:
            raise RuntimeError(f"rolloutgate {' '.join(args)} exited {popen.returncode}:\n{proc.log()}")
        time.sleep(0.05)
    proc.stop(signal.SIGKILL)
    raise RuntimeError(f"rolloutgate {' '.join(args)} did not start in {timeout_s} s:\n{proc.log()}")


def spawn_gateway(
    args: Sequence[str], log_path: Path, timeout_s: float = 60.0, env: dict[str, str] | None = None
) -> Proc:
    return spawn(
        ["serve", "--host", "127.0.0.1", "--port", "0", *args],
        log_path,
        r"rolloutgate serving on (http://[\d.]+:\d+)",
        timeout_s=timeout_s,
        env=env,
    )


def spawn_sim(engines: int, args: Sequence[str], log_path: Path) -> Proc:
    return spawn(
        ["sim", "--engines", str(engines), "--base-port", "0", *args],
        log_path,
        r"engine \d+ \w+ (http://[\d.]+:\d+)",
        count=engines,
    )


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    """Subprocesses a test started; killed at teardown whatever happened."""
    started: list[Proc] = []
    yield started
    for proc in started:
        with contextlib.suppress(Exception):
            proc.stop(signal.SIGKILL, timeout_s=5)


async def wait_for(predicate: Any, timeout_s: float = 20.0, what: str = "condition") -> None:
    """Poll `predicate()` (sync) every 20 ms until true; fail after `timeout_s` real seconds."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not predicate():
        if loop.time() > end:
            raise AssertionError(f"{what} not reached in {timeout_s} s")
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def rss_sampler(pid: int, period_s: float = 0.5) -> AsyncIterator[list[tuple[float, int]]]:
    """Samples (seconds since start, RSS bytes) of `pid` while the block runs."""
    samples: list[tuple[float, int]] = []
    start = time.monotonic()

    async def sample() -> None:
        while True:
            with contextlib.suppress(FileNotFoundError, RuntimeError):
                samples.append((time.monotonic() - start, rss_bytes(pid)))
            await asyncio.sleep(period_s)

    task = asyncio.create_task(sample())
    try:
        yield samples
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
