"""Migration from the last token (server/continuation.py): a call whose engine dies mid-decode goes on from the
output it already has, on another engine, and its client sees one generation."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from rolloutgate.engines.base import Route
from rolloutgate.server.continuation import can_continue_whole, continuation_body
from rolloutsim.faults import Fault
from rolloutsim.ledger import GenerationLedger
from tests.reliability.conftest import wait_for
from tests.server.conftest import MakeCluster, MakeGateway
from tests.sessions.fixtures import build_tiny_tokenizer

LENGTH = 16_000  # the shape: a 16,000-token logprob call, its engine killed at token ~12,000
KILL_AT = 12_000
CHECKPOINT = 256  # the gateway's --checkpoint-tokens here: a dead engine's last chunk is at most this old
SCALE = 25.0  # ~2,250 simulated tokens a real second: the call takes ~7 s


def assert_continued_from_a_chunk(dead_made: int, carried: int) -> None:
    """The engine left was given what the gateway had read of the dead one: a checkpoint chunk's output (the
    simulator sends one every CHECKPOINT tokens), at least one, and no more than the dead engine made. What it
    made after that chunk (and what a crash drops unread: how far the gateway's reading lagged, a matter of
    load) is all that is made twice; printed, not bounded, since it depends on the machine's load."""
    assert CHECKPOINT <= carried <= dead_made and carried % CHECKPOINT == 0
    print(
        f"\ncontinued from token {carried:,}; the dead engine had made {dead_made:,}: {dead_made - carried} twice"
    )


def answer(ids: list[int], *, version: str, prompt_tokens: int, spans: Any = None) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "cached_tokens": 3,
        "completion_tokens": len(ids),
        "weight_version": version,
        "input_token_logprobs": [[None, 1, None]],
        "output_token_logprobs": [[-0.5, i, None] for i in ids],
        "output_token_logprobs_length": len(ids),
        "finish_reason": None,
    }
    if spans is not None:
        meta["weight_versions"] = spans
    return {"text": "".join(f"<{i}>" for i in ids), "output_ids": ids, "meta_info": meta}


def test_a_stitched_answer_is_one_generation_with_the_original_prompt_and_each_versions_span() -> None:
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 10}, "return_logprob": True}
    new, stitcher = continuation_body(
        Route.GENERATE, body, answer([7, 8, 9], version="v1", prompt_tokens=3), 0
    )
    assert orjson.loads(orjson.dumps(new))["input_ids"] == [1, 2, 3, 7, 8, 9]
    assert new["sampling_params"]["max_new_tokens"] == 7
    assert stitcher is not None
    rest = answer([10, 11], version="v2", prompt_tokens=6)
    rest["meta_info"]["cached_tokens"] = 6
    whole = orjson.loads(stitcher.stitch(orjson.dumps(rest)))
    meta = whole["meta_info"]
    assert whole["output_ids"] == [7, 8, 9, 10, 11]
    assert [t[1] for t in meta["output_token_logprobs"]] == [7, 8, 9, 10, 11]
    assert meta["output_token_logprobs_length"] == 5
    assert (meta["completion_tokens"], meta["prompt_tokens"], meta["cached_tokens"]) == (5, 3, 3)
    assert meta["input_token_logprobs"] == [[None, 1, None]]  # the client's prompt, not prompt + output
    assert meta["weight_version"] == "v2"
    assert meta["weight_versions"] == [
        {"version": "v1", "start": 0, "end": 3},
        {"version": "v2", "start": 3, "end": 5},
    ]
    # a second continuation from the stitched answer: spans of one version join, the ids go on
    again, second = continuation_body(Route.GENERATE, body, whole, 0)
    assert orjson.loads(orjson.dumps(again))["input_ids"] == [1, 2, 3, 7, 8, 9, 10, 11]
    assert again["sampling_params"]["max_new_tokens"] == 5
    assert second is not None
    last = orjson.loads(second.stitch(orjson.dumps(answer([12], version="v2", prompt_tokens=8))))["meta_info"]
    assert last["weight_versions"] == [
        {"version": "v1", "start": 0, "end": 3},
        {"version": "v2", "start": 3, "end": 6},
    ]
    assert (last["completion_tokens"], last["prompt_tokens"]) == (6, 3)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4}}, True),
        ({"text": "hi"}, True),
        ({"input_ids": [[1, 2], [3]]}, False),  # a batch
        ({"input_ids": [1, 2], "sampling_params": {"n": 2}}, False),
        ({"input_ids": [1, 2], "return_routed_experts": True}, False),  # per token of the whole sequence
        ({"input_ids": [1, 2], "sampling_params": [{"max_new_tokens": 4}]}, False),
    ],
)
def test_which_whole_answers_can_be_continued(body: dict[str, Any], expected: bool) -> None:
    assert can_continue_whole(Route.GENERATE, body) is expected
    if "input_ids" in body:  # as the front keeps them: a compact fragment, read without parsing it
        kept = {**body, "input_ids": orjson.Fragment(orjson.dumps(body["input_ids"]))}
        assert can_continue_whole(Route.GENERATE, kept) is expected
    assert can_continue_whole(Route.CHAT, {"messages": []}) is False  # a chat route takes no ids


