"""The non-streaming answer a client expects, built from the engine's stream events.

Theory of operation: the gateway streams every request it can (to watch progress), so for a client that
did not ask for a stream it must produce what the engine would have answered without streaming: the same
fields, in the same order, serialized compactly as SGLang (orjson) and vLLM (compact JSON) do.

- Chat: `chat.completion` from `chat.completion.chunk`s. Per choice (by `index`): delta strings (`content`,
  `reasoning_content`, vLLM `reasoning`) concatenated; `tool_calls` merged by their `index` (id, type and
  name from the first delta that has them, `arguments` concatenated); `logprobs` lists concatenated; the last
  non-null `finish_reason`, `matched_stop`, `stop_reason`; per-choice lists such as `token_ids` concatenated.
  Top level: `id`, `created`, `model` from the first chunk, `usage` from the usage frame, SGLang
  `metadata.weight_version` (the engine's, from the hint: SGLang chunks do not carry it).
- Completions: `text_completion` the same way (`text` concatenated, logprobs lists concatenated).
- SGLang `/generate`: chunks are cumulative, so the last chunk of each choice is the answer; only that one
  is kept, and a single-choice answer is returned as the engine's own bytes, unparsed. Batch and n>1 streams
  (chunks carry `index`) become a list ordered by index, without `index`, as the engine answers them. With
  `--incremental-streaming-output` (hint) text, ids and `meta_info.output_*` lists are concatenated; with
  0.5.x's `--stream-output` (hint) the ids alone are, into the last chunk.
- A whole-body event (the engine could not stream the request) is the answer as it is.
- A `/generate` aborted while it waited in the gateway's own queue never met an engine: `aborted_in_queue`
  writes what SGLang answers for one aborted in its waiting queue.

The field sets per family follow SGLang 0.5.23 (`entrypoints/openai/protocol.py`: ChatCompletionResponse,
ChatMessage, CompletionResponse) and vLLM 0.33 (`chat_completion/protocol.py`, `completion/protocol.py`,
non-streaming answers rendered with every field, nulls included). Fields a chunk carries that the table does
not name are kept, after the named ones.

`ResponseAssembler` consumes events one at a time (feed it as they arrive: for `/generate` it keeps only the
last chunk, where a list of all cumulative chunks would grow with the square of the length); `assemble()`
is the one-shot form. Both raise ValueError (or orjson.JSONDecodeError, a ValueError) for events they
cannot read.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import orjson

from rolloutgate.engines.base import AssemblyHint, EngineFamily, Route, UpstreamEvent
from rolloutgate.engines.frames import SSE_DONE, error_body, error_frame, sse_comment, sse_event
from rolloutgate.engines.progress import index_of

__all__ = (
    "SSE_DONE",
    "ResponseAssembler",
    "aborted_in_queue",
    "assemble",
    "error_body",
    "error_frame",
    "sse_comment",
    "sse_event",
)

_LAST_VALUE = frozenset({"finish_reason", "matched_stop", "stop_reason"})
# (message keys, choice keys after message, top-level keys after choices) that the engine always renders
_CHAT_SHAPE: dict[EngineFamily, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    EngineFamily.SGLANG: (
        ("role", "content", "reasoning_content", "tool_calls"),
        ("logprobs", "finish_reason", "matched_stop"),
        ("usage", "metadata"),
    ),
    EngineFamily.VLLM: (
        ("role", "content", "refusal", "annotations", "audio", "function_call", "tool_calls", "reasoning"),
        ("logprobs", "finish_reason", "stop_reason", "token_ids", "routed_experts"),
        (
            "service_tier",
            "system_fingerprint",
            "usage",
            "prompt_logprobs",
            "prompt_token_ids",
            "prompt_text",
            "kv_transfer_params",
            "ec_transfer_params",
            "metrics",
        ),
    ),
    EngineFamily.OPENAI: (("role", "content"), ("logprobs", "finish_reason"), ("usage",)),
}
_COMPLETION_SHAPE: dict[EngineFamily, tuple[tuple[str, ...], tuple[str, ...]]] = {
    EngineFamily.SGLANG: (("logprobs", "finish_reason", "matched_stop"), ("usage", "metadata")),
    EngineFamily.VLLM: (
        ("logprobs", "finish_reason", "stop_reason", "token_ids", "prompt_logprobs", "prompt_token_ids"),
        ("service_tier", "system_fingerprint", "usage", "kv_transfer_params"),
    ),
    EngineFamily.OPENAI: (("logprobs", "finish_reason"), ("usage",)),
}


def aborted_in_queue(body: dict[str, Any], request_id: str) -> bytes:
    """SGLang's answer to a `/generate` aborted while it waited (scheduler `_handle_abort_req`: finish reason
    abort, "Abort in waiting queue", no prompt or cached token counts), for a call the gateway held in its own
    queue when a client aborted everything. The client's `rid`, else the gateway's id."""
    meta: dict[str, Any] = {
        "id": body.get("rid") if isinstance(body.get("rid"), str) else request_id,
        "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
        "completion_tokens": 0,
    }
    if body.get("return_logprob"):
        meta["input_token_logprobs"] = []
        meta["output_token_logprobs"] = []
    return orjson.dumps({"text": "", "output_ids": [], "meta_info": meta})


def assemble(route: Route, events: Iterable[UpstreamEvent], *, hint: AssemblyHint | None = None) -> bytes:
    """The non-streaming answer for `route` from all of one generation's events (see module doc)."""
    assembler = ResponseAssembler(route, hint=hint)
    for event in events:
        assembler.add(event)
    return assembler.result()


