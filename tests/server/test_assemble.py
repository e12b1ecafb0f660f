"""Non-streaming answers assembled from stream events, and the gateway's frames (server/assemble.py)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from rolloutgate.engines.base import AssemblyHint, EngineFamily, Route, UpstreamEvent
from rolloutgate.engines.http import SseParser
from rolloutgate.server.assemble import (
    SSE_DONE,
    ResponseAssembler,
    assemble,
    error_body,
    error_frame,
    sse_comment,
    sse_event,
)
from tests.engines.fakes import (
    completion_chunk,
    sglang_chat_chunk,
    sglang_chat_stream,
    sglang_generate_chunks,
    usage_frame,
    vllm_chat_chunk,
    vllm_chat_stream,
)

SGLANG = AssemblyHint(family=EngineFamily.SGLANG, weight_version="v7")
VLLM = AssemblyHint(family=EngineFamily.VLLM)


def events(chunks: list[bytes], hint: AssemblyHint | None = None) -> list[UpstreamEvent]:
    return [UpstreamEvent(data=c, assembly=hint) for c in chunks]


def answer(route: Route, chunks: list[bytes], hint: AssemblyHint | None = None) -> Any:
    return orjson.loads(assemble(route, events(chunks, hint)))


def logprob(token: str, value: float) -> dict[str, Any]:
    return {"token": token, "bytes": list(token.encode()), "logprob": value, "top_logprobs": []}


def test_sglang_chat_matches_the_engines_non_streaming_shape() -> None:
    chunks = sglang_chat_stream("rid-1", ["Hel", "lo", "!"])
    body = assemble(Route.CHAT, events(chunks, SGLANG))
    assert body == orjson.dumps(
        {
            "id": "rid-1",
            "object": "chat.completion",
            "created": 1700000000,
            "model": "qwen",
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": "Hello!",
                        "reasoning_content": None,
                        "tool_calls": None,
                    },
                    "logprobs": None,
                    "finish_reason": "stop",
                    "matched_stop": 151645,
                }
            ],
            "usage": {"prompt_tokens": 7, "total_tokens": 10, "completion_tokens": 3},
            "metadata": {"weight_version": "v7"},
        }
    )


def test_chat_merges_tool_call_deltas_reasoning_and_logprobs() -> None:
    chunks = [
        sglang_chat_chunk("r", {"role": "assistant", "content": ""}),
        sglang_chat_chunk("r", {"reasoning_content": "Need "}, logprobs={"content": [logprob("Need", -0.1)]}),
        sglang_chat_chunk(
            "r", {"reasoning_content": "weather."}, logprobs={"content": [logprob(" weather", -0.2)]}
        ),
        sglang_chat_chunk(
            "r",
            {
                "tool_calls": [
                    {
                        "id": "call_1",
                        "index": 0,
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": ""},
                    }
                ]
            },
        ),
        sglang_chat_chunk(
            "r",
            {
                "tool_calls": [
                    {
                        "id": None,
                        "index": 0,
                        "type": "function",
                        "function": {"name": None, "arguments": '{"city": '},
                    }
                ]
            },
        ),
        sglang_chat_chunk(
            "r",
            {
                "tool_calls": [
                    {
                        "id": "call_2",
                        "index": 1,
                        "type": "function",
                        "function": {"name": "get_time", "arguments": "{}"},
                    }
                ]
            },
        ),
        sglang_chat_chunk(
            "r",
            {
                "tool_calls": [
                    {
                        "id": None,
                        "index": 0,
                        "type": "function",
                        "function": {"name": None, "arguments": '"Paris"}'},
                    }
                ]
            },
        ),
        sglang_chat_chunk("r", {}, finish="tool_calls"),
        usage_frame("r", 9),
    ]
    choice = answer(Route.CHAT, chunks, SGLANG)["choices"][0]
    assert choice["message"] == {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Need weather.",
        "tool_calls": [
            {
                "id": "call_1",
                "index": 0,
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {
                "id": "call_2",
                "index": 1,
                "type": "function",
                "function": {"name": "get_time", "arguments": "{}"},
            },
        ],
    }
    assert choice["logprobs"] == {"content": [logprob("Need", -0.1), logprob(" weather", -0.2)]}
    assert choice["finish_reason"] == "tool_calls"


def test_vllm_chat_matches_the_engines_non_streaming_shape() -> None:
    chunks = [
        vllm_chat_chunk("r", {"role": "assistant", "content": ""}),
        vllm_chat_chunk("r", {"reasoning": "hmm"}, token_ids=[5]),
        vllm_chat_chunk(
            "r",
            {
                "tool_calls": [
                    {"index": 0, "id": "chatcmpl-tool-1", "type": "function", "function": {"name": "f"}}
                ]
            },
            token_ids=[6],
        ),
        vllm_chat_chunk("r", {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}, token_ids=[7]),
        vllm_chat_chunk("r", {}, finish="tool_calls", token_ids=[]),
        orjson.dumps({**orjson.loads(usage_frame("r", 3)), "id": "chatcmpl-r"}),
    ]
    body = answer(Route.CHAT, chunks, VLLM)
    assert list(body) == [
        "id", "object", "created", "model", "choices", "service_tier", "system_fingerprint", "usage",
        "prompt_logprobs", "prompt_token_ids", "prompt_text", "kv_transfer_params", "ec_transfer_params", "metrics",
    ]  # fmt: skip
    assert body["id"] == "chatcmpl-r" and body["object"] == "chat.completion"
    assert body["choices"] == [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": "",
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
                "tool_calls": [
                    {
                        "id": "chatcmpl-tool-1",
                        "type": "function",
                        "function": {"name": "f", "arguments": "{}"},
                    }
                ],
                "reasoning": "hmm",
            },
            "logprobs": None,
            "finish_reason": "tool_calls",
            "stop_reason": None,
            "token_ids": [5, 6, 7],
            "routed_experts": None,
        }
    ]
    assert body["usage"]["completion_tokens"] == 3


def test_vllm_chat_without_tool_calls_omits_them() -> None:
    message = answer(Route.CHAT, vllm_chat_stream("r", ["a", "b"]), VLLM)["choices"][0]["message"]
    assert "tool_calls" not in message
    assert message["content"] == "ab"


def test_chat_with_n_choices_orders_by_index_and_keeps_first_chunk_top_fields() -> None:
    chunks = [
        vllm_chat_chunk("r", {"role": "assistant", "content": ""}, index=1),
        vllm_chat_chunk("r", {"role": "assistant", "content": ""}, index=0),
        vllm_chat_chunk("r", {"content": "B"}, index=1, finish="length"),
        vllm_chat_chunk("r", {"content": "A"}, index=0, finish="stop"),
    ]
    chunks[0] = orjson.dumps({**orjson.loads(chunks[0]), "prompt_token_ids": [1, 2]})
    body = answer(Route.CHAT, chunks, VLLM)
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "A", "stop"),
        (1, "B", "length"),
    ]
    assert body["prompt_token_ids"] == [1, 2]
    assert body["usage"] is None  # no usage frame in this stream


def test_generic_openai_chat_shape_is_minimal() -> None:
    chunks = [
        orjson.dumps({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "system_fingerprint": "fp",
                      "choices": [{"index": 0, "delta": {"role": "assistant", "content": "", "refusal": None}, "finish_reason": None}]}),
        orjson.dumps({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "system_fingerprint": "fp",
                      "choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": "stop"}]}),
        orjson.dumps({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [],
                      "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}),
    ]  # fmt: skip
    body = answer(Route.CHAT, chunks)  # no hint: the generic shape
    assert body == {
        "id": "c",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "ok"},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        "system_fingerprint": "fp",
    }


def test_completions_concatenate_text_and_logprobs() -> None:
    def lp(token: str, offset: int) -> dict[str, Any]:
        return {
            "text_offset": [offset],
            "token_logprobs": [-0.5],
            "tokens": [token],
            "top_logprobs": [{token: -0.5}],
        }

    chunks = [
        completion_chunk("r", "Hel", logprobs=lp("Hel", 0), token_ids=[1]),
        completion_chunk("r", "lo", logprobs=lp("lo", 3), token_ids=[2]),
        completion_chunk("r", "", finish="length", matched_stop=None),
        usage_frame("r", 2, obj="text_completion"),
    ]
    body = answer(Route.COMPLETIONS, chunks, SGLANG)
    assert list(body) == ["id", "object", "created", "model", "choices", "usage", "metadata"]
    assert body["object"] == "text_completion"
    assert body["choices"] == [
        {
            "index": 0,
            "text": "Hello",
            "logprobs": {
                "text_offset": [0, 3],
                "token_logprobs": [-0.5, -0.5],
                "tokens": ["Hel", "lo"],
                "top_logprobs": [{"Hel": -0.5}, {"lo": -0.5}],
            },
            "finish_reason": "length",
            "matched_stop": None,
            "token_ids": [1, 2],
        }
    ]
    assert body["metadata"] == {"weight_version": "v7"}
    vllm = answer(Route.COMPLETIONS, chunks, VLLM)
    assert list(vllm) == [
        "id",
        "object",
        "created",
        "model",
        "choices",
        "service_tier",
        "system_fingerprint",
        "usage",
        "kv_transfer_params",
    ]
    assert list(vllm["choices"][0]) == [
        "index", "text", "logprobs", "finish_reason", "stop_reason", "token_ids", "prompt_logprobs", "prompt_token_ids",
    ]  # fmt: skip


def test_generate_returns_the_last_cumulative_chunk_unparsed() -> None:
    chunks = sglang_generate_chunks("r", list("abcdef"), per_chunk=2)
    assert assemble(Route.GENERATE, events(chunks, SGLANG)) == chunks[-1]
    assert orjson.loads(chunks[-1])["text"] == "abcdef"


def test_generate_batch_becomes_a_list_ordered_by_index_without_index() -> None:
    a = sglang_generate_chunks("r_0", list("ab"), index=0)
    b = sglang_generate_chunks("r_1", list("xyz"), index=1)
    body = answer(Route.GENERATE, [b[0], a[0], b[1], a[1], b[2]], SGLANG)
    assert [item["text"] for item in body] == ["ab", "xyz"]
    assert all("index" not in item for item in body)
    assert body[1]["meta_info"]["completion_tokens"] == 3


def test_generate_incremental_streams_are_concatenated() -> None:
    hint = AssemblyHint(family=EngineFamily.SGLANG, is_incremental_generate=True)
    chunks = [
        orjson.dumps({"text": "ab", "output_ids": [1, 2], "meta_info": {"completion_tokens": 2, "output_token_logprobs": [[-0.1, 1, None], [-0.2, 2, None]], "finish_reason": None}}),
        orjson.dumps({"text": "c", "output_ids": [3], "meta_info": {"completion_tokens": 3, "output_token_logprobs": [[-0.3, 3, None]], "finish_reason": {"type": "length", "length": 3}}}),
    ]  # fmt: skip
    stream_events = events(chunks, hint)
    body = orjson.loads(assemble(Route.GENERATE, stream_events))
    assert body == {
        "text": "abc",
        "output_ids": [1, 2, 3],
        "meta_info": {
            "completion_tokens": 3,
            "output_token_logprobs": [[-0.1, 1, None], [-0.2, 2, None], [-0.3, 3, None]],
            "finish_reason": {"type": "length", "length": 3},
        },
    }
    assert stream_events[0].json()["text"] == "ab"  # the events themselves are left as they were


def test_generate_stream_output_ids_alone_are_concatenated() -> None:
    """SGLang 0.5.9 with `--stream-output` (measured on the real engine): each chunk's `output_ids` are its
    own, its text and logprobs the whole output so far. The first token's id came in the first chunk only."""
    hint = AssemblyHint(family=EngineFamily.SGLANG, are_generate_ids_incremental=True)
    chunks = [
        orjson.dumps({"text": "er", "output_ids": [1036], "meta_info": {"completion_tokens": 1, "output_token_logprobs": [[-0.1, 1036, None]], "finish_reason": None}}),
        orjson.dumps({"text": "erthe wop", "output_ids": [1036, 1639], "meta_info": {"completion_tokens": 3, "output_token_logprobs": [[-0.1, 1036, None], [-0.2, 1036, None], [-0.3, 1639, None]], "finish_reason": {"type": "length", "length": 3}}}),
    ]  # fmt: skip
    assembler = ResponseAssembler(Route.GENERATE)
    for event in events(chunks, hint):
        assembler.add(event)
        once = orjson.loads(assembler.result())  # read between chunks too, as a continuation does
    assert once == orjson.loads(assembler.result())
    assert once["output_ids"] == [1036, 1036, 1639]
    assert [t[1] for t in once["meta_info"]["output_token_logprobs"]] == once["output_ids"]
    assert once["text"] == "erthe wop" and once["meta_info"]["completion_tokens"] == 3
    cumulative = orjson.loads(assemble(Route.GENERATE, events(chunks, SGLANG)))
    assert cumulative["output_ids"] == [1036, 1639]  # read as cumulative, the first id is lost


