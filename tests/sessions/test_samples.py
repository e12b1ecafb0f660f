"""miles' sample assembly (sessions/samples.py), on records built by hand: the merge, `max_seq_len`, statuses,
weight-version spans, counters, and the tree pickers."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import orjson
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import load

from rolloutgate.sessions.record import TurnRecord, accumulated_ids
from rolloutgate.sessions.samples import SampleStatus, TreePath, assemble_linear, assemble_tree, tree_metadata
from rolloutgate.sessions.samples_wire import encode_samples
from tests.sessions.conftest import make_record


def chain(
    shapes: list[tuple[int, int]],
    finishes: list[str] | None = None,
    metas: list[dict[str, Any]] | None = None,
) -> list[TurnRecord]:
    """Turns extending each other: (new prompt ids, output ids) per turn; token values are their positions."""
    records: list[TurnRecord] = []
    length = 0
    for i, (new_prompt, output) in enumerate(shapes):
        record = make_record(
            i,
            prompt_prefix_len=length,
            prompt_new_ids=list(range(length, length + new_prompt)),
            output_ids=list(range(length + new_prompt, length + new_prompt + output)),
            logprobs=[-(length + new_prompt + j) / 1000 for j in range(output)],
        )
        changes: dict[str, Any] = {"finish_reason": (finishes or [])[i] if finishes else "stop"}
        if metas:
            changes["engine_meta"] = metas[i]
        records.append(dataclasses.replace(record, **changes))
        length += new_prompt + output
    return records


def test_one_sample_of_every_turn_with_the_first_prompt_as_prompt() -> None:
    records = chain([(5, 3), (2, 4), (3, 2)])
    (sample,) = assemble_linear(records, max_seq_len=None, decode=None).samples
    assert sample.tokens == list(range(19))
    assert sample.response_length == 14 and sample.status is SampleStatus.COMPLETED
    assert sample.loss_mask == [1] * 3 + [0] * 2 + [1] * 4 + [0] * 3 + [1] * 2
    assert sample.rollout_log_probs[:3] == [-0.005, -0.006, -0.007] and sample.rollout_log_probs[3:5] == [
        0.0,
        0.0,
    ]
    assert [[(s.abs_start, s.abs_end) for s in call] for call in sample.weight_versions] == [
        [(5, 8)],
        [(10, 14)],
        [(17, 19)],
    ]
    assert sample.response == "okokok"  # no tokenizer: the replies' text


def test_the_merge_ends_after_the_first_turn_that_did_not_complete() -> None:
    records = chain([(5, 3), (2, 4), (3, 2)], finishes=["stop", "abort", "stop"])
    (sample,) = assemble_linear(records, max_seq_len=None, decode=None).samples
    assert sample.tokens == list(range(14)) and sample.status is SampleStatus.ABORTED
    records = chain([(5, 3), (2, 4)], finishes=["length", "stop"])
    (sample,) = assemble_linear(records, max_seq_len=None, decode=None).samples
    assert sample.tokens == list(range(8)) and sample.status is SampleStatus.TRUNCATED


def test_max_seq_len_cuts_inside_a_turn_or_drops_it_whole() -> None:
    records = chain([(5, 3), (2, 4), (3, 2)])
    (sample,) = assemble_linear(records, max_seq_len=12, decode=None).samples  # inside turn 2's output
    assert sample.tokens == list(range(12)) and sample.status is SampleStatus.TRUNCATED
    assert sample.loss_mask == [1] * 3 + [0] * 2 + [1] * 2
    assert sample.weight_versions[-1][0].abs_end == 12
    (sample,) = assemble_linear(records, max_seq_len=10, decode=None).samples  # turn 2 has no output left
    assert sample.tokens == list(range(8)) and sample.status is SampleStatus.COMPLETED
    result = assemble_linear(records, max_seq_len=5, decode=None)
    assert result.samples == [] and result.empty_reason == "all_truncated"
    assert assemble_linear([], max_seq_len=None, decode=None).empty_reason == "no_records"


def test_counters_and_per_span_weight_versions_come_from_the_engine() -> None:
    metas = [
        {"cached_tokens": 2, "prompt_tokens": 5, "spec_verify_ct": 0, "spec_accept_token_num": 9},
        {
            "cached_tokens": 7,
            "prompt_tokens": 10,
            "spec_verify_ct": 2,
            "spec_accept_token_num": 3,
            "spec_draft_token_num": 4,
            "completion_tokens": 4,
            "weight_versions": [
                {"version": "7", "start": 0, "end": 1},
                {"version": "8", "start": 1, "end": 4},
            ],
        },
    ]
    (sample,) = assemble_linear(chain([(5, 3), (2, 4)], metas=metas), max_seq_len=None, decode=None).samples
    assert sample.prefix_cache_info == {"cached_tokens": 9, "total_prompt_tokens": 15}
    assert sample.spec_info == {  # only the speculatively decoded turn counts
        "spec_num_correct_drafts": 3,
        "spec_num_proposed_drafts": 4,
        "spec_verify_ct": 2,
        "completion_tokens": 4,
    }
    assert [(s.version, s.abs_start, s.abs_end) for s in sample.weight_versions[1]] == [
        ("7", 10, 11),
        ("8", 11, 14),
    ]


@settings(max_examples=200, deadline=None)
@given(
    shapes=st.lists(st.tuples(st.integers(1, 6), st.integers(1, 6)), min_size=1, max_size=6),
    finishes=st.lists(st.sampled_from(["stop", "length", "abort", "tool_calls"]), min_size=6, max_size=6),
    limit=st.one_of(st.none(), st.integers(1, 80)),
)
def test_every_sample_is_a_prefix_of_the_session_with_aligned_fields(
    shapes: list[tuple[int, int]], finishes: list[str], limit: int | None
) -> None:
    records = chain(shapes, finishes=finishes[: len(shapes)])
    result = assemble_linear(records, max_seq_len=limit, decode=None)
    if not result.samples:
        assert limit is not None and limit <= shapes[0][0]  # only when the first prompt fills the limit
        return
    (sample,) = result.samples
    accumulated = accumulated_ids(records).tolist()
    assert sample.tokens == accumulated[: len(sample.tokens)]
    assert limit is None or len(sample.tokens) <= limit
    assert len(sample.loss_mask) == len(sample.rollout_log_probs) == sample.response_length
    assert len(sample.tokens) - sample.response_length == shapes[0][0]
    outputs = {t for r in records for t in r.output_ids}  # token values are positions: outputs are known
    response = sample.tokens[shapes[0][0] :]
    assert sample.loss_mask == [1 if t in outputs else 0 for t in response]
    assert all(
        (lp != 0.0) == bool(m) for lp, m in zip(sample.rollout_log_probs, sample.loss_mask, strict=True)
    )


def _paths() -> list[TreePath]:
    """Turn 0, then three attempts at turn 1: a retry of seq 1 with the same prompt (seq 2), a rollback with
    another prompt (seq 3), which is the current path."""
    base = chain([(5, 3), (2, 4)])
    retry = chain([(5, 3), (2, 3)])
    other = dataclasses.replace(chain([(5, 3), (3, 2)])[1])
    return [TreePath(base, [0, 1]), TreePath([base[0], retry[1]], [0, 2]), TreePath([base[0], other], [0, 3])]


def test_drop_same_prompt_keeps_rollbacks_and_trains_a_shared_turn_once() -> None:
    result = assemble_tree(
        _paths(), max_seq_len=None, decode=None, picker="drop_same_prompt", agent_metadata={"reward": 1}
    )
    leaves = [s.metadata["leaf"]["node_id"] for s in result.samples]
    assert leaves == [3, 2]  # seq 1 was retried with the same prompt; longest path first, then newest
    assert [s.reward for s in result.samples] == [1.0, 1.0]
    owner, other = result.samples[1], result.samples[0]
    assert owner.loss_mask[:3] == [1, 1, 1] and other.loss_mask[:3] == [0, 0, 0]
    assert result.session_metadata["tree"]["leaves"][0] == {"node_id": 1, "path_node_ids": [0, 1]}


def test_drop_retries_keeps_only_leaves_no_later_sibling_replaced_as_miles_picker_does() -> None:
    rolled = assemble_tree(_paths(), max_seq_len=None, decode=None)
    assert [s.metadata["leaf"]["node_id"] for s in rolled.samples] == [3]
    # miles' own example: a leaf whose later sibling is an inner node (the retry went on) is dropped too
    base, retry = chain([(5, 3), (2, 4)]), chain([(5, 3), (2, 3), (2, 2)])
    paths = [TreePath(base, [0, 1]), TreePath([base[0], *retry[1:]], [0, 2, 3])]
    assert [
        s.metadata["leaf"]["node_id"] for s in assemble_tree(paths, max_seq_len=None, decode=None).samples
    ] == [3]
    every = assemble_tree(_paths(), max_seq_len=None, decode=None, picker="keep_all")
    assert sorted(s.metadata["leaf"]["node_id"] for s in every.samples) == [1, 2, 3]
    assert assemble_tree([], max_seq_len=None, decode=None).empty_reason == "no_records"


def test_the_wire_holds_each_field_in_its_dtype_and_either_weight_version_shape() -> None:
    result = assemble_linear(chain([(5, 3), (2, 4)]), max_seq_len=None, decode=None)
    for wire, expected in (
        (
            "spans",
            [
                [{"version": "v1", "abs_start": 5, "abs_end": 8}],
                [{"version": "v1", "abs_start": 10, "abs_end": 14}],
            ],
        ),
        ("strings", ["v1", "v1"]),
    ):
        tensors = load(encode_samples(result, tree=False, weight_versions=wire))  # type: ignore[arg-type]
        meta = orjson.loads(tensors["_samples_meta"].tobytes())
        assert tensors["tokens.0"].dtype == np.int64 and tensors["tokens.0"].tolist() == list(range(14))
        assert tensors["loss_mask.0"].dtype == np.uint8 and tensors["rollout_log_probs.0"].dtype == np.float64
        (entry,) = meta["samples"]
        assert entry["weight_versions"] == expected and "reward" not in entry
        assert entry["status"] == "completed" and entry["response_length"] == 9
        assert set(entry) == {
            "response", "response_length", "status", "weight_versions", "spec_info", "prefix_cache_info",
            "metadata", "nulls",
        }  # fmt: skip


def test_tree_tables_have_a_node_per_turn_and_a_leaf_per_path() -> None:
    base = chain([(5, 3), (2, 4)])
    cut = dataclasses.replace(chain([(5, 3), (2, 3)])[1], finish_reason="length")
    tables = tree_metadata([TreePath(base, [0, 1]), TreePath([base[0], cut], [0, 2])])
    assert [(n["id"], n["parent"], n["truncated"]) for n in tables["nodes"]] == [
        (0, None, False),
        (1, 0, False),
        (2, 0, True),
    ]
    assert tables["leaves"] == [
        {"node_id": 1, "path_node_ids": [0, 1]},
        {"node_id": 2, "path_node_ids": [0, 2]},
    ]
    assert tables["nodes"][1]["completion_span"] == [10, 14] and tables["nodes"][1]["num_tokens"] == 14


def test_tree_samples_carry_the_agents_metadata_and_the_current_paths_ids_as_miles_does() -> None:
    result = assemble_tree(
        _paths(),
        max_seq_len=None,
        decode=None,
        agent_metadata={"driver_events": ["append_tool"], "leaf": "not the agent's", "reward": 1},
    )
    (sample,) = result.samples
    assert sample.metadata["driver_events"] == ["append_tool"]  # the agent's, on the sample
    assert sample.metadata["leaf"]["node_id"] == 3  # the server's own keys win
    current = _paths()[-1]
    assert result.session_metadata["accumulated_token_ids"] == accumulated_ids(current.records).tolist()
    assert sample.metadata["accumulated_token_ids"] == accumulated_ids(current.records).tolist()
