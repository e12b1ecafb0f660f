"""Mapping a session turn between the agent's chat API and the engine (pure functions, no I/O).

Theory of operation. Two modes:

- Token in, token out (a tokenizer is configured): the gateway renders the prompt ids itself and calls SGLang
  `POST /generate` with `input_ids` and `return_logprob=True`; the engine's `meta_info.output_token_logprobs`
  triples `[logprob, token_id, text|null]` give the output ids and their logprobs. The agent gets a
  `chat.completion` built from them: the text is decoded from the output ids (minus the final stop token and
  any matched stop string), and, when the request offered tools, tool calls are parsed with the Hermes/Qwen
  convention `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the text before the first call is the
  content; a call that is not valid JSON leaves the whole text as content, and no tool call).
- Recorded (no tokenizer): the agent's chat request goes to the engine's `/v1/chat/completions` with what the
  record needs forced on whatever the agent sent (`logprobs`, SGLang `return_meta_info`, and
  `return_token_ids` / `return_prompt_token_ids`, which vLLM and SGLang both understand and each ignores what
  it does not know), non-streaming; the ids come back from SGLang's `meta_info` or vLLM's `token_ids` /
  `prompt_token_ids`.

Either way the agent gets only what it asked for: logprobs only with `logprobs: true`, `meta_info` only with
`return_meta_info`, token ids only with `return_token_ids` / `return_prompt_token_ids`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import orjson

from rolloutgate.errors import BadRequest
from rolloutgate.sessions.errors import EngineAnswerInvalid, UnsupportedInSession
from rolloutgate.sessions.messages import normalize_messages

if TYPE_CHECKING:
    from rolloutgate.sessions.render import ChatRenderer

__all__ = (
    "ChatRequest",
    "EngineTurn",
    "TurnDefaults",
    "completion_chunks",
    "completion_from_turn",
    "generate_body",
    "parse_chat_answer",
    "parse_generate_answer",
    "parse_tool_calls",
    "read_chat_request",
    "recorded_chat_body",
    "reply_message_of",
    "strip_chat_answer",
    "tito_chat_body",
)

# chat parameter -> SGLang sampling parameter, copied when the agent sets them
_SAMPLING = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "min_tokens": "min_new_tokens",
    "ignore_eos": "ignore_eos",
    "seed": "sampling_seed",
    "logit_bias": "logit_bias",
    "no_stop_trim": "no_stop_trim",
}
# Top-level `/generate` fields a session's chat body carries to the engine as they came: LoRA, and MoE routing
# replay (miles' R3: `return_routed_experts`, `routed_experts_start_len`; DSA indexer top-k).
CARRIED_FIELDS = ("lora_path", "return_routed_experts", "routed_experts_start_len", "return_indexer_topk")
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatRequest:
    body: dict[str, Any]
    messages: list[dict[str, Any]]  # normalized
    tools: list[Any] | None
    template_kwargs: dict[str, Any] | None
    model: str
    stream: bool
    wants_logprobs: bool
    top_logprobs: int
    wants_meta_info: bool
    wants_token_ids: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineTurn:
    output_ids: list[int]
    output_logprobs: list[float]  # aligned to output_ids, or empty when the engine gave none
    finish_reason: str | None  # OpenAI vocabulary: stop, length, abort, tool_calls, ...
    prompt_ids: list[int] | None = None  # recorded mode: the engine's own prompt ids
    matched_stop: int | str | None = None
    weight_version: str | None = None
    top_logprobs: list[list[tuple[float, int]]] | None = None
    meta_info: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnDefaults:
    """What the gateway's launch flags put on every session turn, as miles' session server does from its
    `args`: chat template kwargs (`--apply-chat-template-kwargs`; a request's own keys win, as miles' merge
    does), and top-level engine fields forced on (`lora_path` for LoRA rollouts, `return_routed_experts` and
    `return_indexer_topk` for routing replay)."""

    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    engine_fields: Mapping[str, Any] = field(default_factory=dict)

    def apply(self, request: ChatRequest) -> ChatRequest:
        if not self.template_kwargs and not self.engine_fields:
            return request
        kwargs = {**self.template_kwargs, **(request.template_kwargs or {})} or None
        body = {**request.body, **self.engine_fields}
        if kwargs is not None:
            body["chat_template_kwargs"] = kwargs
        return replace(request, body=body, template_kwargs=kwargs)


def read_chat_request(body: Any) -> ChatRequest:
    """Validate a session chat request. Raises BadRequest (or UnsupportedInSession for n > 1)."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    n = body.get("n")
    if n not in (None, 1):
        raise UnsupportedInSession("a session is one linear conversation: `n` must be 1", param="n")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise BadRequest("`tools` must be a list", param="tools")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise BadRequest("`chat_template_kwargs` must be an object", param="chat_template_kwargs")
    top = body.get("top_logprobs") or 0
    if not isinstance(top, int) or not 0 <= top <= _MAX_TOP_LOGPROBS:
        raise BadRequest(
            f"`top_logprobs` must be an integer in [0, {_MAX_TOP_LOGPROBS}]", param="top_logprobs"
        )
    return ChatRequest(
        body=body,
        messages=normalize_messages(body.get("messages")),
        tools=tools or None,
        template_kwargs=kwargs or None,
        model=str(body.get("model") or "default"),
        stream=bool(body.get("stream")),
        wants_logprobs=bool(body.get("logprobs")),
        top_logprobs=top,
        wants_meta_info=bool(body.get("return_meta_info")),
        wants_token_ids=bool(body.get("return_token_ids") or body.get("return_prompt_token_ids")),
    )


