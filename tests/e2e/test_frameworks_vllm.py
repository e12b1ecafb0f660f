"""SkyRL's and prime-rl's own calls, in their order, through rolloutgate in front of the real vLLM engines (issue 36).

The clients are the wire imitations of tests/compat/frameworks (wire_clients.py; their sources are named in
test_skyrl_client.py and test_prime_rl_client.py, docs/frameworks/skyrl.md and prime-rl.md): SkyRL's
`generate()` turns (token ids to `/inference/v1/generate` with `X-Session-ID`) and `/finish_session` from each
trajectory's `finally`; prime-rl's training turns (the same route, with its API key) and eval turns (chat with
the OpenAI SDK), its session header and `finish_sessions` with the key. Both under `sticky_least_loaded`, their
routers' policy. What is checked is what the engines show over HTTP: the answers, rolloutgate's
`X-Rolloutgate-Engine` header, and each engine's own token counter (`Metrics.generated`), which must agree with
where the answers say each call ran.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter

import httpx
import pytest
from tests.compat.frameworks.wire_clients import (
    PRIME_RL_API_KEY,
    Episode,
    PrimeRLClients,
    SkyRLClient,
    Trajectory,
)
from tests.e2e.conftest import MakeGateway
from tests.e2e.harness import EngineSet, scrape, scrape_all, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.api("vllm")]

TURN = 8  # tokens per turn: a fraction of a second on the tiny model
LONG_TURN = 2_000  # ~7 s alone on real vLLM 0.32 here: still running when the trajectory is cancelled
PLACEMENT = "sticky_least_loaded"


def made_per_engine(calls: list[tuple[str, int]]) -> Counter[str]:
    """Tokens each engine was asked for, by the engine the answer named."""
    made: Counter[str] = Counter()
    for engine, tokens in calls:
        made[engine] += tokens
    return made


async def test_skyrl_trajectories_stick_to_one_engine_and_release_on_success_and_cancel(
    engines: EngineSet, gateways: MakeGateway
) -> None:
    """SkyRL's gym generator: a batch of four trajectories starts at once (each `f"{instance}_{repetition}"` its
    session), every turn `generate()`'s token call with `X-Session-ID`, the prompt growing by the output and the
    observation. `sticky_least_loaded` spreads the four two and two and keeps each trajectory's turns on its
    first engine. On engine A one trajectory ends and one is cancelled during a long turn; both release their
    session from `finally` (`/finish_session`, 200). Two new trajectories then both go to A (no live session
    there against B's two). The engines' own counters: B made exactly the tokens of the turns answered as B's;
    A at least those answered as A's (the cancelled turn ran there for a while)."""
    gateway = gateways(placement=PLACEMENT)
    repetition = int(uuid.uuid4().int % 100_000)  # a session id of this run's own: the gateway outlives tests
    before = await scrape_all(engines.urls)
    client = SkyRLClient(gateway.url, model=engines.model)
    try:
        batch = [Trajectory(client, instance_id=i, repetition_id=repetition) for i in range(4)]
        await asyncio.gather(*(t.turn(TURN) for t in batch))
        first = {t.session_id: t.engines[0] for t in batch}
        assert sorted(Counter(first.values()).values()) == [2, 2], first
        for _ in range(2):
            await asyncio.gather(*(t.turn(TURN) for t in batch))
        for t in batch:
            assert len(t.engines) == 3 and len(set(t.engines)) == 1, (t.session_id, t.engines)

        engine_a = batch[0].engines[0]
        done, cancelled = [t for t in batch if t.engines[0] == engine_a]
        on_b = [t for t in batch if t.engines[0] != engine_a]
        await done.turn(TURN)
        await done.end()  # its last turn, then its `finally`
        long_turn = cancelled.start_turn(LONG_TURN)
        await wait_for("the long turn running on A", lambda: scrape(engine_a), lambda m: m.running > 0, 60.0)
        cancelled.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled.task
        assert not long_turn.done()
        assert sorted(client.finished) == sorted([(done.session_id, 200), (cancelled.session_id, 200)])

        newcomers = [Trajectory(client, instance_id=i, repetition_id=repetition) for i in (10, 11)]
        for t in newcomers:  # one after the other: each placed knowing the last
            await t.turn(TURN)
        assert [t.engines[0] for t in newcomers] == [engine_a, engine_a]
        await asyncio.gather(*(t.turn(TURN) for t in on_b))  # the live sessions keep their engine
        for t in on_b:
            assert set(t.engines) == {t.engines[0]} and t.engines[0] != engine_a
        for t in [*on_b, *newcomers]:
            await t.end()
        assert {sid for sid, _ in client.finished} == {t.session_id for t in [*batch, *newcomers]}
        assert all(status == 200 for _, status in client.finished)
    finally:
        await client.close()

    asked = made_per_engine([call for t in [*batch, *newcomers] for call in t.calls])
    (engine_b,) = set(engines.urls) - {engine_a}
    # the cancelled turn runs on A until the gateway's retry grace ends it: wait for A to be idle
    await wait_for("engine A idle", lambda: scrape(engine_a), lambda m: m.running == 0, 60.0)
    after = await scrape_all(engines.urls)
    assert after[engine_b].generated - before[engine_b].generated == asked[engine_b]
    made_on_a = after[engine_a].generated - before[engine_a].generated
    assert asked[engine_a] < made_on_a <= asked[engine_a] + LONG_TURN, (made_on_a, asked)


async def test_prime_rl_token_and_chat_rollouts_with_its_key_stick_and_release(
    engines: EngineSet, gateways: MakeGateway
) -> None:
    """prime-rl's orchestrator with an API key: `wait_for_ready` (`GET /health`); a group of four training
    rollouts (each one trace, `X-Session-ID: <trace id>`, the renderer's token calls to `/inference/v1/generate`
    with `Authorization: Bearer <key>`) spread two and two and each kept on its engine. On engine A one rollout
    succeeds and one fails (the env raises); both release from the episode's `finally` (`/finish_session` with
    the key, 200). Two eval rollouts (chat through the OpenAI SDK, the same key and header) then both go to A.
    Without the key, a token call and `/finish_session` are refused (401) and the engines make nothing. The
    engines' own counters: each made exactly the tokens of the calls answered as its own."""
    gateway = gateways(placement=PLACEMENT, api_key=PRIME_RL_API_KEY)
    run = uuid.uuid4().hex[:8]  # trace ids of this run's own
    before = await scrape_all(engines.urls)
    clients = PrimeRLClients(f"{gateway.url}/v1", model=engines.model)
    try:
        await clients.wait_for_ready()
        group = [Episode(clients, [f"{run}-trace-{i}"], tokens=True) for i in range(4)]
        await asyncio.gather(*(e.token_turn(e.trace_ids[0], TURN) for e in group))
        first = {e.trace_ids[0]: e.engines[e.trace_ids[0]][0] for e in group}
        assert sorted(Counter(first.values()).values()) == [2, 2], first
        await asyncio.gather(*(e.token_turn(e.trace_ids[0], TURN) for e in group))
        engine_a = group[0].engine(group[0].trace_ids[0])
        succeeding, failing = [e for e in group if e.engine(e.trace_ids[0]) == engine_a]
        on_b = [e for e in group if e.engine(e.trace_ids[0]) != engine_a]

        await succeeding.run(turns=1, last_turn_tokens=TURN)
        with pytest.raises(RuntimeError, match="env exploded"):
            await failing.run(turns=2, fail_after=1)
        assert sorted(clients.released) == sorted(
            [(succeeding.trace_ids[0], 200), (failing.trace_ids[0], 200)]
        )

        evals = [Episode(clients, [f"{run}-eval-{i}"]) for i in range(2)]
        for e in evals:  # one after the other: each placed knowing the last
            await e.turn(e.trace_ids[0], TURN)
        assert [e.engine(e.trace_ids[0]) for e in evals] == [engine_a, engine_a]

        idle = await scrape_all(engines.urls)
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60.0) as keyless:
            body = {"model": engines.model, "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": TURN}}
            refused_call = await keyless.post("/inference/v1/generate", json=body)
            refused_release = await keyless.post(
                "/finish_session", params={"session_id": on_b[0].trace_ids[0]}
            )
        assert (refused_call.status_code, refused_release.status_code) == (401, 401)
        unchanged = await scrape_all(engines.urls)
        assert all(unchanged[u].generated == idle[u].generated for u in engines.urls), "a keyless call ran"

        await asyncio.gather(*(e.run(turns=2, last_turn_tokens=TURN) for e in on_b))
        assert all(e.engine(e.trace_ids[0]) != engine_a for e in on_b)  # the refused release kept its binding
        for e in evals:
            await e.run(turns=1, last_turn_tokens=TURN)
        assert {sid for sid, _ in clients.released} == {e.trace_ids[0] for e in [*group, *evals]}
        assert all(status == 200 for _, status in clients.released)
    finally:
        await clients.close()

    asked = made_per_engine([call for e in [*group, *evals] for call in e.calls])
    after = await scrape_all(engines.urls)
    assert {u: after[u].generated - before[u].generated for u in engines.urls} == {
        u: asked[u] for u in engines.urls
    }
