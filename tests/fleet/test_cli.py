"""`rolloutgate fleet`'s flags (fleet/cli.py): every serve flag for every replica; refusals need no Ray."""

from __future__ import annotations

import pytest

from rolloutgate.cli import build_parser, main


def test_the_fleet_takes_the_gateways_flags_and_its_own() -> None:
    args = build_parser(only="fleet").parse_args(
        ["fleet", "--replicas", "3", "--engine", "http://127.0.0.1:30000", "--stall-timeout", "90"]
    )
    assert args.replicas == 3 and args.engines == ["http://127.0.0.1:30000"] and args.stall_timeout == "90"
    assert args.address is None and args.max_restarts == -1


def test_simulated_engines_in_a_replica_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fleet", "--sim", "2"]) == 2
    assert "rolloutgate sim" in capsys.readouterr().err
