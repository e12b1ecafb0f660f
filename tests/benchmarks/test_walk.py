"""benchmarks/walk.py: its three walks run, and the third is a forward with none of the fleet's loops in it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_three_walks_and_the_forward_walk_holds_the_hop_and_no_fleet_loop() -> None:
    # a child process: the tool imports rolloutgate from its sources (compiled modules bypassed), which must not
    # leak into this test session's imports
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.walk", "--list"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    walks = done.stdout.split("\n\n")[0].split("\na ")
    assert [w.partition(":")[0].removeprefix("a ") for w in walks] == [
        "whole /generate",
        "session turn (/sessions/{id}/generate)",
        "fleet forward (replica-0 -> replica-1 /generate)",
    ]
    forward = {line.strip().rpartition(" x")[0] for line in walks[2].splitlines()[1:]}
    for hop in ("edge.py:install.<locals>.fleet_edge", "routing.py:decide", "forward.py:forward"):
        assert f"rolloutgate/fleet/{hop}" in forward
    assert "rolloutgate/server/front.py:_inference.<locals>.handler" in forward  # the owner's walk 1
    # the controller's pings and the replicas' followers of its view are not the request's walk
    assert not [
        f for f in forward if "fleet/controller.py" in f or f.endswith(("FleetReplica.ping", "_follow"))
    ]
