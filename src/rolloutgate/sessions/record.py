"""One session turn as recorded, and the token-exact trajectory built from a session's turns.

Theory of operation: a session is a chain of turns. Turn k's prompt usually extends everything before it
(turn k-1's prompt and output), so records are delta-encoded to keep memory linear in the session length
(an agent re-sends its whole history every turn; storing it whole per turn would be quadratic):

- `messages_from` + `new_messages`: the request's messages are the first `messages_from` messages of the
  previous state (previous request's messages + the reply) followed by `new_messages`;
- `prompt_prefix_len` + `prompt_new_ids`: the prompt ids are the first `prompt_prefix_len` ids of the
  previous turn's prompt + output, followed by `prompt_new_ids`. With a tokenizer, `prompt_prefix_len` is
  always the whole previous sequence (TITO). Without one the engine re-renders every prompt, and a turn
  whose prompt does not extend the previous sequence has `prompt_prefix_len == 0` and breaks the chain.

Token ids live in `array('i')` (4 bytes each) and logprobs in `array('d')`, not Python lists (~36 bytes per
id). `approx_bytes` is what the registry's memory bound counts.

The trajectory of a chain is `prompt_ids(last) + output_ids(last)`, which equals turn 1's prompt, then each
turn's output followed by the next turn's new prompt ids. The loss mask is 1 exactly on generated tokens;
the logprobs are the engine's, aligned to those tokens (0.0 under a zero mask).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from rolloutgate.sessions.errors import SessionConflict

__all__ = (
    "ENGINE_META_KEYS",
    "RECORD_OVERHEAD_BYTES",
    "Trajectory",
    "TurnRecord",
    "TurnSpan",
    "accumulated_ids",
    "build_trajectory",
    "engine_meta_of",
    "expand_records",
    "ids_array",
    "logprob_array",
    "weight_spans",
)

RECORD_OVERHEAD_BYTES = 600  # the record object, its arrays' headers and dict overhead (measured, rounded up)

# What a record keeps of the engine's `meta_info` besides the ids and logprobs: what miles' assembler reads
# (prefix-cache and speculative-decoding counters, per-span weight versions, MoE routing replay).
ENGINE_META_KEYS = (
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "e2e_latency",
    "spec_verify_ct",
    "spec_num_correct_drafts",
    "spec_num_proposed_drafts",
    "spec_accept_token_num",
    "spec_draft_token_num",
    "weight_versions",
    "routed_experts",
    "indexer_topk",
    "indexer_topk_num_layers",
)


def engine_meta_of(meta: Any) -> dict[str, Any]:
    """The `ENGINE_META_KEYS` an engine's `meta_info` holds."""
    if not isinstance(meta, dict):
        return {}
    return {key: meta[key] for key in ENGINE_META_KEYS if meta.get(key) is not None}


def ids_array(ids: Iterable[int]) -> array[int]:
    return array("i", ids)


def logprob_array(values: Iterable[float]) -> array[float]:
    return array("d", values)


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnRecord:
    """One completed turn: what was asked, what the engine saw and produced, and how long it took."""

    index: int
    request_id: str
    request_at_unix: float  # wall time the turn's request arrived (miles: `request_timestamp`)
    finished_at_unix: float  # wall time it was recorded (miles: `timestamp`)
    request: dict[str, Any]  # the client's body without `messages` (see messages_from/new_messages)
    messages_from: int
    new_messages: tuple[dict[str, Any], ...]
    reply_message: dict[str, Any]  # the assistant message returned to the agent
    response: dict[str, Any]  # the chat.completion returned to the agent
    prompt_prefix_len: int
    prompt_new_ids: array[int]
    output_ids: array[int]
    output_logprobs: array[float]
    finish_reason: str | None
    engine_id: str | None
    weight_version: str | None
    timing: dict[str, Any] | None
    request_key: bytes  # identifies the request (messages + tools) for duplicate commits of a retried turn
    tools_key: bytes  # what besides messages the template renders (tools, chat_template_kwargs)
    message_keys: tuple[bytes, ...]  # comparison keys of new_messages + reply_message
    tokenized_by_gateway: bool  # True: TITO (gateway rendered the prompt); False: recorded from the engine
    engine_meta: dict[str, Any] = field(default_factory=dict)  # the engine's counters (`ENGINE_META_KEYS`)
    method: str = "POST"
    path: str = "/v1/chat/completions"
    status_code: int = 200
    approx_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        if self.prompt_prefix_len < 0:
            raise ValueError(f"prompt_prefix_len must be >= 0, got {self.prompt_prefix_len}")
        if len(self.message_keys) != len(self.new_messages) + 1:
            raise ValueError("message_keys must hold one key per new message plus one for the reply")
        if len(self.output_logprobs) not in (0, len(self.output_ids)):
            raise ValueError(
                f"{len(self.output_logprobs)} logprobs for {len(self.output_ids)} output tokens: they must align"
            )
        size = (
            RECORD_OVERHEAD_BYTES
            + self.prompt_new_ids.itemsize * len(self.prompt_new_ids)
            + self.output_ids.itemsize * len(self.output_ids)
            + self.output_logprobs.itemsize * len(self.output_logprobs)
            + len(orjson.dumps(self.request))
            + len(orjson.dumps(self.new_messages))
            + len(orjson.dumps(self.reply_message))
            + len(orjson.dumps(self.response))
            + len(orjson.dumps(self.engine_meta))
            + len(self.request_key)
            + len(self.tools_key)
            + sum(len(k) for k in self.message_keys)
        )
        object.__setattr__(self, "approx_bytes", size)


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnSpan:
    """Where one turn sits in the trajectory: its new prompt ids in [prompt_start, output_start), its
    generated ids in [output_start, output_end), and which weight version generated which of them
    (`weight_versions`: (version, start, end) in trajectory positions, in order; see `weight_spans`)."""

    turn: int
    prompt_start: int
    output_start: int
    output_end: int
    weight_versions: tuple[tuple[str, int, int], ...] = ()


