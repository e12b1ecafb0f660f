"""What the one hop costs: `python -m benchmarks.fleet.hop_cost [--calls 200]` (docs/fleet.md).

Theory of operation: two simulated SGLang engines (`rolloutgate sim`, a subprocess) behind three fronts, called
in turn with the same small keyed `/generate` (one token, so the engine's time is small and steady):

- a plain gateway (`rolloutgate serve`, a subprocess): no fleet at all;
- the replica that owns the key, called directly: the fleet's edge decides "here";
- the other replica: the edge forwards the call one hop to the owner (its CPU per call is reported too).

Arms are interleaved call by call, so drift on a shared machine falls on all three alike. Prints p50 / p90 of
each and the differences: the hop (forwarded - direct) and the edge's own cost (direct - plain).
"""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING

import httpx

from benchmarks.kit.servers import rolloutgate_process
from benchmarks.kit.stats import percentile
from rolloutgate.config import GatewaySettings

if TYPE_CHECKING:
    from rolloutgate.fleet.launch import Fleet

__all__ = ("main",)

TIME_SCALE = 100.0
WARM_CALLS = 10  # per arm, before the measured calls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--calls", type=int, default=200, help="calls per arm (default 200)")
    args = parser.parse_args(argv)

    import ray

    from rolloutgate.fleet.launch import start_fleet

    sim_args = ["sim", "--engines", "2", "--base-port", "0", "--time-scale", str(TIME_SCALE)]
    with rolloutgate_process(sim_args, "engine ", 2) as engines:
        serve_args = ["serve", "--port", "0", "--time-scale", str(TIME_SCALE), "--log-level", "warning"]
        for url in engines:
            serve_args += ["--engine", f"sglang+{url}"]
        with rolloutgate_process(serve_args, "rolloutgate serving on", 1) as (plain,):
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
            settings = GatewaySettings(time_scale=TIME_SCALE, log_level="warning")
            fleet = start_fleet(2, [f"sglang+{u}" for u in engines], settings, replica_num_cpus=0)
            try:
                time.sleep(1.0)  # both replicas have their engine in the pool
                view = fleet.view()
                key = next(k for k in (f"hop-{i}" for i in range(1000)) if view.key_owner(k) == "replica-1")
                arms = {
                    "plain gateway": plain,
                    "fleet, at the owner": view.replicas["replica-1"],
                    "fleet, one hop": view.replicas["replica-0"],
                }
                idle_cpu_per_s = _idle_cpu_per_s(fleet)  # Ray's own threads, pings, health checks
                cpu_before, started = _forwarder_cpu_s(fleet), time.monotonic()
                samples = _measure(arms, key, args.calls)
                busy_cpu_s = _forwarder_cpu_s(fleet) - cpu_before
                background_s = idle_cpu_per_s * (time.monotonic() - started)
                forwarder_cpu_ms = (busy_cpu_s - background_s) * 1000 / (args.calls + WARM_CALLS)
            finally:
                fleet.stop(grace_s=0)
                ray.shutdown()
    p50 = {arm: percentile(values, 50, method="linear") for arm, values in samples.items()}
    for arm, values in samples.items():
        p90 = percentile(values, 90, method="linear")
        print(f"{arm:22s} p50 {p50[arm]:7.3f} ms   p90 {p90:7.3f} ms   ({len(values)} calls)")
    hop = p50["fleet, one hop"] - p50["fleet, at the owner"]
    edge_cost = p50["fleet, at the owner"] - p50["plain gateway"]
    print(f"the hop: +{hop:.3f} ms at p50; the edge at the owner: {edge_cost:+.3f} ms at p50")
    print(
        f"the forwarder's CPU per forwarded call: {forwarder_cpu_ms:.3f} ms "
        f"(its idle CPU, {idle_cpu_per_s * 1000:.0f} ms per second, taken off)"
    )
    return 0


def _forwarder_cpu_s(fleet: Fleet) -> float:
    cpu: float = fleet.describe()["replica-0"]["cpu_s"]
    return cpu


def _idle_cpu_per_s(fleet: Fleet, seconds: float = 5.0) -> float:
    before = _forwarder_cpu_s(fleet)
    time.sleep(seconds)
    return (_forwarder_cpu_s(fleet) - before) / seconds


def _measure(arms: dict[str, str], key: str, calls: int) -> dict[str, list[float]]:
    body = {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 1}}
    headers = {"X-SMG-Routing-Key": key}
    samples: dict[str, list[float]] = {arm: [] for arm in arms}
    with httpx.Client(timeout=30) as http:
        for url in arms.values():  # warm: connections open, code paths run once
            for _ in range(WARM_CALLS):
                http.post(f"{url}/generate", json=body, headers=headers).raise_for_status()
        for _ in range(calls):
            for arm, url in arms.items():
                started = time.perf_counter()
                http.post(f"{url}/generate", json=body, headers=headers).raise_for_status()
                samples[arm].append((time.perf_counter() - started) * 1000)
    return samples


if __name__ == "__main__":
    raise SystemExit(main())
