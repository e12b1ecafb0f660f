"""Deterministic tokens and text for the simulator.

Theory of operation: there is no model, only a vocabulary of short made-up words. A text prompt becomes
one token per 4 bytes (so prompt_tokens of a text is stable and a shared text prefix gives shared token
prefixes); token ids given by the client are used as they are. Output token i of a request is a pure function
of (seed, prompt ids, i), so the same prompt gives the same answer on every engine and every retry, and text
is the concatenation of the words of the output ids.

The vocabulary's size is the engine's (`SimEngineConfig.vocab_size`: a Qwen-sized 151,936 unless the tokenizer in
use says otherwise, sim/cli.py): prompt ids at or past it are refused with a 400, and text and generated ids stay
below it (a vocabulary smaller than the made-up words folds them onto the ids it has).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = (
    "DEFAULT_VOCAB_SIZE",
    "EOS_TOKEN_ID",
    "MIN_VOCAB_SIZE",
    "decode",
    "logprob_of",
    "output_token",
    "output_tokens",
    "render_chat",
    "request_key",
    "stop_length",
    "tokenize",
    "word",
)

DEFAULT_VOCAB_SIZE = 151_936  # ids accepted in input_ids unless a tokenizer says otherwise (Qwen's)
PAD_TOKEN_ID = 0
BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2
_FIRST_WORD_ID = 3
MIN_VOCAB_SIZE = _FIRST_WORD_ID + 1  # the special ids and one word
_MASK = (1 << 64) - 1

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
_ENDINGS = ("", "s", "n", "r", "l", "t")


def _build_words() -> tuple[str, ...]:
    words = []
    for a in _CONSONANTS:
        for b in _VOWELS:
            for c in _CONSONANTS:
                for d in _VOWELS:
                    for e in _ENDINGS:
                        words.append(f" {a}{b}{c}{d}{e}")
    return tuple(words)


_WORDS = _build_words()  # 14 * 5 * 14 * 5 * 6 = 29,400 distinct words
_OUTPUT_RANGE = len(_WORDS)  # generated ids are _FIRST_WORD_ID .. _FIRST_WORD_ID + _OUTPUT_RANGE - 1


def _mix(x: int) -> int:
    """splitmix64: a fast, well-spread 64-bit hash of an int."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def word(token_id: int) -> str:
    """The text of one token; special ids (pad, bos, eos) have none."""
    index = token_id - _FIRST_WORD_ID
    if index < 0:
        return ""
    return _WORDS[index] if index < _OUTPUT_RANGE else _WORDS[index % _OUTPUT_RANGE]


def decode(token_ids: Iterable[int]) -> str:
    return "".join([word(t) for t in token_ids])


def tokenize(text: str, vocab_size: int = DEFAULT_VOCAB_SIZE) -> list[int]:
    """One token per 4 UTF-8 bytes, the id a checksum of the bytes (stable across processes)."""
    data = text.encode()
    span = vocab_size - _FIRST_WORD_ID
    crc = zlib.crc32
    return [_FIRST_WORD_ID + crc(data[i : i + 4]) % span for i in range(0, len(data), 4)]


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return str(content)


def render_chat(messages: Sequence[Any]) -> str:
    """A fixed chat template: each message as `<|role|>\\ncontent\\n`, then the assistant's header."""
    parts = []
    for message in messages:
        if not isinstance(message, dict):
            raise ValueError("each message must be an object")
        parts.append(f"<|{message.get('role', 'user')}|>\n{_content_text(message.get('content'))}\n")
    parts.append("<|assistant|>\n")
    return "".join(parts)


def request_key(seed: int, prompt_ids: Sequence[int]) -> int:
    """The per-prompt key all of a request's output is derived from."""
    # hash() of a tuple of ints is not randomised per process, unlike hash() of str
    return _mix((seed * 0x100000001B3) ^ (hash(tuple(prompt_ids)) & _MASK))


def _build_table() -> tuple[int, ...]:
    """A fixed shuffle of word ids; a request walks it with its own start and odd stride."""
    ids = [_FIRST_WORD_ID + _mix(i) % _OUTPUT_RANGE for i in range(_TABLE_SIZE)]
    return tuple(ids)


_TABLE_SIZE = 1 << 16
_TABLE_MASK = _TABLE_SIZE - 1
_TABLE = _build_table()


_WORD_IDS_END = _FIRST_WORD_ID + _OUTPUT_RANGE  # a vocabulary this large holds every generated id as it is


def output_token(key: int, position: int, vocab_size: int = DEFAULT_VOCAB_SIZE) -> int:
    token = _TABLE[(key + position * ((key >> 20) | 1)) & _TABLE_MASK]
    return token if vocab_size >= _WORD_IDS_END else _fold(token, vocab_size)


def output_tokens(key: int, start: int, end: int, vocab_size: int = DEFAULT_VOCAB_SIZE) -> list[int]:
    """Output tokens [start, end) of the request with this key (a fast `output_token` over a range)."""
    table, mask, stride = _TABLE, _TABLE_MASK, (key >> 20) | 1
    ids = [table[(key + i * stride) & mask] for i in range(start, end)]
    return ids if vocab_size >= _WORD_IDS_END else [_fold(token, vocab_size) for token in ids]


def _fold(token: int, vocab_size: int) -> int:
    """A word id onto the word ids of a vocabulary smaller than the made-up words."""
    return _FIRST_WORD_ID + (token - _FIRST_WORD_ID) % (vocab_size - _FIRST_WORD_ID)


def logprob_of(key: int, position: int) -> float:
    """A deterministic log-probability in (-4, 0] for output token `position`."""
    return -round((_mix(key ^ (position * 0x9E37)) % 4000) / 1000.0, 3)


def stop_length(key: int, max_new_tokens: int, stop_fraction: float) -> int | None:
    """Where the request stops with EOS (its completion_tokens, EOS included), or None: runs to the max."""
    if stop_fraction <= 0.0 or max_new_tokens < 1:
        return None
    draw = _mix(key ^ 0x5EED) / float(1 << 64)
    if draw >= stop_fraction:
        return None
    return 1 + _mix(key ^ 0xC0FFEE) % max_new_tokens
