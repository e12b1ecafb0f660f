"""`rolloutgate sim`: run simulated engines until interrupted.

rolloutgate sim --engines 2 --base-port 31000 --api sglang --profile incident --time-scale 100
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import signal
import sys
from pathlib import Path
from typing import Any

from rolloutgate.vocabulary import folder_vocab_size
from rolloutsim.cluster import SimCluster
from rolloutsim.faults import parse_fault_flag
from rolloutsim.profiles import PROFILES

__all__ = ("add_arguments", "run")

# flag -> (config field, type, help, scale applied to the flag's value)
_OVERRIDES: dict[str, tuple[str, type, str, float]] = {
    "--served-model-name": ("served_model_name", str, "model name served (default sim-model)", 1.0),
    "--max-running-requests": ("max_running_requests", int, "requests running at once", 1.0),
    "--chunked-prefill-size": ("chunked_prefill_size", int, "tokens per prefill batch", 1.0),
    "--max-queued-requests": ("max_queued_requests", int, "beyond it new requests get 503", 1.0),
    "--prefill-mode": ("prefill_mode", str, "held (SGLang) or mixed (vLLM)", 1.0),
    "--prefill-decode-interval": (
        "prefill_decode_interval",
        int,
        "decode steps between prefill batches",
        1.0,
    ),
    "--prefill-rate": ("prefill_tokens_per_s", float, "prefill tokens per second at zero context", 1.0),
    "--prefill-knee": ("prefill_attention_knee_tokens", float, "context at which prefill cost doubles", 1.0),
    "--decode-base-ms": ("decode_base_s", float, "decode step: fixed part (ms)", 1e-3),
    "--decode-per-request-ms": ("decode_per_request_s", float, "decode step: per running request (ms)", 1e-3),
    "--decode-per-ktoken-ms": ("decode_per_ktoken_s", float, "decode step: per 1K context tokens (ms)", 1e-3),
    "--kv-capacity": ("kv_capacity_tokens", int, "KV cache capacity in tokens", 1.0),
    "--context-len": ("context_len", int, "context length", 1.0),
    "--vocab-size": ("vocab_size", int, "token ids it takes (default 151,936, or --tokenizer's)", 1.0),
    "--default-max-new-tokens": ("default_max_new_tokens", int, "max tokens when a request sets none", 1.0),
    "--stop-fraction": ("stop_fraction", float, "share of requests that stop early with EOS", 1.0),
    "--weight-update-s": ("weight_update_s", float, "duration of a weight update (simulated s)", 1.0),
    "--disconnect-lag-s": ("disconnect_lag_s", float, "SGLang: lag before a disconnect aborts", 1.0),
    "--output-mb-per-s": (
        "output_bytes_per_s",
        float,
        "output path (tokenizer manager): MB serialised per simulated second (inf: free)",
        1e6,
    ),
    "--output-chunk-us": (
        "output_chunk_s",
        float,
        "output path: cost of each stream chunk or body (simulated microseconds)",
        1e-6,
    ),
}
_ALIASES = {"--chunked-prefill-size": ("--chunk-size",)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engines", type=int, default=1, help="number of engines (default 1)")
    parser.add_argument("--api", choices=("sglang", "vllm"), default="sglang")
    parser.add_argument("--profile", choices=sorted(PROFILES), default="default")
    parser.add_argument("--time-scale", type=float, default=1.0, help="simulated seconds per real second")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--base-port", type=int, default=30000, help="engine i listens on base+i (0: any)")
    parser.add_argument("--admin-port", type=int, default=None, help="cluster admin server (0: any)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-prefix-cache", action="store_true", help="disable the prefix cache")
    parser.add_argument(
        "--kv-preemption", action="store_true", help="preempt the newest request when the KV cache is full"
    )
    parser.add_argument(
        "--incremental-streaming-output",
        action="store_true",
        help="SGLang's flag: a streamed /generate chunk carries only its new text, ids and logprobs",
    )
    parser.add_argument(
        "--tokenizer",
        metavar="DIR",
        default=None,
        help="the model or tokenizer folder it plays: its vocabulary (config.json's vocab_size, else the "
        "tokenizer's length) and the model path it reports",
    )
    parser.add_argument(
        "--no-output-cost",
        action="store_true",
        help="answers cost no simulated time on the engine's output path (counters still count)",
    )
    parser.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="ENGINE:KIND[:PARAM]",
        help="inject a fault at start-up, e.g. 0:freeze, all:slow:4, 1:stall:rid-7, 0:refuse:429",
    )
    group = parser.add_argument_group("profile overrides")
    for flag, (_field, kind, help_text, _scale) in _OVERRIDES.items():
        names = [flag, *_ALIASES.get(flag, ())]
        group.add_argument(*names, dest=_dest(flag), type=kind, default=None, help=help_text)


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for flag, (field, _kind, _help, scale) in _OVERRIDES.items():
        value = getattr(args, _dest(flag))
        if value is not None:
            out[field] = value * scale if scale != 1.0 else value
    if args.no_prefix_cache:
        out["enable_prefix_cache"] = False
    if args.kv_preemption:
        out["kv_preemption"] = True
    if args.incremental_streaming_output:
        out["incremental_streaming_output"] = True
    if args.no_output_cost:
        out["output_bytes_per_s"] = math.inf
        out["output_chunk_s"] = 0.0
    if args.tokenizer:
        out["model_path"] = str(Path(args.tokenizer).resolve())
        if "vocab_size" not in out:  # --vocab-size wins
            out["vocab_size"] = folder_vocab_size(args.tokenizer)
            if out["vocab_size"] is None:
                raise SystemExit(f"--tokenizer {args.tokenizer}: no config.json vocab_size or tokenizer.json")
    return out


async def _serve(args: argparse.Namespace) -> int:
    faults = [parse_fault_flag(text) for text in args.fault]
    cluster = SimCluster(
        engines=args.engines,
        api=args.api,
        profile=args.profile,
        time_scale=args.time_scale,
        host=args.host,
        base_port=args.base_port,
        seed=args.seed,
        admin_port=args.admin_port,
        faults=faults,
        **_overrides(args),
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    async with cluster:
        for engine in cluster.engines:
            print(f"engine {engine.index} {args.api} {engine.url}", flush=True)
        if cluster.admin_url:
            print(f"admin {cluster.admin_url}", flush=True)
        print(f"profile {cluster.config.profile}, time scale {cluster.time_scale:g}", flush=True)
        await stop.wait()
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        runner = asyncio.Runner()
    with runner:
        try:
            return runner.run(_serve(args))
        except ValueError as exc:  # a bad --fault or profile override
            print(f"rolloutgate sim: {exc}", file=sys.stderr)
            return 2
