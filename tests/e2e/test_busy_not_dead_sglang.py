"""Busy is not dead, staged on real SGLang 0.5.9 (docs/reliability.md, the busy-is-not-dead table's real rows):

- an engine restarted under load: SIGKILL (the process group: server, scheduler, detokenizer), then started
  again on its port, while four clients call through the gateway;
- a wedged engine: its scheduler process stopped (SIGSTOP) while it holds a call, so nothing progresses while
  its HTTP server lives on (0.5.9's `/health` generates a token, so it hangs rather than answer 200 as vLLM's
  does in vLLM#46811), then continued (SIGCONT).

Each uses the test's own engine (harness.start_extra_engine) beside the session's first, behind a gateway at
its production liveness settings but for the wedge's stall timeout (10 s, not 60: the detection bound is
the same rule, and CI time is short). Each prints its row: false quarantines, spurious 503s, calls lost, and
when the engine was caught or back. The simulator rows: tests/reliability/test_busy_not_dead.py."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.e2e.harness import EngineSet, scrape, start_extra_engine, start_gateway, wait_for
from tests.server.users_path import metric_sum

# Each test starts a real SGLang engine of its own (30-60 s on this CPU), runs its scenario (the wedge: ~40 s)
# and stops the engine (up to 15 s, then SIGKILL): the default 120 s cut one off in its engine's stop, after
# every assertion had passed (fresh-clone CI, 2026-12-07)
pytestmark = [pytest.mark.e2e, pytest.mark.backend("sglang"), pytest.mark.timeout(300)]

CALL_TOKENS = 200  # about a second a call on this machine
PROMPT_IDS = [11, 22, 33, 44, 55]
WEDGE_STALL_S = 10.0
HEALTH_INTERVAL_S = 5.0  # the default


class Load:
    """`workers` clients, each calling `/generate` (logprobs, answered whole) one call after another through
    the gateway until stopped or `max_calls` in all; each call's status, engine and end time is kept."""

    def __init__(self, gateway_url: str, *, workers: int, max_calls: int = 2_000) -> None:
        self._url = gateway_url
        self._workers = workers
        self._left = max_calls
        self._stop = asyncio.Event()
        self.results: list[tuple[int, str | None, float]] = []  # status, engine URL, ended at (monotonic)
        self._tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> Load:
        self._tasks = [asyncio.create_task(self._worker()) for _ in range(self._workers)]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        await asyncio.wait_for(asyncio.gather(*self._tasks), 300.0)

    async def _worker(self) -> None:
        body = {
            "input_ids": PROMPT_IDS,
            "sampling_params": {"max_new_tokens": CALL_TOKENS, "ignore_eos": True},
            "return_logprob": True,
        }
        async with httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=30.0)) as client:
            while not self._stop.is_set() and self._left > 0:
                self._left -= 1
                try:
                    response = await client.post(self._url + "/generate", json=body)
                    status, engine = response.status_code, response.headers.get("x-rolloutgate-engine")
                    if status == 200:
                        assert response.json()["meta_info"]["completion_tokens"] == CALL_TOKENS
                except httpx.HTTPError:
                    status, engine = 0, None  # the connection ended: a lost call
                self.results.append((status, engine, time.monotonic()))

    def served_by(self, url: str, after: float = -1.0) -> int:
        return sum(1 for status, engine, at in self.results if status == 200 and engine == url and at > after)

    async def until(self, what: str, done: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{what}: not within {timeout_s} s; results {Counter(r[:2] for r in self.results)}"
                )
            await asyncio.sleep(0.2)


async def engine_state(client: httpx.AsyncClient, gateway_url: str, engine_url: str) -> str | None:
    workers = (await client.get(gateway_url + "/workers")).json()["workers"]
    return next((w["state"] for w in workers if w["url"] == engine_url), None)


