"""A trace as the replay's workload (rolloutreplay/trace_workload.py), on small hand-written traces."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from rolloutreplay.scenario import ReplayConfig
from rolloutreplay.trace_workload import TraceError, TraceWorkload, read_trace, trace_config

E0, E1 = "http://127.0.0.1:1", "http://127.0.0.1:2"
HEADER = {
    "rolloutgate_trace": 2,
    "clock": "engine",
    "settings": {
        "timeout": 600.0,
        "stall_timeout": 60.0,
        "hang_check_timeout": 2.0,
        "health_interval": 5.0,
        "health_failures": 3,
        "warmup_timeout": 240.0,
    },
    "engines": [E0, E1],
}
CONFIG = ReplayConfig(client_timeout_s=300.0, reply_kept_tokens=1_000)


def request(
    at: float, end: float, session: str | None, prompt: int, max_tokens: int, **extra: Any
) -> dict[str, Any]:
    line = {
        "type": "request",
        "id": f"r{at:g}",
        "at": at,
        "end": end,
        "session": session,
        "user": None,
        "prompt_tokens": prompt,
        "max_tokens": max_tokens,
        "outcome": "ok",
        "client_left": False,
        "output_tokens": max_tokens,
        "timing": {"charged_s": max_tokens / 50.0},
    }
    return line | extra


def write(path: Path, lines: list[dict[str, Any]], header: dict[str, Any] = HEADER) -> Path:
    path.write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in [header, *lines]))
    return path


def test_a_session_replays_its_turns_closed_loop_with_their_gaps_and_prompt_growth(tmp_path: Path) -> None:
    trace = write(
        tmp_path / "t.jsonl",
        [
            request(10.0, 100.0, "s", 100_015, 3_000, user="a"),
            # 8 s of tool time; the prompt grew by 2,000 tokens: 1,000 kept of the answer, 1,000 of tool result
            request(108.0, 600.0, "s", 102_015, 24_000, user="a"),  # 480 s at 50 tok/s: past 300 s
            request(605.0, 800.0, "s", 104_015, 9_000, user="a"),
            # the same user's next session, 20 s after the last answer
            request(820.0, 900.0, "s2", 95_015, 2_000, user="a"),
        ],
    )
    workload = TraceWorkload.read(trace, CONFIG)
    [(_, agent)] = workload.agents()
    assert agent.start_s == 10.0 and len(agent.sessions) == 2
    first, second = agent.next_session(), agent.next_session()
    assert first.history_tokens == 100_000 and second.history_tokens == 95_000
    assert [(t.kind, t.max_tokens, t.tool_time_s, t.tool_tokens) for t in first.turns] == [
        ("opening", 3_000, 8.0, 1_000),
        ("long", 24_000, 5.0, 1_000),
        ("medium", 9_000, 20.0, 0),  # the gap before the user's next session
    ]
    assert workload.events() == []


def test_a_clients_retries_of_a_turn_are_one_turn_and_sessions_without_a_user_start_on_their_own(
    tmp_path: Path,
) -> None:
    trace = write(
        tmp_path / "t.jsonl",
        [
            request(0.0, 300.0, "s", 1_000, 20_000, outcome="ok", client_left=True),
            request(301.0, 601.0, "s", 1_000, 20_000, outcome="timeout"),
            request(602.0, 900.0, "s", 1_000, 20_000, outcome="ok"),
            request(50.0, 60.0, None, 500, 100),
        ],
    )
    agents = dict(TraceWorkload.read(trace, CONFIG).agents())
    assert len(agents) == 2
    [session] = agents["t000"].sessions
    assert [t.max_tokens for t in session.turns] == [20_000]  # three attempts, one turn
    assert agents["t001"].start_s == 50.0


def test_storms_updates_and_an_engine_lost_for_good_become_the_replays_events(tmp_path: Path) -> None:
    storm = [request(500.0 + 0.1 * i, 560.0, f"storm{i}", 100_000, 1_000) for i in range(2)]
    trace = write(
        tmp_path / "t.jsonl",
        [
            request(0.0, 100.0, "a", 100_000, 2_000),
            *storm,
            {"type": "gate", "at": 700.0, "state": "closed", "mode": "in_place"},
            {"type": "gate", "at": 725.0, "state": "open"},
            {"type": "engine", "at": 800.0, "engine": E0, "state": "unhealthy"},  # a blip: it came back
            {"type": "engine", "at": 810.0, "engine": E0, "state": "healthy"},
            {"type": "engine", "at": 1_000.0, "engine": E1, "state": "quarantined"},
            {"type": "engine", "at": 1_010.0, "engine": E1, "state": "unhealthy"},
        ],
    )
    workload = TraceWorkload.read(trace, CONFIG)
    assert [(e.kind, e.at_s, e.detail.get("engine")) for e in workload.events()] == [
        ("storm", 500.0, None),
        ("update", 700.0, None),
        ("freeze", 940.0, 1),  # quarantined: it froze stall_timeout before (the pause check asked within it)
    ]
    lines = [orjson.loads(line) for line in trace.read_bytes().splitlines()]
    old = write(tmp_path / "v1.jsonl", lines[1:], header=HEADER | {"rolloutgate_trace": 1})
    # a version 1 trace's gateway asked the pause check after the stall window: the freeze was 2 s earlier
    assert [e.at_s for e in TraceWorkload.read(old, CONFIG).events() if e.kind == "freeze"] == [938.0]
    storm_event = workload.events()[0]
    assert storm_event.detail["sessions"] == 0 and storm_event.detail["traced_sessions"] == 2
    kinds = {name: agent.sessions[0].turns[0].kind for name, agent in workload.agents()}
    assert sorted(kinds.values()) == ["opening", "storm", "storm"]


def test_the_replays_configuration_comes_from_the_trace_and_the_settings_given(tmp_path: Path) -> None:
    trace = write(tmp_path / "t.jsonl", [request(0.0, 1_234.5, "s", 1_000, 100)])
    config = trace_config(trace, stall_timeout_s=45.0, time_scale=10.0)
    assert (config.engines, config.duration_s, config.agents) == (2, 1_234.5, 1)
    assert (config.gateway_timeout_s, config.stall_timeout_s, config.time_scale) == (600.0, 45.0, 10.0)
    assert config.gateway_settings == (("warmup_timeout", "240"),)  # as the trace's gateway had it
    assert config.trace == str(trace)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "empty"),
        (b'{"type": "request"}\n', "no header line"),
        (b'{"rolloutgate_trace": 3}\n', "trace version 3"),
        (b'{"rolloutgate_trace": 1}\n{"type": "request", "at": 1}\n', ":2: a request line needs"),
        (b'{"rolloutgate_trace": 1}\nnot json\n', ":2: not JSON"),
    ],
)
def test_a_file_that_is_not_a_trace_is_refused_with_its_line(
    tmp_path: Path, content: bytes, message: str
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    with pytest.raises(TraceError, match=message):
        read_trace(path)
