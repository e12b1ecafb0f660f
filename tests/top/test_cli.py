"""`rolloutgate top` as a person runs it: in a real terminal (tmux), and `--once` as a script runs it.

The tmux test runs in real time by nature (a terminal, three processes): `rolloutgate sim` (2 engines) and
`rolloutgate serve` as subprocesses at a fast time scale, a load of streaming requests from this test, and
`rolloutgate top` in a detached tmux session 160x50 whose pane is captured and read as a person reads it. Every
wait is bounded by a deadline (a frame that never shows fails with the last screen in the message).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.reliability.conftest import ROOT, Proc, spawn_gateway, spawn_sim
from tests.server.conftest import MakeCluster, MakeGateway

SCALE = 10.0  # simulated (and gateway) seconds per real second
STALL_TIMEOUT = 40.0  # gateway seconds: a frozen engine is quarantined 4 real seconds after its last token
WORKERS = 6  # streaming requests kept in flight (3 per engine)


def top_command(url: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "rolloutgate", "top", url, *extra]


# --- in a terminal ----------------------------------------------------------------------------------------


def terminal_env() -> dict[str, str]:
    """This process's environment for tmux, written out: under pytest the C environment holds COLUMNS=80 and
    LINES=24 (not in os.environ), which the session would inherit and rich would take over the pane's size."""
    return {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}


class Terminal:
    """A detached tmux session on its own server socket (nothing shared with a person's tmux)."""

    def __init__(self, command: list[str], *, width: int = 160, height: int = 50) -> None:
        tmux = shutil.which("tmux")
        assert tmux is not None, "tmux is needed for this test (installed on this machine and on CI)"
        self._tmux = [tmux, "-L", f"rolloutgate-top-{uuid.uuid4().hex[:8]}"]
        self._run(
            "new-session",
            "-d",
            "-x",
            str(width),
            "-y",
            str(height),
            "-s",
            "top",
            shlex.join(command),
            cwd=ROOT,
        )
        self._run("set-option", "-t", "top", "remain-on-exit", "on")  # a crash stays readable

    def _run(self, *args: str, cwd: object = None) -> str:
        done = subprocess.run(
            [*self._tmux, *args], capture_output=True, text=True, timeout=10, cwd=cwd, env=terminal_env()
        )
        assert done.returncode == 0, f"tmux {args[0]}: {done.stderr}"
        return done.stdout

    def screen(self) -> str:
        return self._run("capture-pane", "-p", "-t", "top")

    def close(self) -> None:
        subprocess.run([*self._tmux, "kill-server"], capture_output=True, timeout=10, env=terminal_env())

    async def wait_for(self, seen: Callable[[str], bool], what: str, timeout_s: float) -> str:
        """Capture the pane until `seen(screen)`; fail after `timeout_s` real seconds with the last screen."""
        end = time.monotonic() + timeout_s
        screen = ""
        while time.monotonic() < end:
            screen = self.screen()
            if seen(screen):
                return screen
            await asyncio.sleep(0.1)
        raise AssertionError(f"{what}: not on the screen in {timeout_s} s; the last screen:\n{screen}")


@contextlib.contextmanager
def terminal(command: list[str]) -> Iterator[Terminal]:
    term = Terminal(command)
    try:
        yield term
    finally:
        term.close()


def row_of(screen: str, engine_url: str) -> str:
    """The engine's row (found by its URL, the last column); empty if it is not on the screen."""
    return next((line for line in screen.splitlines() if line.rstrip().endswith(engine_url)), "")


def state_of(screen: str, engine_url: str) -> str | None:
    match = re.match(r"\s*engine-\d+\s+(quarantined|paused by \w+|\w+)", row_of(screen, engine_url))
    return match.group(1) if match else None


