"""Turn records and the trajectory: loss mask, logprob alignment, the delta encoding, linearity."""

from __future__ import annotations

import dataclasses
from typing import Any

import orjson
import pytest

from rolloutgate.sessions.errors import SessionConflict
from rolloutgate.sessions.record import (
    accumulated_ids,
    build_trajectory,
    expand_records,
    ids_array,
    weight_spans,
)


def three_turns(record: Any) -> list[Any]:
    return [
        record(
            0,
            prompt_new_ids=[1, 2, 3],
            output_ids=[4, 5],
            logprobs=[-0.1, -0.2],
            new_messages=[{"role": "user", "content": "u0"}],
            reply="a0",
        ),
        record(
            1,
            prompt_prefix_len=5,
            prompt_new_ids=[6, 7],
            output_ids=[8],
            logprobs=[-0.3],
            messages_from=2,
            new_messages=[{"role": "user", "content": "u1"}],
            reply="a1",
        ),
        record(
            2,
            prompt_prefix_len=8,
            prompt_new_ids=[9],
            output_ids=[10, 11, 12],
            logprobs=[-0.4, -0.5, -0.6],
            messages_from=4,
            new_messages=[{"role": "user", "content": "u2"}],
            reply="a2",
        ),
    ]


def test_trajectory_masks_prompts_and_aligns_logprobs(record: Any) -> None:
    trajectory = build_trajectory(three_turns(record))
    assert trajectory.token_ids == list(range(1, 13))
    assert trajectory.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1, 0, 1, 1, 1]
    assert trajectory.logprobs == [0.0, 0.0, 0.0, -0.1, -0.2, 0.0, 0.0, -0.3, 0.0, -0.4, -0.5, -0.6]
    generated = [t for t, m in zip(trajectory.token_ids, trajectory.loss_mask, strict=True) if m]
    assert generated == [4, 5, 8, 10, 11, 12]
    body = trajectory.as_dict("s1")
    assert (body["prompt_length"], body["response_length"], body["num_turns"]) == (3, 9, 3)
    assert body["turns"][1] == {
        "turn": 1,
        "prompt_start": 5,
        "output_start": 7,
        "output_end": 8,
        "weight_versions": [{"version": "v1", "abs_start": 7, "abs_end": 8}],
    }
    assert orjson.loads(orjson.dumps(body))["token_ids"] == list(range(1, 13))


def test_a_turn_that_crossed_a_weight_update_has_one_span_per_version(record: Any) -> None:
    crossed = {
        "weight_versions": [{"version": "v1", "start": 0, "end": 2}, {"version": "v2", "start": 2, "end": 3}]
    }
    records = three_turns(record)
    records[2] = dataclasses.replace(records[2], weight_version="v2", engine_meta=crossed)
    body = build_trajectory(records).as_dict("s1")
    assert body["turns"][2]["weight_versions"] == [
        {"version": "v1", "abs_start": 9, "abs_end": 11},
        {"version": "v2", "abs_start": 11, "abs_end": 12},
    ]
    (entry,) = expand_records(records[2:], full_prompt_ids=False)
    assert entry["weight_versions"] == crossed["weight_versions"]  # output offsets, as the engine gave them
    assert weight_spans(records[0]) == [("v1", 0, 2)]  # one version: the whole output


def test_trajectory_equals_the_last_prompt_plus_output(record: Any) -> None:
    records = three_turns(record)
    assert build_trajectory(records).token_ids == accumulated_ids(records).tolist()


def test_a_turn_without_logprobs_gets_zeros_under_its_mask(record: Any) -> None:
    trajectory = build_trajectory([record(0, prompt_new_ids=[1], output_ids=[2, 3], logprobs=[])])
    assert trajectory.loss_mask == [0, 1, 1] and trajectory.logprobs == [0.0, 0.0, 0.0]


def test_a_chain_break_is_reported_with_its_turn(record: Any) -> None:
    records = [
        record(0, prompt_new_ids=[1, 2], output_ids=[3]),
        record(1, prompt_prefix_len=1, prompt_new_ids=[9, 9], output_ids=[4]),
    ]
    with pytest.raises(SessionConflict, match="turn 1") as info:
        build_trajectory(records)
    assert (info.value.status, info.value.code) == (409, "trajectory_not_linear")
    # the records themselves still rebuild each turn's full prompt
    assert accumulated_ids(records).tolist() == [1, 9, 9, 4]
    assert [r["prompt_token_ids"] for r in expand_records(records)] == [[1, 2], [1, 9, 9]]


def test_expand_records_rebuilds_requests_and_prompts(record: Any) -> None:
    expanded = expand_records(three_turns(record))
    assert [m["content"] for m in expanded[2]["request"]["messages"]] == ["u0", "a0", "u1", "a1", "u2"]
    assert expanded[2]["prompt_token_ids"] == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert expanded[2]["output_token_ids"] == [10, 11, 12]
    assert expanded[2]["output_logprobs"] == [-0.4, -0.5, -0.6]
    first = expanded[0]
    for key in ("timestamp", "request_timestamp", "method", "path", "request", "response", "status_code"):
        assert key in first  # the miles SessionRecord fields
    assert (first["path"], first["status_code"], first["engine"], first["weight_version"]) == (
        "/v1/chat/completions",
        200,
        "e0",
        "v1",
    )
    delta = expand_records(three_turns(record), full_prompt_ids=False)
    assert [r["prompt_new_token_ids"] for r in delta] == [[1, 2, 3], [6, 7], [9]]
    assert [r["prompt_prefix_len"] for r in delta] == [0, 5, 8]


def test_record_validates_and_sizes_itself(record: Any) -> None:
    small, big = record(0), record(0, payload="x" * 10_000)
    assert big.approx_bytes - small.approx_bytes == 10_000
    with pytest.raises(ValueError, match="align"):
        record(0, output_ids=[1, 2], logprobs=[-1.0])
    with pytest.raises(ValueError, match="prompt_prefix_len"):
        record(0, prompt_prefix_len=-1)
    assert ids_array([1, 2]).itemsize == 4
