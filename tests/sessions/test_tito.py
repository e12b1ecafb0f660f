"""Mapping chat requests to the engine and its answers back to the agent (tito.py)."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from rolloutgate.errors import BadRequest
from rolloutgate.sessions import tito
from rolloutgate.sessions.errors import EngineAnswerInvalid, UnsupportedInSession
from rolloutgate.sessions.record import engine_meta_of
from rolloutgate.sessions.render import ChatRenderer
from tests.sessions.fixtures import WEATHER_TOOL, generate_answer, scripted_logprob

USER = [{"role": "user", "content": "hi"}]


def request(**body: Any) -> tito.ChatRequest:
    return tito.read_chat_request({"model": "m", "messages": USER, **body})


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ([], BadRequest),
        ({"messages": []}, BadRequest),
        ({"messages": [{"content": "no role"}]}, BadRequest),
        ({"messages": USER, "n": 2}, UnsupportedInSession),
        ({"messages": USER, "tools": {}}, BadRequest),
        ({"messages": USER, "top_logprobs": 99}, BadRequest),
        ({"messages": USER, "chat_template_kwargs": []}, BadRequest),
    ],
)
def test_read_chat_request_rejects(body: Any, error: type[Exception]) -> None:
    with pytest.raises(error):
        tito.read_chat_request(body)


def test_read_chat_request_normalizes_messages() -> None:
    parsed = tito.read_chat_request(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                    "name": None,
                }
            ],
            "stream": True,
            "stream_options": {"include_usage": True},
            "logprobs": True,
            "top_logprobs": 2,
        }
    )
    assert parsed.messages == [{"role": "user", "content": "ab"}]
    assert (parsed.stream, parsed.wants_logprobs, parsed.top_logprobs) == (True, True, 2)
    assert (parsed.model, parsed.wants_meta_info, parsed.wants_token_ids) == ("default", False, False)


def test_generate_body_maps_sampling_parameters() -> None:
    body = tito.generate_body(
        request(
            max_tokens=64,
            temperature=0.7,
            top_p=0.9,
            top_k=20,
            seed=3,
            stop="END",
            stop_token_ids=[7],
            min_tokens=2,
            response_format={"type": "json_schema", "json_schema": {"schema": {"type": "object"}}},
            top_logprobs=0,
            logprobs=False,
        ),
        [1, 2, 3],
        stop_token_ids=[2],
        default_max_tokens=4096,
    )
    assert body["input_ids"] == [1, 2, 3]
    assert body["return_logprob"] is True and body["logprob_start_len"] == -1 and body["stream"] is False
    params = body["sampling_params"]
    assert params == {
        "max_new_tokens": 64,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "sampling_seed": 3,
        "stop": ["END"],
        "stop_token_ids": [2, 7],
        "min_new_tokens": 2,
        "skip_special_tokens": False,
        "json_schema": json.dumps({"type": "object"}),
    }
    assert "top_logprobs_num" not in body


def test_generate_body_defaults_and_context_cap() -> None:
    body = tito.generate_body(
        request(top_logprobs=3, logprobs=True),
        list(range(100)),
        stop_token_ids=[2],
        default_max_tokens=4096,
        max_model_len=1124,
    )
    assert body["sampling_params"]["max_new_tokens"] == 1024
    assert body["top_logprobs_num"] == 3
    capped = tito.generate_body(
        request(max_completion_tokens=10), [1], stop_token_ids=[], default_max_tokens=5
    )
    assert (
        capped["sampling_params"]["max_new_tokens"] == 10
        and "stop_token_ids" not in capped["sampling_params"]
    )


def test_parse_generate_answer() -> None:
    turn = tito.parse_generate_answer(generate_answer([1, 2, 3], [40, 41, 2]), prompt_len=3)
    assert turn.output_ids == [40, 41, 2]
    assert turn.output_logprobs == [scripted_logprob(i, t) for i, t in enumerate([40, 41, 2])]
    assert (turn.finish_reason, turn.matched_stop, turn.weight_version) == ("stop", 2, "v1")
    cut = tito.parse_generate_answer([generate_answer([1], [40], finish="length")], prompt_len=1)
    assert cut.finish_reason == "length" and cut.matched_stop is None


@pytest.mark.parametrize(
    ("answer", "match"),
    [
        ({"text": "x", "meta_info": {}}, "output_token_logprobs"),
        ({"meta_info": {"output_token_logprobs": [[-0.1]]}}, "malformed"),
        ({**generate_answer([1, 2], [5]), "output_ids": [6]}, "disagree"),
        (generate_answer([1, 2, 3], [5]), "prompt tokens"),
        ("not json object", "output_token_logprobs"),
    ],
)
def test_parse_generate_answer_rejects(answer: Any, match: str) -> None:
    with pytest.raises(EngineAnswerInvalid, match=match) as info:
        tito.parse_generate_answer(answer, prompt_len=2)
    assert info.value.status == 502


def test_parse_tool_calls() -> None:
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        '\n<tool_call>{"name": "search", "parameters": {"q": "x"}}</tool_call>'
    )
    content, calls = tito.parse_tool_calls(text, id_prefix="r1")
    assert content == "Let me check."
    assert calls == [
        {
            "id": "call_r1_0",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        },
        {"id": "call_r1_1", "type": "function", "function": {"name": "search", "arguments": '{"q": "x"}'}},
    ]
    assert tito.parse_tool_calls("<tool_call>{not json}</tool_call>", id_prefix="r") == (
        "<tool_call>{not json}</tool_call>",
        [],
    )
    assert tito.parse_tool_calls('<tool_call>{"arguments": {}}</tool_call>', id_prefix="r")[1] == []
    assert tito.parse_tool_calls("plain", id_prefix="r") == ("plain", [])
    assert tito.parse_tool_calls('<tool_call>{"name": "f"}</tool_call>', id_prefix="r")[0] is None


def test_completion_from_a_tool_call_turn(renderer: ChatRenderer) -> None:
    im_end = renderer.stop_token_ids[0]
    ids = [
        *renderer.encode(
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        ),
        im_end,
    ]
    turn = tito.parse_generate_answer(generate_answer([1, 2], ids), prompt_len=2)
    chat = request(tools=[WEATHER_TOOL])
    completion = tito.completion_from_turn(
        chat, turn, renderer, prompt_ids=[1, 2], request_id="r9", created=7
    )
    choice = completion["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_r9_0",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    }
    assert choice["logprobs"] is None and "meta_info" not in choice and "prompt_token_ids" not in choice
    assert completion["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": len(ids),
        "total_tokens": 2 + len(ids),
    }
    assert (completion["id"], completion["created"], completion["metadata"]) == (
        "chatcmpl-r9",
        7,
        {"weight_version": "v1"},
    )
    # without tools offered, the same text is plain content
    plain = tito.completion_from_turn(
        request(), turn, renderer, prompt_ids=[1, 2], request_id="r9", created=7
    )
    assert plain["choices"][0]["message"]["content"].startswith("<tool_call>")
    assert plain["choices"][0]["finish_reason"] == "stop"


def test_completion_gives_what_was_asked(renderer: ChatRenderer) -> None:
    ids = [*renderer.encode("Hello there"), renderer.stop_token_ids[0]]
    answer = generate_answer([1], ids)
    answer["meta_info"]["output_top_logprobs"] = [[[-0.01, t, None], [-5.0, 3, None]] for t in ids]
    turn = tito.parse_generate_answer(answer, prompt_len=1)
    chat = request(logprobs=True, top_logprobs=1, return_meta_info=True, return_token_ids=True)
    choice = tito.completion_from_turn(chat, turn, renderer, prompt_ids=[1], request_id="r", created=0)[
        "choices"
    ][0]
    assert choice["message"] == {"role": "assistant", "content": "Hello there"}
    content = choice["logprobs"]["content"]
    assert [e["logprob"] for e in content] == turn.output_logprobs
    assert "".join(e["token"] for e in content[:-1]) == "Hello there"
    assert all(len(e["top_logprobs"]) == 1 for e in content)
    assert choice["meta_info"]["completion_tokens"] == len(ids)
    assert (choice["prompt_token_ids"], choice["response_token_ids"]) == ([1], ids)


def test_stop_strings_are_trimmed_from_the_text(renderer: ChatRenderer) -> None:
    ids = renderer.encode("answer END")
    answer = generate_answer([1], ids)
    answer["meta_info"]["finish_reason"] = {"type": "stop", "matched": " END"}
    turn = tito.parse_generate_answer(answer, prompt_len=1)
    completion = tito.completion_from_turn(
        request(), turn, renderer, prompt_ids=[1], request_id="r", created=0
    )
    assert completion["choices"][0]["message"]["content"] == "answer"


def test_recorded_body_forces_what_the_record_needs() -> None:
    body = tito.recorded_chat_body(
        request(stream=True, stream_options={"include_usage": True}, logprobs=False)
    )
    assert body["stream"] is False and "stream_options" not in body
    assert body["logprobs"] is True and body["return_meta_info"] is True
    assert body["return_token_ids"] is True and body["return_prompt_token_ids"] is True
    assert body["messages"] == USER


SGLANG_CHAT = {
    "id": "rid",
    "object": "chat.completion",
    "created": 1,
    "model": "m",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "hey"},
            "finish_reason": "stop",
            "logprobs": {"content": [{"token": "hey", "logprob": -0.5}]},
            "prompt_token_ids": [1, 2],
            "response_token_ids": [9, 2],
            "meta_info": {
                "output_token_logprobs": [[-0.5, 9, None], [-0.1, 2, None]],
                "weight_version": "w3",
            },
        }
    ],
    "usage": {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4},
    "metadata": {"weight_version": "w3"},
}
VLLM_CHAT = {
    "id": "chatcmpl-x",
    "object": "chat.completion",
    "created": 1,
    "model": "m",
    "prompt_token_ids": [1, 2],
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "hey"},
            "finish_reason": "length",
            "token_ids": [9, 8],
            "logprobs": {"content": [{"token": "h", "logprob": -0.5}, {"token": "ey", "logprob": -0.25}]},
        }
    ],
}


def test_parse_chat_answers_of_both_families() -> None:
    sglang = tito.parse_chat_answer(SGLANG_CHAT)
    assert (sglang.prompt_ids, sglang.output_ids, sglang.output_logprobs) == ([1, 2], [9, 2], [-0.5, -0.1])
    assert (sglang.finish_reason, sglang.weight_version) == ("stop", "w3")
    vllm = tito.parse_chat_answer(VLLM_CHAT)
    assert (vllm.prompt_ids, vllm.output_ids, vllm.output_logprobs) == ([1, 2], [9, 8], [-0.5, -0.25])
    assert vllm.finish_reason == "length"
    bare = tito.parse_chat_answer({"choices": [{"message": {"content": "x"}}]})
    assert (bare.output_ids, bare.prompt_ids) == ([], None)
    with pytest.raises(EngineAnswerInvalid):
        tito.parse_chat_answer({"object": "error"})


def test_strip_removes_what_the_agent_did_not_ask_for() -> None:
    stripped = tito.strip_chat_answer(SGLANG_CHAT, request())
    choice = stripped["choices"][0]
    assert choice["logprobs"] is None
    assert not {"meta_info", "prompt_token_ids", "response_token_ids"} & choice.keys()
    assert "prompt_token_ids" not in tito.strip_chat_answer(VLLM_CHAT, request())
    kept = tito.strip_chat_answer(
        SGLANG_CHAT, request(logprobs=True, return_meta_info=True, return_token_ids=True)
    )
    assert kept["choices"][0] == SGLANG_CHAT["choices"][0]
    assert SGLANG_CHAT["choices"][0]["meta_info"]  # the original is not mutated


def test_completion_chunks() -> None:
    completion = {
        "id": "chatcmpl-r",
        "created": 5,
        "model": "m",
        "usage": {"total_tokens": 3},
        "choices": [
            {
                "index": 0,
                "finish_reason": "tool_calls",
                "logprobs": None,
                "message": {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                    ],
                },
            }
        ],
    }
    (chunk,) = [orjson.loads(c) for c in tito.completion_chunks(completion)]  # one chunk, as miles sends
    assert chunk["object"] == "chat.completion.chunk" and chunk["usage"] == {"total_tokens": 3}
    (choice,) = chunk["choices"]
    assert choice["delta"]["tool_calls"][0]["index"] == 0 and choice["finish_reason"] == "tool_calls"
    assert choice["delta"]["role"] == "assistant" and choice["delta"]["content"] is None


def test_lora_and_routing_replay_fields_reach_the_engine_and_the_record() -> None:
    carried = {
        "lora_path": "adapter-3",
        "return_routed_experts": True,
        "routed_experts_start_len": 17,
        "return_indexer_topk": True,
    }
    body = tito.generate_body(request(**carried), [1, 2, 3], stop_token_ids=[2], default_max_tokens=8)
    assert {k: body[k] for k in carried} == carried
    chat = tito.tito_chat_body(request(**carried, stream=True), [1, 2, 3], stop_token_ids=[2])
    assert {k: chat[k] for k in carried} == carried and chat["input_ids"] == [1, 2, 3]
    assert "stream" not in chat  # the agent's stream is the gateway's to fake; the engine answers whole
    meta = {"prompt_tokens": 3, "routed_experts": "AAAA", "output_token_logprobs": [[-0.1, 5, None]]}
    assert engine_meta_of(meta) == {
        "prompt_tokens": 3,
        "routed_experts": "AAAA",
    }  # ids and logprobs live apart


def test_launch_defaults_go_under_the_requests_own_kwargs_and_force_engine_fields() -> None:
    defaults = tito.TurnDefaults(
        template_kwargs={"enable_thinking": False, "clear_thinking": False},
        engine_fields={"lora_path": "policy", "return_routed_experts": True},
    )
    request = defaults.apply(
        tito.read_chat_request(
            {
                "messages": [{"role": "user", "content": "hi"}],
                "chat_template_kwargs": {"enable_thinking": True},
            }
        )
    )
    assert request.template_kwargs == {"enable_thinking": True, "clear_thinking": False}
    assert request.body["chat_template_kwargs"] == request.template_kwargs
    body = tito.generate_body(request, [1, 2], stop_token_ids=[], default_max_tokens=8)
    assert body["lora_path"] == "policy" and body["return_routed_experts"] is True
    plain = tito.read_chat_request({"messages": [{"role": "user", "content": "hi"}]})
    assert tito.TurnDefaults().apply(plain) is plain


def test_a_chat_answer_without_a_message_is_a_bad_gateway() -> None:
    with pytest.raises(EngineAnswerInvalid, match="no message") as info:
        tito.parse_chat_answer({"choices": [{"index": 0, "message": None, "finish_reason": "stop"}]})
    assert info.value.status == 502
