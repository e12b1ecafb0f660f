"""The /proc probes (benchmarks/kit/proc.py), read on this test's own process and a child of it."""

from __future__ import annotations

import os
import subprocess
import sys

from benchmarks.kit.proc import (
    cpu_busy_s,
    cpu_count,
    cpu_seconds,
    io_counters,
    machine_description,
    process_tree,
    rss_bytes,
)


def test_a_process_tree_holds_its_children_and_their_cpu_and_memory() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in process_tree(os.getpid()) and process_tree(child.pid) == [child.pid]
        assert rss_bytes(os.getpid()) > rss_bytes(os.getpid()) - rss_bytes(child.pid) > 0
        assert cpu_seconds(os.getpid()) >= cpu_seconds(os.getpid(), tree=False) > 0
    finally:
        child.kill()
        child.wait()


def test_io_cpu_and_machine_readings() -> None:
    assert io_counters(os.getpid()).get("wchar", 0) >= 0
    assert io_counters(-1) == {}  # no such process: nothing, never an error
    busy = cpu_busy_s()
    assert busy and all(seconds >= 0 for seconds in busy.values())
    assert set(cpu_busy_s([min(busy)])) == {min(busy)}
    machine = machine_description()
    assert machine["nproc"] == cpu_count() >= 1 and machine["python"] == sys.version.split()[0]
