"""A session's training samples, as miles' session server assembles them (`POST /sessions/{id}/samples`).

Theory of operation (miles' `samples/merge.py`, read in reference/miles.md and the notes beside it): each turn
is a sample of its own, `tokens` = its prompt + its output, loss mask 1 on the output. `max_seq_len` cuts the
first turn that passes it back to the limit (status `truncated`), or drops it and everything after when no
output token would be left. The turns then merge in order, stopping after the first one that did not complete:
the merged sample's prompt is the first turn's, its response everything after it, loss mask 1 on generated
tokens and 0 on the tool and template tokens between turns, logprobs 0.0 there. Turns here are delta-encoded
records of one token chain (record.py), so the merge is read off the chain's spans rather than by comparing
each turn's full copy; a chain that does not extend (recorded mode, an engine that re-rendered the history)
cannot be merged and is a 422 (`SamplesUnassemblable`), as in miles.

A tree session (miles' v2) has one candidate sample per leaf: the current path and each branch a retry or
rollback left (session.py). A picker chooses the leaves (`PICKERS`), longest path first, and a completion
shared by several chosen leaves trains once, in the leaf committed first (its loss mask is zeroed in the
others). A scalar `metadata.reward` of the request goes to every sample.

This module is sans-IO: records in, `Sample`s out. The wire (safetensors) is samples_wire.py.
"""

from __future__ import annotations

import enum
import hashlib
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from rolloutgate.sessions.errors import SamplesUnassemblable, SessionConflict
from rolloutgate.sessions.record import Trajectory, TurnRecord, TurnSpan, build_trajectory

__all__ = (
    "PICKERS",
    "Picker",
    "Sample",
    "SampleStatus",
    "SamplesResult",
    "TreePath",
    "WeightSpan",
    "assemble_linear",
    "assemble_tree",
)

Decode = Callable[[Sequence[int]], str]
_SERVER_OWNED_METADATA = ("accumulated_token_ids", "tito_session_mismatch", "leaf")
Picker = Literal["drop_retries", "drop_same_prompt", "keep_all"]
PICKERS: tuple[Picker, ...] = ("drop_retries", "drop_same_prompt", "keep_all")


class SampleStatus(enum.Enum):
    """miles' `Sample.Status` values."""

    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"


_STATUS_OF_FINISH = {
    "stop": SampleStatus.COMPLETED,
    "tool_calls": SampleStatus.COMPLETED,
    "length": SampleStatus.TRUNCATED,
    "abort": SampleStatus.ABORTED,
}
_SPEC_KEYS = {  # miles' SpecInfo key <- the engine's meta_info key (newest first, then the older name)
    "spec_num_correct_drafts": ("spec_num_correct_drafts", "spec_accept_token_num"),
    "spec_num_proposed_drafts": ("spec_num_proposed_drafts", "spec_draft_token_num"),
    "spec_verify_ct": ("spec_verify_ct",),
    "completion_tokens": ("completion_tokens",),
}


@dataclass(frozen=True, slots=True)
class WeightSpan:
    """Which weight version produced tokens [abs_start, abs_end) of a sample's `tokens` (prompt included)."""

    version: str
    abs_start: int
    abs_end: int


@dataclass(slots=True, kw_only=True)
class Sample:
    tokens: list[int]
    response_length: int
    loss_mask: list[int]  # len == response_length
    rollout_log_probs: list[float]  # len == response_length
    response: str
    status: SampleStatus
    weight_versions: list[list[WeightSpan]]  # one list per merged call
    prefix_cache_info: dict[str, int]
    spec_info: dict[str, int]
    metadata: dict[str, Any] = field(default_factory=dict)
    reward: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplesResult:
    samples: list[Sample]
    session_metadata: dict[str, Any]
    empty_reason: Literal["no_records", "all_truncated"] | None


@dataclass(frozen=True, slots=True)
class TreePath:
    """One leaf's path from the first turn: its records and their commit seqs (session.py)."""

    records: Sequence[TurnRecord]
    seqs: Sequence[int]


