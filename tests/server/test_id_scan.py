"""server/id_scan.py: one pass over a kept prompt's bytes counts its ids and finds one past the vocabulary, as
parsing it would; and the front's parse then validation (the parse's scan trusted, `kept_checked`) refuses
every large body a parsed check refuses, naming the same id."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rolloutgate.config import GatewaySettings
from rolloutgate.engines.base import Route
from rolloutgate.errors import BadRequest
from rolloutgate.server.id_scan import NOT_IDS, OUT_OF_VOCABULARY, first_suspect_byte, scan_flat_ids
from rolloutgate.server.prompt_ids import FIELD_WISE_FROM
from rolloutgate.server.validate import parse_inference_body, validate_body

VOCAB = 151_936
SETTINGS = GatewaySettings()

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=3),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=12,
)


@given(value=json_values, indent=st.sampled_from([None, 1]))
def test_a_flat_array_of_non_negative_integers_is_counted_and_nothing_else_is(
    value: Any, indent: int | None
) -> None:
    span = json.dumps(value, indent=indent).encode()
    is_ids = type(value) is list and bool(value) and all(type(v) is int and v >= 0 for v in value)
    assert scan_flat_ids(span, None) == (len(value) if is_ids else NOT_IDS)


@given(
    ids=st.lists(st.integers(0, 2 * VOCAB), min_size=1, max_size=40)
    | st.lists(st.integers(0, 10**30), min_size=1, max_size=5),
    indent=st.sampled_from([None, 2]),
)
def test_an_id_past_the_vocabulary_is_found_wherever_it_is(ids: list[int], indent: int | None) -> None:
    span = json.dumps(ids, indent=indent).encode()
    fits = max(ids) < VOCAB
    assert scan_flat_ids(span, VOCAB) == (len(ids) if fits else OUT_OF_VOCABULARY)
    assert (first_suspect_byte(span, VOCAB) < 0) == fits
    batch = json.dumps([ids, [0]]).encode()
    assert (first_suspect_byte(batch, VOCAB) < 0) == fits


@pytest.mark.parametrize("span", [b"[-1]", b"[1.5]", b'["7"]', b"[1e3]", b"[true]", b"[null]"])
def test_anything_but_digits_commas_brackets_and_whitespace_is_suspect(span: bytes) -> None:
    assert scan_flat_ids(span, VOCAB) == NOT_IDS
    assert first_suspect_byte(span, VOCAB) >= 0


def _large_generate(ids: Any) -> bytes:
    """A `/generate` body past FIELD_WISE_FROM, so its prompt is scanned, not parsed (server/prompt_ids.py)."""
    filler = list(range(1, 2_000))
    return orjson.dumps({"input_ids": filler}).replace(
        b"[1,", b"[" + json.dumps(ids)[1:-1].encode() + b",1,", 1
    )


@pytest.mark.parametrize(
    ("ids", "where", "code"),
    [
        ([7, VOCAB], "input_ids[1]", "token_id_out_of_vocabulary"),
        ([10**30], "input_ids[0]", "token_id_out_of_vocabulary"),
        ([3, -1], "input_ids[1]", "invalid_token_id"),
    ],
)
def test_the_front_refuses_a_large_prompt_by_the_parse_alone_and_names_the_id(
    ids: list[int], where: str, code: str
) -> None:
    raw = _large_generate(ids)
    assert len(raw) >= FIELD_WISE_FROM
    body, _ = parse_inference_body(raw, Route.GENERATE, SETTINGS, vocab_size=VOCAB)
    with pytest.raises(BadRequest) as refused:
        validate_body(Route.GENERATE, body, SETTINGS, vocab_size=VOCAB, kept_checked=True)
    assert (refused.value.param, refused.value.code) == ("input_ids", code)
    assert refused.value.message.startswith(f"'{where}'"), refused.value.message


def test_a_large_prompt_within_the_vocabulary_is_kept_counted_and_passes() -> None:
    raw = _large_generate([VOCAB - 1])
    body, count = parse_inference_body(raw, Route.GENERATE, SETTINGS, vocab_size=VOCAB)
    assert isinstance(body["input_ids"], orjson.Fragment) and count == 2_000
    validate_body(Route.GENERATE, body, SETTINGS, vocab_size=VOCAB, kept_checked=True)
