"""Shared plumbing for the engine adapters: SSE framing, error mapping, small JSON/metrics helpers.

Theory of operation:

- `SseParser` is sans-IO: bytes in (any split, LF or CRLF line ends), event data out. It joins buffered
  pieces only when a chunk completes an event, so a megabyte-sized SGLang cumulative chunk that arrives in
  64 KiB pieces is copied once, not once per piece (engines/generation.py `SsePush` drives it).
- `map_exceptions()` is the one boundary where aiohttp, OS and JSON errors become `UpstreamError`; adapters
  wrap every network call in it, so nothing from aiohttp reaches the server. Connection failures, resets,
  timeouts, truncated or unreadable bodies are retryable (another engine may do better); an engine's 4xx is
  not (the request itself is wrong), except 408 and 429; 5xx is.
- Control calls (probe, health, load, abort, pause, weights) go through one injected `aiohttp.ClientSession`
  per gateway, owned by the server, each with its own limits; generations go through the engine's lean pool
  (engines/upstream.py) with no read timeout (the gateway's stall and budget clocks judge them).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from rolloutgate.engines.base import UpstreamError
from rolloutgate.engines.upstream import (
    UpstreamConnectError,
    UpstreamDisconnected,
    UpstreamProtocolError,
)
from rolloutgate.vocabulary import folder_vocab_size

__all__ = (
    "DONE",
    "DRAIN_AFTER_DONE_S",
    "JSON_HEADERS",
    "MAX_ERROR_BODY",
    "ControlTimeouts",
    "ServedModels",
    "SseParser",
    "as_upstream_error",
    "check_json_object",
    "fetch_models",
    "generation_headers",
    "get_json",
    "get_text",
    "has_route",
    "is_error_frame",
    "is_ok",
    "map_exceptions",
    "parse_prometheus",
    "positive_int",
    "post_json",
    "raise_for_error_frame",
    "raise_for_status",
    "status_error",
    "vocab_size_of",
)

log = logging.getLogger(__name__)

DONE = b"[DONE]"
JSON_HEADERS = {"Content-Type": "application/json"}
MAX_ERROR_BODY = 64 * 1024
DRAIN_AFTER_DONE_S = 1.0
# One SSE event larger than this is a broken engine, not an answer: a cumulative /generate chunk of a 100K-token
# output with every logprob is a few MB. Without a bound, a stream that never ends its event grows without end.
MAX_SSE_EVENT_BYTES = 64 << 20


@dataclass(frozen=True, slots=True, kw_only=True)
class ControlTimeouts:
    """Per-call limits for an adapter's calls. `connect_s` also bounds a generation's connect phase; a
    generation has no other limit. SGLang's `/health` generates one token and may take up to 20 s."""

    connect_s: float = 10.0
    probe_s: float = 15.0
    health_s: float = 30.0
    load_s: float = 10.0
    abort_s: float = 10.0
    pause_s: float = 600.0  # SGLang `abort` pause returns only once every in-flight request has ended
    weights_s: float | None = None  # loading weights from disk can take minutes

    def __post_init__(self) -> None:
        for name in ("connect_s", "probe_s", "health_s", "load_s", "abort_s", "pause_s", "weights_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")

    def control(self, total_s: float | None) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=total_s, sock_connect=self.connect_s)


# ---------------------------------------------------------------------------------------------------------
# SSE framing


