"""Input validation at the front: every bad input becomes a `BadRequest` with a message naming the field.

Only what the gateway itself relies on is checked here (shapes, types, limits), and what could take an engine
down: a prompt given as token ids (`/generate` `input_ids`, a `/v1/completions` `prompt` of ids, single or
batch) must hold integers in [0, vocabulary). SGLang 0.5.9 indexes its embedding with each id unchecked (its
`_validate_input_ids_in_vocab` has no caller): an id past the table, or a negative one, raises in the
scheduler and the server exits, with every request on it. The vocabulary is the engines' (server/pool.py
`EnginePool.vocab_size`); while it is unknown only the ids' type and sign are checked. Everything else in
the body is the engine's business and passes through untouched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import orjson

from rolloutgate.config import GatewaySettings
from rolloutgate.engines.base import Route
from rolloutgate.errors import BadRequest, PayloadTooLarge
from rolloutgate.server.id_scan import first_suspect_byte, parse_exact, scan_flat_ids
from rolloutgate.server.prompt_ids import FIELD_WISE_FROM, IDS_FIELD, parse_fields, token_ids_of

__all__ = (
    "NO_OVERRIDES",
    "Overrides",
    "check_token_ids",
    "estimate_prompt_tokens",
    "parse_body",
    "parse_inference_body",
    "parse_overrides",
    "validate_body",
)

# Per-request overrides of the server's budgets, by header (seconds).
OVERRIDE_HEADERS = {
    "timeout_s": "X-Rolloutgate-Timeout",
    "stall_timeout_s": "X-Rolloutgate-Stall-Timeout",
    "queue_timeout_s": "X-Rolloutgate-Queue-Timeout",
    "max_wall_s": "X-Rolloutgate-Max-Wall",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Overrides:
    timeout_s: float | None = None
    stall_timeout_s: float | None = None
    queue_timeout_s: float | None = None
    max_wall_s: float | None = None
    priority: int = 0


NO_OVERRIDES = Overrides()  # what a request without override headers gets (shared: front.py caches by it)


def _check_size(raw: bytes, settings: GatewaySettings) -> None:
    if len(raw) > settings.max_body_bytes:
        raise PayloadTooLarge(f"request body is {len(raw)} bytes; the limit is {settings.max_body_bytes}")


def parse_body(raw: bytes, settings: GatewaySettings) -> dict[str, Any]:
    _check_size(raw, settings)
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", code="invalid_json")
    return body


def parse_inference_body(
    raw: bytes, route: Route, settings: GatewaySettings, *, vocab_size: int | None = None
) -> tuple[dict[str, Any], int | None]:
    """An inference request's body, and its prompt's token-id count where the body keeps them as their JSON
    (a large body: server/prompt_ids.py, which keeps them only once its one pass over them found them ids
    below `vocab_size`: `validate_body(..., kept_checked=True)` with the same vocabulary then reads them no
    more). Raises BadRequest, PayloadTooLarge."""
    if len(raw) < FIELD_WISE_FROM:
        return parse_body(raw, settings), None
    _check_size(raw, settings)
    return parse_fields(raw, route, vocab_size)


# The typed fields every route may carry: (name, allowed types, what the error calls them), in check order.
_TYPED_FIELDS: tuple[tuple[str, tuple[type, ...], str], ...] = (
    ("stream", (bool,), "a boolean"),
    ("model", (str,), "a string"),
    ("temperature", (int, float), "a number"),
    ("top_p", (int, float), "a number"),
    ("n", (int,), "an integer"),
    ("max_tokens", (int,), "an integer"),
    ("max_completion_tokens", (int,), "an integer"),
)
_TOKEN_LIMITED = ("max_tokens", "max_completion_tokens")


def _is_a(value: Any, kinds: tuple[type, ...]) -> bool:
    # The exact type first (what JSON gives); the inexact check refuses a bool where a number is asked.
    return type(value) in kinds or (isinstance(value, kinds) and type(value) is not bool)


def _expect(body: dict[str, Any], name: str, kinds: tuple[type, ...], what: str) -> None:
    value = body.get(name)
    if value is not None and not _is_a(value, kinds):
        raise BadRequest(f"'{name}' must be {what}", param=name, code="invalid_type")


def validate_body(
    route: Route,
    body: dict[str, Any],
    settings: GatewaySettings,
    *,
    vocab_size: int | None = None,
    kept_checked: bool = False,
) -> None:
    """Raise BadRequest for a body the gateway cannot route, that breaks a server limit, or whose prompt ids
    could harm an engine (`check_token_ids`; `vocab_size`: the engines' vocabulary, None while unknown;
    `kept_checked`: a prompt kept as its JSON was checked against it as it was kept, `parse_inference_body`)."""
    for name, kinds, what in _TYPED_FIELDS:  # inline, not `_expect`: a call per field was most of the cost
        value = body.get(name)
        if value is None:
            continue
        if not _is_a(value, kinds):
            raise BadRequest(f"'{name}' must be {what}", param=name, code="invalid_type")
        if name in _TOKEN_LIMITED and not 0 <= value <= settings.max_tokens_limit:
            raise BadRequest(
                f"'{name}' must be between 0 and {settings.max_tokens_limit}",
                param=name,
                code="invalid_value",
            )
    if body.get("n") not in (None, 1):
        raise BadRequest("only n=1 is supported; send n requests instead", param="n", code="invalid_value")
    if route is Route.CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty array", param="messages", code="invalid_type")
        if len(messages) > settings.max_messages:
            raise BadRequest(
                f"'messages' has {len(messages)} entries; the limit is {settings.max_messages}",
                param="messages",
                code="too_many_messages",
            )
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise BadRequest(
                    f"messages[{i}] must be an object with a string 'role'",
                    param="messages",
                    code="invalid_type",
                )
        if "input_ids" in body:  # SGLang's chat takes a prompt of ids instead of rendering the messages
            check_token_ids("input_ids", body["input_ids"], vocab_size, kept_checked=kept_checked)
    elif route is Route.COMPLETIONS:
        prompt = body.get("prompt")
        if not isinstance(prompt, str | list | orjson.Fragment) or (isinstance(prompt, list) and not prompt):
            raise BadRequest(
                "'prompt' must be a string or a non-empty array", param="prompt", code="invalid_type"
            )
        check_token_ids("prompt", prompt, vocab_size, takes_texts=True, kept_checked=kept_checked)
        if "input_ids" in body:  # the simulator, as SGLang's chat, takes the prompt's ids here too
            check_token_ids("input_ids", body["input_ids"], vocab_size, kept_checked=kept_checked)
    elif route is Route.TOKENS:
        _validate_tokens(body, settings, vocab_size, kept_checked)
    else:  # /generate
        has_text = isinstance(body.get("text"), str | list)
        has_ids = isinstance(body.get("input_ids"), list | orjson.Fragment)  # a Fragment: kept ids
        if has_text == has_ids:
            raise BadRequest(
                "exactly one of 'text' and 'input_ids' is required", param="text", code="invalid_type"
            )
        if body.get("input_ids") == []:
            raise BadRequest("'input_ids' must be a non-empty array", param="input_ids", code="invalid_value")
        _expect(body, "sampling_params", (dict,), "an object")
        _expect(body, "rid", (str,), "a string")
        params = body.get("sampling_params") or {}
        new_tokens = params.get("max_new_tokens")
        if new_tokens is not None and (
            not isinstance(new_tokens, int)
            or isinstance(new_tokens, bool)
            or not 0 <= new_tokens <= settings.max_tokens_limit
        ):
            raise BadRequest(
                f"'sampling_params.max_new_tokens' must be an integer between 0 and {settings.max_tokens_limit}",
                param="sampling_params.max_new_tokens",
                code="invalid_value",
            )
        check_token_ids("input_ids", body.get("input_ids"), vocab_size, kept_checked=kept_checked)


def _validate_tokens(
    body: dict[str, Any], settings: GatewaySettings, vocab_size: int | None, kept_checked: bool
) -> None:
    """vLLM's `/inference/v1/generate`: one prompt of ids (`token_ids`) and vLLM's `sampling_params`, which
    the route requires (vLLM 0.32 `GenerateRequest`)."""
    ids = body.get("token_ids")
    if not isinstance(ids, list | orjson.Fragment) or ids == []:
        raise BadRequest("'token_ids' must be a non-empty array", param="token_ids", code="invalid_type")
    params = body.get("sampling_params")
    if not isinstance(params, dict):
        raise BadRequest("'sampling_params' must be an object", param="sampling_params", code="invalid_type")
    _expect(body, "request_id", (str,), "a string")
    limit = params.get("max_tokens")
    if limit is not None and (not _is_a(limit, (int,)) or not 0 <= limit <= settings.max_tokens_limit):
        raise BadRequest(
            f"'sampling_params.max_tokens' must be an integer between 0 and {settings.max_tokens_limit}",
            param="sampling_params.max_tokens",
            code="invalid_value",
        )
    if params.get("n") not in (None, 1):
        raise BadRequest(
            "only n=1 is supported; send n requests instead", param="sampling_params.n", code="invalid_value"
        )
    if isinstance(ids, list) and ids and all(type(prompt) is list for prompt in ids):
        raise BadRequest("'token_ids' must be one prompt's ids", param="token_ids", code="invalid_type")
    check_token_ids("token_ids", ids, vocab_size, kept_checked=kept_checked)


# -- token ids --------------------------------------------------------------------------------------------


def check_token_ids(
    name: str, value: Any, vocab_size: int | None, *, takes_texts: bool = False, kept_checked: bool = False
) -> None:
    """Raise BadRequest unless `value`, a prompt field (`input_ids`, `prompt`), is token ids (a flat array, or
    a batch of arrays) each an integer in [0, vocab_size) (>= 0 only, when `vocab_size` is None), or, where
    the field `takes_texts` (`prompt`), text (a string, an array of strings). Another value is left to the
    route's own checks and the engine. The message names the first bad id and where it is (`input_ids[1][7]`).

    A prompt kept as its JSON (server/prompt_ids.py) is scanned as bytes, not parsed (server/id_scan.py):
    miles sends 100K-id turns, and parsing them was most of the gateway's CPU per turn. A flat one the parse
    kept after its own scan against `vocab_size` (`kept_checked`) is not scanned again."""
    if isinstance(value, orjson.Fragment):
        span = orjson.dumps(value)  # a Fragment's bytes, as written
        if span.startswith(b"[["):  # a batch, kept as compact JSON (prompt_ids.compact_json)
            if _is_batch_of_arrays(span) and first_suspect_byte(span, vocab_size) < 0:
                return
        elif kept_checked or scan_flat_ids(span, vocab_size) > 0:
            return
        value = parse_exact(name, span)  # something is wrong: parsed, to name it
    if not isinstance(value, list) or not value:
        return  # not ids (text, or a shape validate_body refuses by name)
    if takes_texts and all(type(item) is str for item in value):
        return  # a batch of texts
    if all(type(item) is list for item in value):
        for index, prompt in enumerate(value):
            if not prompt:
                raise BadRequest(
                    f"'{name}[{index}]' must be a non-empty array of token ids",
                    param=name,
                    code="invalid_value",
                )
            _check_id_list(name, prompt, vocab_size, f"[{index}]")
        return
    _check_id_list(name, value, vocab_size, "")


def _is_batch_of_arrays(span: bytes) -> bool:
    """Whether the JSON `span` is an array of non-empty arrays of scalars (not nested further)."""
    shape = span.translate(None, b"0123456789,.-+eE \t\r\n")  # what is left of each scalar: nothing
    arrays = len(shape) // 2 - 1
    return shape == b"[" + b"[]" * arrays + b"]" and b"[]" not in span.translate(None, b" \t\r\n")


def _check_id_list(name: str, ids: list[Any], vocab_size: int | None, where: str) -> None:
    limit = -1 if vocab_size is None else vocab_size
    for position, token in enumerate(ids):
        if type(token) is not int:  # a bool or a float is no token id (True and 1.0 pass an isinstance check)
            raise BadRequest(
                f"'{name}{where}[{position}]' must be an integer token id, not {_preview(token)}",
                param=name,
                code="invalid_token_id",
            )
        if token < 0:
            raise BadRequest(
                f"'{name}{where}[{position}]' is {token}: a token id is never negative",
                param=name,
                code="invalid_token_id",
            )
        if token >= limit >= 0:
            raise BadRequest(
                f"'{name}{where}[{position}]' is {token}, outside the engines' vocabulary [0, {limit})",
                param=name,
                code="token_id_out_of_vocabulary",
            )


def _preview(value: Any) -> str:
    text = orjson.dumps(value).decode()
    return text if len(text) <= 40 else text[:37] + "..."


def parse_overrides(headers: Any, settings: GatewaySettings) -> Overrides:
    """Per-request budgets from headers, each within (0, max_timeout_override]."""
    values: dict[str, Any] = {}
    for field, header in OVERRIDE_HEADERS.items():
        raw = headers.get(header)
        if raw is None:
            continue
        try:
            value = float(raw)
        except ValueError:
            raise BadRequest(
                f"header {header} must be a number of seconds", param=header, code="invalid_override"
            ) from None
        if not (math.isfinite(value) and 0 < value <= settings.max_timeout_override):
            raise BadRequest(
                f"header {header} must be > 0 and <= {settings.max_timeout_override:g} seconds",
                param=header,
                code="invalid_override",
            )
        values[field] = value
    raw_priority = headers.get("X-Rolloutgate-Priority")
    if raw_priority is not None:
        try:
            values["priority"] = int(raw_priority)
        except ValueError:
            raise BadRequest(
                "header X-Rolloutgate-Priority must be an integer", code="invalid_override"
            ) from None
    return Overrides(**values) if values else NO_OVERRIDES


def estimate_prompt_tokens(route: Route, body: dict[str, Any]) -> int:
    """A cheap prompt-length estimate (~4 characters a token) for placement and prefill budgets: exact for a
    prompt of token ids (a batch's: all of them)."""
    ids = body.get(IDS_FIELD.get(route, ""))
    if isinstance(ids, orjson.Fragment):
        ids = token_ids_of(ids)  # kept ids whose count was not carried (a body built by the gateway)
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return sum(len(prompt) for prompt in ids if isinstance(prompt, list))
    if isinstance(ids, list) and ids and isinstance(ids[0], int):
        return len(ids)
    if route is Route.CHAT:
        chars = 0
        for message in body.get("messages", ()):
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                chars += len(content)
            elif isinstance(content, list):
                chars += sum(len(part.get("text", "")) for part in content if isinstance(part, dict))
        return chars // 4 + 1
    text = body.get("prompt") if route is Route.COMPLETIONS else body.get("text")
    if isinstance(text, str):
        return len(text) // 4 + 1
    return 1
