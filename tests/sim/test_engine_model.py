"""The engine model's physics, driven directly in simulated time (no asyncio, no sockets)."""

from __future__ import annotations

import math

import pytest

from rolloutsim.engine_model import EngineModel
from rolloutsim.faults import Fault
from rolloutsim.profiles import SimEngineConfig, decode_step_s, make_config, prefill_chunk_s
from rolloutsim.request import RequestState, SimRequest
from rolloutsim.tokens import EOS_TOKEN_ID


def req(rid: str, prompt_len: int = 10, max_new: int = 100, *, start: int = 3, **kw: object) -> SimRequest:
    return SimRequest(rid, list(range(start, start + prompt_len)), max_new_tokens=max_new, **kw)  # type: ignore[arg-type]


def run_until_finished(model: EngineModel, *reqs: SimRequest, limit_s: float = 10_000.0) -> float:
    """Advance event by event until every request finished; returns the time."""
    now = 0.0
    while not all(r.is_finished for r in reqs):
        now = model.next_event_at()
        assert now < limit_s, f"stuck: {model!r}"
        model.advance(now)
    return now


def tokens_between(r: SimRequest, start_at: float, end_at: float) -> int:
    assert r.token_times is not None
    return sum(1 for t in r.token_times if start_at < t <= end_at)


# ------------------------------------------------------------------------------------------ incident


def test_incident_lone_request_decodes_at_about_70_tokens_per_second() -> None:
    config = make_config("incident", record_token_times=True)
    model = EngineModel(config)
    a = req("a", prompt_len=2000, max_new=1000)
    model.submit(a, 0.0)
    end = run_until_finished(model, a)
    assert a.first_token_at is not None
    rate = (a.completion_tokens - 1) / (end - a.first_token_at)
    assert 66 <= rate <= 74
    # and it is exactly what the profile's step formula says for this context
    expected = 1 / decode_step_s(config, 1, 2000 + 500)
    assert rate == pytest.approx(expected, rel=0.01)


def test_incident_100k_prefill_takes_30_to_40_s_and_starves_the_running_request_to_3_to_8_tok_s() -> None:
    model = EngineModel(make_config("incident", record_token_times=True))
    a = req("a", prompt_len=1000, max_new=20_000)
    model.submit(a, 0.0)
    model.advance(5.0)
    b = req("b", prompt_len=100_000, max_new=1, start=50_000)
    model.submit(b, 5.0)
    run_until_finished(model, b)
    assert b.first_token_at is not None
    prefill_s = b.first_token_at - 5.0
    assert 30.0 <= prefill_s <= 40.0
    during = tokens_between(a, 5.0, b.first_token_at) / prefill_s
    assert 3.0 <= during <= 8.0
    # the trickle is fastest while the context is short and slowest at the end
    first = tokens_between(a, 5.0, 10.0) / 5.0
    last = tokens_between(a, b.first_token_at - 5.0, b.first_token_at) / 5.0
    assert 7.0 <= first <= 8.5
    assert 3.5 <= last <= 4.5
    # afterwards a is back to full speed
    model.advance(b.first_token_at + 10.0)
    assert tokens_between(a, b.first_token_at + 1, b.first_token_at + 10) / 9 > 60


def test_strict_prefill_first_gives_running_requests_no_tokens_during_a_prefill() -> None:
    config = make_config("default", prefill_decode_interval=0, record_token_times=True)
    model = EngineModel(config)
    a = req("a", max_new=5000)
    model.submit(a, 0.0)
    model.advance(1.0)
    b = req("b", prompt_len=5000, max_new=1, start=1000)
    model.submit(b, 1.0)
    run_until_finished(model, b)
    assert b.first_token_at is not None
    expected = sum(prefill_chunk_s(config, s, 256) for s in range(0, 4864, 256)) + prefill_chunk_s(
        config, 4864, 136
    )
    assert b.first_token_at - 1.0 == pytest.approx(expected + 0.0, abs=0.02)
    assert tokens_between(a, 1.02, b.first_token_at) == 0


def test_mixed_prefill_keeps_decoding_during_a_prefill() -> None:
    config = make_config("default", prefill_mode="mixed", record_token_times=True)
    model = EngineModel(config, api="vllm")
    a = req("a", max_new=5000)
    model.submit(a, 0.0)
    model.advance(1.0)
    b = req("b", prompt_len=5000, max_new=1, start=1000)
    model.submit(b, 1.0)
    run_until_finished(model, b)
    assert b.first_token_at is not None
    steps = tokens_between(a, 1.0, b.first_token_at)
    # every step decodes a and prefills (budget - 1) tokens of b (+1: the step in flight at submission)
    assert steps in (math.ceil(5000 / (config.chunked_prefill_size - 1)) + d for d in (0, 1))


