"""SkyRL's router calls, imitated, against rolloutgate in front of simulated vLLM engines (docs/frameworks/skyrl.md).

This test does not run SkyRL's code: skyrl 0.3.0 (the package index's wheel) does not import on this venv's
Python 3.11 (its `SampleRequestBody` is a `typing.TypedDict`, which pydantic refuses below 3.12), and its
trainer pulls torch and Ray. It makes, on the wire, the calls SkyRL's `RemoteInferenceClient` makes through its
router (`proxy_url`), in the order its generators make them. Sources: NovaSky-AI/SkyRL a9564572 (2026-08-21),
the same code in the skyrl 0.3.0 wheel:

- `skyrl/backends/skyrl_train/inference_servers/remote_inference_client.py`:
  `_get_session` (one `aiohttp.ClientSession`, `TCPConnector(keepalive_timeout=2)`, no total timeout);
  `_post` (`orjson.loads` of the body, an error status raises); `completion` and `chat_completion` (the body's
  `session_id` taken out and sent as the `X-Session-ID` header, `Content-Type: application/json`, to
  `/v1/completions` and `/v1/chat/completions`); `finish_session` (`POST /finish_session` with the query
  `session_id`, no body, a 10 s bound, failures only logged).
- `skyrl/train/generators/skyrl_gym_generator.py` `agent_loop`: one session id per trajectory
  (`f"{instance_id}_{repetition_id}"`), every turn's prompt the previous prompt plus the output ids plus the
  observation ids, and `finish_session(session_id)` in its `finally` (done, failed or cancelled);
  `examples/train_integrations/harbor/harbor_generator.py`: a uuid4 hex session per trial attempt, released
  in the attempt's `finally`.

The gym generator's turns are `generate()`'s `_generate_single`: token ids to vLLM's `/inference/v1/generate`
(`{"sampling_params", "model", "token_ids"}`, `X-Session-ID`), reading `choices[0].token_ids`,
`finish_reason` and `logprobs.content[].logprob`. The imitation also reads rolloutgate's
`X-Rolloutgate-Engine` answer header, which SkyRL ignores, to see where each turn ran.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from typing import Any

import pytest
from tests.compat.frameworks.sim_engines import wait_running
from tests.compat.frameworks.wire_clients import SkyRLClient, Trajectory
from tests.server import conftest as server_conftest
from tests.server.conftest import MakeCluster, MakeGateway

make_cluster = server_conftest.make_cluster  # the gateway tests' fixtures, reused here
make_gateway = server_conftest.make_gateway

SCALE = 100.0


@pytest.mark.looptime
async def test_a_skyrl_batch_sticks_each_trajectory_and_releases_it_on_success_and_cancel(
    make_cluster: MakeCluster, make_gateway: MakeGateway
) -> None:
    """Four trajectories start at once (SkyRL gathers a batch's agent loops): `sticky_least_loaded` spreads
    their sessions two and two, and every turn of a trajectory runs on its first turn's engine. On engine A,
    one trajectory ends and one is cancelled mid-turn; both release their session from `finally`. Two new
    trajectories then both go to A, which now holds none against B's two: counted, the releases would have
    left A and B at two each and the two new sessions on different engines."""
    cluster = await make_cluster(engines=2, api="vllm", time_scale=SCALE)
    gateway = await make_gateway(cluster, placement="sticky_least_loaded")
    client = SkyRLClient(gateway.url)
    try:
        batch = [Trajectory(client, instance_id=i) for i in range(4)]
        await asyncio.gather(*(t.turn() for t in batch))
        first = {t.session_id: t.engines[0] for t in batch}
        assert sorted(Counter(first.values()).values()) == [2, 2], first
        for _ in range(2):
            await asyncio.gather(*(t.turn() for t in batch))
        for t in batch:
            assert len(t.engines) == 3 and len(set(t.engines)) == 1, (t.session_id, t.engines)

        engine_a = batch[0].engines[0]
        on_a = [t for t in batch if t.engines[0] == engine_a]
        on_b = [t for t in batch if t.engines[0] != engine_a]
        done, cancelled = on_a
        await done.turn()
        await done.end()  # the trajectory's last turn, then its `finally`
        long_turn = cancelled.start_turn(4000)  # a long turn, cancelled while the engine runs it
        await wait_running(cluster, engine_a)
        cancelled.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled.task
        assert not long_turn.done()
        assert sorted(client.finished) == sorted([(done.session_id, 200), (cancelled.session_id, 200)])

        newcomers = [Trajectory(client, instance_id=i) for i in (10, 11)]
        for t in newcomers:  # one after the other: each placed knowing the last
            await t.turn()
        assert [t.engines[0] for t in newcomers] == [engine_a, engine_a]
        await asyncio.gather(*(t.turn() for t in on_b))  # the live sessions keep their engine
        for t in on_b:
            assert set(t.engines) == {t.engines[0]} and t.engines[0] != engine_a

        for t in [*on_b, *newcomers]:
            await t.end()
        assert {sid for sid, _ in client.finished} == {t.session_id for t in [*batch, *newcomers]}
        assert all(status == 200 for _, status in client.finished)
    finally:
        await client.close()


@pytest.mark.looptime
async def test_a_failed_harbor_attempt_is_released_and_its_retry_placed_by_live_sessions(
    make_cluster: MakeCluster, make_gateway: MakeGateway
) -> None:
    """HarborGenerator's trials: the agent's chat calls carry the attempt's uuid4 session as `X-Session-ID`
    (and as the body's `session_id`, which `chat_completion` takes out). An attempt fails while its call runs
    (the agent timed out: its call is dropped); its `finally` releases the session, and the retry, a new
    session, goes to the failed attempt's engine, which holds no session now though its dropped call may still
    run there. Counted, that session would tie the engines and the less busy one would take the retry. An id
    never seen (a trial that failed before its first call) is released all the same."""
    cluster = await make_cluster(engines=2, api="vllm", time_scale=SCALE)
    gateway = await make_gateway(cluster, placement="sticky_least_loaded")
    client = SkyRLClient(gateway.url)

    async def chat_turn(session_id: str, messages: list[Any], max_tokens: int = 6) -> tuple[list[Any], str]:
        body, engine = await client.chat_completion(
            {
                "json": {
                    "messages": messages,
                    "max_tokens": max_tokens,
                    "ignore_eos": True,
                    "session_id": session_id,
                }
            }
        )
        return [*messages, body["choices"][0]["message"], {"role": "user", "content": "go on"}], engine

    async def trial(session_id: str, turns: int) -> list[str]:
        engines, messages = [], [{"role": "user", "content": f"task {session_id}"}]
        for _ in range(turns):
            messages, engine = await chat_turn(session_id, messages)
            engines.append(engine)
        return engines

    try:
        live = uuid.uuid4().hex
        engine_a = (await trial(live, 2))[0]
        failed = uuid.uuid4().hex
        try:
            messages, engine_b = await chat_turn(failed, [{"role": "user", "content": "task"}])
            assert engine_b != engine_a  # a new session goes where none lives
            stuck = asyncio.create_task(chat_turn(failed, messages, max_tokens=4000))
            await wait_running(cluster, engine_b)
            stuck.cancel()  # AgentTimeoutError: the trial gives up on its call
            with pytest.raises(asyncio.CancelledError):
                await stuck
        finally:
            await client.finish_session(failed)
        retry = uuid.uuid4().hex
        assert set(await trial(retry, 3)) == {engine_b}
        assert set(await trial(live, 1)) == {engine_a}  # the live session kept its engine
        never_called = uuid.uuid4().hex
        await client.finish_session(never_called)
        for session_id in (live, retry):
            await client.finish_session(session_id)
        assert client.finished == [(failed, 200), (never_called, 200), (live, 200), (retry, 200)]
    finally:
        await client.close()


@pytest.mark.looptime
async def test_skyrls_token_in_generate_is_an_inference_call_placed_by_its_session(
    make_cluster: MakeCluster, make_gateway: MakeGateway
) -> None:
    """`_generate_single`'s call carries no credentials (SkyRL sends none): with an admin token set on the
    gateway, it is still served, as an inference call (the answer names its engine), and placed by its session. It
    went to the catch-all proxy as engine control before rolloutgate served the route: 401 there."""
    cluster = await make_cluster(engines=2, api="vllm", time_scale=SCALE)
    gateway = await make_gateway(cluster, placement="sticky_least_loaded", admin_token="admin-secret")
    client = SkyRLClient(gateway.url)
    try:
        params = {"max_tokens": 8, "logprobs": 0}
        first, engine = await client.generate_single(list(range(1, 30)), params, "0_0")
        assert first["stop_reason"] in ("length", "stop") and first["response_logprobs"]
        _, other_engine = await client.generate_single(list(range(1, 30)), params, "1_0")
        assert other_engine != engine  # a second live session goes to the engine holding none
        for _ in range(3):
            _, again = await client.generate_single([*range(1, 30), *first["response_ids"]], params, "0_0")
            assert again == engine
    finally:
        await client.close()
