"""Parsing and validating generation requests (SGLang /generate and the OpenAI routes) into `GenParams`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rolloutsim import tokens
from rolloutsim.profiles import SimEngineConfig

__all__ = ("BadRequest", "GenParams", "parse_chat", "parse_completion", "parse_generate", "parse_tokens")


class BadRequest(Exception):
    """The request is invalid; `status` is the HTTP status to answer with."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param


@dataclass(frozen=True, slots=True, kw_only=True)
class GenParams:
    prompt_ids: list[int]
    max_new_tokens: int
    rid: str | None = None
    stream: bool = False
    stream_interval: int = 1
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    logprobs_text: bool = False  # SGLang return_text_in_logprobs
    include_usage: bool = False
    return_meta_info: bool = False
    return_token_ids: bool = False
    return_prompt_token_ids: bool = False
    logprob_start_len: int = -1  # SGLang: >= 0 also scores the prompt from there (miles' scoring calls)
    model: str | None = None


def _int(value: Any, name: str, *, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or int(value) != value:
        raise BadRequest(f"{name} must be an integer", param=name)
    if value < minimum:
        raise BadRequest(f"{name} must be >= {minimum}, got {value}", param=name)
    return int(value)


def _token_ids(value: Any, name: str, vocab_size: int) -> list[int]:
    """A prompt of ids, each in the engine's vocabulary: the 400 an engine that checks them answers (vLLM does;
    SGLang 0.5.9 dies instead, which the gateway's own check keeps from happening: server/validate.py)."""
    if not isinstance(value, list) or not value:
        raise BadRequest(f"{name} must be a non-empty list of token ids", param=name)
    if not all(type(t) is int for t in value) or min(value) < 0 or max(value) >= vocab_size:
        raise BadRequest(f"{name} must hold token ids in [0, {vocab_size})", param=name)
    return value


def _check_length(prompt_ids: list[int], max_new: int, config: SimEngineConfig) -> None:
    limit = config.context_len
    if len(prompt_ids) >= limit:
        raise BadRequest(
            f"The input ({len(prompt_ids)} tokens) is longer than the model's context length ({limit} tokens)."
        )
    if len(prompt_ids) + max_new > limit:
        raise BadRequest(
            f"Requested token count exceeds the model's maximum context length of {limit} tokens. "
            f"You requested a total of {len(prompt_ids) + max_new} tokens: {len(prompt_ids)} tokens from "
            f"the input messages and {max_new} tokens for the completion."
        )


def _interval(value: Any) -> int:
    return 1 if value is None else _int(value, "stream_interval", minimum=1)


def parse_tokens(body: dict[str, Any], config: SimEngineConfig) -> GenParams:
    """vLLM's token-in/token-out `/inference/v1/generate` (vLLM 0.32 `scale_out/token_in_token_out`
    protocol.py): `token_ids`, `sampling_params` (vLLM's: `max_tokens`, `logprobs` the number of top
    logprobs, `ignore_eos`), `stream`, `stream_options`, `return_token_ids` (the prompt's ids in the answer)."""
    prompt_ids = _token_ids(body.get("token_ids"), "token_ids", config.vocab_size)
    sampling = body.get("sampling_params")
    if not isinstance(sampling, dict):
        raise BadRequest("sampling_params: Field required", param="sampling_params")
    if _int(sampling.get("n", 1), "n", minimum=1) != 1:
        raise BadRequest("n > 1 is not supported by the simulator", param="n")
    raw_max = sampling.get("max_tokens")
    if raw_max is None:
        max_new = max(0, min(config.default_max_new_tokens, config.context_len - len(prompt_ids)))
    else:
        max_new = _int(raw_max, "max_tokens")
    _check_length(prompt_ids, max_new, config)
    logprobs = sampling.get("logprobs")
    options = body.get("stream_options") or {}
    return GenParams(
        prompt_ids=prompt_ids,
        max_new_tokens=max_new,
        stream=bool(body.get("stream", False)),
        ignore_eos=bool(sampling.get("ignore_eos", False)),
        logprobs=logprobs is not None,
        top_logprobs=0 if logprobs is None else _int(logprobs, "logprobs", minimum=-1),
        include_usage=bool(options.get("include_usage", False)) if isinstance(options, dict) else False,
        return_token_ids=True,  # the route's answer always carries the output ids
        return_prompt_token_ids=bool(body.get("return_token_ids", False)),
        model=body.get("model"),
    )


def parse_generate(body: dict[str, Any], config: SimEngineConfig) -> tuple[list[GenParams], bool]:
    """SGLang `/generate`: one request, or a batch (list text / list of input_ids lists).

    Returns the requests and whether the input was a batch. rids of a batch are `rid_i` (or a given list).
    """
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise BadRequest("Either text or input_ids should be provided.")
    if text is not None:
        batch = isinstance(text, list)
        texts = text if batch else [text]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise BadRequest("text must be a string or a list of strings")
        prompts = [tokens.tokenize(t, config.vocab_size) or [tokens.BOS_TOKEN_ID] for t in texts]
    else:
        batch = isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list)
        raw: Any = input_ids
        prompts = [_token_ids(p, "input_ids", config.vocab_size) for p in (raw if batch else [raw])]
    sampling = body.get("sampling_params") or {}
    if isinstance(sampling, list):
        if len(sampling) != len(prompts):
            raise BadRequest("sampling_params list must match the batch size")
    elif isinstance(sampling, dict):
        sampling = [sampling] * len(prompts)
    else:
        raise BadRequest("sampling_params must be an object")
    rid = body.get("rid")
    if batch:
        if isinstance(rid, list):
            if len(rid) != len(prompts):
                raise BadRequest("The rid should be a list with the same length as the batch.")
            rids: list[str | None] = [str(r) for r in rid]
        else:
            rids = [None if rid is None else f"{rid}_{i}" for i in range(len(prompts))]
    else:
        rids = [None if rid is None else str(rid)]
    out = []
    for prompt_ids, params, one_rid in zip(prompts, sampling, rids, strict=True):
        if _int(params.get("n", 1), "n", minimum=1) != 1:
            raise BadRequest("n > 1 is not supported by the simulator", param="n")
        max_new = _int(params.get("max_new_tokens", config.default_max_new_tokens), "max_new_tokens")
        _check_length(prompt_ids, max_new, config)
        out.append(
            GenParams(
                prompt_ids=prompt_ids,
                max_new_tokens=max_new,
                rid=one_rid,
                stream=bool(body.get("stream", False)),
                stream_interval=_interval(params.get("stream_interval")),
                ignore_eos=bool(params.get("ignore_eos", False)),
                logprobs=bool(body.get("return_logprob", False)),
                top_logprobs=_int(body.get("top_logprobs_num") or 0, "top_logprobs_num"),
                logprobs_text=bool(body.get("return_text_in_logprobs", False)),
                return_prompt_token_ids=bool(body.get("return_prompt_token_ids", False)),
                logprob_start_len=_start_len(body.get("logprob_start_len"), len(prompt_ids)),
            )
        )
    return out, batch


