"""A short incident replay (both modes at once, 48 s) and what it must show.

The scenario is the incident scaled down so that it runs in 48 s: 6 agents on 3 simulated SGLang
engines, ~12K-token histories instead of 100K, a client timeout of 30 s instead of 300 s (long turns take ~40 s,
so in wallclock mode they can never finish, as the incident's ~460 s decodes against 300 s), a stall timeout of
25 s, a weight update (25 s) and a freeze. The gateway timeout stays the incident's 600 s. Everything else is the
real thing: LiteLLM with its default retries, the gateway in both clock modes, the simulator's physics.

The time scale is low (x5) so that a busy machine does not distort the run much: the replay measures its own
event-loop stalls, and the one bound that is tight in simulated time (detection within stall_timeout + 10% and
the pause check's 2 s) is
allowed the stall the run measured on top (and, as in the replay's own verdict, the prefill allowance of new
sessions the gateway sent to the engine after it froze).
"""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
import pytest_asyncio

from rolloutgate.config import GatewaySettings
from rolloutreplay.result import ReplayResult
from rolloutreplay.run import run_replay
from rolloutreplay.scenario import ReplayConfig

# LiteLLM leaves a coroutine unawaited when an agent's call is cancelled at the end of the run
pytestmark = pytest.mark.filterwarnings(
    "ignore:coroutine 'OpenAIChatCompletion.acompletion' was never awaited:RuntimeWarning"
)

SHORT = ReplayConfig(
    time_scale=5.0,
    agents=6,
    engines=3,
    duration_s=240.0,
    client_timeout_s=30.0,
    gateway_timeout_s=600.0,
    stall_timeout_s=25.0,
    history_tokens=(10_000, 14_000),
    opening_tokens=(300, 500),
    medium_tokens=(700, 1_300),
    long_tokens=(2_600, 3_000),
    long_share=0.4,
    turns_per_session=3,
    tool_tokens=200,
    reply_kept_tokens=200,
    tool_time_s=(2.0, 5.0),
    start_spread_s=10.0,
    storm_sessions=4,
    storm_tokens=(200, 400),
    storms_at=(0.2, 0.55),
    update_at=0.4,
    freeze_at=0.6,
)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def replayed(tmp_path_factory: pytest.TempPathFactory) -> tuple[ReplayResult, Path]:
    out = Path(tmp_path_factory.mktemp("replay"))
    return await run_replay(SHORT, out, in_process=True, plot=True), out


@pytest.fixture
def replay(replayed: tuple[ReplayResult, Path]) -> ReplayResult:
    return replayed[0]


@pytest.mark.timeout(150)
def test_engine_time_mode_keeps_its_guarantees(replay: ReplayResult) -> None:
    engine, wall = replay.figures["engine"], replay.figures["wallclock"]
    assert engine["spurious_timeouts"] == 0, engine["kills"]
    assert engine["client_visible_failures_progressing"] == 0, engine["failure_errors"]
    assert engine["turns"]["completed"] > 0 and engine["turns"]["by_kind"]["long"]["completed"] > 0
    assert wall["wasted_engine_seconds"] > 0
    assert engine["wasted_engine_seconds"] <= 0.01 * wall["wasted_engine_seconds"], (
        engine["engine_seconds"],
        wall["engine_seconds"],
    )
    detection = engine["detection"]
    # new sessions sent to the engine after it froze legitimately widen its stall window (core/liveness.py);
    # and the run's own event-loop stalls delay every timer
    allowance = detection["prefill_allowance_s"] + engine["loop_stalls"]["max_simulated_s"]
    allowance += GatewaySettings().hang_check_timeout  # the pause check before the verdict (core/liveness.py)
    assert detection["detected_as"] == "quarantined"
    assert detection["detected_after_s"] <= 1.1 * SHORT.stall_timeout_s + allowance, (detection, allowance)
    frozen = engine["frozen_engine_requests"]
    assert frozen["caught"] >= 1
    assert frozen["answered_by_other_engines"] == frozen["caught"] and frozen["failed"] == 0


@pytest.mark.timeout(150)
def test_wallclock_mode_reproduces_the_incident(replay: ReplayResult) -> None:
    wall = replay.figures["wallclock"]
    assert wall["spurious_timeouts"] > 0
    assert wall["client_visible_failures"] > 0
    assert (
        wall["turns"]["by_kind"]["long"]["completed"] == 0
    )  # 40 s of decode never fits in a 30 s read timeout
    # every failed turn is LiteLLM's default chain: 3 attempts, each cut by the client timeout
    assert set(wall["failed_turn_attempts"]) == {"3"}
    assert wall["failed_turn_chain_s_median"] == pytest.approx(3 * SHORT.client_timeout_s, rel=0.15)
    assert wall["generations"] > wall["answers_delivered"]