# ------------------------------------------------------------------------------------------ batching


def test_continuous_batching_admits_at_most_max_running_and_keeps_fcfs_order() -> None:
    model = EngineModel(make_config("default", max_running_requests=2))
    reqs = [req(f"r{i}", max_new=50) for i in range(4)]
    for r in reqs:
        model.submit(r, 0.0)
    model.advance(0.01)
    assert model.running_count == 2
    assert model.waiting_count == 2
    assert [r.state for r in reqs[2:]] == [RequestState.WAITING, RequestState.WAITING]
    run_until_finished(model, *reqs)
    starts = [r.started_at for r in reqs]
    assert starts == sorted(starts)
    assert reqs[2].started_at == pytest.approx(reqs[0].finished_at)


def test_a_decode_step_gets_slower_with_batch_size() -> None:
    config = make_config("default")
    lone = EngineModel(config)
    one = req("x", max_new=200)
    lone.submit(one, 0.0)
    lone_end = run_until_finished(lone, one)
    busy = EngineModel(config)
    many = [req(f"y{i}", max_new=200) for i in range(8)]
    for r in many:
        busy.submit(r, 0.0)
    busy_end = run_until_finished(busy, *many)
    assert busy_end > lone_end * 1.4


def test_bursts_give_the_same_result_as_single_steps() -> None:
    config = make_config("incident")
    fine, coarse = EngineModel(config), EngineModel(config)
    a1, a2 = req("a", max_new=3000), req("a", max_new=3000)
    fine.submit(a1, 0.0)
    coarse.submit(a2, 0.0)
    t = 0.0
    while t < 20.0:
        t += 0.001
        fine.advance(t)
    coarse.advance(20.0)
    assert a1.completion_tokens == a2.completion_tokens
    assert fine.next_event_at() == pytest.approx(coarse.next_event_at())


# ------------------------------------------------------------------------------------------ prefix cache


def test_next_turn_on_the_same_engine_prefills_only_the_new_tokens() -> None:
    config = make_config("default")
    warm = EngineModel(config)
    turn1 = req("t1", prompt_len=4000, max_new=50)
    warm.submit(turn1, 0.0)
    end1 = run_until_finished(warm, turn1)
    history = list(range(3, 4003)) + turn1.output_ids() + list(range(9000, 9100))
    turn2 = SimRequest("t2", history, max_new_tokens=1)
    warm.submit(turn2, end1)
    run_until_finished(warm, turn2)
    assert turn2.cached_tokens >= 4000 + 50 - config.prefix_block_tokens
    cold = EngineModel(config)
    other = SimRequest("t2", history, max_new_tokens=1)
    cold.submit(other, 0.0)
    run_until_finished(cold, other)
    assert other.cached_tokens == 0
    assert turn2.e2e_latency() < other.e2e_latency() / 5


def test_prefix_cache_is_evicted_lru_at_kv_capacity() -> None:
    model = EngineModel(make_config("default", kv_capacity_tokens=3000))
    first = req("first", prompt_len=2000, max_new=1, start=100)
    model.submit(first, 0.0)
    t = run_until_finished(model, first)
    second = req("second", prompt_len=2000, max_new=1, start=50_000)
    model.submit(second, t)
    t = run_until_finished(model, second)
    assert model.cache.size_tokens <= 3000
    again = req("again", prompt_len=2000, max_new=1, start=100)
    model.submit(again, t)
    run_until_finished(model, again)
    assert again.cached_tokens < 2000 - 16  # the first prompt was (partly) evicted


def test_flush_cache_is_refused_while_requests_run() -> None:
    model = EngineModel(make_config("default"))
    a = req("a", max_new=100)
    model.submit(a, 0.0)
    assert not model.flush_cache(0.01)
    run_until_finished(model, a)
    assert model.cache.size_tokens == 0 or model.flush_cache(10.0)
    assert model.cache.size_tokens == 0


# ------------------------------------------------------------------------------------------ abort