def weight_spans(record: TurnRecord) -> list[tuple[str, int, int]]:
    """(version, start, end) per weight version of the turn's output, as offsets in it: the engine's own
    spans when its output crossed an in-place update (SGLang `meta_info.weight_versions`, `{"version",
    "start", "end"}`), else its one version for the whole output, else none (the engine reported none)."""
    listed = record.engine_meta.get("weight_versions")
    if isinstance(listed, list) and listed:
        spans = [
            (str(v.get("version")), int(v.get("start", 0)), int(v.get("end", 0)))
            for v in listed
            if isinstance(v, dict)
        ]
    elif record.weight_version is not None:
        spans = [(record.weight_version, 0, len(record.output_ids))]
    else:
        spans = []
    length = len(record.output_ids)
    return [(v, a, min(b, length)) for v, a, b in spans if a < min(b, length)]


@dataclass(frozen=True, slots=True, kw_only=True)
class Trajectory:
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]  # aligned to token_ids; 0.0 where loss_mask is 0
    spans: tuple[TurnSpan, ...]

    @property
    def prompt_length(self) -> int:
        """Length of the first turn's prompt: everything before the first generated token."""
        return self.spans[0].output_start if self.spans else 0

    def as_dict(self, session_id: str) -> dict[str, Any]:
        prompt_length = self.prompt_length
        return {
            "session_id": session_id,
            "token_ids": self.token_ids,
            "loss_mask": self.loss_mask,
            "logprobs": self.logprobs,
            "prompt_length": prompt_length,
            "response_length": len(self.token_ids) - prompt_length,
            "num_turns": len(self.spans),
            "turns": [
                {
                    "turn": s.turn,
                    "prompt_start": s.prompt_start,
                    "output_start": s.output_start,
                    "output_end": s.output_end,
                    "weight_versions": [
                        {"version": v, "abs_start": a, "abs_end": b} for v, a, b in s.weight_versions
                    ],
                }
                for s in self.spans
            ],
        }


def accumulated_ids(records: Sequence[TurnRecord]) -> array[int]:
    """The last turn's prompt + output ids (empty for no turns), rebuilt from the delta-encoded chain."""
    sequence: array[int] = array("i")
    for record in records:
        if record.prompt_prefix_len != len(sequence):
            sequence = sequence[: record.prompt_prefix_len]
        sequence.extend(record.prompt_new_ids)
        sequence.extend(record.output_ids)
    return sequence