class ResponseAssembler:
    """Accumulates one generation's events; `result()` renders the answer. The hint defaults to the one the
    adapter put on the events, else a generic OpenAI shape."""

    __slots__ = ("_choices", "_events", "_hint", "_ids", "_route", "_texts", "_top", "_whole_body")

    def __init__(self, route: Route, *, hint: AssemblyHint | None = None) -> None:
        self._route = route
        self._hint = hint
        self._whole_body: bytes | None = None
        self._top: dict[str, Any] = {}
        self._choices: dict[Any, Any] = {}  # by choice index; /generate: the last chunk (or merge)
        self._texts: dict[Any, list[str]] = {}  # incremental /generate: each choice's text pieces
        self._ids: dict[Any, list[int]] = {}  # /generate under `--stream-output`: each choice's ids so far
        self._events = 0

    def add(self, event: UpstreamEvent) -> None:
        self._events += 1
        if self._hint is None:
            self._hint = event.assembly
        if event.is_whole_body:
            self._whole_body = event.data
        elif self._route is Route.GENERATE:
            self._add_generate(event)
        else:
            self._add_chunk(event.json())

    def result(self) -> bytes:
        """Raises ValueError when no event was added (an engine that ended a stream without any)."""
        if self._whole_body is not None:
            return self._whole_body
        if self._events == 0:
            raise ValueError("the engine's stream had no events")
        hint = self._hint or AssemblyHint(family=EngineFamily.OPENAI)
        if self._route is Route.GENERATE:
            return self._generate_result(hint)
        return orjson.dumps(self._openai_result(hint))

    # -- /generate ---------------------------------------------------------------------------------------

    def _add_generate(self, event: UpstreamEvent) -> None:
        index = index_of(event.data)
        hint = self._hint
        if hint is None or not hint.is_incremental_generate:
            self._choices[index] = event.data  # cumulative: the last chunk holds everything...
            if hint is not None and hint.are_generate_ids_incremental:  # ...but its ids (`--stream-output`)
                self._ids.setdefault(index, []).extend(event.json().get("output_ids") or ())
            return
        # Each chunk's own text, ids and output lists are appended in place (a chunk a token at
        # `--checkpoint-tokens 1`: building new lists or strings per chunk grew with the square of the length);
        # the text's pieces are joined when the answer is rendered.
        chunk = event.json()
        merged = self._choices.get(index)
        if merged is None:  # copies: the event's parsed JSON is not ours to change
            meta = dict(chunk.get("meta_info") or {})
            for key, value in meta.items():
                if key.startswith("output_") and isinstance(value, list):
                    meta[key] = list(value)
            merged = self._choices[index] = {**chunk, "output_ids": [], "meta_info": meta}
            self._texts[index] = []
        else:
            meta = merged["meta_info"]
            for key, value in (chunk.get("meta_info") or {}).items():
                if key.startswith("output_") and isinstance(value, list):
                    meta.setdefault(key, []).extend(value)
                else:
                    meta[key] = value
        merged["output_ids"].extend(chunk.get("output_ids") or ())
        self._texts[index].append(chunk.get("text") or "")

    def _generate_result(self, hint: AssemblyHint) -> bytes:
        for index, pieces in self._texts.items():  # incremental chunks: the text so far, whole
            self._choices[index]["text"] = "".join(pieces)
        for index, ids in self._ids.items():  # `--stream-output`: the last chunk with every chunk's ids
            last = self._choices[index]
            self._choices[index] = (
                {**orjson.loads(last), "output_ids": ids} if isinstance(last, bytes) else last
            )
        if list(self._choices) == [None]:
            only = self._choices[None]
            return only if isinstance(only, bytes) else orjson.dumps(only)
        answers = []
        for index in sorted(i for i in self._choices if i is not None):
            item = self._choices[index]
            parsed = orjson.loads(item) if isinstance(item, bytes) else item
            parsed.pop("index", None)
            answers.append(parsed)
        return orjson.dumps(answers)

    # -- chat and completions ----------------------------------------------------------------------------

    def _add_chunk(self, chunk: Any) -> None:
        if not isinstance(chunk, dict):
            raise ValueError("a stream chunk is not a JSON object")
        for key, value in chunk.items():
            if key == "choices":
                continue
            if key == "usage":
                if value is not None:
                    self._top["usage"] = value
            elif self._top.get(key) is None:
                self._top[key] = value  # id, created, model from the first chunk; others once set
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict):
                raise ValueError("a stream chunk's choice is not a JSON object")
            index = choice.get("index", 0)
            state = self._choices.get(index)
            if state is None:
                state = self._choices[index] = _Choice(index)
            state.merge(choice)

    def _openai_result(self, hint: AssemblyHint) -> dict[str, Any]:
        is_chat = self._route is Route.CHAT
        family = hint.family
        if is_chat:
            message_keys, choice_keys, top_keys = _CHAT_SHAPE[family]
        else:
            message_keys = ()
            choice_keys, top_keys = _COMPLETION_SHAPE[family]
        choices = [
            self._choices[i].render(
                is_chat=is_chat, family=family, message_keys=message_keys, choice_keys=choice_keys
            )
            for i in sorted(self._choices)
        ]
        top = dict(self._top)
        answer: dict[str, Any] = {
            "id": top.pop("id", None),
            "object": "chat.completion" if is_chat else "text_completion",
            "created": top.pop("created", None),
            "model": top.pop("model", None),
            "choices": choices,
        }
        top.pop("object", None)
        if family is EngineFamily.SGLANG and top.get("metadata") is None:
            top["metadata"] = {"weight_version": hint.weight_version}
        for key in top_keys:
            answer[key] = top.pop(key, None)
        answer.update((key, value) for key, value in top.items() if value is not None)
        return answer


