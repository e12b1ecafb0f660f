"""Session turns end to end, without HTTP: token-exact trajectories over multi-turn tool use, divergence,
rollback, eviction, recorded mode, failures and concurrency (SessionService over a scripted engine)."""

from __future__ import annotations

import asyncio
from array import array
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest

from rolloutgate.core.clock import ManualClock
from rolloutgate.errors import Timeout
from rolloutgate.sessions import tito
from rolloutgate.sessions.errors import (
    ChatTemplateError,
    EngineAnswerInvalid,
    SessionConflict,
    SessionDiverged,
    SessionEvicted,
    SessionNotFound,
)
from rolloutgate.sessions.registry import SessionLimits, SessionRegistry
from rolloutgate.sessions.render import ChatRenderer
from rolloutgate.sessions.service import SessionAnswer, SessionCall, SessionService, SessionSettings
from tests.sessions.fixtures import WEATHER_TOOL, ScriptedGenerate, scripted_logprob

TOOL_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>'


def service_for(
    dispatcher: Any, clock: ManualClock, renderer: ChatRenderer | None, **limits: Any
) -> SessionService:
    ids = iter(range(1_000_000))
    return SessionService(
        SessionRegistry(SessionLimits(**limits)),
        dispatcher,
        clock,
        renderer=renderer,
        wall_clock=lambda: 1_700_000_000.0,
        new_request_id=lambda: f"req{next(ids)}",
    )


def chat_body(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": messages, "tools": [WEATHER_TOOL], **extra}


async def test_multi_turn_tool_use_trajectory_is_token_exact(
    clock: ManualClock, renderer: ChatRenderer
) -> None:
    engine = ScriptedGenerate(
        renderer,
        replies=[
            TOOL_CALL % "Paris",
            "Paris is sunny. Let me check Lyon too.\n" + TOOL_CALL % "Lyon",
            "Both are sunny: 21 and 19 degrees.",
            "You are welcome!",
        ],
    )
    service = service_for(engine, clock, renderer)
    sid = service.create()
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the weather in Paris?"},
    ]
    follow_ups = [
        lambda call_id: [{"role": "tool", "tool_call_id": call_id, "content": '{"temperature": 21}'}],
        lambda call_id: [{"role": "tool", "tool_call_id": call_id, "content": '{"temperature": 19}'}],
        lambda _: [{"role": "user", "content": "Thank you!"}],
    ]
    for turn in range(4):
        outcome = await service.chat(sid, chat_body(messages))
        assert outcome.status == 200 and outcome.recorded
        message = outcome.completion["choices"][0]["message"]  # type: ignore[index]
        messages = [*messages, message]  # the agent echoes the reply as the SDK returns it
        if turn < 3:
            messages += follow_ups[turn](message.get("tool_calls", [{}])[0].get("id"))

    seen, produced = engine.seen_input_ids, engine.produced_output_ids
    # every turn's input starts with everything the engine saw and produced before
    for k in range(1, 4):
        assert seen[k][: len(seen[k - 1]) + len(produced[k - 1])] == seen[k - 1] + produced[k - 1]
    # the engine-side ids of every turn (new prompt ids + output ids), concatenated, byte for byte
    engine_side: list[int] = []
    for k in range(4):
        engine_side += seen[k][len(engine_side) :] + produced[k]
    trajectory = service.trajectory(sid)
    assert array("i", trajectory["token_ids"]).tobytes() == array("i", engine_side).tobytes()
    assert trajectory["token_ids"] == seen[-1] + produced[-1]
    # the loss mask marks exactly the generated ids, with their logprobs
    generated = [
        (t, lp)
        for t, m, lp in zip(
            trajectory["token_ids"], trajectory["loss_mask"], trajectory["logprobs"], strict=True
        )
        if m
    ]
    assert [t for t, _ in generated] == [t for out in produced for t in out]
    assert [lp for _, lp in generated] == [
        scripted_logprob(i, t) for out in produced for i, t in enumerate(out)
    ]
    assert trajectory["prompt_length"] == len(seen[0]) and trajectory["num_turns"] == 4
    # the upstream calls were /generate with the session as routing key and what the record needs
    assert {(c.path, c.routing_key) for c in engine.calls} == {("/generate", sid)}
    assert all(c.body["return_logprob"] is True for c in engine.calls)  # type: ignore[index]
    # GET /sessions/{id}: per-turn records with the engine-side ids, metadata, timing
    described = service.describe(sid)
    records = described["records"]
    assert [r["prompt_token_ids"] for r in records] == seen
    assert [r["output_token_ids"] for r in records] == produced
    assert [r["finish_reason"] for r in records] == ["stop"] * 4
    assert records[0]["response"]["choices"][0]["finish_reason"] == "tool_calls"
    assert (records[0]["engine"], records[0]["weight_version"], records[0]["timing"]["charged_s"]) == (
        "engine-0",
        "v1",
        0.4,
    )
    assert [m["role"] for m in records[3]["request"]["messages"]] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
        "tool",
        "assistant",
        "user",
    ]
    assert described["metadata"]["accumulated_token_ids"] == trajectory["token_ids"]