def scheduler_pids(group: int) -> list[int]:
    """The processes of an SGLang engine's group whose title names its scheduler (`sglang::scheduler...`)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if os.getpgid(int(entry.name)) != group:
                continue
            title = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if "scheduler" in title:
                found.append(int(entry.name))
    return found


def row(name: str, results: list[tuple[int, str | None, float]], quarantines: float, note: str) -> str:
    statuses = Counter(status for status, _, _ in results)
    lost = sum(n for status, n in statuses.items() if status != 200)
    return (
        f"| {name} | {len(results)} calls | false quarantines {quarantines:g} | spurious 503s {statuses[503]}"
        f" | lost {lost} | {note} |"
    )


async def test_an_engine_restarted_under_load_loses_nothing(engines: EngineSet, log_dir: Path) -> None:
    """Four clients call through the gateway; one of its two engines is killed and started again on its port.
    The calls on it move to the other engine, no client sees an error or a 503, the engine is never judged
    hung, and it serves again within a health interval of answering its `/health`."""
    process, doomed = start_extra_engine(engines, log_dir, "engine-restarted")
    port = int(doomed.rsplit(":", 1)[1])
    gateway = start_gateway(dataclasses.replace(engines, urls=(doomed, engines.urls[0])), log_dir, {})
    try:
        async with httpx.AsyncClient(timeout=30.0) as admin, Load(gateway.url, workers=4) as load:
            await load.until("calls served by the doomed engine", lambda: load.served_by(doomed) >= 2, 120.0)
            await wait_for("a call running there", lambda: scrape(doomed), lambda m: m.running > 0, 30.0)
            os.killpg(process.pid, signal.SIGKILL)
            process.stop()
            died_at = time.monotonic()
            process, _ = await asyncio.to_thread(
                start_extra_engine, engines, log_dir, "engine-restarted-again", port=port
            )
            ready_at = time.monotonic()
            await wait_for(
                "the restarted engine back in service",
                lambda: engine_state(admin, gateway.url, doomed),
                lambda state: state == "healthy",
                60.0,
            )
            back_at = time.monotonic()
            await load.until(
                "calls served by the restarted engine",
                lambda: load.served_by(doomed, after=back_at) >= 2,
                120.0,
            )
            metrics = (await admin.get(gateway.url + "/metrics")).text
        quarantines = metric_sum(metrics, "rolloutgate_engine_quarantines_total")
        note = (
            f"down {ready_at - died_at:.1f} s (restart until its /health answered);"
            f" back in service {back_at - ready_at:.1f} s after"
        )
        print("\n" + row("engine restarted under load, real SGLang 0.5.9", load.results, quarantines, note))
        assert [r for r in load.results if r[0] != 200] == [], Counter(r[:2] for r in load.results)
        assert quarantines == 0
        assert back_at - ready_at <= HEALTH_INTERVAL_S + 2.0  # a health interval and its check
    finally:
        gateway.process.stop()
        process.stop()


async def test_a_wedged_engine_is_caught_within_its_stall_timeout_and_kept_out_until_it_generates(
    engines: EngineSet, log_dir: Path
) -> None:
    """A call runs on an engine whose scheduler is then stopped. The gateway quarantines it within its stall
    timeout plus the pause check, moves the call to the other engine (its client gets the whole answer), sends
    nothing there while it is stopped, and takes it back once it generates again."""
    process, wedged = start_extra_engine(engines, log_dir, "engine-wedged")
    flags: dict[str, Any] = {"stall_timeout": WEDGE_STALL_S}
    gateway = start_gateway(dataclasses.replace(engines, urls=(wedged, engines.urls[0])), log_dir, flags)
    schedulers = scheduler_pids(process.pid)
    assert schedulers, "no scheduler process found in the engine's group"
    stopped = False
    try:
        async with httpx.AsyncClient(timeout=30.0) as admin, Load(gateway.url, workers=3) as load:
            await load.until("calls served by the engine", lambda: load.served_by(wedged) >= 1, 120.0)
            await wait_for("a call running there", lambda: scrape(wedged), lambda m: m.running > 0, 30.0)
            for pid in schedulers:
                os.kill(pid, signal.SIGSTOP)
            stopped, stopped_at = True, time.monotonic()
            await wait_for(
                "the wedged engine quarantined",
                lambda: engine_state(admin, gateway.url, wedged),
                lambda state: state == "quarantined",
                WEDGE_STALL_S + 60.0,
                every_s=0.1,
            )
            caught_s = time.monotonic() - stopped_at
            await asyncio.sleep(WEDGE_STALL_S)  # held out while wedged: every call goes to the other engine
            served_while_wedged = load.served_by(wedged, after=stopped_at + caught_s)
            for pid in schedulers:
                os.kill(pid, signal.SIGCONT)
            stopped, continued_at = False, time.monotonic()
            await wait_for(
                "the engine back once it generates",
                lambda: engine_state(admin, gateway.url, wedged),
                lambda state: state == "healthy",
                60.0,
            )
            back_s = time.monotonic() - continued_at
            metrics = (await admin.get(gateway.url + "/metrics")).text
        quarantines = metric_sum(metrics, "rolloutgate_engine_quarantines_total")
        note = f"caught {caught_s:.1f} s after its scheduler stopped; back {back_s:.1f} s after it continued"
        print(
            "\n"
            + row("wedged engine (scheduler stopped), real SGLang 0.5.9", load.results, quarantines - 1, note)
        )
        assert [r for r in load.results if r[0] != 200] == [], Counter(r[:2] for r in load.results)
        assert quarantines == 1  # the wedge, once
        assert served_while_wedged == 0
        # the stall timeout after its last progress (the check is asked before its end), and a poll
        assert caught_s <= WEDGE_STALL_S + 3.0, caught_s
        assert back_s <= HEALTH_INTERVAL_S + 5.0, back_s
    finally:
        if stopped:
            for pid in schedulers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        gateway.process.stop()
        process.stop()
