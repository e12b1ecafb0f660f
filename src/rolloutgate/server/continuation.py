"""Continuing a generation on a new attempt from the tokens it already has (hung, dead or drained engine).

Theory of operation: an attempt that ends early has output the gateway already holds: a streaming client has
read part of it, and a non-streaming `/generate` call's chunks carry it too (the engine sends the output so
far every `--checkpoint-tokens` tokens, engines/sglang.py). Where the engine API allows it, the next attempt
asks for the rest instead of starting over: the prompt plus the partial output, and the remaining token
budget. What the client then reads is the earlier part followed by the new part:

- chat (`/v1/chat/completions`, streaming clients only): the partial answer becomes a final assistant message
  with `continue_final_message: true` and `add_generation_prompt: false` (vLLM; SGLang ignores unknown fields
  and renders it as a turn, which is the closest it offers). Deltas simply go on. The usage frame counts the
  new attempt's tokens only.
- completions (streaming clients only): prompt + partial text (string prompts only).
- SGLang `/generate` (streaming or not): input_ids + partial output_ids (or text + partial text). Its answer
  and stream are cumulative, so each chunk of the new attempt is rewritten to carry the earlier output first
  (`GenerateStitcher`): ids, text, every `meta_info.output_*` list (the logprobs), the completion count, the
  original prompt's figures (`prompt_tokens`, `cached_tokens`, `input_*` logprobs) and the weight version
  of each span of the output (`weight_versions`, as SGLang reports an output that crossed an update).

Guarantee: the client never reads a token twice and never gets a second, unrelated answer; the continuation
is a new generation conditioned on the output already made (exact under greedy decoding, a valid sample
otherwise), and the engines generate each token once, but for what a dead engine made after its last chunk.
Requests with more than one choice, batches, prompts given as token lists to completions, and `/generate`
calls that ask for per-token payloads of the whole sequence (routed experts, hidden states) are not
continued: a streaming client gets a clear error, a non-streaming one a fresh start (`can_continue_whole`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from rolloutgate.engines.base import AssemblyHint, Route, UpstreamEvent
from rolloutgate.server.assemble import ResponseAssembler
from rolloutgate.server.prompt_ids import compact_json, token_ids_of

__all__ = (
    "CannotContinue",
    "GenerateStitcher",
    "answer_of_stream",
    "can_continue_whole",
    "continuation_body",
)

# per-token payloads that cover the whole sequence (prompt and output), which a stitch cannot join
_WHOLE_SEQUENCE_FIELDS = ("return_routed_experts", "return_hidden_states", "return_indexer_topk")
# the prompt's own figures: a continuation's prompt is the original plus the earlier output, so the earlier
# answer's values are the ones that describe the client's prompt
_PROMPT_FIGURES = ("prompt_tokens", "cached_tokens", "input_token_logprobs", "input_top_logprobs")


class CannotContinue(Exception):
    pass


def can_continue_whole(route: Route, body: dict[str, Any]) -> bool:
    """Whether a call whose client does not stream can go on from its partial output on a new attempt: a
    single `/generate` prompt (ids or text) sampled once, with nothing asked per token of the whole sequence."""
    if route is not Route.GENERATE or any(body.get(name) for name in _WHOLE_SEQUENCE_FIELDS):
        return False
    params = body.get("sampling_params")
    if params is not None and (not isinstance(params, dict) or params.get("n", 1) != 1):
        return False
    ids = body.get("input_ids")
    if isinstance(ids, orjson.Fragment):  # the front's compact copy: its first bytes tell, no parse needed
        head = orjson.dumps(ids)[:32].lstrip()
        return head.startswith(b"[") and not head[1:].lstrip().startswith(b"[")
    if ids is not None:
        return isinstance(ids, list) and all(isinstance(i, int) for i in ids[:1])
    return isinstance(body.get("text"), str)


def answer_of_stream(route: Route, history: list[bytes], shape: AssemblyHint | None = None) -> Any:
    """The answer so far of the events a streaming client was sent; `shape`: how they add up (None:
    SGLang's cumulative chunks, or OpenAI deltas)."""
    assembler = ResponseAssembler(route, hint=shape)
    for data in history:
        assembler.add(UpstreamEvent(data=data))
    return orjson.loads(assembler.result())


def _remaining(limit: Any, delivered: int) -> int | None:
    if not isinstance(limit, int):
        return None
    return max(1, limit - delivered)


def continuation_body(
    route: Route, body: dict[str, Any], answer: Any, delivered_tokens: int
) -> tuple[dict[str, Any], GenerateStitcher | None]:
    """The body of the next attempt, given the answer so far; for /generate the stitcher for its chunks.
    Raises CannotContinue."""
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
    if route is Route.TOKENS:
        return _continued_tokens(body, answer), None
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
    tokens = len(ids) or delivered_tokens
    params = dict(body.get("sampling_params") or {})
    if "max_new_tokens" in params:
        params["max_new_tokens"] = _remaining(params["max_new_tokens"], tokens)
    new["sampling_params"] = params
    meta = answer.get("meta_info")
    return new, GenerateStitcher(
        ids=ids, text=text, tokens=tokens, meta=meta if isinstance(meta, dict) else {}
    )


def _continued_tokens(body: dict[str, Any], answer: Any) -> dict[str, Any]:
    """vLLM's `/inference/v1/generate` from its last token: the ids made so far appended to the prompt, the
    rest of `max_tokens` asked. Its stream is of deltas, so the next attempt's chunks follow the client's as
    they come; the prompt's ids (`return_token_ids`) went out on the first attempt's first chunk."""
    ids = answer["choices"][0].get("token_ids") or []
    prompt_ids = token_ids_of(body.get("token_ids"))
    if not isinstance(prompt_ids, list) or not ids:
        raise CannotContinue("this /inference/v1/generate request cannot be continued")
    params = dict(body.get("sampling_params") or {})
    if "max_tokens" in params:
        params["max_tokens"] = _remaining(params["max_tokens"], len(ids))
    return {
        **body,
        "token_ids": compact_json([*prompt_ids, *ids]),
        "sampling_params": params,
        "return_token_ids": False,
    }


@dataclass(slots=True)
class GenerateStitcher:
    """Rewrites a continued /generate attempt's chunks (cumulative) or answer to include the earlier output."""

    ids: list[int]
    text: str
    tokens: int
    meta: dict[str, Any]  # the earlier answer's meta_info (itself stitched, after more than one continuation)

    def stitch(self, data: bytes) -> bytes:
        chunk = orjson.loads(data)
        if not isinstance(chunk, dict):
            return data
        chunk["text"] = self.text + (chunk.get("text") or "")
        if "output_ids" in chunk:
            chunk["output_ids"] = [*self.ids, *(chunk.get("output_ids") or [])]
        meta = chunk.get("meta_info")
        if isinstance(meta, dict):
            self._stitch_meta(meta)
        return orjson.dumps(chunk)

    def _stitch_meta(self, meta: dict[str, Any]) -> None:
        earlier = self.meta
        new_tokens = meta.get("completion_tokens")
        for key, value in list(meta.items()):
            before = earlier.get(key)
            if key.startswith("output_") and isinstance(value, list) and isinstance(before, list):
                meta[key] = [*before, *value]
            elif key.startswith("output_") and key.endswith("_length") and isinstance(value, int):
                meta[key] = value + self.tokens
        for key in _PROMPT_FIGURES:
            if key in meta and key in earlier:
                meta[key] = earlier[key]
            elif key == "prompt_tokens" and isinstance(meta.get(key), int):
                meta[key] -= self.tokens
        if isinstance(new_tokens, int):
            meta["completion_tokens"] = new_tokens + self.tokens
            spans = _joined_spans(
                _spans_of(earlier, 0, self.tokens), _spans_of(meta, self.tokens, new_tokens)
            )
            if len(spans) > 1:
                meta["weight_versions"] = [{"version": v, "start": a, "end": b} for v, a, b in spans]


def _spans_of(meta: dict[str, Any], offset: int, count: int) -> list[tuple[str, int, int]]:
    """(version, start, end) of an answer's output, shifted by `offset`: its own spans, else its one version."""
    listed = meta.get("weight_versions")
    if isinstance(listed, list) and listed:
        return [
            (str(s.get("version")), offset + int(s.get("start", 0)), offset + int(s.get("end", 0)))
            for s in listed
            if isinstance(s, dict)
        ]
    version = meta.get("weight_version")
    return [(str(version), offset, offset + count)] if version is not None and count > 0 else []


def _joined_spans(*parts: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    joined: list[tuple[str, int, int]] = []
    for version, start, end in (span for part in parts for span in part):
        if joined and joined[-1][0] == version and joined[-1][2] == start:
            joined[-1] = (version, joined[-1][1], end)
        else:
            joined.append((version, start, end))
    return joined
