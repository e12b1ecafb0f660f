"""One request inside a simulated engine, and how it finished.

`SimRequest` is the engine model's mutable record (the HTTP layer reads it, only the model writes it).
Output tokens are lazy: the model only counts them (`completion_tokens`); their ids come from
`tokens.output_token(key, i)` when someone reads them, so a decode step costs O(batch), not O(tokens).
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass
from typing import Any

from rolloutsim import tokens

__all__ = ("ONLY_AT_END", "FinishReason", "RequestState", "SimRequest")

ONLY_AT_END = 1 << 62  # `SimRequest.notify_from` of a request whose handler waits for its end only


class RequestState(enum.Enum):
    WAITING = "waiting"  # in the engine's queue (or accepted and never started, under the blackhole fault)
    PREFILLING = "prefilling"  # admitted, prompt being computed
    RUNNING = "running"  # decoding
    FINISHED = "finished"


@dataclass(frozen=True, slots=True, kw_only=True)
class FinishReason:
    kind: str  # "stop" | "length" | "abort"
    message: str | None = None  # abort only
    status_code: int | None = None  # abort only: an HTTP status the engine answers with (503 queue full)
    matched: int | None = None  # stop only: the token id matched
    length: int = 0  # length only
    in_queue: bool = False  # abort only: the request never left the waiting queue

    def sglang(self) -> dict[str, Any]:
        """SGLang's meta_info.finish_reason."""
        if self.kind == "stop":
            return {"type": "stop", "matched": self.matched}
        if self.kind == "length":
            return {"type": "length", "length": self.length}
        if self.in_queue:
            return {"type": "abort", "message": self.message}
        return {"type": "abort", "message": self.message, "status_code": self.status_code, "err_type": None}

    @property
    def openai(self) -> str:
        return self.kind


