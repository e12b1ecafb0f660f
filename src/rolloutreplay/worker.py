"""One mode of the replay in a process of its own: `python -m rolloutreplay.worker`.

The two modes run side by side, one process each, so that each has a core to itself on a 2-core machine: a
mode's engines, gateway and agents share one event loop, and a loop that falls behind delays progress events,
keep-alive bytes and timers alike, which at a high time scale is many simulated seconds. The worker prints one
JSON progress line per half second on stdout and writes the records to `--out` at the end (world.py).

Start-up handshake: once LiteLLM is imported and warm, the worker prints `{"ready": true}` and waits for a line
on stdin before it starts its engines, so that neither mode runs while the other is still loading.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

import orjson

from rolloutreplay.scenario import ReplayConfig
from rolloutreplay.world import run_mode

__all__ = ("main",)


def _event_loop_runner() -> object:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency where it builds
        import asyncio

        return asyncio.run
    return uvloop.run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rolloutreplay.worker")
    parser.add_argument("--mode", choices=("engine", "wallclock"), required=True)
    parser.add_argument("--config", required=True, help="ReplayConfig as JSON")
    parser.add_argument("--out", required=True, help="where to write the records (JSON)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    config = ReplayConfig.from_json(orjson.loads(args.config))

    def progress(state: dict[str, object]) -> None:
        sys.stdout.write(orjson.dumps(state).decode() + "\n")
        sys.stdout.flush()

    async def ready() -> None:
        progress({"mode": args.mode, "ready": True})
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)

    run = _event_loop_runner()
    records = run(run_mode(config, args.mode, progress, ready))  # type: ignore[operator]
    Path(args.out).write_bytes(orjson.dumps(records.to_json()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
