"""The /proc probes: what a benchmark reads about the processes it started and the machine it runs on.

Theory of operation: every reading is of one process tree (a pid and its live descendants: a launcher may run
the server as a child) or of the whole machine, read from Linux's /proc at the moment of the call; the caller
takes differences. Nothing here starts, stops or pins a process (servers.py does). A process that ends between
listing and reading is skipped; a file that cannot be read gives nothing (an empty dict, 0), never an error.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterable

__all__ = (
    "cpu_busy_s",
    "cpu_count",
    "cpu_seconds",
    "io_counters",
    "machine_description",
    "process_tree",
    "rss_bytes",
)


def cpu_count() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _stat_fields(pid: int) -> list[str]:
    """/proc/<pid>/stat after the command name (which may hold spaces): field 3 of proc(5) is index 0."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (read from /proc; a launcher may run the server as a child)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            parent = int(_stat_fields(int(entry))[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo.extend(children.get(current, ()))
    return tree


def cpu_seconds(pid: int, *, tree: bool = True) -> float:
    """User + system CPU seconds of `pid` and (with `tree`) its live descendants."""
    total = 0
    for member in process_tree(pid) if tree else [pid]:
        try:
            fields = _stat_fields(member)
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int:
    """Resident memory of `pid` and its live descendants (VmRSS from /proc/<pid>/status)."""
    total = 0
    for member in process_tree(pid):
        try:
            with open(f"/proc/{member}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
                        break
        except OSError:
            continue
    return total


def io_counters(pid: int) -> dict[str, int]:
    """/proc/<pid>/io (rchar, wchar, syscr, syscw, ...); empty where it cannot be read."""
    out: dict[str, int] = {}
    with contextlib.suppress(OSError), open(f"/proc/{pid}/io") as f:
        for line in f:
            key, _, value = line.partition(":")
            out[key.strip()] = int(value)
    return out


def cpu_busy_s(cpus: Iterable[int] | None = None) -> dict[int, float]:
    """Busy seconds so far of each CPU (/proc/stat: all but idle and iowait), to tell the neighbours' share."""
    out: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    with contextlib.suppress(OSError), open("/proc/stat") as f:
        for line in f:
            head, *values = line.split()
            if not head.startswith("cpu") or head == "cpu":
                continue
            index = int(head[3:])
            if cpus is not None and index not in cpus:
                continue
            numbers = [int(v) for v in values[:8]]
            out[index] = (sum(numbers) - numbers[3] - numbers[4]) / tick
    return out


def _first_field(path: str, prefix: str) -> str | None:
    with contextlib.suppress(OSError), open(path) as f:
        for line in f:
            if line.startswith(prefix):
                return line
    return None


def machine_description() -> dict[str, object]:
    """The machine a run was measured on (CPUs, model, memory, load, Python, kernel), for its report."""
    model_line = _first_field("/proc/cpuinfo", "model name")
    mem_line = _first_field("/proc/meminfo", "MemTotal:")
    mem_kb = int(mem_line.split()[1]) if mem_line else 0
    load = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
    return {
        "nproc": cpu_count(),
        "cpu_model": model_line.split(":", 1)[1].strip() if model_line else "unknown",
        "memory_gib": round(mem_kb / 1024**2, 1),
        "load_average_at_start": [round(x, 2) for x in load],
        "python": sys.version.split()[0],
        "kernel": os.uname().release,
    }