class SseParser:
    """Splits an SSE byte stream into event data payloads (the joined `data:` lines of each event).

    `feed(chunk)` returns the events the chunk completed; `finish()` returns the data of an unterminated last
    event, if any (a stream cut mid-event, or a server that omits the final blank line). Comments (`:` lines)
    and fields other than `data` (`event`, `id`, `retry`) are ignored; events without data are skipped.

    Speed: line ends are found with `bytes.find(b"\n")` (memchr, many GB/s) rather than by searching for
    b"\n\n" or splitting (both run at a few hundred MB/s on JSON); a chunk without any line end is only
    buffered, so an event arriving in many pieces is joined once.
    """

    __slots__ = ("_parts", "_parts_size", "_skip_lf")

    def __init__(self) -> None:
        self._parts: list[bytes] = []  # bytes of the current, incomplete event
        self._parts_size = 0  # their length, bounded by MAX_SSE_EVENT_BYTES
        self._skip_lf = False  # the last chunk ended in b"\r": a b"\n" starting the next one belongs to it

    def feed(self, chunk: bytes) -> list[bytes]:
        if self._skip_lf or b"\r" in chunk:
            chunk = self._normalize_line_ends(chunk)
        if not chunk:
            return []
        first = chunk.find(b"\n")
        if first < 0:
            self._keep(chunk)
            return []
        size = len(chunk)
        if self._parts:
            self._parts.append(chunk)
            chunk = b"".join(self._parts)
            self._parts.clear()
            self._parts_size = 0
            first = chunk.find(b"\n")  # a leftover may hold a line end of its own
            size = len(chunk)
        elif first == size - 2 and chunk[-1] == 0x0A and chunk.startswith(b"data: "):
            return [chunk[6:first]]  # the usual read: exactly one single-line event
        events: list[bytes] = []
        start = scan = 0
        end = first
        while end >= 0 and end + 1 < size:  # else: no line end, or one whose next byte is still to come
            if chunk[end + 1] != 0x0A:
                scan = end + 1  # a line end inside a multi-line event
                end = chunk.find(b"\n", scan)
                continue
            if scan == start and chunk.startswith(b"data: ", start):
                events.append(chunk[start + 6 : end])  # the common case: one `data: ` line
            else:
                data = _event_data(chunk[start:end])
                if data is not None:
                    events.append(data)
            start = scan = end + 2
            end = chunk.find(b"\n", scan)
        if start < size:
            self._keep(chunk[start:] if start else chunk)
        return events

    def _keep(self, piece: bytes) -> None:
        """Buffer part of an event still incomplete. Raises UpstreamError (retryable) past the bound."""
        self._parts_size += len(piece)
        if self._parts_size > MAX_SSE_EVENT_BYTES:
            self._parts.clear()
            self._parts_size = 0
            raise UpstreamError(
                f"the engine sent an SSE event over {MAX_SSE_EVENT_BYTES >> 20} MB without ending it",
                retryable=True,
            )
        self._parts.append(piece)

    def finish(self) -> bytes | None:
        tail = b"".join(self._parts)
        self._parts.clear()
        self._parts_size = 0
        self._skip_lf = False
        return _event_data(tail.rstrip(b"\n")) if tail.strip() else None

    def _normalize_line_ends(self, chunk: bytes) -> bytes:
        """CRLF and lone CR become LF; a CR ending a chunk counts at once, and its LF is dropped later."""
        if self._skip_lf and chunk[:1] == b"\n":
            chunk = chunk[1:]
        self._skip_lf = chunk[-1:] == b"\r"
        return chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")


def _event_data(block: bytes) -> bytes | None:
    lines: list[bytes] = []
    for line in block.split(b"\n"):
        if not line or line[0] == 0x3A:  # blank, or a `:` comment
            continue
        name, _, value = line.partition(b":")
        if name == b"data":
            lines.append(value[1:] if value[:1] == b" " else value)
    return b"\n".join(lines) if lines else None


# ---------------------------------------------------------------------------------------------------------
# Errors


def check_json_object(data: bytes) -> None:
    """Raise UpstreamError (retryable) unless `data` looks like one JSON object: a brace at each end.

    Not a parse (that would cost what progress must not, see engines/progress.py), but it stops a garbled
    stream from reaching a client as events.
    """
    if data[:1] == b"{" and data[-1:] == b"}":
        return
    stripped = data.strip()
    if stripped[:1] == b"{" and stripped[-1:] == b"}":
        return
    raise UpstreamError(
        "the engine sent an event that is not a JSON object", retryable=True, body=data[:4096]
    )


def is_error_frame(data: bytes) -> bool:
    """True for a mid-stream error event, `{"error": {...}}` (SGLang and vLLM both send these)."""
    if data.startswith(b'{"error"'):
        return True
    return data[1:2].isspace() and data[:24].lstrip(b"{ \t\r\n").startswith(b'"error"')


