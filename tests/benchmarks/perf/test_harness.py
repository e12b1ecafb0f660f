"""Smoke tests of the performance benchmark's harness: parsing, summaries, report, and one tiny real load.

No timing assertions: these check that the harness measures and reports, not how fast anything is.
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import pytest

from benchmarks.kit.proc import cpu_seconds, rss_bytes
from benchmarks.kit.servers import start_sim
from benchmarks.perf import dispatch, profile, report
from benchmarks.perf.load import parse_wrk, run_load
from benchmarks.perf.throughput import Cell, request_body, summarize_matrix

WRK_OUTPUT = """Running 5s test @ http://127.0.0.1:4000/generate
  1 threads and 32 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     7.02ms    3.10ms  52.31ms   88.12%
    Req/Sec     4.61k   312.52     5.01k    82.00%
  Latency Distribution
     50%    6.51ms
     75%    7.80ms
     90%    9.12ms
     99%   1.20s
  22950 requests in 5.01s, 9.95MB read
  Socket errors: connect 0, read 0, write 0, timeout 3
  Non-2xx or 3xx responses: 7
Requests/sec:   4580.12
Transfer/sec:      1.99MB
"""


def test_parse_wrk_reads_counts_percentiles_and_failures() -> None:
    result = parse_wrk(WRK_OUTPUT)
    assert result.requests == 22950 - 7
    assert result.seconds == pytest.approx(5.01)
    assert result.failures == 10
    assert result.p50_ms == pytest.approx(6.51)
    assert result.p99_ms == pytest.approx(1200.0)
    assert result.rps == pytest.approx(22943 / 5.01)


def test_profile_summary_counts_self_and_inclusive_time() -> None:
    raw = "\n".join(
        [
            'process 1:"python";main (/x/src/rolloutgate/cli.py:10);handle (/x/src/rolloutgate/server/driver.py:5) 30',
            'process 1:"python";main (/x/src/rolloutgate/cli.py:10);parse (/x/lib/python3.11/json/decoder.py:3) 10',
        ]
    )
    summary = profile.summarize(raw)
    assert summary.samples == 40
    assert summary.self_top[0] == ("handle (rolloutgate/server/driver.py)", 0.75)
    assert ("main (rolloutgate/cli.py)", 1.0) in summary.inclusive_top
    assert "| 75.0 | `handle (rolloutgate/server/driver.py)` |" in summary.render("t")


def test_dispatch_cost_is_measured_with_the_queue_full() -> None:
    cost = dispatch.measure_dispatch(50, engines=2, capacity=2, samples=20)
    assert cost.queued == 50 and cost.dispatch_us > 0 and cost.enqueue_us > 0
    sessions = dispatch.measure_dispatch(50, engines=2, capacity=2, samples=20, sessions=True)
    assert sessions.shape == "sessions" and sessions.dispatch_us > 0


def _cell(target: str, rps: float, round_index: int, cpu_s: float = 1.0) -> Cell:
    load = parse_wrk(WRK_OUTPUT.replace("22950 requests in 5.01s", f"{int(rps * 5)} requests in 5.00s"))
    return Cell(round=round_index, target=target, streaming=False, connections=32, load=load, cpu_s=cpu_s)


def test_matrix_summary_takes_medians_and_per_round_ratios() -> None:
    cells = [
        _cell("rolloutgate", 1000, 0),
        _cell("sglang-router", 2000, 0),
        _cell("rolloutgate", 3000, 1),
        _cell("sglang-router", 2000, 1),
        _cell("smg", 4000, 0),
        _cell("smg", 1000, 1),
    ]
    rows = {row["target"]: row for row in summarize_matrix(cells)}
    assert rows["rolloutgate"]["ratio_to"]["sglang-router"] == pytest.approx(1.0)  # median of 0.5 and 1.5
    assert rows["rolloutgate"]["ratio_to"]["smg"] == pytest.approx(1.625, rel=0.01)  # median of 0.25 and 3.0
    requests = (1000 * 5 - 7) + (3000 * 5 - 7)
    assert rows["rolloutgate"]["cpu_s_per_1k_requests"] == pytest.approx(2000 / requests)


def test_report_renders_goals_and_doc_block_is_replaced(tmp_path: Path) -> None:
    rows = summarize_matrix(
        [_cell("rolloutgate", 1000, 0), _cell("sglang-router", 2000, 0), _cell("smg", 800, 0)]
    )
    results = {
        "meta": {
            "command": "rolloutgate bench",
            "started": "now",
            "elapsed_s": 1.0,
            "machine": {
                "nproc": 2,
                "cpu_model": "cpu",
                "memory_gib": 1.0,
                "kernel": "k",
                "python": "3.11",
                "load_average_at_start": [0.0, 0.0, 0.0],
            },
            "generator": "wrk",
            "pinning": "none",
        },
        "throughput": {
            "output_tokens": 16,
            "duration_s": 5,
            "rounds": 1,
            "gateway_args": [],
            "rows": rows,
        },
        "dispatch": [
            {"shape": "fifo", "queued": 100, "dispatch_us": 30.0, "dispatch_p99_us": 50.0, "enqueue_us": 7.0},
            {
                "shape": "fifo",
                "queued": 10000,
                "dispatch_us": 36.0,
                "dispatch_p99_us": 60.0,
                "enqueue_us": 8.0,
            },
        ],
    }
    text = report.render(results)
    assert "| req/s at 32 connections >= sglang-router's (non-streaming) | ratio 0.50 | NOT met |" in text
    assert "| req/s at 32 connections >= smg's (non-streaming) | ratio 1.25 | met |" in text
    assert "O(log n)" in text and "| met |" in text
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nhand-written intro\n")
    report.update_doc(doc, "first")
    report.update_doc(doc, "second")
    page = doc.read_text()
    assert "hand-written intro" in page and "second" in page and "first" not in page
    assert page.count(report.BEGIN) == 1


@pytest.mark.timeout(60)
def test_a_tiny_real_load_against_the_simulator() -> None:
    sim = start_sim(None)
    try:
        before = cpu_seconds(sim.pid)
        for use_wrk in (False, True) if shutil.which("wrk") else (False,):
            for streaming in (False, True):
                result = run_load(
                    sim.url + "/generate",
                    request_body(streaming),
                    connections=2,
                    duration_s=1,
                    cpus=None,
                    use_wrk=use_wrk,
                )
                assert result.requests > 0 and result.failures == 0, result
                assert not math.isnan(result.p50_ms)
        assert cpu_seconds(sim.pid) > before
        assert rss_bytes(sim.pid) > 1_000_000
        assert rss_bytes(os.getpid()) > 0
    finally:
        sim.stop()