def _start_len(value: Any, prompt_len: int) -> int:
    if value is None or value == -1:
        return -1
    start = _int(value, "logprob_start_len")
    if start >= prompt_len:
        raise BadRequest(f"logprob_start_len ({start}) must be less than the prompt length ({prompt_len})")
    return start


def _openai_common(body: dict[str, Any], prompt_ids: list[int], config: SimEngineConfig) -> dict[str, Any]:
    if _int(body.get("n", 1) if body.get("n") is not None else 1, "n", minimum=1) != 1:
        raise BadRequest("n > 1 is not supported by the simulator", param="n")
    raw_max = body.get("max_completion_tokens", body.get("max_tokens"))
    if raw_max is None:
        max_new = max(0, min(config.default_max_new_tokens, config.context_len - len(prompt_ids)))
    else:
        max_new = _int(raw_max, "max_tokens")
    _check_length(prompt_ids, max_new, config)
    options = body.get("stream_options") or {}
    rid = body.get("rid")
    return {
        "prompt_ids": prompt_ids,
        "max_new_tokens": max_new,
        "rid": None if rid is None else str(rid),
        "stream": bool(body.get("stream", False)),
        "stream_interval": _interval(body.get("stream_interval")),
        "ignore_eos": bool(body.get("ignore_eos", False)),
        "include_usage": bool(options.get("include_usage", False)) if isinstance(options, dict) else False,
        "return_token_ids": bool(body.get("return_token_ids", False)),
        "return_prompt_token_ids": bool(body.get("return_prompt_token_ids", False)),
        "model": body.get("model"),
    }


def parse_chat(body: dict[str, Any], config: SimEngineConfig) -> GenParams:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:  # SGLang requires them with input_ids too
        raise BadRequest("messages must be a non-empty list", param="messages")
    if body.get("input_ids") is not None:  # SGLang: pre-tokenized, the template is skipped
        prompt_ids = _token_ids(body["input_ids"], "input_ids", config.vocab_size)
    else:
        try:
            prompt_ids = tokens.tokenize(tokens.render_chat(messages), config.vocab_size)
        except ValueError as exc:
            raise BadRequest(str(exc), param="messages") from exc
    common = _openai_common(body, prompt_ids, config)
    top = body.get("top_logprobs")
    return GenParams(
        **common,
        logprobs=bool(body.get("logprobs", False)),
        top_logprobs=0 if top is None else _int(top, "top_logprobs"),
        return_meta_info=bool(body.get("return_meta_info", False)),
    )


def parse_completion(body: dict[str, Any], config: SimEngineConfig) -> GenParams:
    prompt = body.get("input_ids", body.get("prompt"))
    if isinstance(prompt, str):
        prompt_ids = tokens.tokenize(prompt, config.vocab_size) or [tokens.BOS_TOKEN_ID]
    elif isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        prompt_ids = _token_ids(prompt, "prompt", config.vocab_size)
    elif isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt_ids = tokens.tokenize(prompt[0], config.vocab_size) or [tokens.BOS_TOKEN_ID]
    else:
        raise BadRequest("prompt must be a string or a list of token ids (one prompt)", param="prompt")
    common = _openai_common(body, prompt_ids, config)
    logprobs = body.get("logprobs")
    return GenParams(
        **common,
        logprobs=logprobs is not None and logprobs is not False,
        top_logprobs=0 if logprobs in (None, False, True) else _int(logprobs, "logprobs"),
    )
