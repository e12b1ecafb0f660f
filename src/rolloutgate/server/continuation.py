"""Continuing a stream the client already read part of, on a new attempt (gate abort mode, hung engine).

Theory of operation: a streaming client that has seen k tokens of an attempt cannot be given a fresh answer.
Where the engine API allows it, the next attempt asks for the rest instead: the prompt plus the partial output,
and the remaining token budget. What the client then reads is the earlier part followed by the new part:

- chat (`/v1/chat/completions`): the partial answer becomes a final assistant message with
  `continue_final_message: true` and `add_generation_prompt: false` (vLLM; SGLang ignores unknown fields and
  renders it as a turn, which is the closest it offers). Deltas simply go on. The usage frame counts the new
  attempt's tokens only.
- completions: prompt + partial text (string prompts only).
- SGLang `/generate`: input_ids + partial output_ids (or text + partial text). Its stream is cumulative, so
  each chunk of the new attempt is rewritten to carry the earlier output first (`GenerateStitcher`).

Guarantee: the client never reads a token twice and never gets a second, unrelated answer; the continuation
is a new generation conditioned on the text already sent (exact under greedy decoding, a valid sample
otherwise). Requests with more than one choice, or prompts given as token lists to completions, are not
continued: they fail with a clear error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from rolloutgate.engines.assemble import ResponseAssembler
from rolloutgate.engines.base import Route, UpstreamEvent
from rolloutgate.server.prompt_ids import compact_json, token_ids_of

__all__ = ("CannotContinue", "GenerateStitcher", "continuation_body")


class CannotContinue(Exception):
    pass


def _remaining(limit: Any, delivered: int) -> int | None:
    if not isinstance(limit, int):
        return None
    return max(1, limit - delivered)


def continuation_body(
    route: Route, body: dict[str, Any], history: list[bytes], delivered_tokens: int
) -> tuple[dict[str, Any], GenerateStitcher | None]:
    """The body of the next attempt, and for /generate the stitcher for its chunks. Raises CannotContinue."""
    assembler = ResponseAssembler(route)
    for data in history:
        assembler.add(UpstreamEvent(data=data))
    answer = orjson.loads(assembler.result())
    if route is Route.CHAT:
        text = answer["choices"][0]["message"].get("content") or ""
        new = {
            **body,
            "messages": [*body["messages"], {"role": "assistant", "content": text}],
            "continue_final_message": True,
            "add_generation_prompt": False,
        }
        for name in ("max_tokens", "max_completion_tokens"):
            if name in body:
                new[name] = _remaining(body[name], delivered_tokens)
        return new, None
    if route is Route.COMPLETIONS:
        if not isinstance(body.get("prompt"), str):
            raise CannotContinue("only string prompts can be continued")
        text = answer["choices"][0].get("text") or ""
        new = {**body, "prompt": body["prompt"] + text}
        if "max_tokens" in body:
            new["max_tokens"] = _remaining(body["max_tokens"], delivered_tokens)
        return new, None
    if isinstance(answer, list):
        raise CannotContinue("batch /generate streams cannot be continued")
    ids = list(answer.get("output_ids") or [])
    text = answer.get("text") or ""
    new = dict(body)
    prompt_ids = token_ids_of(body.get("input_ids"))
    if isinstance(prompt_ids, list) and ids:
        new["input_ids"] = compact_json([*prompt_ids, *ids])  # kept for the attempt: compact, as the front's
    elif isinstance(body.get("text"), str):
        new["text"] = body["text"] + text
    else:
        raise CannotContinue("this /generate request cannot be continued")
    params = dict(body.get("sampling_params") or {})
    if "max_new_tokens" in params:
        params["max_new_tokens"] = _remaining(params["max_new_tokens"], len(ids) or delivered_tokens)
    new["sampling_params"] = params
    return new, GenerateStitcher(ids=ids, text=text, tokens=len(ids) or delivered_tokens)


@dataclass(slots=True)
class GenerateStitcher:
    """Rewrites a continued /generate stream's cumulative chunks to include what the client already has."""

    ids: list[int]
    text: str
    tokens: int

    def stitch(self, data: bytes) -> bytes:
        chunk = orjson.loads(data)
        if not isinstance(chunk, dict):
            return data
        chunk["text"] = self.text + (chunk.get("text") or "")
        if "output_ids" in chunk:
            chunk["output_ids"] = [*self.ids, *(chunk.get("output_ids") or [])]
        meta = chunk.get("meta_info")
        if isinstance(meta, dict) and isinstance(meta.get("completion_tokens"), int):
            meta["completion_tokens"] += self.tokens
        return orjson.dumps(chunk)