async def killed_at(cluster: Any, engine: int, tokens: int) -> None:
    """Crash `engine` once it has generated `tokens` (its ledger tells how many it made in all)."""
    await wait_for(
        lambda: cluster.engines[engine].generated_tokens_total >= tokens,
        what=f"{tokens} tokens",
        timeout_s=60,
    )
    cluster.engines[engine].set_fault(Fault(kind="crash"))


def split_work(ledgers: list[GenerationLedger], dead: int, prompt: int) -> tuple[int, int, int]:
    """(tokens the killed engine made, tokens the other was given as prompt beyond the client's, tokens the
    other made), from the engines' own ledgers: each ran the call once, the dead one to its abort."""
    [killed] = ledgers[dead].records
    [continued] = ledgers[1 - dead].records
    assert (killed.finish, continued.finish) == ("abort", "length")
    return killed.completion_tokens, continued.prompt_tokens - prompt, continued.completion_tokens


PROMPT = list(range(11, 111))


async def call_killed_midway(
    cluster: Any, url: str, http: httpx.AsyncClient, *, length: int, kill_at: int, stream: bool = False
) -> tuple[httpx.Response, int]:
    """A `length`-token logprob `/generate` of PROMPT through the gateway at `url`, its engine crashed once it
    has made `kill_at` tokens: the answer, and which engine was killed."""
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": length, "ignore_eos": True},
        "return_logprob": True,
        "stream": stream,
    }
    call = asyncio.create_task(http.post(f"{url}/generate", json=body, timeout=120))
    await wait_for(lambda: any(e.running_count for e in cluster.engines), what="the call running")
    first = next(i for i, e in enumerate(cluster.engines) if e.running_count)
    await killed_at(cluster, first, kill_at)
    response = await call
    assert response.status_code == 200, response.text
    return response, first


def assert_whole(answer: Any) -> None:
    """A call answered whole: all LENGTH tokens, each with its logprob, the client's own prompt count."""
    meta, ids = answer["meta_info"], answer["output_ids"]
    assert len(ids) == LENGTH and meta["completion_tokens"] == LENGTH
    assert [t[1] for t in meta["output_token_logprobs"]] == ids
    assert all(isinstance(t[0], float) for t in meta["output_token_logprobs"])
    assert meta["prompt_tokens"] == len(PROMPT)


