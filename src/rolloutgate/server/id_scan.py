"""Byte scans of a prompt of token ids kept as its JSON (server/prompt_ids.py): what the gateway needs to know
of 100K ids without parsing them.

Theory of operation: miles sends every turn as 20K-100K ids (0.1-0.65 MB of JSON). The gateway needs their
count (placement, prefill budgets) and that each is an id the engines' vocabulary holds: an out-of-vocabulary
id kills a real SGLang engine (issue 32). Both come from one pass over the bytes here, compiled by mypyc on
machine integers (`i64`): ~2 ns a byte. Before, a `bytes.translate` pass counted the ids and a second pass
in Python integers checked them (0.48 + 1.67 ms for 60K ids; 35% and 14% of the gateway's CPU on such a
call, py-spy). The spans come from a JSON parser that validated them, so the scans read bytes, not grammar.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from rolloutgate.errors import BadRequest

if TYPE_CHECKING:  # mypyc's machine integer: only annotations name it, so nothing imports it at run time
    from mypy_extensions import i64

__all__ = ("NOT_IDS", "OUT_OF_VOCABULARY", "first_suspect_byte", "parse_exact", "scan_flat_ids")

NOT_IDS = -1  # `scan_flat_ids`: not a non-empty flat array of non-negative integers
OUT_OF_VOCABULARY = -2  # `scan_flat_ids`: such an array, with an id the vocabulary does not hold

# Above any vocabulary: an id's value stays below ten times it, within 64 bits (a larger vocabulary would only
# send ids past it to the exact check, validate.py `_check_id_list`, which reads the prompt parsed).
_MAX_VOCAB = 10**17


def scan_flat_ids(span: bytes, vocab_size: int | None) -> int:
    """How many ids the valid JSON value `span` holds when it is a non-empty flat array of non-negative
    integers each below `vocab_size` (any size, when None); else NOT_IDS, or OUT_OF_VOCABULARY for such an
    array with an id at or past `vocab_size`. Valid JSON with nothing but digits, commas and whitespace inside
    its one pair of brackets is exactly such an array (a sign, a point, an exponent, a quote, a nested bracket
    would show), and it has no leading zeros, so an id's digits give its value."""
    limit: i64 = -1 if vocab_size is None else min(vocab_size, _MAX_VOCAB)
    size: i64 = len(span)
    offset: i64 = 0
    while offset < size and _is_space(span[offset]):
        offset += 1
    if offset == size or span[offset] != 91:  # [
        return NOT_IDS
    offset += 1
    commas: i64 = 0
    digits: i64 = 0
    value: i64 = 0
    out_of_vocabulary = False
    while offset < size:
        byte: i64 = span[offset]
        if 48 <= byte <= 57:  # a digit
            digits += 1
            if limit >= 0 and not out_of_vocabulary:
                value = value * 10 + (byte - 48)
                out_of_vocabulary = value >= limit
        elif byte == 44:  # ,
            commas += 1
            value = 0
        elif byte == 93:  # ]: valid JSON ends the array here (only whitespace may follow)
            if digits == 0:
                return NOT_IDS  # []
            return OUT_OF_VOCABULARY if out_of_vocabulary else commas + 1
        elif _is_space(byte):
            value = 0
        else:
            return NOT_IDS
        offset += 1
    return NOT_IDS


def first_suspect_byte(span: bytes, vocab_size: int | None) -> int:
    """The offset in `span` (the JSON of a prompt of ids, flat or a batch) of the first byte that may make it
    unfit for an engine: the last digit of an id >= `vocab_size`, or anything but digits, commas, brackets and
    whitespace (a sign, a point, a quote, a letter); -1 when there is none."""
    limit: i64 = -1 if vocab_size is None else min(vocab_size, _MAX_VOCAB)
    value: i64 = 0
    size: i64 = len(span)
    offset: i64 = 0
    while offset < size:
        byte: i64 = span[offset]
        if 48 <= byte <= 57:  # a digit
            if limit >= 0:
                value = value * 10 + (byte - 48)
                if value >= limit:
                    return offset
        elif byte == 44 or byte == 91 or byte == 93 or _is_space(byte):  # , [ ]
            value = 0
        else:
            return offset
        offset += 1
    return -1


def parse_exact(name: str, span: bytes) -> Any:
    """A prompt the scans found unfit, parsed to name what is wrong with it: by `json`, which keeps an integer
    past 64 bits an integer (orjson makes it a float). Only refused prompts come here. Raises BadRequest for
    a number past Python's 4,300 digits."""
    try:
        return json.loads(span)
    except ValueError:
        raise BadRequest(
            f"'{name}' holds a number no vocabulary reaches", param=name, code="token_id_out_of_vocabulary"
        ) from None


def _is_space(byte: i64) -> bool:
    return byte == 32 or byte == 10 or byte == 13 or byte == 9  # JSON's whitespace: space \n \r \t