@dataclass(frozen=True, slots=True)
class _Turn:
    record: TurnRecord
    span: TurnSpan
    end: int  # after max_seq_len
    status: SampleStatus


def _trajectory(records: Sequence[TurnRecord]) -> Trajectory:
    try:
        return build_trajectory(records)
    except SessionConflict as exc:
        raise SamplesUnassemblable(str(exc)) from None


def _kept_turns(
    records: Sequence[TurnRecord], spans: Sequence[TurnSpan], max_seq_len: int | None
) -> list[_Turn]:
    """The turns left after `max_seq_len`, each with its end and status (miles'
    `truncate_samples_by_total_tokens`: every turn's tokens hold the whole prefix, so the cut is at a turn)."""
    kept: list[_Turn] = []
    for record, span in zip(records, spans, strict=True):
        status = _STATUS_OF_FINISH.get(record.finish_reason or "", SampleStatus.PENDING)
        if max_seq_len is not None and span.output_end > max_seq_len:
            if max_seq_len <= span.output_start:
                break  # no output token would be left: this turn and all after it go
            kept.append(_Turn(record, span, max_seq_len, SampleStatus.TRUNCATED))
            break
        kept.append(_Turn(record, span, span.output_end, status))
    return kept


def _merge(turns: Sequence[_Turn], trajectory: Trajectory, decode: Decode | None) -> Sample:
    """One sample of the turns, merged in order up to and including the first one that did not complete."""
    merged: list[_Turn] = []
    for turn in turns:
        merged.append(turn)
        if turn.status is not SampleStatus.COMPLETED:
            break
    start, end = merged[0].span.output_start, merged[-1].end
    tokens = trajectory.token_ids[:end]
    response_ids = tokens[start:]
    cached = sum(int(t.record.engine_meta.get("cached_tokens") or 0) for t in merged)
    prompts = sum(int(t.record.engine_meta.get("prompt_tokens") or t.span.output_start) for t in merged)
    return Sample(
        tokens=tokens,
        response_length=end - start,
        loss_mask=trajectory.loss_mask[start:end],
        rollout_log_probs=trajectory.logprobs[start:end],
        response=decode(response_ids) if decode is not None else _replies_text(merged),
        status=merged[-1].status,
        weight_versions=[_weight_spans(t) for t in merged],
        prefix_cache_info={"cached_tokens": cached, "total_prompt_tokens": prompts},
        spec_info=_spec_info(merged),
        metadata={"lifecycle": _lifecycle(merged)},
    )


def _replies_text(turns: Sequence[_Turn]) -> str:
    """Without a tokenizer (recorded mode) the response text is the assistant replies' text, joined; the
    tokens between them (tool results, template) are in `tokens` but have no text here."""
    return "".join(str(t.record.reply_message.get("content") or "") for t in turns)


def _weight_spans(turn: _Turn) -> list[WeightSpan]:
    """miles' `WeightVersionsPerCall.from_meta_info`: the turn's spans in the trajectory (record.py
    `weight_spans`: the engine's per-span versions, else its one version), clipped to the turn's end."""
    spans = [WeightSpan(v, a, min(b, turn.end)) for v, a, b in turn.span.weight_versions]
    return [s for s in spans if s.abs_start < s.abs_end]


def _spec_info(turns: Sequence[_Turn]) -> dict[str, int]:
    totals = dict.fromkeys(_SPEC_KEYS, 0)
    for turn in turns:
        meta = turn.record.engine_meta
        if not int(meta.get("spec_verify_ct") or 0) > 0:
            continue  # miles adds a turn's counters only when it was speculatively decoded
        for key, sources in _SPEC_KEYS.items():
            totals[key] += int(next((meta[s] for s in sources if meta.get(s) is not None), 0))
    return totals


def _lifecycle(turns: Sequence[_Turn]) -> dict[str, Any] | list[dict[str, Any]]:
    entries = []
    for turn in turns:
        record, latency = turn.record, turn.record.engine_meta.get("e2e_latency")
        entries.append(
            {
                "t0": record.finished_at_unix - latency if isinstance(latency, int | float) else None,
                "t1": record.finished_at_unix,
                "turn": record.index + 1,
                "req_ts": record.request_at_unix,
            }
        )
    return entries[0] if len(entries) == 1 else entries  # miles' shape: one turn's is not a list