class SimRequest:
    """A request as the engine sees it. Times are simulated seconds (the model's clock)."""

    __slots__ = (
        "abort_pending",
        "answered_at",
        "arrived_at",
        "cached_tokens",
        "completion_tokens",
        "emit_log",
        "finish",
        "finished_at",
        "first_token_at",
        "internal",
        "key",
        "listener",
        "max_new_tokens",
        "notify_from",
        "num_retractions",
        "prefill_target",
        "prefilled",
        "prompt_ids",
        "prompt_len",
        "rid",
        "started_at",
        "state",
        "stop_at",
        "submitted_at",
        "token_times",
        "vocab_size",
        "wants_logprobs",
        "weight_spans",
    )

    def __init__(
        self,
        rid: str,
        prompt_ids: list[int],
        *,
        max_new_tokens: int,
        seed: int = 0,
        ignore_eos: bool = False,
        stop_fraction: float = 0.0,
        wants_logprobs: bool = False,
        internal: bool = False,
        vocab_size: int = tokens.DEFAULT_VOCAB_SIZE,
    ) -> None:
        if not prompt_ids:
            raise ValueError("a prompt needs at least one token")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens!r}")
        self.rid = rid
        self.prompt_ids = prompt_ids  # released when the request finishes (finished ones are kept around)
        self.prompt_len = len(prompt_ids)
        self.max_new_tokens = max_new_tokens
        self.key = tokens.request_key(seed, prompt_ids)
        self.stop_at = None if ignore_eos else tokens.stop_length(self.key, max_new_tokens, stop_fraction)
        self.wants_logprobs = wants_logprobs
        self.vocab_size = vocab_size  # the engine's: its generated ids stay below
        self.internal = internal  # health checks: physics only, never counted or listed
        self.state = RequestState.WAITING
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.prefilled = 0  # tokens of prefill_target in KV (cached + computed)
        self.prefill_target = len(prompt_ids)  # prompt, plus already generated tokens after a retraction
        self.num_retractions = 0
        self.submitted_at = 0.0
        # when its HTTP call reached the engine, before it waited behind a pause or a weight update (set by
        # the HTTP layer; None: as submitted)
        self.arrived_at: float | None = None
        self.started_at: float | None = None
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.finish: FinishReason | None = None
        self.abort_pending: FinishReason | None = None
        self.token_times: list[float] | None = None
        # streamed requests (set by the HTTP layer): one (tokens before, count, at, times or None) per token
        # burst, consumed by the handler to know when each streamed token was produced (sim/output_path.py)
        self.emit_log: deque[tuple[int, int, float, list[float] | None]] | None = None
        # the token count from which its handler wants to hear of progress (a stream's next mark; ONLY_AT_END
        # for a whole answer; its end is always told): token bursts before it wake no handler and are not
        # logged. Behind 128 streams at stream_interval 2^30 (the gateway's progress signal) a log of every
        # burst held ~4M tuples and made the garbage collector the simulator's largest cost, and a wake per
        # engine step per request was its next
        self.notify_from = 1
        self.answered_at: float | None = None  # its answer's last chunk or body left the output path
        self.listener: Any = None  # set by the driver's user (an asyncio.Event); the model never reads it
        # (version, first output offset under it) per weight version its output crossed; None: it crossed none
        self.weight_spans: list[tuple[str, int]] | None = None

    @property
    def prompt_tokens(self) -> int:
        return self.prompt_len

    def note_weight_version(self, old: str, new: str) -> None:
        """Its engine adopted `new` weights in place: the tokens it generates from now on are `new`'s."""
        if not self.completion_tokens:
            return  # nothing generated yet: its whole output is `new`'s (its final weight_version says so)
        spans = self.weight_spans if self.weight_spans is not None else [(old, 0)]
        if spans[-1][1] == self.completion_tokens:
            spans.pop()  # no token under the version before: it has no span
        spans.append((new, self.completion_tokens))
        self.weight_spans = spans

    def weight_versions(self, count: int) -> list[dict[str, Any]] | None:
        """SGLang's `meta_info.weight_versions` of its first `count` output tokens: `{"version", "start",
        "end"}` per version (output offsets), when it crossed an update; else None (one version)."""
        spans = self.weight_spans
        if spans is None:
            return None
        ends = [start for _, start in spans[1:]] + [count]
        return [
            {"version": version, "start": start, "end": min(end, count)}
            for (version, start), end in zip(spans, ends, strict=True)
            if start < min(end, count)
        ]

    @property
    def limit(self) -> int:
        """completion_tokens at which the request finishes by itself."""
        return self.stop_at if self.stop_at is not None else self.max_new_tokens

    @property
    def is_finished(self) -> bool:
        return self.state is RequestState.FINISHED

    @property
    def context_tokens(self) -> int:
        return self.prompt_len + self.completion_tokens

    def output_ids(self, start: int = 0, end: int | None = None) -> list[int]:
        """Output token ids [start, end) (end defaults to completion_tokens); EOS last when stopped."""
        stop = self.completion_tokens if end is None else min(end, self.completion_tokens)
        ids = tokens.output_tokens(self.key, start, stop, self.vocab_size)
        if self.stop_at is not None and stop == self.stop_at and stop > start:
            ids[-1] = tokens.EOS_TOKEN_ID
        return ids

    def e2e_latency(self) -> float:
        end = self.finished_at if self.finished_at is not None else self.submitted_at
        return end - self.submitted_at

    def snapshot(self) -> dict[str, Any]:
        """A JSON-able view for /sim/state."""
        out: dict[str, Any] = {
            "rid": self.rid,
            "state": self.state.value,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "max_new_tokens": self.max_new_tokens,
            "num_retractions": self.num_retractions,
            "submitted_at": self.submitted_at,
            "started_at": self.started_at,
            "first_token_at": self.first_token_at,
            "finished_at": self.finished_at,
            "answered_at": self.answered_at,
            "finish_reason": None if self.finish is None else self.finish.sglang(),
        }
        if self.token_times is not None:
            out["token_times"] = self.token_times
        return out

    def __repr__(self) -> str:
        return f"<SimRequest {self.rid} {self.state.value} {self.completion_tokens}/{self.limit}>"
