"""Cheap token counting (engines/progress.py)."""

from __future__ import annotations

import orjson
import pytest

from rolloutgate.engines.progress import (
    ChunkCounter,
    CumulativeCounter,
    finish_reason_of,
    index_of,
    is_usage_frame,
    last_finish_reason_of,
    whole_body_tokens,
)

from .fakes import sglang_chat_stream, sglang_generate_chunks, vllm_chat_stream


def count(chunks: list[bytes]) -> list[int]:
    counter = ChunkCounter()
    return [counter.observe(c)[0] for c in chunks]


def test_sglang_chat_counts_one_per_token_chunk_and_none_for_the_role_chunk() -> None:
    chunks = sglang_chat_stream("r1", ["a", "b", "c"])
    # role chunk, 3 tokens, the finish chunk (an empty delta), usage frame
    assert count(chunks) == [0, 1, 1, 1, 0, 0]


def test_vllm_merged_chunks_are_corrected_by_the_usage_frame() -> None:
    chunks = vllm_chat_stream("r1", [f"w{i}" for i in range(10)], merged=3)  # 4 content chunks for 10 tokens
    tokens = count(chunks)
    assert tokens[0] == 0  # role
    assert tokens[1:5] == [1, 1, 1, 1]
    assert tokens[5] == 6  # the usage frame adds what the per-chunk count missed
    assert sum(tokens) == 10


def test_usage_frame_never_takes_tokens_back() -> None:
    counter = ChunkCounter()
    for _ in range(5):
        counter.observe(b'{"choices":[{"index":0,"delta":{"content":"x"}}]}')
    frame = b'{"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":3,"total_tokens":4}}'
    assert is_usage_frame(frame)
    assert counter.observe(frame) == (0, True, None)
    assert counter.observe(b'{"choices":[],"usage":null}') == (0, True, None)
    assert is_usage_frame(b'{"choices": [ ], "usage": {"completion_tokens": 1}}')  # spaced JSON


@pytest.mark.parametrize(
    "chunk",
    [
        b'{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}',
        b'{"choices":[{"index":0,"delta":{"role":"assistant","content":"","refusal":null}}]}',
        b'{"choices": [{"index": 0, "delta": {"role": "assistant", "content": null, "reasoning_content": null}}]}',
        b'{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}',
        b'{"choices":[{"index":0,"delta":{"role":null,"content":null,"tool_calls":null},"finish_reason":"stop"}]}',
        b'{"choices":[{"index":0,"text":"","logprobs":null,"finish_reason":"length"}]}',
    ],
)
def test_empty_chunks_carry_no_token(chunk: bytes) -> None:
    assert ChunkCounter().observe(chunk)[0] == 0


@pytest.mark.parametrize(
    "chunk",
    [
        b'{"choices":[{"index":0,"delta":{"role":"assistant","content":"Hi"}}]}',
        b'{"choices":[{"index":0,"delta":{"role":null,"content":"Hi","reasoning_content":null,"tool_calls":null}}]}',
        b'{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{}"}}]}}]}',
        b'{"choices":[{"index":0,"text":"a","finish_reason":null}]}',
    ],
)
def test_chunks_with_output_are_a_token(chunk: bytes) -> None:
    assert ChunkCounter().observe(chunk)[0] == 1


def test_text_that_looks_like_a_usage_frame_is_not_one() -> None:
    chunk = orjson.dumps({"choices": [{"index": 0, "delta": {"content": 'say "choices":[] and "usage"'}}]})
    assert not is_usage_frame(chunk)


def test_cumulative_counter_reads_deltas_per_index() -> None:
    counter = CumulativeCounter()
    assert [counter.tokens(c) for c in sglang_generate_chunks("r", list("abcdefgh"), per_chunk=3)] == [
        3,
        3,
        2,
    ]
    batch = CumulativeCounter()
    a = sglang_generate_chunks("r_0", list("abcd"), per_chunk=2, index=0)
    b = sglang_generate_chunks("r_1", list("xyz"), per_chunk=1, index=1)
    interleaved = [a[0], b[0], b[1], a[1], b[2]]
    assert [batch.tokens(c) for c in interleaved] == [2, 1, 1, 2, 1]
    assert batch.tokens(b'{"text":"no meta"}') == 1


def test_cumulative_counter_ignores_lookalikes_inside_text() -> None:
    chunk = orjson.dumps(
        {
            "text": 'he wrote "completion_tokens": 999',
            "output_ids": [1],
            "meta_info": {"completion_tokens": 1},
        }
    )
    assert CumulativeCounter().tokens(chunk) == 1


def test_finish_reasons() -> None:
    assert finish_reason_of(b'{"choices":[{"finish_reason":null}]}') is None
    assert finish_reason_of(b'{"choices":[{"finish_reason":"stop"}]}') == "stop"
    assert finish_reason_of(b'{"choices":[{"index":0}]}') is None
    last = sglang_generate_chunks("r", list("ab"), per_chunk=1, finish="abort")
    assert [last_finish_reason_of(c) for c in last] == [None, "abort"]
    assert last_finish_reason_of(sglang_generate_chunks("r", ["a"])[0]) == "length"
    assert last_finish_reason_of(b"{}") is None
    assert index_of(sglang_generate_chunks("r", ["a"], index=4)[0]) == 4
    assert index_of(sglang_generate_chunks("r", ["a"])[0]) is None


def test_whole_body_tokens() -> None:
    assert whole_body_tokens(b'{"choices":[],"usage":{"completion_tokens":12}}') == 12
    assert (
        whole_body_tokens(b'[{"meta_info":{"completion_tokens":3}},{"meta_info":{"completion_tokens":4}}]')
        == 7
    )
    assert whole_body_tokens(b"not json") == 1
    assert whole_body_tokens(b'{"usage":{}}') == 1
