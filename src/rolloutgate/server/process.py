"""What a serving process sets up once: its event loop, its garbage collector, its allocator (`rolloutgate
serve`, and each process of `--processes N`, fleet/processes.py)."""

from __future__ import annotations

import asyncio
import ctypes
import gc
import signal
import sys
from collections.abc import Callable

__all__ = ("event_loop_factory", "keep_large_buffers_returnable", "tune_gc", "until_stop_signal")


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


async def until_stop_signal(
    on_again: Callable[[], None], signals: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM)
) -> None:
    """Returns at the first of `signals` (a graceful shutdown starts); each one after calls `on_again` (cut the
    grace short)."""
    stop = asyncio.Event()

    def on_signal() -> None:
        if stop.is_set():
            on_again()
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in signals:
        loop.add_signal_handler(sig, on_signal)
    await stop.wait()