# -- token in, token out ----------------------------------------------------------------------------------


def generate_body(
    request: ChatRequest,
    prompt_ids: Sequence[int],
    *,
    stop_token_ids: Sequence[int],
    default_max_tokens: int,
    max_model_len: int | None = None,
) -> dict[str, Any]:
    """The SGLang `/generate` body for one TITO turn (non-streaming; the dispatcher may stream it)."""
    body = request.body
    params: dict[str, Any] = {key: body[src] for src, key in _SAMPLING.items() if body.get(src) is not None}
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or default_max_tokens
    if max_model_len is not None:
        max_tokens = max(1, min(max_tokens, max_model_len - len(prompt_ids)))
    params["max_new_tokens"] = max_tokens
    stop = body.get("stop")
    if stop:
        params["stop"] = [stop] if isinstance(stop, str) else list(stop)
    stops = _stop_ids(request, stop_token_ids)
    if stops:
        params["stop_token_ids"] = stops
    params["skip_special_tokens"] = False  # the gateway decodes the ids itself
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema", {})
        params["json_schema"] = json.dumps(schema)
    elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
        params["json_schema"] = '{"type": "object"}'
    out: dict[str, Any] = {
        "input_ids": list(prompt_ids),
        "sampling_params": params,
        "return_logprob": True,
        "logprob_start_len": -1,
        "stream": False,
    }
    if request.top_logprobs:
        out["top_logprobs_num"] = request.top_logprobs
    out.update({key: body[key] for key in CARRIED_FIELDS if body.get(key) is not None})
    return out


def parse_generate_answer(answer: Any, *, prompt_len: int) -> EngineTurn:
    """Read a `/generate` answer. Raises EngineAnswerInvalid when it lacks what the record needs."""
    if isinstance(answer, list) and len(answer) == 1:
        answer = answer[0]
    meta = answer.get("meta_info") if isinstance(answer, dict) else None
    triples = meta.get("output_token_logprobs") if isinstance(meta, dict) else None
    if not isinstance(meta, dict) or not isinstance(triples, list):
        raise EngineAnswerInvalid("the engine's /generate answer has no meta_info.output_token_logprobs")
    try:
        output_ids = [int(t[1]) for t in triples]
        logprobs = [float(t[0]) for t in triples]
    except (TypeError, ValueError, IndexError) as exc:
        raise EngineAnswerInvalid(f"malformed output_token_logprobs: {exc}") from exc
    listed = answer.get("output_ids")
    if isinstance(listed, list) and listed and listed != output_ids:
        raise EngineAnswerInvalid("output_ids and output_token_logprobs disagree in the engine's answer")
    reported = meta.get("prompt_tokens")
    if isinstance(reported, int) and reported != prompt_len:
        raise EngineAnswerInvalid(f"the engine saw {reported} prompt tokens, the gateway sent {prompt_len}")
    finish = meta.get("finish_reason")
    reason = finish.get("type") if isinstance(finish, dict) else finish
    top = meta.get("output_top_logprobs")
    return EngineTurn(
        output_ids=output_ids,
        output_logprobs=logprobs,
        finish_reason=str(reason) if reason is not None else None,
        matched_stop=finish.get("matched") if isinstance(finish, dict) else None,
        weight_version=_str_or_none(meta.get("weight_version")),
        top_logprobs=[[(float(e[0]), int(e[1])) for e in (p or [])] for p in top]
        if isinstance(top, list)
        else None,
        meta_info=meta,
    )