def test_abort_of_a_waiting_request_is_immediate_and_says_so() -> None:
    model = EngineModel(make_config("default", max_running_requests=1))
    a, b = req("a", max_new=1000), req("b", max_new=10)
    model.submit(a, 0.0)
    model.submit(b, 0.0)
    assert model.abort("b", 0.5) == 1
    assert b.is_finished and b.finish is not None
    assert b.finish.sglang() == {"type": "abort", "message": "Abort in waiting queue"}
    assert b.finished_at == 0.5


def test_sglang_abort_of_a_running_request_ends_with_the_step_and_frees_its_slot() -> None:
    model = EngineModel(make_config("default", max_running_requests=1))
    a, b = req("a", max_new=10_000), req("b", max_new=10)
    model.submit(a, 0.0)
    model.submit(b, 0.0)
    model.advance(1.0)
    step_end = model.next_event_at()
    model.abort("a", 1.0)
    assert not a.is_finished
    model.advance(step_end)
    assert a.is_finished and a.finish is not None
    assert a.finish.sglang() == {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    assert a.finished_at == step_end
    assert b.state is not RequestState.WAITING  # the slot went to b


def test_vllm_abort_is_immediate_and_prefix_abort_matches_many() -> None:
    model = EngineModel(make_config("default"), api="vllm")
    rs = [req("job-1", max_new=1000), req("job-2", max_new=1000), req("other", max_new=1000)]
    for r in rs:
        model.submit(r, 0.0)
    model.advance(1.0)
    assert model.abort("job-", 1.0, prefix=True) == 2
    assert rs[0].is_finished and rs[1].is_finished and not rs[2].is_finished
    assert rs[0].finished_at == 1.0


# ------------------------------------------------------------------------------------------ pause


def test_pause_in_place_stops_the_clock_and_resumes_exactly() -> None:
    model = EngineModel(make_config("default", record_token_times=True))
    a = req("a", max_new=2000)
    model.submit(a, 0.0)
    model.advance(1.0)
    before = a.completion_tokens
    model.pause("in_place", 1.0)
    assert model.next_event_at() == math.inf
    model.advance(50.0)
    assert a.completion_tokens == before
    model.resume(50.0)
    model.advance(51.0)
    gained = a.completion_tokens - before
    assert abs(gained - before) <= 2  # one more second of decode, same pace as the first


def test_pause_retract_requeues_running_requests_and_reprefills_from_cache() -> None:
    model = EngineModel(make_config("default"))
    a = req("a", prompt_len=2000, max_new=500)
    model.submit(a, 0.0)
    model.advance(1.0)
    made = a.completion_tokens
    model.pause("retract", 1.0)
    assert a.state is RequestState.WAITING and a.num_retractions == 1
    assert model.running_count == 0 and model.waiting_count == 1
    model.resume(5.0)
    run_until_finished(model, a)
    assert a.completion_tokens == 500
    assert a.cached_tokens == 0  # reported for the first admission
    assert made > 0


def test_pause_abort_ends_everything_with_the_right_messages() -> None:
    model = EngineModel(make_config("default", max_running_requests=1))
    a, b = req("a", max_new=1000), req("b", max_new=1000)
    model.submit(a, 0.0)
    model.submit(b, 0.0)
    model.advance(0.5)
    model.pause("abort", 0.5)
    assert a.finish is not None and a.finish.message == "Aborted"
    assert b.finish is not None and b.finish.message == "Abort in waiting queue"
    assert model.paused


# ------------------------------------------------------------------------------------------ faults


def test_freeze_stops_all_progress_until_cleared() -> None:
    model = EngineModel(make_config("default"))
    a = req("a", max_new=5000)
    model.submit(a, 0.0)
    model.advance(1.0)
    model.set_fault(Fault(kind="freeze"), 1.0)
    frozen_at = a.completion_tokens
    b = req("b", max_new=5)
    model.submit(b, 2.0)
    model.abort("a", 3.0)
    model.advance(100.0)
    assert a.completion_tokens == frozen_at and not a.is_finished and b.completion_tokens == 0
    assert model.next_event_at() == math.inf
    model.clear_fault("freeze", 100.0)
    model.advance(101.0)
    assert a.is_finished  # the abort went through once it thawed
    assert b.completion_tokens > 0


def test_slow_multiplies_step_time() -> None:
    config = make_config("default")
    normal, slow = EngineModel(config), EngineModel(config)
    slow.set_fault(Fault(kind="slow", factor=4.0), 0.0)
    a, b = req("a", max_new=400), req("a", max_new=400)
    normal.submit(a, 0.0)
    slow.submit(b, 0.0)
    assert run_until_finished(slow, b) == pytest.approx(4 * run_until_finished(normal, a), rel=1e-6)


def test_stall_holds_one_request_while_others_progress() -> None:
    model = EngineModel(make_config("default"))
    model.set_fault(Fault(kind="stall", rid="stuck"), 0.0)
    stuck, fine = req("stuck", max_new=100), req("fine", max_new=100)
    model.submit(stuck, 0.0)
    model.submit(fine, 0.0)
    run_until_finished(model, fine)
    assert stuck.completion_tokens == 0 and stuck.state is RequestState.RUNNING
    model.clear_fault("stall:stuck", 50.0)
    run_until_finished(model, stuck)
    assert stuck.completion_tokens == 100


def test_blackhole_accepts_but_never_starts() -> None:
    model = EngineModel(make_config("default"))
    model.set_fault(Fault(kind="blackhole"), 0.0)
    a = req("a", max_new=10)
    model.submit(a, 0.0)
    model.advance(100.0)
    assert a.state is RequestState.WAITING and model.waiting_count == 1 and a.started_at is None
    model.clear_fault("blackhole", 100.0)
    run_until_finished(model, a)
    assert a.completion_tokens == 10


# ------------------------------------------------------------------------------------------ tokens


def test_output_is_deterministic_per_seed_and_prompt() -> None:
    a = req("a", seed=7, max_new=20)
    b = req("b", seed=7, max_new=20)
    c = req("c", seed=8, max_new=20)
    for r in (a, b, c):
        r.completion_tokens = 20
    assert a.output_ids() == b.output_ids() != c.output_ids()


def test_stop_fraction_makes_some_requests_stop_early_with_eos() -> None:
    config = make_config("default", stop_fraction=0.5)
    model = EngineModel(config)
    reqs = [
        SimRequest(f"r{i}", [3 + i, 4, 5], max_new_tokens=40, stop_fraction=config.stop_fraction)
        for i in range(40)
    ]
    for r in reqs:
        model.submit(r, 0.0)
    run_until_finished(model, *reqs)
    stopped = [r for r in reqs if r.finish is not None and r.finish.kind == "stop"]
    assert 8 <= len(stopped) <= 32
    for r in stopped:
        assert r.output_ids()[-1] == EOS_TOKEN_ID and r.completion_tokens <= 40
    ignoring = SimRequest("x", [3, 4, 5], max_new_tokens=40, stop_fraction=1.0, ignore_eos=True)
    assert ignoring.stop_at is None


def test_zero_max_new_tokens_finishes_after_prefill() -> None:
    model = EngineModel(make_config("default"))
    a = req("a", max_new=0)
    model.submit(a, 0.0)
    run_until_finished(model, a)
    assert a.completion_tokens == 0 and a.finish is not None and a.finish.kind == "length"


def test_a_full_queue_refuses_with_503() -> None:
    model = EngineModel(make_config("default", max_running_requests=1, max_queued_requests=1))
    rs = [req(f"r{i}", max_new=100) for i in range(3)]
    for r in rs:
        model.submit(r, 0.0)
    assert rs[2].finish is not None and rs[2].finish.status_code == 503


def test_duplicate_live_rid_is_rejected() -> None:
    model = EngineModel(make_config("default"))
    model.submit(req("same"), 0.0)
    with pytest.raises(ValueError, match="Duplicate"):
        model.submit(req("same"), 0.0)


def test_config_validation() -> None:
    with pytest.raises(ValueError):
        SimEngineConfig(max_running_requests=0)
    with pytest.raises(TypeError):
        make_config("default", no_such_field=1)
    with pytest.raises(ValueError):
        make_config("nope")


def test_retract_ends_requests_that_were_being_aborted() -> None:
    model = EngineModel(make_config("default"))
    a, b = req("a", max_new=1000), req("b", max_new=1000)
    model.submit(a, 0.0)
    model.submit(b, 0.0)
    model.advance(1.0)
    model.abort("a", 1.0)  # pending until the step in flight ends
    model.pause("retract", 1.0)
    assert a.is_finished and a.finish is not None and a.finish.message == "Aborted"
    assert b.state is RequestState.WAITING and model.waiting_count == 1
    model.resume(2.0)
    run_until_finished(model, b)
    assert b.completion_tokens == 1000