async def keep_streaming(url: str, stop: asyncio.Event) -> None:
    """A client that keeps one long streaming request in flight until `stop`."""
    body = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": "tell me a long story"}],
        "max_tokens": 3000,  # ~3 real s at SCALE on the default profile
        "ignore_eos": True,
        "stream": True,
    }
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as client:
        while not stop.is_set():
            with contextlib.suppress(httpx.HTTPError):
                async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
                    async for _ in response.aiter_raw():
                        if stop.is_set():
                            break


@pytest.mark.tmux
@pytest.mark.timeout(90)
async def test_top_in_a_terminal_shows_an_engine_freeze_then_its_quarantine(
    procs: list[Proc], tmp_path: Path
) -> None:
    sim = spawn_sim(2, ["--time-scale", str(SCALE)], tmp_path / "sim.log")
    procs.append(sim)
    frozen_url, healthy_url = sim.urls
    engines = [arg for url in sim.urls for arg in ("--engine", url)]
    timing = ["--time-scale", str(SCALE), "--stall-timeout", str(STALL_TIMEOUT)]
    gateway = spawn_gateway([*engines, *timing], tmp_path / "gateway.log")
    procs.append(gateway)
    stop = asyncio.Event()
    load = [asyncio.create_task(keep_streaming(gateway.url, stop)) for _ in range(WORKERS)]
    try:
        with terminal(top_command(gateway.url, "--interval", "0.25")) as term:
            screen = await term.wait_for(
                lambda s: all(
                    state_of(s, u) == "healthy" and re.search(r"\s[1-9]\d*/8\s", row_of(s, u))
                    for u in sim.urls
                ),
                "both engines healthy and running requests",
                timeout_s=30,
            )
            assert f"gateway {gateway.url}  gate open" in screen
            assert re.search(r"in flight [1-9]\d*/16", screen)

            async with httpx.AsyncClient() as client:
                frozen = await client.post(f"{frozen_url}/sim/faults", json={"fault": "freeze"})
                assert frozen.status_code == 200, frozen.text
            screen = await term.wait_for(
                lambda s: state_of(s, frozen_url) == "hung", "the frozen engine shown hung", timeout_s=15
            )
            assert re.search(rf"hung\s.*\s\d+s/{STALL_TIMEOUT:.0f}s\s", row_of(screen, frozen_url))
            assert state_of(screen, healthy_url) in ("healthy", "prefilling")

            screen = await term.wait_for(
                lambda s: state_of(s, frozen_url) == "quarantined",
                "the frozen engine shown quarantined",
                timeout_s=15,
            )
            assert state_of(screen, healthy_url) in ("healthy", "prefilling")
            screen = await term.wait_for(
                lambda s: re.search(r"quarantines [1-9][\d.]*", s) is not None,
                "the quarantine counted per minute",
                timeout_s=10,
            )
    finally:
        stop.set()
        for task in load:
            task.cancel()
        await asyncio.gather(*load, return_exceptions=True)


# --- --once -----------------------------------------------------------------------------------------------


async def run_top(*args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        *top_command(*args), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=ROOT
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_once_prints_one_frame_with_every_engine_and_exits(
    make_cluster: MakeCluster, make_gateway: MakeGateway
) -> None:
    cluster = await make_cluster(engines=2)
    gateway = await make_gateway(cluster)
    code, out, err = await run_top(gateway.url, "--once", "--interval", "0.1")
    assert code == 0, err
    assert f"gateway {gateway.url}  gate open" in out
    for url in cluster.urls:
        assert re.search(rf"engine-\d\s+healthy\s+0/\d+\s.*{re.escape(url)}", out), out


async def test_once_against_nothing_says_unreachable_and_exits_1() -> None:
    code, out, _ = await run_top("http://127.0.0.1:9", "--once", "--interval", "0.01", "--timeout", "2")
    assert code == 1
    assert "unreachable" in out


async def test_a_bad_interval_is_refused() -> None:
    code, _, err = await run_top("http://127.0.0.1:9", "--interval", "0")
    assert code == 2
    assert "--interval" in err
