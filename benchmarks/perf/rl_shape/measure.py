"""One phase of the RL shape run and measured: the engines idle and flushed, counters, CPU and /proc readings
before and after, the gateway's RSS and the clients' in-flight bytes sampled every 0.25 s by a thread, the
clients pinned to their CPU (module docstring of the package)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import threading
import time
from collections.abc import Callable, Iterator

from benchmarks.kit.proc import cpu_busy_s, cpu_seconds, io_counters, rss_bytes
from benchmarks.kit.prometheus import quantile_bound
from benchmarks.kit.servers import ManagedProcess
from benchmarks.perf.rl_shape.clients import InFlight, drive
from benchmarks.perf.rl_shape.engines import (
    COUNTERS,
    engine_counters,
    flush,
    loop_lag_buckets,
    wait_idle,
    warm,
)
from benchmarks.perf.rl_shape.phase import PhaseResult, Sample
from benchmarks.perf.rl_shape.plan import TOKENS_PER_S, ShapeOptions, Turn

__all__ = ("SAMPLE_EVERY_S", "run_phase")

SAMPLE_EVERY_S = 0.25


def _runner() -> asyncio.Runner:
    try:
        import uvloop

        return asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.Runner()


def run_phase(
    name: str,
    plan: list[list[Turn]],
    options: ShapeOptions,
    *,
    sim: ManagedProcess,
    gateway: ManagedProcess | None,
    server_cpu: str | None = None,
    client_cpu: str | None = None,
    log: Callable[[str], None] = print,
) -> PhaseResult:
    engine_urls = sim.extra_urls
    if gateway is None:
        warm(engine_urls[0])

        def url_of(turn: Turn) -> str:
            return engine_urls[turn.session_number % len(engine_urls)] + "/generate"
    else:
        warm(gateway.url)
        time.sleep(1.0)
        gateway_url = gateway.url + "/generate"

        def url_of(turn: Turn) -> str:
            return gateway_url

    wait_idle(engine_urls, 30)
    flush(engine_urls)
    idle_rss = rss_bytes(gateway.pid) if gateway is not None else None
    lag_before = loop_lag_buckets(gateway.url) if gateway is not None else {}
    before = engine_counters(engine_urls)
    io_before = io_counters(sim.pid)
    sim_before = cpu_seconds(sim.pid)
    gw_before = cpu_seconds(gateway.pid) if gateway is not None else None
    client_before = resource.getrusage(resource.RUSAGE_SELF)
    busy_before = cpu_busy_s()

    tracker = InFlight()
    samples: list[Sample] = []
    stop = threading.Event()
    began = time.perf_counter()

    def sample() -> None:
        while not stop.wait(SAMPLE_EVERY_S):
            rss = rss_bytes(gateway.pid) if gateway is not None else 0
            samples.append(Sample(time.perf_counter() - began, tracker.count, tracker.bytes, rss))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        with _pinned_to(client_cpu), _runner() as runner:
            results, cut, wall = runner.run(
                drive(plan, url_of, cap_s=options.phase_cap_s, tracker=tracker, ramp_s=options.ramp)
            )
    finally:
        stop.set()
        sampler.join(timeout=5)
    client_after = resource.getrusage(resource.RUSAGE_SELF)
    busy_after = cpu_busy_s()
    gw_after = cpu_seconds(gateway.pid) if gateway is not None else None
    lag_after = loop_lag_buckets(gateway.url) if gateway is not None else {}
    sim_after = cpu_seconds(sim.pid)
    if cut:
        log(f"  {name}: cut at {options.phase_cap_s:g} s; waiting for the engines to finish what they hold")
    # a cut phase leaves generations the gateway aborts; count their work too, within bounds
    wait_idle(engine_urls, 60 if cut else 10)
    after = engine_counters(engine_urls)
    io_after = io_counters(sim.pid)

    engine: dict[str, float] = {}
    for key in COUNTERS:
        if all(key in b and key in a for b, a in zip(before, after, strict=True)):
            engine[key] = sum(a[key] - b[key] for b, a in zip(before, after, strict=True))
    from_state = any("from_state" in a for a in after)
    if "output_bytes" in engine and "output_chunks" in engine and not from_state:
        source = "sim:output_bytes_total, sim:output_chunks_total (the engines' /metrics)"
    elif "output_bytes" in engine and "output_chunks" in engine:
        source = (
            "FALLBACK: /sim/state output_bytes_total and output_chunks_total (no sim:output_* in /metrics)"
        )
    else:
        engine["output_bytes"] = float(io_after.get("wchar", 0) - io_before.get("wchar", 0))
        engine["output_chunks"] = float(io_after.get("syscw", 0) - io_before.get("syscw", 0))
        source = (
            "FALLBACK: /proc/<sim>/io wchar and syscw of the simulator process (sim:output_bytes_total and "
            "sim:output_chunks_total are not exposed by this simulator); includes response headers and "
            "the answers to any gateway's probes"
        )
    requests_per_engine = [
        a.get("requests", 0) - b.get("requests", 0) for b, a in zip(before, after, strict=True)
    ]
    client_cpu_used = (client_after.ru_utime - client_before.ru_utime) + (
        client_after.ru_stime - client_before.ru_stime
    )
    ideal = {t.key: t.max_new / TOKENS_PER_S / options.time_scale for turns in plan for t in turns}
    return PhaseResult(
        name=name,
        wall_s=wall,
        turns_planned=sum(len(t) for t in plan),
        results=results,
        cut=cut,
        engine=engine,
        engine_requests=requests_per_engine,
        work_source=source,
        gateway_cpu_s=None if gw_before is None or gw_after is None else gw_after - gw_before,
        sim_cpu_s=sim_after - sim_before,
        client_cpu_s=client_cpu_used,
        idle_rss=idle_rss,
        samples=samples,
        ideal_s=ideal,
        cpu_busy_s={c: busy_after[c] - busy_before.get(c, 0.0) for c in busy_after},
        server_cpus=_cpu_list(server_cpu),
        client_cpus=_cpu_list(client_cpu),
        loop_lag={f"p{round(100 * q)}": quantile_bound(lag_before, lag_after, q) for q in (0.5, 0.99)}
        if lag_after
        else None,
    )


def _cpu_list(cpus: str | None) -> tuple[int, ...]:
    return () if cpus is None else tuple(int(c) for c in cpus.split(",") if c.strip())


@contextlib.contextmanager
def _pinned_to(cpus: str | None) -> Iterator[None]:
    """Run this process (the clients) on `cpus` for a while; the servers are started outside, pinned by
    taskset (pin_prefix reads this process's affinity, so it must not be narrowed when they start)."""
    if cpus is None or not hasattr(os, "sched_setaffinity"):
        yield
        return
    previous = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, set(_cpu_list(cpus)))
    except (OSError, ValueError):
        yield
        return
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, previous)