class _Choice:
    """One choice's merged deltas."""

    __slots__ = ("extras", "index", "logprobs", "message", "text", "tool_calls")

    def __init__(self, index: int) -> None:
        self.index = index
        self.message: dict[str, Any] = {}
        self.tool_calls: dict[int, dict[str, Any]] = {}
        self.text: list[str] = []
        self.logprobs: dict[str, Any] | None = None
        self.extras: dict[str, Any] = {}

    def merge(self, choice: dict[str, Any]) -> None:
        for key, value in choice.items():
            if key == "index":
                continue
            if key == "delta":
                self._merge_delta(value or {})
            elif key == "text":
                self.text.append(value or "")
            elif key == "logprobs":
                if isinstance(value, dict):
                    self.logprobs = _merge_lists(self.logprobs or {}, value)
            elif isinstance(value, list) and key not in _LAST_VALUE:
                first_only = key.startswith("prompt_")  # sent once, on the first chunk
                if not (first_only and self.extras.get(key) is not None):
                    self.extras[key] = (self.extras.get(key) or []) + value
            elif value is not None or key not in self.extras:
                self.extras[key] = value

    def _merge_delta(self, delta: dict[str, Any]) -> None:
        message = self.message
        for key, value in delta.items():
            if key == "tool_calls":
                for position, call in enumerate(value or ()):
                    self._merge_tool_call(call.get("index", position), call)
            elif key == "role":
                if message.get("role") is None:
                    message["role"] = value
            elif isinstance(value, str):
                message[key] = (message.get(key) or "") + value
            elif isinstance(value, list):
                message[key] = (message.get(key) or []) + value
            elif value is not None or key not in message:
                message[key] = value

    def _merge_tool_call(self, index: int, call: dict[str, Any]) -> None:
        merged = self.tool_calls.setdefault(index, {"id": None, "index": index, "type": None, "function": {}})
        for key, value in call.items():
            if key == "function":
                function = merged["function"]
                for name, part in (value or {}).items():
                    if name == "arguments":
                        function["arguments"] = (function.get("arguments") or "") + (part or "")
                    elif not function.get(name):
                        function[name] = part
            elif key != "index" and merged.get(key) is None:
                merged[key] = value  # id and type: the first delta that has them

    def render(
        self,
        *,
        is_chat: bool,
        family: EngineFamily,
        message_keys: tuple[str, ...],
        choice_keys: tuple[str, ...],
    ) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        if is_chat:
            out["message"] = self._render_message(family, message_keys)
        else:
            out["text"] = "".join(self.text)
        extras = dict(self.extras)
        extras["logprobs"] = self.logprobs
        for key in choice_keys:
            out[key] = extras.pop(key, None)
        out.update((key, value) for key, value in extras.items() if value is not None)
        return out

    def _render_message(self, family: EngineFamily, keys: tuple[str, ...]) -> dict[str, Any]:
        source = dict(self.message)
        source.setdefault("role", "assistant")
        calls = [self._render_tool_call(self.tool_calls[i], family) for i in sorted(self.tool_calls)]
        source["tool_calls"] = calls or None
        message: dict[str, Any] = {}
        for key in keys:
            value = source.pop(key, None)
            if key == "tool_calls" and value is None and family is not EngineFamily.SGLANG:
                continue  # vLLM drops an empty tool_calls list; OpenAI omits it
            message[key] = value
        message.update((key, value) for key, value in source.items() if value is not None)
        return message

    @staticmethod
    def _render_tool_call(call: dict[str, Any], family: EngineFamily) -> dict[str, Any]:
        rendered = {key: value for key, value in call.items() if key != "function"}
        rendered["type"] = rendered.get("type") or "function"
        if family is not EngineFamily.SGLANG:
            rendered.pop("index", None)
        function = call["function"]
        rendered["function"] = {
            "name": function.get("name"),
            "arguments": function.get("arguments") or "",
            **{k: v for k, v in function.items() if k not in ("name", "arguments")},
        }
        return rendered


def _merge_lists(merged: dict[str, Any], part: dict[str, Any]) -> dict[str, Any]:
    """Concatenate the list fields of two logprobs objects (chat `content`, completions `tokens`, ...)."""
    for key, value in part.items():
        if isinstance(value, list):
            merged[key] = (merged.get(key) or []) + value
        elif value is not None or key not in merged:
            merged[key] = value
    return merged