def raise_for_error_frame(data: bytes) -> None:
    """Raise UpstreamError for an error event (call only when `is_error_frame(data)`).

    The status is the frame's `code` when it is an HTTP status; retryable follows the status, or the
    frame's own `retryable` (SGLang `/generate`) when it has one.
    """
    try:
        error = orjson.loads(data)["error"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        raise UpstreamError("the engine sent an unreadable error event", retryable=True, body=data) from None
    if not isinstance(error, dict):
        error = {"message": str(error)}
    code = error.get("code")
    status = code if isinstance(code, int) and 400 <= code <= 599 else None
    retryable = error.get("retryable")
    if not isinstance(retryable, bool):
        retryable = status is None or _is_retryable_status(status)
    message = str(error.get("message") or "the engine reported an error mid-stream")
    raise UpstreamError(message, retryable=retryable, status=status, body=data)


def _is_retryable_status(status: int) -> bool:
    return status >= 500 or status in (408, 429)


def status_error(status: int, body: bytes, *, what: str) -> UpstreamError:
    """The UpstreamError for an engine's non-2xx answer; `body` is kept for the client."""
    return UpstreamError(
        f"{what}: HTTP {status}: {_error_message(body)}",
        retryable=_is_retryable_status(status),
        status=status,
        body=body,
    )


def _error_message(body: bytes) -> str:
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body[:200].decode("utf-8", "replace").strip() or "(empty body)"
    if isinstance(parsed, dict):
        error = parsed.get("error", parsed)
        if isinstance(error, dict):
            for key in ("message", "detail"):
                if error.get(key):
                    return str(error[key])
        elif isinstance(error, str):
            return error
    return body[:200].decode("utf-8", "replace")


async def raise_for_status(resp: Any, *, what: str) -> None:
    """Raise the UpstreamError of a non-2xx answer (an aiohttp response or the lean pool's)."""
    if resp.status >= 300:
        body = await resp.content.read(MAX_ERROR_BODY)
        raise status_error(resp.status, body, what=what)


class map_exceptions:
    """Turn aiohttp, OS and JSON errors raised inside into UpstreamError; UpstreamError passes unchanged.

    Cancellation (a BaseException) is never caught. A class, not a generator context manager: a generation
    holds one for as long as it runs (every stream in flight), and this is a quarter of the size.
    """

    __slots__ = ("_what",)

    def __init__(self, what: str) -> None:
        self._what = what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if exc is None or not isinstance(exc, Exception) or isinstance(exc, UpstreamError):
            return  # nothing raised, cancellation, or already ours: it propagates as it is
        error = _translate(self._what, exc)
        if error is not None:
            raise error from exc


def as_upstream_error(what: str, exc: Exception) -> UpstreamError | None:
    """`exc` as `map_exceptions` raises it: itself when an UpstreamError, else its translation; None when it
    is not a network or answer error (a bug: let it pass)."""
    return exc if isinstance(exc, UpstreamError) else _translate(what, exc)


def _translate(what: str, exc: Exception) -> UpstreamError | None:
    """The UpstreamError for an exception raised by a network call, or None to let it pass."""
    if isinstance(exc, (aiohttp.ClientConnectorError, UpstreamConnectError)):
        return UpstreamError(f"{what}: cannot connect: {exc}", retryable=True, unreachable=True)
    if isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, UpstreamDisconnected)):
        return UpstreamError(f"{what}: connection lost mid-response: {exc}", retryable=True, lost=True)
    if isinstance(exc, UpstreamProtocolError):
        return UpstreamError(f"{what}: {exc}", retryable=True)
    if isinstance(exc, aiohttp.ClientResponseError):
        if isinstance(exc.__cause__, aiohttp.http_exceptions.HttpProcessingError):
            # aiohttp reports an answer it cannot parse (a garbage status line or headers) as a 400 of the
            # engine's; the engine said nothing of the kind: it is broken, and another engine may do better.
            return UpstreamError(f"{what}: unreadable HTTP answer: {exc.message}", retryable=True)
        return UpstreamError(
            f"{what}: HTTP {exc.status}: {exc.message}",
            retryable=_is_retryable_status(exc.status),
            status=exc.status or None,
        )
    if isinstance(exc, TimeoutError):  # aiohttp's own timeouts subclass it too
        return UpstreamError(f"{what}: timed out", retryable=True)
    if isinstance(exc, (aiohttp.ClientError, OSError)):
        return UpstreamError(f"{what}: {type(exc).__name__}: {exc}", retryable=True)
    if isinstance(exc, (orjson.JSONDecodeError, UnicodeDecodeError)):
        return UpstreamError(f"{what}: unreadable answer: {exc}", retryable=True)
    return None


def generation_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """A generation POST's headers: the client's that are passed on, and the JSON content type."""
    return {**headers, **JSON_HEADERS}


# ---------------------------------------------------------------------------------------------------------
# Small control-call helpers (each raises UpstreamError)


async def get_json(
    session: aiohttp.ClientSession, url: str, *, limits: aiohttp.ClientTimeout, what: str
) -> Any:
    with map_exceptions(what):
        async with session.get(url, timeout=limits) as resp:
            await raise_for_status(resp, what=what)
            return orjson.loads(await resp.read())


async def get_text(
    session: aiohttp.ClientSession, url: str, *, limits: aiohttp.ClientTimeout, what: str
) -> str:
    with map_exceptions(what):
        async with session.get(url, timeout=limits) as resp:
            await raise_for_status(resp, what=what)
            return (await resp.read()).decode("utf-8", "replace")