def test_a_whole_body_event_is_the_answer() -> None:
    whole = UpstreamEvent(data=b'{"id":"x","choices":[]}', is_whole_body=True)
    assert assemble(Route.CHAT, [whole]) == b'{"id":"x","choices":[]}'


def test_incremental_assembler_matches_one_shot() -> None:
    chunks = sglang_chat_stream("r", ["a", "b", "c"])
    assembler = ResponseAssembler(Route.CHAT)
    for event in events(chunks, SGLANG):
        assembler.add(event)
    assert assembler.result() == assemble(Route.CHAT, events(chunks, SGLANG))


def test_unreadable_streams_raise_value_error() -> None:
    with pytest.raises(ValueError, match="no events"):
        assemble(Route.CHAT, [])
    with pytest.raises(ValueError):
        assemble(Route.CHAT, events([b"[1, 2]"]))
    with pytest.raises(ValueError):
        assemble(Route.CHAT, events([b'{"choices": [3]}']))
    with pytest.raises(ValueError):
        assemble(Route.CHAT, events([b"{not json"]))


def test_frames_render_and_parse_back() -> None:
    assert sse_event(b'{"a":1}') == b'data: {"a":1}\n\n'
    assert sse_comment("keep-alive") == b": keep-alive\n\n"
    assert sse_comment("two\nlines") == b": two lines\n\n"
    assert SSE_DONE == b"data: [DONE]\n\n"
    multi = sse_event(b"line1\nline2")
    parser = SseParser()
    assert parser.feed(sse_comment() + multi + error_frame("boom", code=503) + SSE_DONE) == [
        b"line1\nline2",
        error_body("boom", code=503),
        b"[DONE]",
    ]
    assert orjson.loads(error_body("bad", err_type="invalid_request_error", code=400, param="model")) == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "model", "code": 400}
    }
