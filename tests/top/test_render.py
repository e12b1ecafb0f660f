"""The screen `rolloutgate top` draws, read as text as a person reads it."""

from __future__ import annotations

import io

from rich.console import Console

from rolloutgate.top.render import render
from rolloutgate.top.snapshot import GatewaySnapshot
from rolloutgate.top.view import build_view
from tests.top.helpers import engine, snapshot, unreachable


def screen(history: list[list[GatewaySnapshot]]) -> str:
    console = Console(width=160, record=True, file=io.StringIO())
    console.print(render(build_view(history), title="rolloutgate top  http://gw"))
    return console.export_text()


def line_of(text: str, needle: str) -> str:
    return next(line for line in text.splitlines() if needle in line)


def test_each_engine_is_a_row_with_its_state_load_and_silence() -> None:
    engines = [
        engine("engine-0", running=3, queued=1, generated_tokens=0),
        engine("engine-1", running=2, silent_s=30.0, hung_after_s=60.0, generated_tokens=0),
        engine("engine-2", state="quarantined", quarantined=True, healthy=False, generated_tokens=0),
        engine("engine-3", prefilling=True, running=1, generated_tokens=0),
    ]
    later = [dict(e) for e in engines]
    later[0]["generated_tokens"] = 200
    text = screen([[snapshot(0.0, engines)], [snapshot(2.0, later, wasted={"stall": 42.0})]])
    assert line_of(text, "engine-0").split()[:6] == ["engine-0", "healthy", "3/8", "1", "100", "-"]
    assert "hung" in line_of(text, "engine-1") and "30s/60s" in line_of(text, "engine-1")
    assert "quarantined" in line_of(text, "engine-2")
    assert "prefilling" in line_of(text, "engine-3") and "long" in line_of(text, "engine-3")
    assert "wasted engine-s 42 (21.0/s) stall 42" in text
    assert "in flight 6/32" in text


def test_figures_not_known_yet_are_dashes() -> None:
    text = screen([[snapshot(0.0)]])
    assert "timeouts -  stalls -  quarantines -" in text
    assert "wasted engine-s -" in text
    assert "clocks of 0 requests finished since start: -" in text


def test_the_clocks_split_is_shown_in_shares_of_wall_time() -> None:
    before = {c: (0, 0.0) for c in ("wall", "queue", "paused", "contention", "charged")}
    after = {"wall": (4, 40.0), "queue": (4, 4.0), "paused": (4, 0.0), "contention": (4, 8.0)}
    after["charged"] = (4, 28.0)
    text = screen([[snapshot(0.0, clocks=before)], [snapshot(30.0, clocks=after)]])
    assert (
        "clocks of 4 requests finished in the last 30 s: queue 10%  paused 0%  contention 20%  charged 70%"
        in text
    )


def test_an_unreachable_gateway_says_why() -> None:
    text = screen([[unreachable(0.0)]])
    assert "gateway http://gw  unreachable: connection refused" in text