async def post_json(
    session: aiohttp.ClientSession,
    url: str,
    body: Any,
    *,
    limits: aiohttp.ClientTimeout,
    what: str,
    params: Mapping[str, str] | None = None,
) -> Any:
    """POST `body` as JSON (no body when it is None); return the parsed answer (None for an empty one)."""
    data = orjson.dumps(body) if body is not None else None
    with map_exceptions(what):
        async with session.post(url, data=data, headers=JSON_HEADERS, params=params, timeout=limits) as resp:
            await raise_for_status(resp, what=what)
            raw = await resp.read()
            return orjson.loads(raw) if raw.strip() else None


async def is_ok(session: aiohttp.ClientSession, url: str, *, limits: aiohttp.ClientTimeout) -> bool:
    """True if GET `url` answers 2xx; False for any other answer or failure (never raises, except cancel)."""
    try:
        async with session.get(url, timeout=limits) as resp:
            return 200 <= resp.status < 300
    except (aiohttp.ClientError, OSError):  # TimeoutError is an OSError
        return False


async def generates_one(
    session: aiohttp.ClientSession, url: str, body: Any, *, limits: aiohttp.ClientTimeout
) -> bool:
    """True if POST `body` to `url` (a one-token generation) answers 2xx with its whole body; False for any
    other answer or failure (never raises, except cancel)."""
    try:
        async with session.post(url, data=orjson.dumps(body), headers=JSON_HEADERS, timeout=limits) as resp:
            await resp.read()
            return 200 <= resp.status < 300
    except (aiohttp.ClientError, OSError):  # TimeoutError is an OSError
        return False


async def status_of(session: aiohttp.ClientSession, url: str, *, limits: aiohttp.ClientTimeout) -> int | None:
    """The HTTP status GET `url` answers; None if it answered nothing (never raises, except cancel)."""
    try:
        async with session.get(url, timeout=limits) as resp:
            return resp.status
    except (aiohttp.ClientError, OSError):  # TimeoutError is an OSError
        return None


async def has_route(session: aiohttp.ClientSession, url: str, *, limits: aiohttp.ClientTimeout) -> bool:
    """Whether the server has a route at `url` (a POST route: SGLang's `/generate`), asked with a GET, which
    such a route answers 405 and never runs: any answer but 404 is True. Raises UpstreamError (retryable) when
    nothing answers."""
    status = await status_of(session, url, limits=limits)
    if status is None:
        raise UpstreamError(f"no answer at {url}", retryable=True)
    return status != 404


_SAMPLE = re.compile(rb"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})?\s+(\S+)", re.MULTILINE)


def parse_prometheus(text: str | bytes, names: frozenset[str]) -> dict[str, float]:
    """Sum the samples of each metric in `names` over all label sets (Prometheus text format).

    Metrics absent from the text are absent from the result; unparseable values are skipped.
    """
    raw = text.encode() if isinstance(text, str) else text
    totals: dict[str, float] = {}
    for match in _SAMPLE.finditer(raw):
        name = match.group(1).decode()
        if name not in names:
            continue
        try:
            value = float(match.group(2))
        except ValueError:
            continue
        totals[name] = totals.get(name, 0.0) + value
    return totals


def positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


@dataclass(frozen=True, slots=True)
class ServedModels:
    """What `/v1/models` says: the model ids, the largest `max_model_len`, and the vocabulary (`vocab_size`)."""

    names: tuple[str, ...]
    max_model_len: int | None
    vocab_size: int | None


async def fetch_models(
    session: aiohttp.ClientSession, url: str, *, limits: aiohttp.ClientTimeout
) -> ServedModels:
    """The engine's models from `/v1/models`. Raises UpstreamError."""
    answer = await get_json(session, url + "/v1/models", limits=limits, what="v1/models")
    data = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(data, list):
        raise UpstreamError("/v1/models answered without a model list", retryable=True)
    cards = [card for card in data if isinstance(card, dict) and isinstance(card.get("id"), str)]
    lengths = [length for card in cards if (length := positive_int(card.get("max_model_len"))) is not None]
    base = [card for card in cards if card.get("parent") is None] or cards  # LoRA adapters share the base's
    return ServedModels(
        tuple(card["id"] for card in cards),
        max(lengths) if lengths else None,
        vocab_size_of(base[0].get("vocab_size"), base[0].get("root")) if base else None,
    )


def vocab_size_of(stated: Any, model_folder: Any) -> int | None:
    """An engine's vocabulary: what it states (`stated`; the simulator does, no real engine so far), else its
    model folder's (`model_folder`: a path the engine names, read when it is a local folder: an engine on this
    machine or a shared file system; rolloutgate/vocabulary.py), else None."""
    size = positive_int(stated)
    if size is None and isinstance(model_folder, str) and model_folder:
        size = folder_vocab_size(model_folder)
    return size
