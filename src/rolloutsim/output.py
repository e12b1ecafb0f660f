"""Response bodies: SGLang /generate items and OpenAI chat/completion bodies and chunks, per flavour."""

from __future__ import annotations

import time
from typing import Any

from rolloutsim import tokens
from rolloutsim.params import GenParams
from rolloutsim.request import SimRequest

__all__ = ("OpenAIFormatter", "TokenView", "generate_item")


class TokenView:
    """A request's output ids and words, materialised as far as they have been read."""

    __slots__ = ("ids", "lps", "req", "words")

    def __init__(self, req: SimRequest) -> None:
        self.req = req
        self.ids: list[int] = []
        self.words: list[str] = []
        self.lps: list[float] = []  # logprobs computed so far (cumulative chunks repeat them all)

    def upto(self, count: int) -> None:
        if count > len(self.ids):
            new = self.req.output_ids(len(self.ids), count)
            self.ids.extend(new)
            self.words.extend(tokens.word(t) for t in new)

    def text(self, start: int, end: int) -> str:
        self.upto(end)
        return "".join(self.words[start:end])

    def logprob(self, position: int) -> float:
        lps = self.lps
        if position >= len(lps):
            key = self.req.key
            lps.extend(tokens.logprob_of(key, i) for i in range(len(lps), position + 1))
        return lps[position]

    def alternatives(self, position: int, count: int) -> list[tuple[float, int]]:
        """The chosen token first, then `count - 1` made-up, less likely ones."""
        self.upto(position + 1)
        chosen = self.logprob(position)
        out = [(chosen, self.ids[position])]
        for j in range(1, count):
            other = tokens.output_token(self.req.key ^ (j * 0x2545F491), position, self.req.vocab_size)
            out.append((round(chosen - 0.5 * j - 0.25, 3), other))
        return out


def prompt_logprobs(params: GenParams) -> list[list[Any]]:
    """SGLang's `input_token_logprobs` from `logprob_start_len` on: `[logprob, token_id, None]` per prompt
    token, the first token of the prompt scored None (nothing precedes it). Deterministic in the prefix."""
    if params.logprob_start_len < 0:
        return []
    ids = params.prompt_ids
    out: list[list[Any]] = []
    for i in range(params.logprob_start_len, len(ids)):
        score = None if i == 0 else tokens.logprob_of(ids[i] * 1_000_003 + ids[i - 1], i)
        out.append([score, ids[i], None])
    return out


def generate_item(
    req: SimRequest,
    view: TokenView,
    params: GenParams,
    count: int,
    *,
    final: bool,
    weight_version: str,
    since: int = 0,
) -> dict[str, Any]:
    """One SGLang /generate result up to `count` tokens; `final` adds finish and latency. Its text, ids and
    output logprobs are tokens `since`..`count`: all of them (0, cumulative), or a chunk's own under
    `--incremental-streaming-output`; the counts in `meta_info` are the whole output's either way."""
    view.upto(count)
    finish = req.finish if final else None
    meta: dict[str, Any] = {"id": req.rid, "finish_reason": None if finish is None else finish.sglang()}
    if finish is None or not finish.in_queue:
        meta["prompt_tokens"] = req.prompt_tokens
    meta["weight_version"] = weight_version
    spans = req.weight_versions(count)
    if spans is not None:  # its output crossed an in-place weight update (SGLang's per-span versions)
        meta["weight_versions"] = spans
    meta["num_retractions"] = req.num_retractions
    meta["reasoning_tokens"] = 0
    meta["completion_tokens"] = count
    if finish is None or not finish.in_queue:
        meta["cached_tokens"] = req.cached_tokens
    if params.logprobs:
        text_of = tokens.word if params.logprobs_text else None
        meta["input_token_logprobs"] = prompt_logprobs(params)
        if count:
            view.logprob(count - 1)
        ids, lps = view.ids, view.lps
        if text_of is None:
            meta["output_token_logprobs"] = [
                [lp, tid, None] for lp, tid in zip(lps[since:count], ids[since:count], strict=True)
            ]
        else:
            meta["output_token_logprobs"] = [
                [lp, tid, text_of(tid)] for lp, tid in zip(lps[since:count], ids[since:count], strict=True)
            ]
        meta["output_token_logprobs_length"] = count
        if params.top_logprobs:
            meta["input_top_logprobs"] = []
            meta["output_top_logprobs"] = [
                [[lp, tid, None] for lp, tid in view.alternatives(i, params.top_logprobs)]
                for i in range(since, count)
            ]
    if final:
        meta["e2e_latency"] = req.e2e_latency()
    item: dict[str, Any] = {
        "text": view.text(since, count),
        "output_ids": view.ids[since:count],
        "meta_info": meta,
    }
    if params.return_prompt_token_ids:
        item["prompt_token_ids"] = params.prompt_ids
    return item


