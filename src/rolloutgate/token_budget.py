"""Session token budgets: cap a call's output so its prompt plus what it generates stays within `max_seq_len`.

Theory of operation (pure functions, no I/O): a budget comes from a session (`POST /sessions {"max_seq_len"}`,
or the server's `--session-max-seq-len`) or a request header (`X-Rolloutgate-Max-Seq-Len`); where several
apply, the tightest wins (`tightest`). `cap` reads the call's own output limit (SGLang
`sampling_params.max_new_tokens`, OpenAI `max_completion_tokens` / `max_tokens`), lowers it to what the budget
leaves after the prompt, and says how many tokens that saved. The engine then ends the call with its own
`length` finish reason at the budget. A call that sets no limit gets what the budget leaves as its limit (and
saves nothing: it asked for nothing in particular).

A prompt that already fills the budget leaves nothing to generate (`BudgetCap.has_no_room`); what the client
gets then is its API's answer to a context that is full (the callers decide, by the client's API):
- SGLang `/generate` (miles' own TITO call): a zero-token answer with finish reason `length`
  (`zero_token_answer`), never sent to an engine. It is what miles decides itself when its own context budget
  is spent (`compute_request_payload`: no call, the sample TRUNCATED); its `post` retries any non-2xx 60 times
  before failing the rollout, so a 4xx there would cost a minute and the step;
- OpenAI chat and completions (agents, session turns): 400 `context_length_exceeded` (`no_room_error`), worded
  so LiteLLM raises its ContextWindowExceededError; no client retries a 400, and the agent ends its trial as on
  an engine's own context-overflow 400. A zero-token reply would invite it to carry on, each empty turn costing
  a prefill of the whole history, and miles' `/samples` drops such a turn anyway (truncation at `max_seq_len`).

The prompt's length is exact where the call carries token ids (SGLang `input_ids`, a completions prompt of ids,
a session turn the gateway tokenized) and the gateway's estimate otherwise (~4 characters a token).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rolloutgate.engines.base import Route
from rolloutgate.errors import BadRequest

__all__ = (
    "HEADER",
    "BudgetCap",
    "cap",
    "header_budget",
    "no_room_error",
    "parse_max_seq_len",
    "tightest",
    "zero_token_answer",
)

HEADER = "X-Rolloutgate-Max-Seq-Len"
# where each route keeps its output limit, the first one the preferred (OpenAI: max_tokens is deprecated)
_LIMIT_FIELDS = {
    Route.CHAT: ("max_completion_tokens", "max_tokens"),
    Route.COMPLETIONS: ("max_tokens",),
}
# the routes whose output limit is a field of `sampling_params`: SGLang's and vLLM's names for it
_SAMPLING_LIMIT_FIELDS = {Route.GENERATE: "max_new_tokens", Route.TOKENS: "max_tokens"}


def parse_max_seq_len(value: Any, *, param: str) -> int | None:
    """A `max_seq_len` from a JSON body: a positive integer or null. Raises BadRequest."""
    if value is None:
        return None
    if type(value) is not int or value < 1:
        raise BadRequest(f"'{param}' must be a positive integer or null", param=param, code="invalid_value")
    return value


def header_budget(headers: Mapping[str, str]) -> int | None:
    """The `X-Rolloutgate-Max-Seq-Len` of `headers` (a positive integer), or None. Raises BadRequest.
    `headers` compare names without case, as aiohttp's and the session service's do (sessions/service.py)."""
    raw = headers.get(HEADER)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise BadRequest(
            f"header {HEADER} must be a positive integer (tokens)", param=HEADER, code="invalid_override"
        )
    return value


def tightest(*budgets: int | None) -> int | None:
    """The smallest of the budgets given (None: none is)."""
    given = [b for b in budgets if b is not None]
    return min(given) if given else None


@dataclass(frozen=True, slots=True, kw_only=True)
class BudgetCap:
    """What a budget did to one call: its own limit (`asked`, None: it set none) and what the budget left."""

    max_seq_len: int
    prompt_tokens: int
    asked: int | None
    allowed: int  # max_seq_len - prompt_tokens, at least 0

    @property
    def limit(self) -> int:
        """The call's output limit under the budget."""
        return self.allowed if self.asked is None else min(self.asked, self.allowed)

    @property
    def saved(self) -> int:
        """Tokens the call asked for that the budget did not allow."""
        return 0 if self.asked is None else self.asked - self.limit

    @property
    def has_no_room(self) -> bool:
        """The prompt fills the budget and the call asked to generate (a call asking for 0 tokens has room)."""
        return self.allowed == 0 and self.asked != 0


def cap(
    route: Route, body: dict[str, Any], *, prompt_tokens: int, max_seq_len: int
) -> tuple[dict[str, Any], BudgetCap]:
    """The body with its output limit lowered to what `max_seq_len` leaves after `prompt_tokens` (a new dict
    where it changes; `body` is not modified), and the decision. Raises BadRequest for a batch `/generate`
    (several prompts, one budget: send them one by one)."""
    allowed = max(0, max_seq_len - prompt_tokens)
    sampled_limit = _SAMPLING_LIMIT_FIELDS.get(route)
    if sampled_limit is not None:
        params = body.get("sampling_params")
        if isinstance(params, list) or _is_batch(body):
            raise BadRequest(f"{HEADER} budgets one prompt; send a batch's prompts one by one", param=HEADER)
        params = params if isinstance(params, dict) else {}
        asked = params.get(sampled_limit)
        decision = BudgetCap(
            max_seq_len=max_seq_len, prompt_tokens=prompt_tokens, asked=asked, allowed=allowed
        )
        if asked != decision.limit:
            body = {**body, "sampling_params": {**params, sampled_limit: decision.limit}}
        return body, decision
    fields = _LIMIT_FIELDS[route]
    limits = [body[f] for f in fields if body.get(f) is not None]
    decision = BudgetCap(
        max_seq_len=max_seq_len,
        prompt_tokens=prompt_tokens,
        asked=min(limits) if limits else None,
        allowed=allowed,
    )
    if decision.asked is None:
        return {**body, fields[-1]: decision.limit}, decision
    if decision.saved:
        body = {**body, **{f: decision.limit for f in fields if body.get(f) is not None}}
    return body, decision


def _is_batch(body: dict[str, Any]) -> bool:
    ids, text = body.get("input_ids"), body.get("text")
    return (isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)) or isinstance(text, list)


def no_room_error(decision: BudgetCap) -> BadRequest:
    """400 `context_length_exceeded` for an OpenAI-route call whose prompt fills its budget."""
    return BadRequest(
        f"This model's maximum context length is {decision.max_seq_len} tokens under the session's token "
        f"budget (max_seq_len); the prompt has {decision.prompt_tokens} tokens, which leaves none to generate",
        param="max_seq_len",
        code="context_length_exceeded",
    )


def zero_token_answer(body: dict[str, Any], decision: BudgetCap, rid: str) -> dict[str, Any]:
    """SGLang's `/generate` answer for a call the budget leaves no room: no tokens, finish reason `length`."""
    meta: dict[str, Any] = {
        "id": body.get("rid") if isinstance(body.get("rid"), str) else rid,
        "finish_reason": {"type": "length", "length": 0},
        "prompt_tokens": decision.prompt_tokens,
        "completion_tokens": 0,
        "cached_tokens": 0,
        "e2e_latency": 0.0,
    }
    if body.get("return_logprob"):
        meta["output_token_logprobs"] = []
        meta["input_token_logprobs"] = []
    return {"text": "", "output_ids": [], "meta_info": meta}