async def test_divergence_is_a_400_and_changes_nothing(clock: ManualClock, renderer: ChatRenderer) -> None:
    engine = ScriptedGenerate(renderer, replies=["Hello!", "Fine.", "Good."])
    service = service_for(engine, clock, renderer)
    sid = service.create()
    first = [{"role": "user", "content": "Hi"}]
    reply = (await service.chat(sid, chat_body(first))).completion["choices"][0]["message"]  # type: ignore[index]
    second = [*first, reply, {"role": "user", "content": "How are you?"}]
    reply2 = (await service.chat(sid, chat_body(second))).completion["choices"][0]["message"]  # type: ignore[index]
    edited_reply = {**reply, "content": "Hello"}  # the agent rewrote the model's first answer
    with pytest.raises(SessionDiverged) as info:
        await service.chat(
            sid, chat_body([*first, edited_reply, {"role": "user", "content": "How are you?"}])
        )
    assert info.value.status == 400 and info.value.code == "session_diverged"
    assert info.value.message.startswith("rollback failed: discard_count=2")  # both turns would go
    assert len(engine.calls) == 2 and service.registry.get(sid, clock.now()).turns == 2
    outcome = await service.chat(sid, chat_body([*second, reply2, {"role": "user", "content": "And now?"}]))
    assert outcome.status == 200


async def test_a_rewritten_first_answer_restarts_a_one_turn_session(
    clock: ManualClock, renderer: ChatRenderer
) -> None:
    engine = ScriptedGenerate(renderer, replies=["Hello!", "Fine."])
    service = service_for(engine, clock, renderer)
    sid = service.create()
    first = [{"role": "user", "content": "Hi"}]
    reply = (await service.chat(sid, chat_body(first))).completion["choices"][0]["message"]  # type: ignore[index]
    edited = [*first, {**reply, "content": "Hello"}, {"role": "user", "content": "How are you?"}]
    outcome = await service.chat(sid, chat_body(edited))  # miles: back to the empty checkpoint
    assert outcome.status == 200
    records = service.describe(sid)["records"]
    assert len(records) == 1 and records[0]["request"]["messages"] == edited
    assert engine.seen_input_ids[1] == renderer.first_prompt(
        edited, tools=[WEATHER_TOOL], template_kwargs=None
    )


async def test_a_retried_last_turn_rolls_back(clock: ManualClock, renderer: ChatRenderer) -> None:
    engine = ScriptedGenerate(renderer, replies=["One.", "Two.", "Two again, differently."])
    service = service_for(engine, clock, renderer)
    sid = service.create()
    first = [{"role": "user", "content": "Count"}]
    reply = (await service.chat(sid, chat_body(first))).completion["choices"][0]["message"]  # type: ignore[index]
    second = [*first, reply, {"role": "user", "content": "Next"}]
    await service.chat(sid, chat_body(second))
    retried = await service.chat(sid, chat_body(second))  # the agent retries the same request
    assert retried.completion["choices"][0]["message"]["content"] == "Two again, differently."  # type: ignore[index]
    assert engine.seen_input_ids[2] == engine.seen_input_ids[1]  # re-run on the same prompt
    described = service.describe(sid)
    assert len(described["records"]) == 2
    trajectory = service.trajectory(sid)
    assert trajectory["token_ids"] == engine.seen_input_ids[2] + engine.produced_output_ids[2]
    assert service.registry.stats().turns_rolled_back_total == 1