class _Formatter:
    """What every formatter of one request's bodies holds: the request, its parameters, the names it answers
    with, and its output as read so far."""

    def __init__(self, *, req: SimRequest, params: GenParams, model_name: str, weight_version: str) -> None:
        self.req = req
        self.params = params
        self.model_name = model_name
        self.weight_version = weight_version
        self.created = int(time.time())
        self.view = TokenView(req)


class OpenAIFormatter(_Formatter):
    """Builds one request's OpenAI bodies. `flavour` is "sglang" or "vllm"; `kind` "chat" or "completion"."""

    def __init__(
        self,
        *,
        flavour: str,
        kind: str,
        req: SimRequest,
        params: GenParams,
        model_name: str,
        weight_version: str,
    ) -> None:
        super().__init__(req=req, params=params, model_name=model_name, weight_version=weight_version)
        self.flavour = flavour
        self.kind = kind
        if flavour == "vllm":
            self.id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{req.rid}"
        else:
            self.id = req.rid
        self.object = "chat.completion" if kind == "chat" else "text_completion"

    # ----------------------------------------------------------------------------- pieces

    def _finish_fields(self, final: bool) -> dict[str, Any]:
        finish = self.req.finish if final else None
        fields: dict[str, Any] = {"finish_reason": None if finish is None else finish.openai}
        if self.flavour == "sglang":
            fields["matched_stop"] = None if finish is None else finish.matched
        elif final:
            fields["stop_reason"] = None
        return fields

    def usage(self) -> dict[str, Any]:
        req = self.req
        usage: dict[str, Any] = {
            "prompt_tokens": req.prompt_tokens,
            "completion_tokens": req.completion_tokens,
            "total_tokens": req.prompt_tokens + req.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": req.cached_tokens}
            if self.req.cached_tokens or self.flavour == "sglang"
            else None,
        }
        if self.flavour == "sglang":
            usage["reasoning_tokens"] = 0
        return usage

    def _logprobs(self, start: int, end: int) -> dict[str, Any] | None:
        if not self.params.logprobs:
            return None
        view = self.view
        view.upto(end)
        top = self.params.top_logprobs
        if self.kind == "chat":
            content = []
            for i in range(start, end):
                word = view.words[i]
                entry: dict[str, Any] = {
                    "token": word,
                    "logprob": view.logprob(i),
                    "bytes": list(word.encode()),
                    "top_logprobs": [
                        {"token": tokens.word(t), "logprob": lp, "bytes": list(tokens.word(t).encode())}
                        for lp, t in view.alternatives(i, top)
                    ]
                    if top
                    else [],
                }
                content.append(entry)
            return {"content": content}
        offsets, offset = [], len(view.text(0, start))
        for i in range(start, end):
            offsets.append(offset)
            offset += len(view.words[i])
        return {
            "text_offset": offsets,
            "token_logprobs": [view.logprob(i) for i in range(start, end)],
            "tokens": view.words[start:end],
            "top_logprobs": [
                {tokens.word(t): lp for lp, t in view.alternatives(i, top)} for i in range(start, end)
            ]
            if top
            else None,
        }

    def _head(self, object_name: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model_name}

    # ----------------------------------------------------------------------------- bodies

    def whole(self) -> dict[str, Any]:
        """The non-streaming response."""
        req, view = self.req, self.view
        count = req.completion_tokens
        text = view.text(0, count)
        choice: dict[str, Any] = {"index": 0}
        if self.kind == "chat":
            if self.flavour == "vllm":
                choice["message"] = {
                    "role": "assistant",
                    "content": text,
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "tool_calls": [],
                    "reasoning_content": None,
                }
            else:
                choice["message"] = {
                    "role": "assistant",
                    "content": text,
                    "reasoning_content": None,
                    "tool_calls": None,
                }
        else:
            choice["text"] = text
        choice["logprobs"] = self._logprobs(0, count)
        choice.update(self._finish_fields(True))
        body = self._head(self.object)
        if self.flavour == "vllm":
            choice["token_ids"] = view.ids[:count] if self.params.return_token_ids else None
            body["choices"] = [choice]
            body["service_tier"] = None
            body["system_fingerprint"] = None
            body["usage"] = self.usage()
            body["prompt_logprobs"] = None
            body["prompt_token_ids"] = self.params.prompt_ids if self.params.return_token_ids else None
            body["kv_transfer_params"] = None
            return body
        if self.params.return_token_ids or self.params.return_prompt_token_ids:
            choice["prompt_token_ids"] = self.params.prompt_ids
        if self.params.return_token_ids:
            choice["response_token_ids" if self.kind == "chat" else "token_ids"] = view.ids[:count]
        if self.params.return_meta_info and self.kind == "chat":
            meta_params = GenParams(
                prompt_ids=self.params.prompt_ids,
                max_new_tokens=req.max_new_tokens,
                logprobs=self.params.logprobs,
                logprobs_text=True,
            )
            item = generate_item(
                req, view, meta_params, count, final=True, weight_version=self.weight_version
            )
            choice["meta_info"] = item["meta_info"]
        body["choices"] = [choice]
        body["usage"] = self.usage()
        body["metadata"] = {"weight_version": self.weight_version}
        return body

    def role_chunk(self) -> dict[str, Any]:
        """The first chat chunk: the assistant role and empty content."""
        choice: dict[str, Any] = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
        choice.update(self._finish_fields(False))
        body = self._head("chat.completion.chunk")
        body["choices"] = [choice]
        if self.flavour == "sglang":
            body["usage"] = None
        return body

    def delta_chunk(self, start: int, end: int, *, final: bool) -> dict[str, Any]:
        """Tokens [start, end) as one chunk; `final` adds the finish reason."""
        text = self.view.text(start, end)
        choice: dict[str, Any] = {"index": 0}
        if self.kind == "chat":
            choice["delta"] = {"content": text} if end > start or not final else {}
        else:
            choice["text"] = text
        choice["logprobs"] = self._logprobs(start, end)
        choice.update(self._finish_fields(final))
        if self.params.return_token_ids:
            choice["token_ids"] = self.view.ids[start:end]
        body = self._head("chat.completion.chunk" if self.kind == "chat" else "text_completion")
        body["choices"] = [choice]
        if self.flavour == "sglang":
            body["usage"] = None
        return body

    def usage_chunk(self) -> dict[str, Any]:
        body = self._head("chat.completion.chunk" if self.kind == "chat" else "text_completion")
        body["choices"] = []
        body["usage"] = self.usage()
        return body