def assemble_linear(
    records: Sequence[TurnRecord], *, max_seq_len: int | None, decode: Decode | None
) -> SamplesResult:
    """miles' v1: one sample of the session's turns."""
    if not records:
        return SamplesResult(
            samples=[], session_metadata=_linear_metadata(records), empty_reason="no_records"
        )
    trajectory = _trajectory(records)
    kept = _kept_turns(records, trajectory.spans, max_seq_len)
    metadata = _linear_metadata(records, trajectory)
    if not kept:
        return SamplesResult(samples=[], session_metadata=metadata, empty_reason="all_truncated")
    return SamplesResult(
        samples=[_merge(kept, trajectory, decode)], session_metadata=metadata, empty_reason=None
    )


def _linear_metadata(records: Sequence[TurnRecord], trajectory: Trajectory | None = None) -> dict[str, Any]:
    ids = trajectory.token_ids if trajectory is not None else []
    return {"accumulated_token_ids": ids, "max_trim_tokens": 0}  # the gateway never trims a turn's ids


# -- tree sessions -------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Leaf:
    path: TreePath
    trajectory: Trajectory
    sample: Sample | None

    @property
    def node_id(self) -> int:
        return self.path.seqs[-1]

    @property
    def parent(self) -> int | None:
        return self.path.seqs[-2] if len(self.path.seqs) > 1 else None


def assemble_tree(
    paths: Sequence[TreePath],
    *,
    max_seq_len: int | None,
    decode: Decode | None,
    picker: Picker = "drop_retries",
    agent_metadata: Mapping[str, Any] | None = None,
) -> SamplesResult:
    """miles' v2: one sample per leaf the picker keeps (paths: every branch, then the current one)."""
    paths = [p for p in paths if p.records]
    leaves = [_leaf(p, max_seq_len, decode) for p in paths]
    metadata: dict[str, Any] = {
        "accumulated_token_ids": leaves[-1].trajectory.token_ids if leaves else [],  # the current path
        "max_trim_tokens": 0,
        "tree": _tree_tables([(leaf.path, leaf.trajectory) for leaf in leaves]),
    }
    if agent_metadata is not None:
        metadata["agent"] = dict(agent_metadata)
    if not leaves:
        return SamplesResult(samples=[], session_metadata=metadata, empty_reason="no_records")
    chosen = [leaf for leaf in _pick(leaves, picker) if leaf.sample is not None]
    if not chosen:
        return SamplesResult(samples=[], session_metadata=metadata, empty_reason="all_truncated")
    chosen.sort(key=lambda leaf: (len(leaf.path.seqs), leaf.node_id), reverse=True)
    _train_shared_turns_once(chosen)
    reward = (agent_metadata or {}).get("reward")
    # the agent's metadata goes on every sample, less what the server owns (miles' default_postprocess)
    agent_fields = {k: v for k, v in (agent_metadata or {}).items() if k not in _SERVER_OWNED_METADATA}
    samples = []
    for leaf in chosen:
        sample = leaf.sample
        assert sample is not None
        sample.metadata = {
            **sample.metadata,
            **agent_fields,
            "accumulated_token_ids": list(leaf.trajectory.token_ids),
            "leaf": {
                "node_id": leaf.node_id,
                "parent": leaf.parent,
                "path_node_ids": list(leaf.path.seqs),
                "response_id": leaf.path.records[-1].response.get("id"),
            },
        }
        if isinstance(reward, int | float) and not isinstance(reward, bool):
            sample.reward = float(reward)
        samples.append(sample)
    return SamplesResult(samples=samples, session_metadata=metadata, empty_reason=None)


def _leaf(path: TreePath, max_seq_len: int | None, decode: Decode | None) -> _Leaf:
    trajectory = _trajectory(path.records)
    kept = _kept_turns(path.records, trajectory.spans, max_seq_len)
    return _Leaf(path, trajectory, _merge(kept, trajectory, decode) if kept else None)


