"""Groups on against off on a GRPO-shaped workload: prefill tokens saved and group tail latency, side by side.

`python -m benchmarks.grpo` runs benchmarks/grpo/world.py twice on the same seed (samples sent with their
group ids, and without) and prints one table; `--out DIR` also writes grpo.json. Bounded: the default
(4 engines, 32 prompts of 20K tokens x 8 samples) takes well under two minutes on one core.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from benchmarks.grpo.world import GrpoConfig, run_grpo

__all__ = ("main", "table")


def table(off: dict[str, Any], on: dict[str, Any]) -> str:
    """The two runs' summaries side by side (markdown)."""

    def tail(run: dict[str, Any], q: str) -> str:
        return f"{run['group_completion_s'][q]:.1f}"

    saved = off["prefill_tokens"] - on["prefill_tokens"]
    share = saved / off["prefill_tokens"] if off["prefill_tokens"] else 0.0
    rows = [
        ("prompt tokens sent", f"{off['prompt_tokens']:,}", f"{on['prompt_tokens']:,}"),
        ("prefill tokens computed by the engines", f"{off['prefill_tokens']:,}", f"{on['prefill_tokens']:,}"),
        ("prefill tokens saved by groups", "-", f"{saved:,} ({share:.0%})"),
        (
            "  the core's estimate (rolloutgate_group_prefill_tokens_saved)",
            "-",
            f"{on['estimated_saved_tokens']:,}",
        ),
        ("prefix-cache hit rate", f"{off['hit_rate']:.1%}", f"{on['hit_rate']:.1%}"),
        (
            "group completion p50 / p90 (s)",
            f"{tail(off, 'p50')} / {tail(off, 'p90')}",
            f"{tail(on, 'p50')} / {tail(on, 'p90')}",
        ),
        (
            "group completion p99 / max (s)",
            f"{tail(off, 'p99')} / {tail(off, 'max')}",
            f"{tail(on, 'p99')} / {tail(on, 'max')}",
        ),
        (
            "groups finished",
            f"{off['groups_finished']}/{off['groups']}",
            f"{on['groups_finished']}/{on['groups']}",
        ),
        ("last sample's end (s)", f"{off['makespan_s']:.1f}", f"{on['makespan_s']:.1f}"),
        ("samples per engine", str(off["per_engine_samples"]), str(on["per_engine_samples"])),
    ]
    lines = ["| | ungrouped | grouped |", "| --- | ---: | ---: |"]
    lines += [f"| {name} | {a} | {b} |" for name, a, b in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    defaults = GrpoConfig()
    parser = argparse.ArgumentParser(prog="python -m benchmarks.grpo", description=__doc__.split("\n")[0])
    parser.add_argument("--engines", type=int, default=defaults.engines)
    parser.add_argument("--groups", type=int, default=defaults.groups, help="prompts (one group each)")
    parser.add_argument("--n", type=int, default=defaults.n, help="samples per prompt")
    parser.add_argument("--prompt-tokens", type=int, default=defaults.prompt_tokens)
    parser.add_argument("--min-new-tokens", type=int, default=defaults.min_new_tokens)
    parser.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens)
    parser.add_argument(
        "--arrival-gap", type=float, default=defaults.arrival_gap_s, help="seconds between groups"
    )
    parser.add_argument("--placement", default=defaults.placement)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--out", type=Path, default=None, help="folder for grpo.json")
    args = parser.parse_args(argv)
    config = GrpoConfig(
        engines=args.engines,
        groups=args.groups,
        n=args.n,
        prompt_tokens=args.prompt_tokens,
        min_new_tokens=args.min_new_tokens,
        max_new_tokens=args.max_new_tokens,
        arrival_gap_s=args.arrival_gap,
        placement=args.placement,
        seed=args.seed,
    )
    started = time.perf_counter()
    off = run_grpo(config, grouped=False).summary()
    on = run_grpo(config, grouped=True).summary()
    wall_s = time.perf_counter() - started
    print(
        f"GRPO: {config.groups} prompts x {config.n} samples, {config.prompt_tokens:,}-token prompts, "
        f"{config.min_new_tokens}-{config.max_new_tokens} new tokens, {config.engines} engines "
        f"(incident profile), placement {config.placement}, seed {config.seed}; {wall_s:.0f} s of real time\n"
    )
    print(table(off, on))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        result = {
            "config": {f: getattr(config, f) for f in config.__dataclass_fields__},
            "off": off,
            "on": on,
        }
        (args.out / "grpo.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