@pytest.mark.timeout(150)
def test_replay_writes_json_and_figure(replayed: tuple[ReplayResult, Path]) -> None:
    result, out = replayed
    summary = orjson.loads((out / "replay.json").read_bytes())
    assert set(summary["modes"]) == {"engine", "wallclock"}
    assert summary["modes"]["engine"]["spurious_timeouts"] == result.figures["engine"]["spurious_timeouts"]
    claims = {(v["mode"], v["claim"].split(" (")[0]) for v in summary["verdicts"]}
    assert ("engine", "0 spurious timeouts") in claims
    assert ("wallclock", "3-attempt retry chains of about 3 x the client timeout") in claims
    assert (out / "replay.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for mode in ("engine", "wallclock"):
        records = orjson.loads((out / f"records-{mode}.json").read_bytes())
        assert records["generations"] and records["attempts"] and records["turns"]


def test_a_request_moved_off_the_frozen_engine_and_still_running_at_the_end_is_not_lost() -> None:
    from rolloutreplay.measure import GenerationView, _frozen_requests

    def view(request_id: str, engine: int, end_at: float, outcome: str) -> GenerationView:
        return GenerationView(
            record={"engine": engine},
            request_id=request_id,
            attempt=0,
            end_at=end_at,
            engine_seconds=1.0,
            outcome=outcome,
            killed_at=None,
        )

    records = {
        "events": [{"kind": "freeze", "engine": 0, "at": 100.0}],
        "engine_urls": ["http://e0", "http://e1"],
    }
    views = [
        view("done", 0, 200.0, "fault"),  # caught by the freeze, then answered by e1
        view("done", 1, 300.0, "delivered"),
        view("moving", 0, 200.0, "fault"),  # caught, moved to e1, still decoding when the run stopped
        view("moving", 1, 900.0, "in_progress"),
        # caught, moved, its answer recorded a moment after the run's end (make demo, 2026-12-01 23:11)
        view("late", 0, 200.0, "fault"),
        view("late", 1, 900.0, "in_progress"),
    ]
    joined = {
        "ends": {
            "done": {"engine_url": "http://e1", "ok": True},
            "late": {"engine_url": "http://e1", "ok": True},
        },
        "killed_at": {},
        "answered": {"done"},
    }
    frozen = _frozen_requests(views, records, joined)
    assert frozen == {
        "caught": 3,
        "answered": 1,
        "answered_by_other_engines": 1,
        "still_running_elsewhere_at_end": 2,
        "failed": 0,
    }


def generation(rid: str, finished_at: float, finish: str = "length") -> dict[str, object]:
    """A simulated engine's generation record, as sim/ledger.py writes it (the fields the measure reads)."""
    return {"engine": 0, "rid": rid, "started_at": 10.0, "finished_at": finished_at, "finish": finish}


def ended(request_id: str, at: float, *, ok: bool, status: int = 200, client_gone: bool = False) -> tuple:
    """A gateway request's end and the client attempt it answered, ending then (plus `client_gone`)."""
    end = {"request_id": request_id, "at": at, "ok": ok}
    attempt = {"request_id": request_id, "ended_at": at, "status": status, "client_gone": client_gone}
    return end, attempt


def run_of(requests: list[tuple], generations: list[dict[str, object]]) -> dict[str, object]:
    """A run ending at 100 s with these requests (`ended`) and generations, nothing paused or frozen."""
    return {
        "ended_at": 100.0,
        "ends": [end for end, _ in requests],
        "attempts": [attempt for _, attempt in requests],
        "events": [],
        "holds": [],
        "generations": generations,
    }


def test_an_answer_on_its_way_when_the_run_ends_is_in_progress_not_wasted() -> None:
    """A generation the engine finished 2 s before the end, whose answer its client was still reading when the
    run stopped (the make demo run of 2026-12-01 19:31 counted its 528 engine-seconds as wasted)."""
    from rolloutreplay.measure import view_generations

    late, gone = ended("late", 100.1, ok=True), ended("gone", 50.0, ok=True, client_gone=True)
    late[1]["ended_at"], gone[1]["ended_at"] = 100.2, 40.0  # still reading at the end; left before its end
    records = run_of([late, gone], [generation("late-01", 98.0), generation("gone-01", 50.0)])
    views, _ = view_generations(records)
    assert {v.request_id: v.outcome for v in views} == {"late": "in_progress", "gone": "wasted"}


def test_a_partial_sample_is_delivered_and_an_earlier_aborted_attempt_is_wasted() -> None:
    """`--on-stale partial`: the stale request's last attempt, ended by its engine's abort, is the answer its
    client received (a partial sample); an attempt aborted before it (re-queued) was still work for nobody."""
    from rolloutreplay.measure import view_generations

    records = run_of(
        [ended("stale", 41.0, ok=True), ended("cut", 41.0, ok=False, status=504)],
        [
            generation("stale-01", 40.0, "abort"),
            generation("stale-02", 40.0, "abort"),
            generation("cut-01", 40.0, "abort"),
        ],
    )
    views, _ = view_generations(records)
    assert [(v.request_id, v.attempt, v.outcome) for v in views] == [
        ("stale", 1, "wasted"),
        ("stale", 2, "delivered"),
        ("cut", 1, "wasted"),  # aborted and its client answered with an error: nobody got its tokens
    ]
