"""What the tests on Ray share: simulated engines in a subprocess, a fleet on a local Ray cluster, waiting."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

import httpx
import ray

from benchmarks.fleet.hop_cost import rolloutgate_process
from benchmarks.kit.servers import rolloutgate_subprocess
from rolloutgate.config import GatewaySettings
from rolloutgate.fleet import Fleet, start_fleet


@contextmanager
def simulated_engines(count: int, time_scale: float) -> Iterator[list[str]]:
    """`rolloutgate sim` with `count` SGLang engines, in a subprocess; their URLs."""
    args = ["sim", "--engines", str(count), "--base-port", "0", "--time-scale", str(time_scale)]
    with rolloutgate_process(args, "engine ", count) as urls:
        yield urls


@contextmanager
def simulated_engine_processes(
    count: int, time_scale: float
) -> Iterator[list[tuple[subprocess.Popen[str], str]]]:
    """`count` simulated SGLang engines, each in a subprocess of its own (one can be SIGKILLed alone)."""
    args = ["sim", "--engines", "1", "--base-port", "0", "--time-scale", str(time_scale)]
    with ExitStack() as stack:
        started = [stack.enter_context(rolloutgate_subprocess(args, "engine ", 1)) for _ in range(count)]
        yield [(proc, url) for proc, (url,) in started]


@contextmanager
def fleet_on_ray(
    replicas: int,
    engines: list[str],
    settings: GatewaySettings,
    namespace: str,
    *,
    shared_port: int | None = None,
) -> Iterator[Fleet]:
    """A fleet on a local Ray cluster (`num_cpus=2`), once every engine is in a pool."""
    ray.init(num_cpus=2, include_dashboard=False, namespace=namespace)
    started = start_fleet(
        replicas,
        [f"sglang+{url}" for url in engines],
        settings,
        replica_num_cpus=0,
        shared_port=shared_port,
    )
    try:
        wait_for(lambda: pools_hold(started, len(engines)), "every engine in a pool")
        yield started
    finally:
        started.stop(grace_s=1)
        ray.shutdown()


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> float:
    """Seconds until `condition()` held; fails after `timeout_s`."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, f"not in {timeout_s:g} s: {what}"
        time.sleep(0.05)
    return time.monotonic() - start


def pools(fleet: Fleet, replica_ids: list[str] | None = None) -> dict[str, list[str]]:
    """Each replica's own pool, from its /admin/state."""
    view = fleet.view()
    out = {}
    for replica_id in replica_ids or list(view.replicas):
        state = httpx.get(f"{view.replicas[replica_id]}/admin/state", timeout=10).json()
        out[replica_id] = sorted(e["url"] for e in state["engines"])
    return out


def pools_hold(fleet: Fleet, count: int, replica_ids: list[str] | None = None) -> bool:
    try:
        held = [url for urls in pools(fleet, replica_ids).values() for url in urls]
    except (httpx.HTTPError, KeyError):
        return False
    return len(held) == count and len(set(held)) == count
