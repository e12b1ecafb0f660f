"""A non-streamed answer's event (engines/generation.py `whole_body_event`): parsed once for its checks, its
token count and finish reason, and not kept parsed (a long answer with logprobs parsed is several times its
bytes)."""

from __future__ import annotations

import random
import tracemalloc

import orjson
import pytest

from rolloutgate.engines.base import AssemblyHint, EngineFamily, UpstreamError
from rolloutgate.engines.generation import whole_body_event
from rolloutgate.engines.progress import whole_body_tokens

HINT = AssemblyHint(family=EngineFamily.SGLANG)


def logprob_answer(tokens: int) -> bytes:
    """An SGLang `/generate` answer with per-token logprobs, ~47 bytes a token."""
    rng = random.Random(0)
    ids = [rng.randrange(150_000) for _ in range(tokens)]
    meta = {
        "id": "r",
        "finish_reason": {"type": "length", "length": tokens},
        "prompt_tokens": 10,
        "completion_tokens": tokens,
        "output_token_logprobs": [[-rng.random(), i, None] for i in ids],
    }
    return orjson.dumps({"text": "x" * tokens, "output_ids": ids, "meta_info": meta})


def test_a_whole_body_event_reads_its_tokens_and_finish_and_keeps_only_the_bytes() -> None:
    body = logprob_answer(32_768)
    tracemalloc.start()
    try:
        event = whole_body_event(body, hint=HINT)
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert event.data is body and event.is_whole_body and event.assembly is HINT
    assert event.tokens == 32_768 and event.finish_reason == "length"
    assert event._parsed is None
    assert peak > len(body)  # it was parsed...
    assert kept < 0.05 * len(body), (kept, len(body))  # ...and the parsed tree is gone
    assert event.json()["meta_info"]["completion_tokens"] == 32_768  # parsed again on demand


def test_a_whole_openai_body_reads_its_usage_and_first_finish_reason() -> None:
    body = (
        b'{"id":"c","choices":[{"index":0,"text":"hi","finish_reason":"stop"}],'
        b'"usage":{"completion_tokens":5}}'
    )
    event = whole_body_event(body, hint=HINT)
    assert (event.tokens, event.finish_reason, event._parsed) == (5, "stop", None)
    batch = (
        b'[{"meta_info":{"completion_tokens":3,"finish_reason":{"type":"stop"}}},'
        b'{"meta_info":{"completion_tokens":4}}]'
    )
    event = whole_body_event(batch, hint=HINT)
    assert (event.tokens, event.finish_reason) == (7, "stop")


def test_a_whole_body_that_is_no_json_or_an_error_raises() -> None:
    with pytest.raises(UpstreamError, match="not JSON"):
        whole_body_event(b"<html>", hint=HINT)
    with pytest.raises(UpstreamError):
        whole_body_event(b'{"error":{"message":"bad","code":400}}', hint=HINT)


def test_whole_body_tokens_takes_the_bytes_or_the_parsed_answer() -> None:
    body = b'[{"meta_info":{"completion_tokens":3}},{"meta_info":{"completion_tokens":4}}]'
    assert whole_body_tokens(body) == whole_body_tokens(orjson.loads(body)) == 7
    assert whole_body_tokens(bytearray(body)) == 7
    assert whole_body_tokens({"usage": {"completion_tokens": 12}}) == 12
    assert whole_body_tokens(b"not json") == whole_body_tokens({"usage": {}}) == whole_body_tokens(None) == 1
