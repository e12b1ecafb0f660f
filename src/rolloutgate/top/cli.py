"""`rolloutgate top URL`: a live terminal view of a gateway, or of every replica of a fleet.

    rolloutgate top http://127.0.0.1:8000                 # refreshed every second until Ctrl-C
    rolloutgate top http://127.0.0.1:8000 --once          # one frame (two readings --interval apart), then exit

Reads only the gateway's own endpoints (`/admin/state`, `/metrics`): admin calls need the admin token when the
gateway has one (--admin-token or ROLLOUTGATE_ADMIN_TOKEN), else a loopback client. Rates are per real second.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
from collections import deque

import aiohttp
from rich.console import Console
from rich.live import Live

from rolloutgate.top.fetch import GatewayReader
from rolloutgate.top.render import render
from rolloutgate.top.snapshot import GatewaySnapshot
from rolloutgate.top.view import build_view

__all__ = ("add_arguments", "run")

History = deque[list[GatewaySnapshot]]
SCRIPT_WIDTH = 200


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "url", nargs="?", default="http://127.0.0.1:8000", help="the gateway (or a fleet replica)"
    )
    parser.add_argument(
        "--interval", type=float, default=1.0, help="real seconds between refreshes (default 1)"
    )
    parser.add_argument(
        "--window",
        type=float,
        default=60.0,
        help="real seconds over which per-minute rates and the clocks' split are taken (default 60)",
    )
    parser.add_argument("--once", action="store_true", help="print one frame and exit (1 if unreachable)")
    parser.add_argument(
        "--admin-token",
        default=os.environ.get("ROLLOUTGATE_ADMIN_TOKEN"),
        help="the gateway's admin token, if it has one (default $ROLLOUTGATE_ADMIN_TOKEN)",
    )
    parser.add_argument("--timeout", type=float, default=5.0, help="real seconds to wait for each reading")


def run(args: argparse.Namespace) -> int:
    if not args.interval > 0 or not args.window > 0 or not args.timeout > 0:
        print("rolloutgate top: --interval, --window and --timeout must be > 0", file=sys.stderr)
        return 2
    with contextlib.suppress(KeyboardInterrupt):
        return asyncio.run(_once(args) if args.once else _live(args))
    return 0


async def _once(args: argparse.Namespace) -> int:
    # into a pipe or a file (a script), wide enough that no row is cut; in a terminal, the terminal's width
    console = Console() if sys.stdout.isatty() else Console(width=SCRIPT_WIDTH)
    async with aiohttp.ClientSession() as session:
        reader = GatewayReader(session, admin_token=args.admin_token, timeout_s=args.timeout)
        history: History = deque([await reader.read_all(args.url)])
        await asyncio.sleep(args.interval)
        history.append(await reader.read_all(args.url))
    console.print(render(build_view(history), title=_title(args)))
    return 0 if all(s.error is None for s in history[-1]) else 1


async def _live(args: argparse.Namespace) -> int:
    console = Console()
    history: History = deque()
    async with aiohttp.ClientSession() as session:
        reader = GatewayReader(session, admin_token=args.admin_token, timeout_s=args.timeout)
        with Live(console=console, screen=True, auto_refresh=False) as live:
            while True:
                history.append(await reader.read_all(args.url))
                _trim(history, args.window)
                live.update(render(build_view(history), title=_title(args)), refresh=True)
                await asyncio.sleep(args.interval)


def _trim(history: History, window_s: float) -> None:
    """Drop readings older than the window, keeping at least two (the rates need them)."""
    newest = min(s.taken_at for s in history[-1]) if history[-1] else 0.0
    while len(history) > 2 and history[0] and min(s.taken_at for s in history[0]) < newest - window_s:
        history.popleft()


def _title(args: argparse.Namespace) -> str:
    return f"rolloutgate top  {args.url}  every {args.interval:g} s  {time.strftime('%H:%M:%S')}"
