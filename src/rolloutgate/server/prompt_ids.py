"""A prompt given as token ids, kept as the JSON it came in: parsed around, never into 100K Python ints.

Theory of operation: miles sends every turn as `/generate` with `input_ids` of up to 100K ids (~0.65 MB of
JSON). The gateway needs their count (placement, prefill budgets) and nothing else of them; the engine needs
their bytes. Parsed, each id is an 8-byte list slot and a 28-byte int, ~5.6x its JSON, and building them was
~4.3 ms of the gateway's ~5.3 ms of CPU per such turn (make bench-rl's py-spy profile).

So a large inference body is parsed field by field: msgspec validates the whole document and hands each
top-level value back as its raw JSON span, without building it. The prompt's span is kept, as an
`orjson.Fragment` that every engine adapter's `orjson.dumps` writes back verbatim, once one compiled pass over
its bytes shows it is a flat array of non-negative integers below the engines' vocabulary and counts them
(server/id_scan.py); every other field is parsed with orjson as before. Measured on a 66K-id body (0.41 MB):
4.8 ms for `orjson.loads` and a compact re-dump, 1.0 ms this way.
Below `FIELD_WISE_FROM` bytes one `orjson.loads` is cheaper (2.4 against 5.7 us on a 16-id body) and the
ids are few, so small bodies are parsed whole and keep their ids as a list.

`token_ids_of` reads a kept prompt back as ids (a continued generation appends to it: server/continuation.py).
"""

from __future__ import annotations

from typing import Any

import msgspec
import orjson

from rolloutgate.engines.base import Route
from rolloutgate.errors import BadRequest
from rolloutgate.server.id_scan import OUT_OF_VOCABULARY, parse_exact, scan_flat_ids

__all__ = (
    "FIELD_WISE_FROM",
    "IDS_FIELD",
    "compact_json",
    "parse_fields",
    "token_ids_of",
)

FIELD_WISE_FROM = 4096  # bytes: from here a field-wise parse is cheaper than one orjson.loads (docstring)

IDS_FIELD = {
    Route.GENERATE: "input_ids",
    Route.COMPLETIONS: "prompt",
    Route.TOKENS: "token_ids",
}  # where a route's prompt ids go

_TOP_LEVEL = msgspec.json.Decoder(dict[str, msgspec.Raw])


def parse_fields(
    raw: bytes, route: Route, vocab_size: int | None = None
) -> tuple[dict[str, Any], int | None]:
    """The JSON object `raw` (at least `FIELD_WISE_FROM` bytes), with the route's prompt kept as its JSON
    when it is a flat array of token ids below `vocab_size` (any, when None) or a batch of ids, and how many
    ids that is (else None). A flat prompt with an id past the vocabulary is parsed, exactly
    (id_scan.parse_exact), for validation to name the id. Raises BadRequest."""
    try:
        spans = _TOP_LEVEL.decode(raw)
    except msgspec.ValidationError:
        raise BadRequest("request body must be a JSON object", code="invalid_json") from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    ids_field = IDS_FIELD.get(route)
    body: dict[str, Any] = {}
    count = None
    try:
        for name, span in spans.items():
            if name != ids_field:
                body[name] = orjson.loads(memoryview(span))
                continue
            ids = bytes(span)
            scanned = scan_flat_ids(ids, vocab_size)
            if scanned > 0:
                body[name], count = orjson.Fragment(ids), scanned
                continue
            if scanned == OUT_OF_VOCABULARY:
                body[name] = parse_exact(name, ids)
                continue
            value = body[name] = orjson.loads(ids)
            if type(value) is list and value and all(type(item) is list for item in value):
                count = sum(len(item) for item in value)  # a batch: every prompt is prefilled
                body[name] = compact_json(value)
    except orjson.JSONDecodeError as exc:  # what msgspec's skip lets through (a string's bad UTF-8)
        raise BadRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    return body, count


def compact_json(value: Any) -> orjson.Fragment:
    """`value` as its compact JSON, which `orjson.dumps` (every engine adapter's) writes back verbatim: how a
    prompt built of ids in the gateway (a continuation's) is kept, as the front keeps a client's.

    A copy of orjson's output at its size: orjson allocates far more than it writes (16.6 MB for the 0.63 MB
    of 100K ids), pages that cost no RSS untouched but are address space for as long as the value is kept."""
    return orjson.Fragment(bytes(memoryview(orjson.dumps(value))))


def token_ids_of(value: Any) -> Any:
    """A body field as parsed JSON: a kept prompt (an `orjson.Fragment`) parsed back; any other value as is."""
    if isinstance(value, orjson.Fragment):
        return orjson.loads(orjson.dumps(value))  # dumps writes a Fragment's bytes verbatim
    return value