class TokensFormatter(_Formatter):
    """Builds one request's bodies for vLLM's token-in/token-out `/inference/v1/generate` (vLLM 0.32
    `scale_out/token_in_token_out`: GenerateTokensResponse, GenerateTokensStreamResponse), in their field
    order. Its streaming chunks carry the new ids; there is no role chunk."""

    kind = "tokens"

    def __init__(self, *, req: SimRequest, params: GenParams, model_name: str, weight_version: str) -> None:
        super().__init__(req=req, params=params, model_name=model_name, weight_version=weight_version)
        self.id = f"generate-tokens-{req.rid}"

    def usage(self) -> dict[str, Any]:
        req = self.req
        return {
            "prompt_tokens": req.prompt_tokens,
            "total_tokens": req.prompt_tokens + req.completion_tokens,
            "completion_tokens": req.completion_tokens,
            "prompt_tokens_details": None,
        }

    def _choice(self, start: int, end: int, *, final: bool) -> dict[str, Any]:
        view = self.view
        view.upto(end)
        finish = self.req.finish if final else None
        logprobs = None
        if self.params.logprobs:
            top = self.params.top_logprobs
            content = []
            for i in range(start, end):
                alternatives = view.alternatives(i, max(top, 1))  # vLLM: at least the sampled token
                content.append(
                    {
                        "token_id": view.ids[i],
                        "logprob": view.logprob(i),
                        "rank": 1,
                        "top_logprobs": [
                            {"token_id": t, "logprob": lp, "rank": rank + 1}
                            for rank, (lp, t) in enumerate(alternatives)
                        ],
                    }
                )
            logprobs = {"content": content}
        return {
            "index": 0,
            "finish_reason": None if finish is None else finish.openai,
            "stop_reason": None,
            "token_ids": view.ids[start:end],
            "routed_experts": None,
            "sampling_mask": None,
            "weight_versions": None,
            "logprobs": logprobs,
        }

    def whole(self) -> dict[str, Any]:
        """The non-streaming response (every field rendered, nulls included, as vLLM's JSONResponse does)."""
        count = self.req.completion_tokens
        choice = self._choice(0, count, final=True)
        choice["finish_reason"] = choice["finish_reason"] or "stop"
        return {
            "request_id": self.id,
            "model": self.model_name,
            "created": self.created,
            "usage": self.usage(),
            "prompt_logprobs": None,
            "prompt_token_id_logprobs": None,
            "prompt_token_ids": self.params.prompt_ids if self.params.return_prompt_token_ids else None,
            "mm_placeholders": None,
            "metrics": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "output_mode": "tokens",
            "choices": [choice],
        }

    def role_chunk(self) -> dict[str, Any]:
        raise AssertionError("the tokens route has no role chunk")

    def delta_chunk(self, start: int, end: int, *, final: bool) -> dict[str, Any]:
        """Tokens [start, end) as one chunk; `final` adds the finish reason. The prompt's ids, when asked,
        ride on the first chunk only."""
        body: dict[str, Any] = {"request_id": self.id, "usage": None}
        if start == 0 and self.params.return_prompt_token_ids:
            body["prompt_token_ids"] = self.params.prompt_ids
        body["output_mode"] = "tokens"
        body["choices"] = [self._choice(start, end, final=final)]
        return body

    def usage_chunk(self) -> dict[str, Any]:
        usage = {key: value for key, value in self.usage().items() if value is not None}  # exclude_none
        return {"request_id": self.id, "usage": usage, "output_mode": "tokens", "choices": []}
