"""Command line: `rolloutgate {serve,sim,replay,fleet,top}`.

Each subcommand lives with its part (server, sim, replay) and registers its own flags; this module only
dispatches, importing a part when its subcommand runs so `rolloutgate sim` never loads the gateway. The
benchmarks are not a subcommand: they live beside the package, in the repository's benchmarks/ (`make bench`).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# subcommand -> module exposing `add_arguments(parser)` and `run(args) -> int`
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("rolloutgate.server.cli", "run the gateway"),
    "sim": ("rolloutsim.cli", "run simulated SGLang or vLLM engines"),
    "replay": ("rolloutreplay.cli", "replay the incident side by side (engine time vs wallclock)"),
    "fleet": ("rolloutgate.fleet.cli", "gateway replicas on Ray, each owning a shard of the engines"),
    "top": ("rolloutgate.top.cli", "a live view of a gateway or fleet: engines, queue, clocks, waste"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rolloutgate", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text)
        if only is None or only == name:
            importlib.import_module(module_name).add_arguments(sub_parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv and not argv[0].startswith("-") else None
    args = build_parser(only=command).parse_args(argv)
    module_name, _ = SUBCOMMANDS[args.command]
    result: int = importlib.import_module(module_name).run(args)
    return result