def build_trajectory(records: Sequence[TurnRecord]) -> Trajectory:
    """The token-exact training trajectory of a linear session.

    Raises SessionConflict(code="trajectory_not_linear") when some turn's prompt does not extend the
    sequence before it (possible only for turns recorded without a tokenizer), naming the turn.
    """
    token_ids: list[int] = []
    loss_mask: list[int] = []
    logprobs: list[float] = []
    spans: list[TurnSpan] = []
    for record in records:
        if record.prompt_prefix_len != len(token_ids):
            raise SessionConflict(
                f"turn {record.index}'s prompt does not extend the turns before it (its engine re-rendered "
                f"the history: {record.prompt_prefix_len} of {len(token_ids)} ids match); run the gateway with "
                "--tokenizer for token-exact multi-turn trajectories",
                code="trajectory_not_linear",
            )
        prompt_start = len(token_ids)
        token_ids.extend(record.prompt_new_ids)
        output_start = len(token_ids)
        token_ids.extend(record.output_ids)
        new_prompt = len(record.prompt_new_ids)
        loss_mask.extend([0] * new_prompt)
        loss_mask.extend([1] * len(record.output_ids))
        logprobs.extend([0.0] * new_prompt)
        if len(record.output_logprobs) == len(record.output_ids):
            logprobs.extend(record.output_logprobs)
        else:  # the engine returned no logprobs (recorded mode against a plain server)
            logprobs.extend([0.0] * len(record.output_ids))
        spans.append(
            TurnSpan(
                turn=record.index,
                prompt_start=prompt_start,
                output_start=output_start,
                output_end=len(token_ids),
                weight_versions=tuple(
                    (v, output_start + a, output_start + b) for v, a, b in weight_spans(record)
                ),
            )
        )
    return Trajectory(token_ids=token_ids, loss_mask=loss_mask, logprobs=logprobs, spans=tuple(spans))


def expand_records(records: Sequence[TurnRecord], *, full_prompt_ids: bool = True) -> list[dict[str, Any]]:
    """The records as the API shows them (miles-compatible fields first, then token metadata).

    Each record's `request` carries its full `messages` again. With `full_prompt_ids` each record lists its
    whole prompt; otherwise only `prompt_new_token_ids` after `prompt_prefix_len` (linear in size).
    """
    out: list[dict[str, Any]] = []
    state: list[dict[str, Any]] = []
    sequence: array[int] = array("i")
    for record in records:
        messages = state[: record.messages_from] + list(record.new_messages)
        if record.prompt_prefix_len != len(sequence):
            sequence = sequence[: record.prompt_prefix_len]
        entry: dict[str, Any] = {
            "timestamp": record.finished_at_unix,
            "request_timestamp": record.request_at_unix,
            "method": record.method,
            "path": record.path,
            "request": {**record.request, "messages": messages},
            "response": record.response,
            "status_code": record.status_code,
            "turn": record.index,
            "request_id": record.request_id,
            "prompt_prefix_len": record.prompt_prefix_len,
        }
        if full_prompt_ids:
            prompt_ids = sequence.tolist() + record.prompt_new_ids.tolist()
            entry["prompt_token_ids"] = prompt_ids
            entry["request"]["input_ids"] = prompt_ids  # where miles' assembler reads the prompt
        else:
            entry["prompt_new_token_ids"] = record.prompt_new_ids.tolist()
        entry["response"] = _with_meta_info(record)
        entry.update(
            output_token_ids=record.output_ids.tolist(),
            output_logprobs=record.output_logprobs.tolist(),
            finish_reason=record.finish_reason,
            engine=record.engine_id,
            weight_version=record.weight_version,
            weight_versions=[{"version": v, "start": a, "end": b} for v, a, b in weight_spans(record)],
            timing=record.timing,
            tokenized_by_gateway=record.tokenized_by_gateway,
        )
        out.append(entry)
        sequence.extend(record.prompt_new_ids)
        sequence.extend(record.output_ids)
        state = [*messages, record.reply_message]
    return out


def _with_meta_info(record: TurnRecord) -> dict[str, Any]:
    """The agent's completion with the engine's `meta_info` on its first choice, as SGLang's chat endpoint
    answers with `return_meta_info` (what miles' assembler reads: `output_token_logprobs` as
    `[logprob, token_id, null]`, the finish reason, weight version and counters)."""
    response = dict(record.response)
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return response
    logprobs = record.output_logprobs if len(record.output_logprobs) == len(record.output_ids) else None
    meta: dict[str, Any] = {
        **record.engine_meta,
        "output_token_logprobs": [
            [None if logprobs is None else logprobs[i], token, None]
            for i, token in enumerate(record.output_ids)
        ],
        "finish_reason": {"type": record.finish_reason} if record.finish_reason else None,
        "weight_version": record.weight_version,
    }
    meta.setdefault("completion_tokens", len(record.output_ids))
    response["choices"] = [{**choices[0], "meta_info": meta}, *choices[1:]]
    return response