async def test_eviction_gives_gone(clock: ManualClock, renderer: ChatRenderer) -> None:
    service = service_for(ScriptedGenerate(renderer, replies=["a"]), clock, renderer, idle_ttl_s=60)
    sid = service.create()
    await service.chat(sid, chat_body([{"role": "user", "content": "x"}]))
    clock.advance(61)
    assert service.expire() == [sid]
    for call in (lambda: service.describe(sid), lambda: service.trajectory(sid), lambda: service.delete(sid)):
        with pytest.raises(SessionEvicted) as info:
            call()
        assert info.value.status == 410
    with pytest.raises(SessionEvicted):
        await service.chat(sid, chat_body([{"role": "user", "content": "x"}]))
    with pytest.raises(SessionNotFound):
        service.describe("never-existed")


async def test_template_errors_are_400_before_any_engine_call(
    clock: ManualClock, renderer: ChatRenderer
) -> None:
    engine = ScriptedGenerate(renderer, replies=["a"])
    service = service_for(engine, clock, renderer)
    sid = service.create()
    with pytest.raises(ChatTemplateError):
        await service.chat(
            sid, chat_body([{"role": "user", "content": "x"}, {"role": "system", "content": "late"}])
        )
    assert engine.calls == [] and service.registry.stats().turns_in_flight == 0


@dataclass
class FakeChatEngine:
    """An engine's chat endpoint (SGLang shape) for recorded mode: prompt ids from a naive 'tokenizer'."""

    answers: list[dict[str, Any]] = field(default_factory=list)
    calls: list[SessionCall] = field(default_factory=list)
    prompts: list[list[int]] = field(default_factory=list)

    async def __call__(self, call: SessionCall) -> SessionAnswer:
        self.calls.append(call)
        prompt = self.prompts[len(self.calls) - 1]
        output = [900 + len(self.calls), 2]
        return SessionAnswer(
            status=200,
            engine_id="e1",
            body=orjson.dumps(
                {
                    "id": "x",
                    "object": "chat.completion",
                    "created": 1,
                    "model": "m",
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": f"answer {len(self.calls)}"},
                            "finish_reason": "stop",
                            "logprobs": {"content": []},
                            "prompt_token_ids": prompt,
                            "response_token_ids": output,
                            "meta_info": {
                                "output_token_logprobs": [[-0.25, t, None] for t in output],
                                "weight_version": "w7",
                            },
                        }
                    ],
                    "usage": {
                        "prompt_tokens": len(prompt),
                        "completion_tokens": 2,
                        "total_tokens": len(prompt) + 2,
                    },
                }
            ),
        )


