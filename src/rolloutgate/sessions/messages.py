"""Chat messages as a session sees them: validated, lightly normalized, and compared by a canonical key.

Theory of operation: a session's turns form one linear history, so every request is compared with what the
session already holds. Clients echo the history back with cosmetic differences that change nothing the
chat template renders (the OpenAI SDK sends `content: null` with tool calls, `refusal: null`, text parts
instead of a string, its own tool-call ids), so the comparison uses `message_key`, a canonical form that
ignores exactly those differences and nothing else:

- keys whose value is null are dropped; `refusal`, `annotations` and `audio` are ignored;
- content given as a list of text parts is joined into one string (also for rendering); an assistant's
  missing or null content equals "";
- a tool call compares by function name and arguments (parsed when they are a JSON string, so key order and
  spacing do not matter); its `id` and `type` are ignored (the template does not render them).

Everything else (role, content text byte for byte, name, tool_call_id, reasoning_content, ...) must match.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import orjson

from rolloutgate.errors import BadRequest

__all__ = (
    "describe_difference",
    "first_difference",
    "message_key",
    "normalize_messages",
    "tools_key",
)

_IGNORED_KEYS = frozenset({"refusal", "annotations", "audio"})


def normalize_messages(raw: Any, *, param: str = "messages") -> list[dict[str, Any]]:
    """Validate a chat `messages` value and return normalized copies (text parts joined, nulls dropped).

    Raises BadRequest for anything that is not a non-empty list of objects with a string `role`.
    """
    if not isinstance(raw, list) or not raw:
        raise BadRequest("`messages` must be a non-empty list", param=param)
    out: list[dict[str, Any]] = []
    for index, message in enumerate(raw):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(f"messages[{index}] must be an object with a string `role`", param=param)
        out.append(_normalize_message(message))
    return out


def _normalize_message(message: dict[str, Any]) -> dict[str, Any]:
    normalized = {k: v for k, v in message.items() if v is not None}
    content = normalized.get("content")
    if isinstance(content, list) and all(_is_text_part(p) for p in content):
        normalized["content"] = "".join(p["text"] for p in content)
    return normalized


def _is_text_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)


def message_key(message: dict[str, Any]) -> bytes:
    """The canonical comparison form of one normalized message (see the module docstring)."""
    comparable: dict[str, Any] = {
        k: v for k, v in message.items() if v is not None and k not in _IGNORED_KEYS and k != "tool_calls"
    }
    if message.get("role") == "assistant":
        comparable["content"] = message.get("content") or ""
    tool_calls = message.get("tool_calls")
    if tool_calls:
        comparable["tool_calls"] = [_tool_call_key(call) for call in tool_calls]
    return orjson.dumps(comparable, option=orjson.OPT_SORT_KEYS)


def _tool_call_key(call: Any) -> Any:
    if not isinstance(call, dict):
        return call
    function = call.get("function")
    if not isinstance(function, dict):
        return {k: v for k, v in call.items() if k not in ("id", "index")}
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        with contextlib.suppress(orjson.JSONDecodeError):  # else compared as the raw string
            arguments = orjson.loads(arguments)
    return {"name": function.get("name"), "arguments": arguments}


def tools_key(tools: Any, template_kwargs: Any) -> bytes:
    """What else the template renders besides the messages: tools and chat_template_kwargs."""
    return orjson.dumps(
        {"tools": tools or None, "kwargs": template_kwargs or None}, option=orjson.OPT_SORT_KEYS
    )


def first_difference(stored: Sequence[bytes], incoming: Sequence[bytes]) -> int | None:
    """The first index where the two key lists differ (within the shorter one), or None if one prefixes."""
    for index, (a, b) in enumerate(zip(stored, incoming, strict=False)):
        if a != b:
            return index
    return None


def describe_difference(
    stored: Sequence[dict[str, Any]], incoming: Sequence[dict[str, Any]], index: int
) -> str:
    """A short human description of how message `index` differs, for error messages."""
    if index >= len(incoming):
        return f"the request has {len(incoming)} messages, fewer than the {len(stored)} the session holds"
    if index >= len(stored):
        return f"message {index} is new"
    old, new = stored[index], incoming[index]
    if old.get("role") != new.get("role"):
        return f"message {index} has role {new.get('role')!r}, the session has {old.get('role')!r}"
    return (
        f"message {index} ({new.get('role')}) differs from the session's: "
        f"{_preview(message_key(new))} != {_preview(message_key(old))}"
    )


def _preview(key: bytes, limit: int = 160) -> str:
    text = key.decode("utf-8", "replace")
    return text if len(text) <= limit else text[: limit - 3] + "..."