def tree_metadata(paths: Sequence[TreePath]) -> dict[str, Any]:
    """miles' v2 tree tables (`GET /sessions/{id}` and the samples' `session_metadata.tree`): a node per
    committed turn of any path, keyed by its commit seq (`completion_span`: its output's place in the path's
    ids), and a leaf per path (a path always ends where another left it: retries and rollbacks replace)."""
    return _tree_tables([(path, _trajectory(path.records)) for path in paths if path.records])


def _tree_tables(paths: Sequence[tuple[TreePath, Trajectory]]) -> dict[str, Any]:
    nodes: dict[int, dict[str, Any]] = {}
    for path, trajectory in paths:
        parent: int | None = None
        for seq, record, span in zip(path.seqs, path.records, trajectory.spans, strict=True):
            nodes.setdefault(
                seq,
                {
                    "id": seq,
                    "parent": parent,
                    "seq": seq,
                    "truncated": record.finish_reason == "length",
                    "committed_at": record.finished_at_unix,
                    "completion_span": [span.output_start, span.output_end],
                    "num_tokens": span.output_end,
                    "response_id": record.response.get("id"),
                },
            )
            parent = seq
    return {
        "nodes": [nodes[seq] for seq in sorted(nodes)],
        "leaves": [
            {"node_id": path.seqs[-1], "path_node_ids": list(path.seqs)}
            for path, _ in sorted(paths, key=lambda entry: entry[0].seqs[-1])
        ],
    }


def _prompt_digest(trajectory: Trajectory, turn: int) -> bytes:
    """Turn `turn`'s prompt ids, digested: a retry re-sends the same prompt."""
    prompt = array("q", trajectory.token_ids[: trajectory.spans[turn].output_start])
    return hashlib.sha256(prompt.tobytes()).digest()


def _pick(leaves: Sequence[_Leaf], picker: Picker) -> list[_Leaf]:
    """`drop_retries` (miles' default picker, `picker_hub/drop_retries.py`): a leaf with any later node under
    the same parent was abandoned for it (a retry, or a rollback to another tool result): it is dropped;
    a root leaf is kept. `drop_same_prompt`: dropped only when a later node under the same parent had the same
    prompt (the very request re-sent), so a rollback stays a sample of its own. `keep_all`: every leaf."""
    if picker == "keep_all":
        return list(leaves)
    later_siblings: dict[int, list[int]] = {}  # node -> the nodes under the same parent committed after it
    prompts: dict[int, bytes] = {}
    for leaf in leaves:
        for depth, seq in enumerate(leaf.path.seqs):
            if depth and seq not in prompts:
                parent = leaf.path.seqs[depth - 1]
                prompts[seq] = _prompt_digest(leaf.trajectory, depth)
                later_siblings.setdefault(parent, []).append(seq)
    kept = []
    for leaf in leaves:
        if leaf.parent is None:
            kept.append(leaf)
            continue
        later = [seq for seq in later_siblings[leaf.parent] if seq > leaf.node_id]
        if picker == "drop_same_prompt":
            later = [seq for seq in later if prompts[seq] == prompts[leaf.node_id]]
        if not later:
            kept.append(leaf)
    return kept


def _train_shared_turns_once(chosen: Sequence[_Leaf]) -> None:
    """A turn on several chosen paths belongs to the leaf committed first; the others mask it out."""
    owner: dict[int, int] = {}
    for leaf in chosen:
        for seq in leaf.path.seqs:
            owner[seq] = min(owner.get(seq, leaf.node_id), leaf.node_id)
    for leaf in chosen:
        sample = leaf.sample
        assert sample is not None
        response_start = len(sample.tokens) - sample.response_length
        for seq, span in zip(leaf.path.seqs, leaf.trajectory.spans, strict=True):
            if owner[seq] == leaf.node_id:
                continue
            lo = max(span.output_start - response_start, 0)
            hi = min(span.output_end - response_start, sample.response_length)
            for i in range(lo, hi):
                sample.loss_mask[i] = 0