async def test_recorded_mode_without_a_tokenizer(clock: ManualClock) -> None:
    engine = FakeChatEngine(prompts=[[1, 2, 3], [1, 2, 3, 901, 2, 7, 8], [5, 6]])
    service = service_for(engine, clock, renderer=None)
    sid = service.create()
    first = [{"role": "user", "content": "q1"}]
    outcome = await service.chat(
        sid, {"messages": first, "stream": True, "stream_options": {"include_usage": True}}
    )
    choice = outcome.completion["choices"][0]  # type: ignore[index]
    assert choice["logprobs"] is None and "meta_info" not in choice and "prompt_token_ids" not in choice
    sent = engine.calls[0]
    assert (sent.path, sent.routing_key) == ("/v1/chat/completions", sid)
    assert sent.body["stream"] is False and "stream_options" not in sent.body  # type: ignore[index]
    assert sent.body["logprobs"] and sent.body["return_meta_info"] and sent.body["return_token_ids"]  # type: ignore[index]
    second = [*first, choice["message"], {"role": "user", "content": "q2"}]
    await service.chat(sid, {"messages": second})
    trajectory = service.trajectory(sid)
    assert trajectory["token_ids"] == [1, 2, 3, 901, 2, 7, 8, 902, 2]
    assert trajectory["loss_mask"] == [0, 0, 0, 1, 1, 0, 0, 1, 1]
    records = service.describe(sid)["records"]
    assert records[1]["weight_version"] == "w7" and records[1]["engine"] == "e1"
    assert "stream" not in records[0]["request"] and "stream_options" not in records[0]["request"]
    # without a tokenizer a request that does not extend is still answered and recorded...
    await service.chat(sid, {"messages": [{"role": "user", "content": "something else"}]})
    assert len(service.describe(sid)["records"]) == 3
    # ...and the trajectory says where the chain broke
    with pytest.raises(SessionConflict, match="turn 2") as info:
        service.trajectory(sid)
    assert info.value.code == "trajectory_not_linear"


async def test_an_engine_error_is_relayed_and_not_recorded(
    clock: ManualClock, renderer: ChatRenderer
) -> None:
    async def failing(call: SessionCall) -> SessionAnswer:
        return SessionAnswer(status=400, body=b'{"object": "error", "message": "context too long"}')

    service = service_for(failing, clock, renderer)
    sid = service.create()
    outcome = await service.chat(sid, chat_body([{"role": "user", "content": "x"}]))
    assert (outcome.status, outcome.completion, outcome.error_body) == (
        400,
        None,
        b'{"object": "error", "message": "context too long"}',
    )
    stats = service.registry.stats()
    assert (stats.records, stats.turns_in_flight, stats.turns_abandoned_total) == (0, 0, 1)


async def test_a_gateway_verdict_propagates_and_frees_the_session(
    clock: ManualClock, renderer: ChatRenderer
) -> None:
    async def timing_out(call: SessionCall) -> SessionAnswer:
        raise Timeout("charged engine time passed the request's timeout", code="timeout")

    service = service_for(timing_out, clock, renderer)
    sid = service.create()
    with pytest.raises(Timeout):
        await service.chat(sid, chat_body([{"role": "user", "content": "x"}]))
    assert service.registry.stats().turns_in_flight == 0


@dataclass
class Gate:
    """Wraps a dispatcher; calls wait until `open` is set."""

    inner: Any
    open: asyncio.Event = field(default_factory=asyncio.Event)
    arrivals: asyncio.Queue[SessionCall] = field(default_factory=asyncio.Queue)

    async def arrived(self, count: int) -> None:
        for _ in range(count):
            await self.arrivals.get()

    async def __call__(self, call: SessionCall) -> SessionAnswer:
        self.arrivals.put_nowait(call)
        await self.open.wait()
        return await self.inner(call)


async def test_concurrent_requests_of_one_session(clock: ManualClock, renderer: ChatRenderer) -> None:
    gate = Gate(ScriptedGenerate(renderer, replies=["A", "A"]))
    service = service_for(gate, clock, renderer)
    sid = service.create()
    body = chat_body([{"role": "user", "content": "x"}])
    first = asyncio.create_task(service.chat(sid, body))
    twin = asyncio.create_task(service.chat(sid, body))  # a client retry of the same request
    await gate.arrived(2)
    with pytest.raises(SessionConflict) as info:  # a different request meanwhile
        await service.chat(sid, chat_body([{"role": "user", "content": "other"}]))
    assert info.value.status == 409
    gate.open.set()
    outcomes = await asyncio.gather(first, twin)
    assert [o.status for o in outcomes] == [200, 200]
    assert service.registry.get(sid, clock.now()).turns == 1
    assert service.registry.stats().duplicate_commits_total == 1


