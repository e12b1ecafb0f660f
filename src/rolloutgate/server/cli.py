"""`rolloutgate serve`: flags, each also settable as `ROLLOUTGATE_<NAME>` or in the `--config` file."""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import logging
import signal
import sys
from collections.abc import Callable

from rolloutgate.config import load_settings

__all__ = ("add_arguments", "run")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--config", help="TOML or JSON file with any of the settings below (flags win, then environment)")
    add("--host", help="address to bind (default 127.0.0.1)")
    add("--port", type=int, help="port to bind (default 8000; 0 picks a free one)")
    add(
        "--engine",
        dest="engines",
        action="append",
        metavar="URL",
        help="engine URL, repeatable; prefix the family to skip detection: vllm+http://host:port",
    )
    add("--sim", type=int, metavar="N", help="serve in front of N simulated engines started in this process")
    add("--sim-api", choices=["sglang", "vllm"])
    add("--sim-profile")
    add("--time-scale", type=float, help="gateway seconds per real second (match the simulator's)")
    add("--clock", choices=["engine", "wallclock"], help="what timeouts measure (default engine)")
    add("--timeout", type=float, help="charged engine seconds per request (default 600)")
    add("--stall-timeout", type=float, help="seconds without progress before a stall verdict (default 60)")
    add("--queue-timeout", type=float, help="seconds a request may wait in the gateway queue (default none)")
    add("--max-wall", type=float, help="absolute cap on a request's wall time (default none)")
    add("--capacity", type=int, help="in-flight requests per engine (default: read from the engine)")
    add("--keepalive-interval", type=float, help="seconds of client silence before a keep-alive (0 = off)")
    add("--retry-grace", type=float, help="seconds a disconnected client's generation waits for a retry")
    add("--admin-token", help="token required by admin and worker endpoints")
    add("--allow-remote-admin", action="store_const", const=True, help="admin from non-loopback clients")
    add("--api-key", dest="api_keys", action="append", help="accepted inference API key, repeatable")
    add(
        "--engine-poll-interval",
        type=float,
        help="seconds between load readings of an engine whose calls come whole (default stall/20, <= 3)",
    )
    add(
        "--placement",
        choices=["prefill_aware", "session_affinity", "least_outstanding"],
        help="placement policy (default prefill_aware; docs/prefill.md)",
    )
    add(
        "--prefill-budget-tokens",
        help="uncached prompt tokens in prefill per engine; 'off' disables (default derived)",
    )
    add(
        "--prefill-rest-ratio",
        type=float,
        help="rest after long prefills, as a share of their time (default 0.5)",
    )
    add("--tokenizer", help="local Hugging Face tokenizer folder for token-in-token-out sessions")
    add("--state-dir", help="folder for durable session records (SQLite); sessions survive a restart")
    add(
        "--shutdown-grace",
        type=float,
        help="seconds in-flight requests get to finish on SIGTERM (default 30)",
    )
    add("--log-level", choices=["debug", "info", "warning", "error"])


def run(args: argparse.Namespace) -> int:
    flags = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    settings = load_settings(flags, args.config)
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    from rolloutgate.sessions.store import StateDirInUse

    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        try:
            runner.run(_serve(settings))
        except StateDirInUse as exc:  # a second gateway on one --state-dir: say so, no traceback
            print(f"rolloutgate serve: {exc}", file=sys.stderr)
            return 2
    return 0


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop where available (the HTTP paths are measured on it), else the default loop."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


# The cyclic collector's first threshold. CPython's default (700 allocations) runs a young-generation
# collection every few requests at load; the gateway makes few reference cycles (tracebacks of handled
# errors, mostly), so collecting 70x less often costs little memory and saves CPU (docs/benchmarks.md).
GC_THRESHOLDS = (50_000, 20, 50)


# glibc's M_MMAP_THRESHOLD, fixed at 128 KiB (its initial value). glibc raises it to the size of each mmap'd
# buffer freed, up to 32 MB: one freed orjson output of a 100K-token prompt (~16 MB of address space for 0.7 MB
# of ids) is enough, and from then on every large transient buffer comes from the heap and stays resident after
# it is freed. Fixed, they go back to the OS when freed (tests/reliability/test_memory_per_request.py).
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 128 * 1024


def keep_large_buffers_returnable() -> None:
    """Fix glibc's mmap threshold (above); a no-op where the C library is not glibc."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    except (OSError, AttributeError):  # not glibc (musl has no mallopt): nothing to fix there
        return


def tune_gc() -> None:
    """After start-up: move everything allocated so far (modules, the app, the engine pool) out of the
    collector's sight (`gc.freeze`: it is never garbage, and each full collection would walk it again), and
    collect young objects less often."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


async def _serve(settings: object) -> None:
    from rolloutgate.server.app import GatewayServer

    server = GatewayServer(settings)  # type: ignore[arg-type]
    url = await server.start()
    tune_gc()
    keep_large_buffers_returnable()
    logging.getLogger("rolloutgate").info("rolloutgate serving on %s", url)
    print(f"rolloutgate serving on {url}", flush=True)
    stop = asyncio.Event()

    def on_signal() -> None:
        # The first SIGTERM/SIGINT starts a graceful shutdown (in-flight requests get `shutdown_grace`);
        # a second one ends the grace period at once.
        if stop.is_set():
            server.hurry()
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    await stop.wait()
    await server.stop()
    print("rolloutgate stopped", flush=True)
