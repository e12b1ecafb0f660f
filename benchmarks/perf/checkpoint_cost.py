"""What `--checkpoint-tokens` costs the engine: `python -m benchmarks.perf.checkpoint_cost` (docs/gateway.md).

Theory of operation: one simulated SGLang engine (`rolloutgate sim --profile incident`, a subprocess) and, for
each interval, a gateway (`rolloutgate serve --checkpoint-tokens N`, a subprocess) in front of it. Each arm sends
the same non-streaming `/generate` with `return_logprob` (its length a flag) once directly and once through each
gateway, and reads what the engine serialised for it (`/sim/state` output bytes and chunks) and the engine
process's CPU. SGLang's stream is cumulative, so each checkpoint chunk repeats the output so far: the bytes grow
with length^2 / interval; that is the price of continuing from the last chunk when an engine dies. With
`--incremental` the engine runs as SGLang's `--incremental-streaming-output` does: each chunk carries only its own
tokens, and the bytes grow with length / interval.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.kit.servers import rolloutgate_subprocess

__all__ = ("main",)

TIME_SCALE = 20.0
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def engine_output(http: httpx.Client, url: str) -> dict[str, float]:
    state = http.get(f"{url}/sim/state", params={"requests": "0"}).json()
    return {"bytes": state["output_bytes_total"], "chunks": state["output_chunks_total"]}


def measure(
    http: httpx.Client, url: str, engine: str, pid: int, body: dict[str, Any], gateway_pid: int | None = None
) -> dict[str, float]:
    before, cpu_before = engine_output(http, engine), cpu_s(pid)
    gateway_before = 0.0 if gateway_pid is None else cpu_s(gateway_pid)
    response = http.post(f"{url}/generate", json=body)
    response.raise_for_status()
    after = engine_output(http, engine)
    gateway = math.nan if gateway_pid is None else cpu_s(gateway_pid) - gateway_before
    return {
        "cpu_s": cpu_s(pid) - cpu_before,
        "gateway_cpu_s": gateway,
        **{k: after[k] - before[k] for k in after},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 8192, 16_000])
    parser.add_argument("--intervals", type=int, nargs="+", default=[0, 4096, 1024, 256])
    parser.add_argument(
        "--incremental", action="store_true", help="the engine streams incremental chunks (SGLang's flag)"
    )
    args = parser.parse_args(argv)
    sim_args = ["sim", "--engines", "1", "--base-port", "0", "--profile", "incident"]
    if args.incremental:
        sim_args.append("--incremental-streaming-output")
    with (
        rolloutgate_subprocess([*sim_args, "--time-scale", str(TIME_SCALE)], "engine ", 1) as (
            sim,
            (engine,),
        ),
        httpx.Client(timeout=None) as http,
    ):
        print(
            "| output tokens | path | engine bytes | x direct | engine chunks | engine CPU s | gateway CPU s |"
        )
        print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
        for length in args.lengths:
            body = {
                "input_ids": list(range(11, 2011)),
                "sampling_params": {"max_new_tokens": length, "ignore_eos": True},
                "return_logprob": True,
            }
            direct = measure(http, engine, engine, sim.pid, body)
            rows = [("direct", direct)]
            for interval in args.intervals:
                serve = [
                    "serve",
                    "--port",
                    "0",
                    "--engine",
                    f"sglang+{engine}",
                    "--time-scale",
                    str(TIME_SCALE),
                ]
                serve += ["--checkpoint-tokens", str(interval), "--log-level", "warning"]
                with rolloutgate_subprocess(serve, "rolloutgate serving on", 1) as (gateway, (url,)):
                    time.sleep(0.5)  # its first health check
                    rows.append(
                        (
                            f"gateway, --checkpoint-tokens {interval}",
                            measure(http, url, engine, sim.pid, body, gateway.pid),
                        )
                    )
            for name, row in rows:
                ratio = row["bytes"] / direct["bytes"]
                gateway_cpu = "" if math.isnan(row["gateway_cpu_s"]) else f"{row['gateway_cpu_s']:.2f}"
                print(
                    f"| {length:,} | {name} | {row['bytes']:,.0f} | {ratio:.2f} | {row['chunks']:.0f} | "
                    f"{row['cpu_s']:.2f} | {gateway_cpu} |"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