async def test_an_engine_killed_at_token_12000_of_16000_costs_no_token_twice(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    cluster = await make_cluster(engines=2, time_scale=SCALE)
    ledgers = GenerationLedger.attach_fleet(cluster.engines)
    gateway = await make_gateway(cluster, checkpoint_tokens=CHECKPOINT, keepalive_interval=0)
    response, first = await call_killed_midway(cluster, gateway.url, http, length=LENGTH, kill_at=KILL_AT)
    assert_whole(response.json())
    # the engine left ran one generation: the prompt plus what the dead one had sent, then the rest
    dead_made, carried, rest = split_work(ledgers, first, len(PROMPT))
    assert dead_made >= KILL_AT and carried + rest == LENGTH
    assert_continued_from_a_chunk(dead_made, carried)
    assert response.headers["X-Rolloutgate-Engine"] == cluster.urls[1 - first]


async def test_with_incremental_chunks_every_token_a_killed_engines_output_is_made_once(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    """SGLang's `--incremental-streaming-output` makes each chunk carry only its own tokens, so the gateway can
    read a call's output every token (`--checkpoint-tokens 1`) for bytes in proportion to the output, not its
    square. A killed engine then loses only what it made and had not sent yet (printed: how many that was
    depends on the machine's load, as in `assert_continued_from_a_chunk`)."""
    cluster = await make_cluster(engines=2, time_scale=SCALE, incremental_streaming_output=True)
    ledgers = GenerationLedger.attach_fleet(cluster.engines)
    gateway = await make_gateway(cluster, checkpoint_tokens=1, keepalive_interval=0)
    response, first = await call_killed_midway(cluster, gateway.url, http, length=LENGTH, kill_at=KILL_AT)
    assert_whole(response.json())
    dead_made, carried, rest = split_work(ledgers, first, len(PROMPT))
    assert dead_made >= KILL_AT and carried + rest == LENGTH and carried <= dead_made
    print(
        f"\ncontinued from token {carried:,}; the dead engine had made {dead_made:,}: {dead_made - carried} twice"
    )


async def test_a_streaming_client_of_an_incremental_engine_is_continued_from_what_it_was_sent(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    """A streaming client's answer so far is every chunk it was sent, added up as the engine streams them:
    incremental chunks are joined (read as cumulative, the next engine was given the last chunk's tokens
    alone as the answer so far)."""
    length, kill_at = 4_000, 2_000
    cluster = await make_cluster(engines=2, time_scale=SCALE, incremental_streaming_output=True)
    ledgers = GenerationLedger.attach_fleet(cluster.engines)
    gateway = await make_gateway(cluster, keepalive_interval=0)
    response, first = await call_killed_midway(
        cluster, gateway.url, http, length=length, kill_at=kill_at, stream=True
    )
    events = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    ids = [i for chunk in chunks for i in chunk["output_ids"]]
    logprob_ids = [t[1] for chunk in chunks for t in chunk["meta_info"]["output_token_logprobs"]]
    assert len(ids) == length and logprob_ids == ids
    dead_made, carried, rest = split_work(ledgers, first, len(PROMPT))
    assert carried + rest == length and kill_at <= carried <= dead_made


async def test_a_session_turn_continued_elsewhere_is_recorded_as_one_turn_with_the_answers_ids(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    cluster = await make_cluster(engines=2, time_scale=SCALE)
    ledgers = GenerationLedger.attach_fleet(cluster.engines)
    gateway = await make_gateway(
        cluster,
        tokenizer=str(build_tiny_tokenizer(tmp_path / "tok")),
        checkpoint_tokens=CHECKPOINT,
        keepalive_interval=0,
    )
    session_id = (await http.post(f"{gateway.url}/sessions")).json()["session_id"]
    turn = asyncio.create_task(
        http.post(
            f"{gateway.url}/sessions/{session_id}/v1/chat/completions",
            json={
                "model": "sim-model",
                "messages": [{"role": "user", "content": "a long answer please"}],
                "max_tokens": LENGTH,
                "ignore_eos": True,
                "logprobs": True,
            },
            timeout=120,
        )
    )
    await wait_for(lambda: any(e.running_count for e in cluster.engines), what="the turn running")
    first = next(i for i, e in enumerate(cluster.engines) if e.running_count)
    await killed_at(cluster, first, KILL_AT)
    reply = await turn
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == LENGTH
    [record] = (await http.get(f"{gateway.url}/sessions/{session_id}")).json()["records"]
    dead_made, carried, rest = split_work(ledgers, first, len(record["prompt_token_ids"]))
    assert carried + rest == LENGTH
    assert_continued_from_a_chunk(dead_made, carried)
    assert len(record["output_token_ids"]) == LENGTH
    assert len(record["output_logprobs"]) == LENGTH
    assert record["timing"]["attempts"] == 2 and record["engine"] == f"engine-{1 - first}"
    content = reply.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == LENGTH
    trajectory = (await http.get(f"{gateway.url}/sessions/{session_id}/trajectory")).json()
    assert trajectory["token_ids"] == record["prompt_token_ids"] + record["output_token_ids"]