async def test_cancelling_a_turn_abandons_it(clock: ManualClock, renderer: ChatRenderer) -> None:
    gate = Gate(ScriptedGenerate(renderer, replies=["A"]))
    service = service_for(gate, clock, renderer)
    sid = service.create()
    task = asyncio.create_task(service.chat(sid, chat_body([{"role": "user", "content": "x"}])))
    await gate.arrived(1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    stats = service.registry.stats()
    assert (stats.turns_in_flight, stats.turns_abandoned_total, stats.records) == (0, 1, 0)


async def test_a_session_deleted_mid_turn_still_answers(clock: ManualClock, renderer: ChatRenderer) -> None:
    gate = Gate(ScriptedGenerate(renderer, replies=["A"]))
    service = service_for(gate, clock, renderer)
    sid = service.create()
    task = asyncio.create_task(service.chat(sid, chat_body([{"role": "user", "content": "x"}])))
    await gate.arrived(1)
    service.delete(sid)
    gate.open.set()
    outcome = await task
    assert outcome.status == 200 and not outcome.recorded


@dataclass
class ChatEngine:
    """SGLang's chat endpoint taking `input_ids`: its own parser has read a tool call out of the reply."""

    renderer: ChatRenderer
    prompt_tokens_off: int = 0  # an engine that ignored input_ids saw another prompt
    calls: list[SessionCall] = field(default_factory=list)

    async def __call__(self, call: SessionCall) -> SessionAnswer:
        self.calls.append(call)
        assert call.body is not None
        output = [*self.renderer.encode(TOOL_CALL % "Paris"), *self.renderer.stop_token_ids[:1]]
        answer = {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "model": "tiny",
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": None,
                        "reasoning_content": "look it up",
                        "tool_calls": [
                            {
                                "id": "call_0",
                                "type": "function",
                                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                            }
                        ],
                    },
                    "finish_reason": "tool_calls",
                    "logprobs": {"content": []},
                    "meta_info": {
                        "prompt_tokens": len(call.body["input_ids"]) + self.prompt_tokens_off,
                        "completion_tokens": len(output),
                        "cached_tokens": 0,
                        "weight_version": "v7",
                        "finish_reason": {"type": "stop", "matched": output[-1]},
                        "output_token_logprobs": [[-0.25, t, None] for t in output],
                        "routed_experts": "AAAA",  # a replay payload: for the record, not the agent
                    },
                }
            ],
            "usage": {"prompt_tokens": len(call.body["input_ids"]), "completion_tokens": len(output)},
        }
        return SessionAnswer(status=200, body=orjson.dumps(answer), engine_id="engine-0")


def chat_route_service(engine: ChatEngine, clock: ManualClock, renderer: ChatRenderer) -> SessionService:
    return SessionService(
        SessionRegistry(SessionLimits()),
        engine,
        clock,
        renderer=renderer,
        settings=SessionSettings(engine_route="chat"),
        wall_clock=lambda: 1_700_000_000.0,
    )


async def test_the_chat_route_sends_the_gateways_ids_and_keeps_the_engines_parsed_reply(
    clock: ManualClock, renderer: ChatRenderer
) -> None:
    engine = ChatEngine(renderer)
    service = chat_route_service(engine, clock, renderer)
    session_id = service.create()
    messages = [{"role": "user", "content": "weather in Paris?"}]
    outcome = await service.chat(session_id, chat_body(messages))
    (call,) = engine.calls
    assert call.path == "/v1/chat/completions"
    assert (
        call.body is not None and call.body["messages"] == messages
    )  # SGLang requires them beside input_ids
    expected = renderer.first_prompt(messages, tools=[WEATHER_TOOL], template_kwargs=None)
    assert call.body["input_ids"] == expected and call.body["return_meta_info"] is True
    assert call.body["stop_token_ids"] == list(renderer.stop_token_ids)
    assert outcome.completion is not None
    reply = outcome.completion["choices"][0]["message"]
    assert reply["tool_calls"][0]["function"]["name"] == "get_weather"  # the engine's parser, kept
    meta = outcome.completion["choices"][0]["meta_info"]  # kept for the agent, as miles' session server does
    assert meta["weight_version"] == "v7" and "routed_experts" not in meta  # less the replay payloads
    (record,) = service.registry.get(session_id, clock.now()).records
    assert record.prompt_new_ids.tolist() == expected
    assert record.output_ids.tolist() == [*renderer.encode(TOOL_CALL % "Paris"), *renderer.stop_token_ids[:1]]
    assert record.output_logprobs.tolist() == [-0.25] * len(record.output_ids)
    assert record.weight_version == "v7" and record.tokenized_by_gateway