def parse_tool_calls(text: str, *, id_prefix: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Split Hermes-style `<tool_call>{json}</tool_call>` blocks from `text`: (content, tool_calls)."""
    matches = list(_TOOL_CALL.finditer(text))
    if not matches:
        return text, []
    calls: list[dict[str, Any]] = []
    for index, match in enumerate(matches):
        try:
            obj = json.loads(match.group(1))
        except json.JSONDecodeError:
            return text, []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, []
        arguments = obj.get("arguments", obj.get("parameters", {}))
        calls.append(
            {
                "id": f"call_{id_prefix}_{index}",
                "type": "function",
                "function": {
                    "name": obj["name"],
                    "arguments": arguments
                    if isinstance(arguments, str)
                    else json.dumps(arguments, ensure_ascii=False),
                },
            }
        )
    content = text[: matches[0].start()].rstrip()
    return content or None, calls


def _output_text(turn: EngineTurn, renderer: ChatRenderer) -> str:
    ids = turn.output_ids
    if ids and (ids[-1] in renderer.stop_token_ids or ids[-1] == turn.matched_stop):
        ids = ids[:-1]
    text = renderer.decode(ids)
    if isinstance(turn.matched_stop, str) and turn.matched_stop:
        cut = text.rfind(turn.matched_stop)
        if cut >= 0:
            text = text[:cut]
    return text


def completion_from_turn(
    request: ChatRequest,
    turn: EngineTurn,
    renderer: ChatRenderer,
    *,
    prompt_ids: Sequence[int],
    request_id: str,
    created: int,
) -> dict[str, Any]:
    """The `chat.completion` the agent gets for a TITO turn."""
    text = _output_text(turn, renderer)
    content: str | None = text
    tool_calls: list[dict[str, Any]] = []
    if request.tools:
        content, tool_calls = parse_tool_calls(text, id_prefix=request_id)
    message: dict[str, Any] = {"role": "assistant", "content": content if tool_calls else (content or "")}
    if tool_calls:
        message["tool_calls"] = tool_calls
    finish = turn.finish_reason
    if tool_calls and finish in ("stop", None):
        finish = "tool_calls"
    choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
    if request.wants_logprobs:
        choice["logprobs"] = {"content": _logprob_content(turn, renderer, request.top_logprobs)}
    if request.wants_meta_info and turn.meta_info is not None:
        choice["meta_info"] = turn.meta_info
    if request.wants_token_ids:
        choice["prompt_token_ids"] = list(prompt_ids)
        choice["response_token_ids"] = list(turn.output_ids)
    completion: dict[str, Any] = {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion",
        "created": created,
        "model": request.model,
        "choices": [choice],
        "usage": {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(turn.output_ids),
            "total_tokens": len(prompt_ids) + len(turn.output_ids),
        },
    }
    if turn.weight_version is not None:
        completion["metadata"] = {"weight_version": turn.weight_version}
    return completion


def _logprob_content(turn: EngineTurn, renderer: ChatRenderer, top_n: int) -> list[dict[str, Any]]:
    entries: list[dict[str, Any]] = []
    tops = turn.top_logprobs or []
    for position, (token_id, logprob) in enumerate(zip(turn.output_ids, turn.output_logprobs, strict=False)):
        token = renderer.token_text(token_id)
        top = tops[position] if top_n and position < len(tops) else []
        entries.append(
            {
                "token": token,
                "logprob": logprob,
                "bytes": list(token.encode("utf-8")),
                "top_logprobs": [
                    {"token": (t := renderer.token_text(i)), "logprob": lp, "bytes": list(t.encode("utf-8"))}
                    for lp, i in top[:top_n]
                ],
            }
        )
    return entries


# -- recorded mode ----------------------------------------------------------------------------------------


def recorded_chat_body(request: ChatRequest) -> dict[str, Any]:
    """The agent's chat body with what the record needs forced on, for the engine's chat endpoint."""
    body = {k: v for k, v in request.body.items() if k != "stream_options"}
    body.update(
        stream=False,
        logprobs=True,
        return_meta_info=True,
        return_token_ids=True,
        return_prompt_token_ids=True,
    )
    return body


def tito_chat_body(
    request: ChatRequest, prompt_ids: Sequence[int], *, stop_token_ids: Sequence[int]
) -> dict[str, Any]:
    """The engine's chat endpoint with the gateway's prompt ids (SGLang `input_ids`, as miles sends it): the
    engine skips its template and takes these ids, and its own tool-call and reasoning parsers read the reply.
    `messages` stay (SGLang requires them, and they set the tool-call constraint); SGLang applies only the
    request's own stops to pre-tokenized input, so the template's stop ids are added."""
    body = {k: v for k, v in request.body.items() if k not in ("stream", "stream_options")}
    stops = _stop_ids(request, stop_token_ids)
    body.update(
        logprobs=True, return_meta_info=True, no_stop_trim=False, input_ids=list(prompt_ids)
    )  # `stream` left out, as miles' server sends it: the engine answers whole by default
    if stops:
        body["stop_token_ids"] = stops
    return body


def _stop_ids(request: ChatRequest, template_stops: Sequence[int]) -> list[int]:
    """The template's stop ids, then the request's own, each once."""
    return list(dict.fromkeys([*template_stops, *(request.body.get("stop_token_ids") or [])]))


def parse_chat_answer(answer: Any) -> EngineTurn:
    """Read the ids and logprobs an engine returned on its chat endpoint (SGLang or vLLM). Missing ids give
    an empty record (the turn still answers the agent). Raises EngineAnswerInvalid for a non-completion."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise EngineAnswerInvalid("the engine's chat answer has no choices")
    choice = choices[0]
    if not isinstance(choice.get("message"), dict):  # nothing to answer the agent with, or to record
        raise EngineAnswerInvalid(
            "the engine's chat answer has no message (assistant message content is None)"
        )
    meta = choice.get("meta_info") if isinstance(choice.get("meta_info"), dict) else None
    ids: list[int] = []
    logprobs: list[float] = []
    triples = meta.get("output_token_logprobs") if meta else None
    if isinstance(triples, list) and triples:
        ids = [int(t[1]) for t in triples]
        logprobs = [float(t[0]) for t in triples]
    else:
        listed = choice.get("token_ids") or choice.get("response_token_ids") or []
        ids = [int(i) for i in listed]
        content = (choice.get("logprobs") or {}).get("content") or []
        if len(content) == len(ids):
            logprobs = [float(e.get("logprob", 0.0)) for e in content]
    prompt = (
        choice.get("prompt_token_ids")
        or answer.get("prompt_token_ids")
        or ((answer.get("sglext") or {}).get("input_ids"))
    )
    metadata = answer.get("metadata") if isinstance(answer.get("metadata"), dict) else {}
    versions = choice.get("weight_versions")
    version = (
        (meta or {}).get("weight_version")
        or metadata.get("weight_version")
        or (versions[-1] if isinstance(versions, list) and versions else None)
    )
    return EngineTurn(
        output_ids=ids,
        output_logprobs=logprobs,
        finish_reason=_str_or_none(choice.get("finish_reason")),
        prompt_ids=[int(i) for i in prompt] if isinstance(prompt, list) else None,
        weight_version=_str_or_none(version),
        meta_info=meta,
    )


# Routing-replay payloads (one row per token, per layer): for the training record, never for the agent (miles'
# `_CLIENT_STRIPPED_META_KEYS`).
_REPLAY_META_KEYS = ("routed_experts", "indexer_topk")


def strip_chat_answer(
    answer: dict[str, Any], request: ChatRequest, *, keep_meta_info: bool = False
) -> dict[str, Any]:
    """The engine's chat answer without what the gateway asked for on the agent's behalf. `keep_meta_info`:
    the agent gets `meta_info` whether it asked or not, less the replay payloads (miles' TITO chat answer)."""
    out = {
        k: v for k, v in answer.items() if request.wants_token_ids or k not in ("prompt_token_ids", "sglext")
    }
    choices = []
    for choice in answer.get("choices") or []:
        kept = dict(choice)
        if not request.wants_logprobs:
            kept["logprobs"] = None
        meta = kept.get("meta_info")
        if not (request.wants_meta_info or keep_meta_info):
            kept.pop("meta_info", None)
        elif isinstance(meta, dict) and any(key in meta for key in _REPLAY_META_KEYS):
            kept["meta_info"] = {k: v for k, v in meta.items() if k not in _REPLAY_META_KEYS}
        if not request.wants_token_ids:
            for key in ("prompt_token_ids", "response_token_ids", "token_ids"):
                kept.pop(key, None)
        choices.append(kept)
    out["choices"] = choices
    return out


def reply_message_of(completion: dict[str, Any]) -> dict[str, Any]:
    """The assistant message of a completion, normalized as the session stores it."""
    message = completion["choices"][0].get("message") or {}
    return {k: v for k, v in message.items() if v is not None}


def completion_chunks(completion: dict[str, Any]) -> list[bytes]:
    """A finished completion as one `chat.completion.chunk` SSE payload, as miles' session server streams it:
    one delta holding the whole message (tool calls with their `index`: some clients mis-assemble arguments
    split over chunks), its finish reason, and the usage. Streaming deltas concatenate, so one is legal."""
    choices = []
    for choice in completion.get("choices") or []:
        message = choice.get("message") or {}
        delta: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
        if message.get("reasoning_content") is not None:
            delta["reasoning_content"] = message["reasoning_content"]
        calls = message.get("tool_calls")
        if calls:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
        choices.append(
            {
                "index": choice.get("index", 0),
                "delta": delta,
                "logprobs": choice.get("logprobs"),
                "finish_reason": choice.get("finish_reason"),
            }
        )
    chunk: dict[str, Any] = {
        "id": completion["id"],
        "object": "chat.completion.chunk",
        "created": completion.get("created", 0),
        "model": completion.get("model", ""),
        "choices": choices,
    }
    if completion.get("usage") is not None:
        chunk["usage"] = completion["usage"]
    return [orjson.dumps(chunk)]


def _str_or_none(value: Any) -> str | None:
    return None if value is None else str(value)
