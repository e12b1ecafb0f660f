"""The fleet's cost as it grows: `python -m benchmarks.fleet.scale [--replicas 1 2 4]` (docs/fleet.md).

Theory of operation: simulated SGLang engines (`rolloutgate sim`, a subprocess) and the same load for each
fleet size: `--clients` rollouts, each a loop of token-in-token-out `/generate` calls with `return_logprob`
(a `--prompt`-token prompt, `--decode` tokens out with `ignore_eos`), each rollout keyed and sent where miles
sends a session: to the URL of the replica that owns its key (no hop). Before each fleet size the same calls
go straight to the engines (client i to engine i mod E), so the added latency is measured beside its baseline
on the same machine at the same moment.

Per fleet size it prints the replicas' CPU per million generated tokens (the sum over replicas of the CPU of
each one's event-loop thread during the load, where the gateway runs, less that thread's idle CPU measured
just before, over the tokens the answers carried; Ray's own threads are left out),
each replica's share, and the p50 / p90 latency added to a call (fleet - direct). Flat across sizes is the goal:
the work per token is the gateway's own, not the fleet's. `--replicas N --serving 1 2 4`: one fleet size, the
load on 1, 2, 4 of its replicas: the same processes, the work split differently (tells the cost of more
processes on the machine from the cost of splitting the work).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import TYPE_CHECKING, Any

import httpx
import orjson

from benchmarks.kit.servers import rolloutgate_process
from benchmarks.kit.stats import percentile
from rolloutgate.config import GatewaySettings

if TYPE_CHECKING:
    from rolloutgate.fleet.launch import Fleet

__all__ = ("main",)

TIME_SCALE = 50.0
IDLE_S = 5.0  # each replica's idle CPU is measured over this long before the load


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--clients", type=int, default=8, help="concurrent rollouts (default 8)")
    parser.add_argument("--calls", type=int, default=96, help="calls per arm, over all clients (default 96)")
    parser.add_argument("--prompt", type=int, default=20_000, help="prompt tokens (default 20,000)")
    parser.add_argument("--decode", type=int, default=2_000, help="tokens out, with logprobs (default 2,000)")
    parser.add_argument(
        "--serving",
        type=int,
        nargs="+",
        default=None,
        help="one fleet of --replicas N (one size), the load on only K of its replicas for each K given: the "
        "same processes, the work split K ways",
    )
    args = parser.parse_args(argv)

    import ray

    from rolloutgate.fleet.launch import start_fleet

    sim_args = ["sim", "--engines", str(args.engines), "--base-port", "0", "--time-scale", str(TIME_SCALE)]
    with rolloutgate_process(sim_args, "engine ", args.engines) as engines:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            sizes = args.replicas if args.serving is None else args.replicas[:1] * len(args.serving)
            for run, size in enumerate(sizes):
                serving = size if args.serving is None else args.serving[run]

                def engine_url(i: int) -> str:
                    return engines[i % len(engines)]

                direct_keys = [f"scale-{i}" for i in range(args.clients)]
                # warm, as the fleet's arm is
                asyncio.run(_load(args, engine_url, direct_keys, calls=args.clients))
                direct = asyncio.run(_load(args, engine_url, direct_keys))
                settings = GatewaySettings(time_scale=TIME_SCALE, log_level="warning")
                fleet = start_fleet(size, [f"sglang+{u}" for u in engines], settings, replica_num_cpus=0)
                try:
                    _wait_for_pools(fleet, len(engines))
                    view = fleet.view()
                    keys = [_key_at(view, f"replica-{i % serving}", i) for i in range(args.clients)]

                    def owner_url(i: int, view: Any = view, keys: list[str] = keys) -> str:
                        return str(view.replicas[view.key_owner(keys[i])])

                    # warm: connections, code paths
                    asyncio.run(_load(args, owner_url, keys, calls=args.clients))
                    idle = _cpu(fleet)
                    time.sleep(IDLE_S)
                    idle_per_s = {r: (c - idle[r]) / IDLE_S for r, c in _cpu(fleet).items()}
                    before, started = _cpu(fleet), time.monotonic()
                    through = asyncio.run(_load(args, owner_url, keys))
                    spent_s = time.monotonic() - started
                    after = _cpu(fleet)
                finally:
                    fleet.stop(grace_s=0)
                busy = {r: after[r] - before[r] - idle_per_s[r] * spent_s for r in after}
                label = f"{size} replicas" + ("" if args.serving is None else f", {serving} serving")
                _report(label, direct, through, busy, sum(idle_per_s.values()) * spent_s)
        finally:
            ray.shutdown()
    return 0


class _Arm:
    def __init__(self) -> None:
        self.latencies_ms: list[float] = []
        self.tokens = 0


async def _load(args: argparse.Namespace, url_of: Any, keys: list[str], *, calls: int | None = None) -> _Arm:
    """`calls` /generate calls over `args.clients` concurrent rollouts; client i sends to `url_of(i)` with
    routing key `keys[i]`."""
    arm, remaining = _Arm(), calls or args.calls
    prompt = list(range(1000, 1000 + args.prompt))
    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)

    async def client(i: int, http: httpx.AsyncClient) -> None:
        nonlocal remaining
        body = orjson.dumps(
            {
                "input_ids": [i, *prompt],
                "sampling_params": {"max_new_tokens": args.decode, "ignore_eos": True},
                "return_logprob": True,
            }
        )
        headers = {"X-SMG-Routing-Key": keys[i], "Content-Type": "application/json"}
        url = f"{url_of(i)}/generate"
        while remaining > 0:
            remaining -= 1
            started = time.perf_counter()
            answer = await http.post(url, content=body, headers=headers)
            answer.raise_for_status()
            arm.latencies_ms.append((time.perf_counter() - started) * 1000)
            arm.tokens += int(orjson.loads(answer.content)["meta_info"]["completion_tokens"])

    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        await asyncio.gather(*(client(i, http) for i in range(args.clients)))
    return arm


def _key_at(view: Any, replica_id: str, client: int) -> str:
    """A key for `client` that `replica_id` owns."""
    return next(k for k in (f"scale-{client}-{j}" for j in range(10_000)) if view.key_owner(k) == replica_id)


def _cpu(fleet: Fleet) -> dict[str, float]:
    """Each replica's event-loop thread's CPU so far: the gateway's own work, not Ray's threads."""
    return {r: float(d["loop_cpu_s"]) for r, d in fleet.describe().items()}


def _wait_for_pools(fleet: Fleet, engines: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        held = [len(d["engines"]) for d in fleet.describe().values()]
        if sum(held) == engines:
            return
        time.sleep(0.2)
    raise RuntimeError("the fleet's engines did not join its pools")


def _report(label: str, direct: _Arm, through: _Arm, busy: dict[str, float], idle_s: float) -> None:
    total = sum(busy.values())
    per_m = total / through.tokens * 1e6
    shares = ", ".join(f"{r} {s:.2f}" for r, s in sorted(busy.items()))
    p = {
        (arm, q): percentile(values, q, method="linear")
        for arm, values in (("direct", direct.latencies_ms), ("through", through.latencies_ms))
        for q in (50, 90)
    }
    added = {q: p["through", q] - p["direct", q] for q in (50, 90)}
    print(
        f"{label}: {per_m:.2f} CPU-s per M generated tokens ({total:.2f} CPU-s over "
        f"{through.tokens:,} tokens; {shares}; idle CPU taken off {idle_s:.2f} CPU-s); added latency p50 {added[50]:+.1f} ms, p90 {added[90]:+.1f} ms "
        f"(direct p50 {p['direct', 50]:.0f} ms, {len(through.latencies_ms)} calls)",
        flush=True,
    )


if __name__ == "__main__":
    raise SystemExit(main())