async def test_an_engine_that_ignored_the_ids_is_refused(clock: ManualClock, renderer: ChatRenderer) -> None:
    service = chat_route_service(ChatEngine(renderer, prompt_tokens_off=3), clock, renderer)
    session_id = service.create()
    with pytest.raises(EngineAnswerInvalid, match="prompt tokens"):
        await service.chat(session_id, chat_body([{"role": "user", "content": "hi"}]))
    assert service.registry.get(session_id, clock.now()).records == []  # nothing recorded


async def test_a_sessions_end_is_told_when_deleted_sampled_or_expired(clock: ManualClock) -> None:
    """The gateway releases the session's engine binding on each (server/sessions_mount.py)."""
    engine = FakeChatEngine(prompts=[[1, 2, 3]])
    service = service_for(engine, clock, renderer=None, idle_ttl_s=60.0)
    ended: list[str] = []
    service.on_end.append(ended.append)
    sampled, deleted, idle = service.create(), service.create(), service.create()
    await service.chat(sampled, {"messages": [{"role": "user", "content": "q1"}]})
    assert service.samples(sampled, {"max_seq_len": 64})
    service.delete(deleted)
    assert ended == [sampled, deleted]
    clock.advance(61.0)
    service.expire()
    assert sorted(ended[2:]) == sorted([sampled, idle])  # sampled, it stays readable until it idles out


async def test_the_chat_route_takes_the_ids_it_sent_when_the_engine_reports_no_prompt_tokens(
    clock: ManualClock, renderer: ChatRenderer
) -> None:
    """miles' MockSGLangServer (and any engine whose chat answer has no `meta_info.prompt_tokens`)."""

    class Silent(ChatEngine):
        async def __call__(self, call: SessionCall) -> SessionAnswer:
            answer = orjson.loads((await super().__call__(call)).body)
            del answer["choices"][0]["meta_info"]["prompt_tokens"]
            return SessionAnswer(status=200, body=orjson.dumps(answer), engine_id="engine-0")

    service = chat_route_service(Silent(renderer), clock, renderer)
    session_id = service.create()
    outcome = await service.chat(session_id, chat_body([{"role": "user", "content": "weather in Paris?"}]))
    assert outcome.status == 200 and outcome.recorded


async def test_in_place_routing_replay_asks_only_for_the_rows_past_the_checkpoint(
    clock: ManualClock, renderer: ChatRenderer
) -> None:
    """miles' `--pause-generation-mode in_place` with routing replay: `routed_experts_start_len` is the
    checkpoint's length less one, sent to the engine and kept on the record."""
    engine = ChatEngine(renderer)
    service = SessionService(
        SessionRegistry(SessionLimits()),
        engine,
        clock,
        renderer=renderer,
        settings=SessionSettings(
            engine_route="chat",
            replay_added_rows=True,
            turn_defaults=tito.TurnDefaults(engine_fields={"return_routed_experts": True}),
        ),
    )
    session_id = service.create()
    first = [{"role": "user", "content": "weather in Paris?"}]
    outcome = await service.chat(session_id, chat_body(first))
    assert outcome.completion is not None and engine.calls[0].body is not None
    assert engine.calls[0].body["routed_experts_start_len"] == 0
    checkpoint = len(service.registry.get(session_id, clock.now()).token_ids)
    reply = outcome.completion["choices"][0]["message"]
    await service.chat(session_id, chat_body([*first, reply, {"role": "tool", "content": "sunny"}]))
    assert engine.calls[1].body is not None
    assert engine.calls[1].body["routed_experts_start_len"] == checkpoint - 1
    records = service.registry.get(session_id, clock.now()).records
    assert [r.request["routed_experts_start_len"] for r in records] == [0, checkpoint - 1]
