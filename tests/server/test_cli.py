"""`rolloutgate serve` flags (server/cli.py): one per setting, read by pydantic exactly as the environment is."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

import rolloutgate.server.app  # noqa: F401  (loaded, as in the gateway's process: describe_build() reads it)
from rolloutgate.cli import build_parser
from rolloutgate.compiled import describe_build
from rolloutgate.config import GatewaySettings, load_settings
from rolloutgate.server import cli


def _settings(*argv: str) -> GatewaySettings:
    args = build_parser(only="serve").parse_args(["serve", *argv])
    return load_settings({k: v for k, v in vars(args).items() if k not in ("command", "config")})


def test_every_setting_has_a_flag_with_its_description() -> None:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    dests = {action.dest: action for action in parser._actions}
    for name, field in GatewaySettings.model_fields.items():
        assert name in dests, f"setting {name} has no flag"
        assert field.description and field.description in str(dests[name].help)


def test_flags_reach_the_settings_and_absent_ones_keep_their_defaults() -> None:
    settings = _settings(
        "--engine", "http://10.0.0.1:30000", "--engine", "vllm+http://10.0.0.2:8000",
        "--trust-network", "10.0.0.0/8",
        "--session-idle-ttl", "7200", "--session-max", "50000",
        "--queue-timeout", "120", "--no-keepalive-non-streaming", "--prefill-budget-tokens", "off",
    )  # fmt: skip
    assert [(e.url, e.family) for e in settings.engines] == [
        ("http://10.0.0.1:30000", "auto"),
        ("http://10.0.0.2:8000", "vllm"),
    ]
    assert settings.trusted_networks == ["10.0.0.0/8"]
    assert (settings.session_idle_ttl, settings.session_max) == (7200.0, 50000)
    assert settings.queue_timeout == 120.0 and settings.keepalive_non_streaming is False
    assert settings.prefill_budget_tokens == 0
    assert settings.timeout == GatewaySettings().timeout  # not given: the default


def test_none_clears_an_optional_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLOUTGATE_QUEUE_TIMEOUT", "30")
    assert _settings().queue_timeout == 30.0  # the environment, with no flag
    assert _settings("--queue-timeout", "none").queue_timeout is None  # the flag wins, and clears it


def test_a_bad_value_is_refused_with_the_setting_named(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser(only="serve").parse_args(["serve", "--session-idle-ttl", "-5"])
    assert cli.run(args) == 2
    assert "session_idle_ttl" in capsys.readouterr().err


def test_docs_list_every_setting_as_the_settings_say() -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "gateway.md").read_text()
    listed = text.split("<!-- settings:begin -->\n", 1)[1].split("<!-- settings:end -->", 1)[0]
    assert listed == cli.settings_table(), "docs/gateway.md's settings table is stale: paste settings_table()"


def test_serve_says_where_it_listens_as_the_harnesses_read_it_and_which_modules_run_compiled() -> None:
    """The e2e and bench harnesses find the gateway's URL in `rolloutgate serving on URL` (a build note once
    glued to that line read as the port `39547;`). The gateway serves before its engine answers."""
    command = [sys.executable, "-m", "rolloutgate", "serve", "--host", "127.0.0.1", "--port", "0"]
    command += ["--engine", "sglang+http://127.0.0.1:1", "--log-level", "info"]
    gateway = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines: list[str] = []
    try:
        assert gateway.stderr is not None
        for (
            line
        ) in gateway.stderr:  # bounded: the gateway logs its URL within seconds, or the timeout ends it
            lines.append(line)
            if "modules " in line and any("serving on" in seen for seen in lines):
                break
    finally:
        gateway.terminate()
        gateway.wait(timeout=30)
    served = [m for line in lines if (m := re.search(r"rolloutgate serving on (http://\S+)", line))]
    assert served and re.fullmatch(r"http://127\.0\.0\.1:\d+", served[0].group(1)), lines
    assert any(f"modules {describe_build()}" in line for line in lines), lines
