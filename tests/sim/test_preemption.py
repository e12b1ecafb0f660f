"""Preemption under KV pressure (`kv_preemption`): the engine model's physics, driven in simulated time."""

from __future__ import annotations

from typing import Any

import pytest

from rolloutsim.engine_model import EngineModel
from rolloutsim.metrics import render_sglang, render_vllm
from rolloutsim.profiles import SimEngineConfig, decode_step_s, make_config, prefill_chunk_s
from rolloutsim.request import RequestState, SimRequest


def req(rid: str, prompt_len: int, max_new: int, *, start: int = 3) -> SimRequest:
    return SimRequest(rid, list(range(start, start + prompt_len)), max_new_tokens=max_new)


def config(**overrides: Any) -> SimEngineConfig:
    base: dict[str, Any] = {
        "kv_capacity_tokens": 300,
        "kv_preemption": True,
        "enable_prefix_cache": False,
        "record_token_times": True,
    }
    base.update(overrides)
    return make_config("default", **base)


def run(model: EngineModel, *reqs: SimRequest, capacity: int | None = None) -> list[float]:
    """Advance event by event until every request finished; checks the KV use at every event."""
    now = 0.0
    seen = []
    while not all(r.is_finished for r in reqs):
        now = model.next_event_at()
        assert now < 1_000.0, f"stuck: {model!r}"
        model.advance(now)
        seen.append(now)
        if capacity is not None:
            assert model.kv_used_tokens <= capacity
    return seen


def test_a_request_is_preempted_when_kv_is_full_readmitted_and_reprefills_prompt_and_output() -> None:
    cfg = config()
    model = EngineModel(cfg)
    a = req("a", 100, 150)
    b = req("b", 100, 150, start=1000)
    model.submit(a, 0.0)
    model.submit(b, 0.0)
    run(model, a, b, capacity=300)
    # both decode until their 2 x (100 + 50) tokens fill the 300: the next step does not fit, and the newest
    # admitted (b) goes back to the queue; a runs alone to its end, then b is prefilled again and finishes
    assert a.num_retractions == 0
    assert b.num_retractions == 1
    assert model.stats.preempted_total == 1
    assert model.stats.retracted_total == 1
    for r in (a, b):
        assert r.finish is not None and r.finish.kind == "length"
        assert r.completion_tokens == 150
        assert r.token_times is not None and len(r.token_times) == 150
        assert r.token_times == sorted(r.token_times)
    assert b.token_times is not None and a.finished_at is not None
    # b had 50 tokens when preempted; its 51st comes after a's end plus a prefill of prompt + output (150 tokens)
    assert b.token_times[49] < a.finished_at
    reprefill = prefill_chunk_s(cfg, 0, 150)
    assert b.token_times[50] == pytest.approx(a.finished_at + reprefill)
    # it waited: its 51st token did not come one decode step after its 50th
    assert b.token_times[50] - b.token_times[49] > 10 * decode_step_s(cfg, 1, 250)
    assert model.kv_used_tokens == 0


def test_the_preemption_counter_is_in_both_flavours_metrics() -> None:
    model = EngineModel(config())
    a, b = req("a", 100, 150), req("b", 100, 150, start=1000)
    model.submit(a, 0.0)
    model.submit(b, 0.0)
    now = run(model, a, b)[-1]
    sglang = render_sglang(model, now)
    assert any(
        line.startswith("sglang:num_retracted_requests_total{") and line.endswith(" 1")
        for line in sglang.splitlines()
    )
    assert any(
        line.startswith("sim:num_preemptions_total{") and line.endswith(" 1") for line in sglang.splitlines()
    )
    vllm = render_vllm(EngineModel(config()), 0.0)
    assert any(line.startswith("vllm:num_preemptions_total{") for line in vllm.splitlines())
    assert any(line.startswith("sim:num_preemptions_total{") for line in vllm.splitlines())


def test_off_by_default_running_requests_grow_past_the_capacity() -> None:
    model = EngineModel(config(kv_preemption=False))
    assert make_config("default").kv_preemption is False
    a, b = req("a", 100, 150), req("b", 100, 150, start=1000)
    model.submit(a, 0.0)
    model.submit(b, 0.0)
    peak = 0
    while not (a.is_finished and b.is_finished):
        model.advance(model.next_event_at())
        peak = max(peak, model.kv_used_tokens)
    assert peak > 300
    assert a.num_retractions == b.num_retractions == 0
    assert model.stats.preempted_total == 0


def test_a_waiting_request_is_admitted_only_when_its_kv_fits_beside_the_next_decode_step() -> None:
    model = EngineModel(config(kv_capacity_tokens=400))
    a = req("a", 100, 20)
    model.submit(a, 0.0)
    model.advance(0.05)
    assert a.state is RequestState.RUNNING
    # the step in flight gives a one more token; then c would fill the 400 exactly, leaving no room for a's
    # next token: it waits (without the reserve it would be admitted)
    c = req("c", 400 - (model.kv_used_tokens + 1), 10, start=2000)
    model.submit(c, 0.05)
    model.advance(0.1)
    assert c.state is RequestState.WAITING
    assert a.state is RequestState.RUNNING
    run(model, a, c, capacity=400)
    assert c.started_at is not None and a.finished_at is not None
    assert c.started_at >= a.finished_at - 1e-9
    assert model.stats.preempted_total == 0
    assert c.completion_tokens == 10


def test_mixed_mode_preempts_the_newest_admits_nobody_that_step_and_everything_finishes() -> None:
    cfg = config(kv_capacity_tokens=500)
    model = EngineModel(cfg, api="vllm")
    assert model.mode == "mixed"
    reqs = [req(f"r{i}", 100, 120, start=1000 * i + 3) for i in range(4)]
    for r in reqs:
        model.submit(r, 0.0)
    run(model, *reqs, capacity=500)
    assert model.stats.preempted_total >= 1
    assert reqs[0].num_retractions == 0  # the oldest is never the one preempted
    assert sum(r.num_retractions for r in reqs) == model.stats.preempted_total
    for r in reqs:
        assert r.finish is not None and r.finish.kind == "length"
        assert r.completion_tokens == 120
        assert r.token_times is not None and len(r.token_times) == 120


def test_a_preempted_request_reprefills_from_the_prefix_cache_where_its_blocks_survive() -> None:
    cfg = config(enable_prefix_cache=True, kv_capacity_tokens=300)
    model = EngineModel(cfg)
    a, b = req("a", 96, 150), req("b", 96, 150, start=1000)
    model.submit(a, 0.0)
    model.submit(b, 0.0)
    run(model, a, b, capacity=300)
    assert b.num_retractions == 1
    assert b.completion_tokens == 150 and a.completion_tokens == 150
    assert b.token_times is not None and a.finished_at is not None
    # re-prefill no dearer than the whole prompt + output, and at least one token computed
    gap = next(t for t in b.token_times if t > a.finished_at) - a.finished_at
    assert 0 < gap <= prefill_chunk_s(cfg, 0, 96 + 54) + 1e-9
