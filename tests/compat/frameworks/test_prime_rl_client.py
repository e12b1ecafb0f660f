"""prime-rl's router calls, imitated, against rolloutgate in front of simulated vLLM engines
(docs/frameworks/prime-rl.md).

This test does not run prime-rl's code (its orchestrator needs verifiers, renderers, vLLM and torch). It makes,
on the wire, the calls prime-rl's orchestrator makes through the client-facing router once prime-rl#3563
(2026-09-16) made `sticky_least_loaded` its default, in the order it makes them:

- `packages/prime-rl-configs/src/prime_rl/configs/orchestrator.py` `auto_setup_session_headers` (snapshot
  559b447, 2026-08-21): every rollout request carries `X-Session-ID: <trajectory_id>`
  (`extra_headers_from_state`); after #3563 the session ids are the episode's trace ids.
- `src/prime_rl/orchestrator/clients.py` after #3563, `InferenceClient.finish_sessions`: one `httpx.AsyncClient`
  on the router's URL without `/v1` (`setup_admin_clients` with `admin_base_url=None`: the config's headers,
  `Authorization: Bearer <$api_key_var>` when set, no client timeout), and per session id, gathered,
  `_admin_post(client, "/finish_session", timeout_s=5.0, params={"session_id": id})`: a POST with no body,
  `raise_for_status`, transport errors and 5xx retried (tenacity, at most 10 tries), any failure only logged.
  It is called only where `admin_base_url` is set (a managed, routed deployment).
- the dispatcher (`src/prime_rl/orchestrator/dispatcher.py` after #3563, PR description and its review): an
  episode's sessions are released when it completes, fails or is cancelled (a stale or superseded group
  dropped), `finish_sessions(sorted(trace ids))` from the episode task's `finally`, shielded from the
  cancellation.
- `AdminPlane.wait_for_ready`: `GET /health` on the router.

What differs, on purpose: prime-rl's training rollouts go through its renderer client, token ids to vLLM's
`/inference/v1/generate`, which rolloutgate does not serve as an inference route (a gap: the SkyRL test's last
test shows it); here every turn is a chat completion with the OpenAI SDK, as prime-rl's eval client
(`openai_chat_completions`) sends it, with the session header. The imitation also reads rolloutgate's
`X-Rolloutgate-Engine` answer header, which prime-rl ignores, to see where each turn ran.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx
import pytest
from tests.compat.frameworks.sim_engines import wait_running
from tests.compat.frameworks.wire_clients import PRIME_RL_API_KEY as API_KEY
from tests.compat.frameworks.wire_clients import Episode, PrimeRLClients
from tests.server import conftest as server_conftest
from tests.server.conftest import MakeCluster, MakeGateway

make_cluster = server_conftest.make_cluster  # the gateway tests' fixtures, reused here
make_gateway = server_conftest.make_gateway

SCALE = 100.0


@pytest.mark.looptime
async def test_a_prime_rl_group_sticks_and_releases_on_success_failure_and_cancellation(
    make_cluster: MakeCluster, make_gateway: MakeGateway
) -> None:
    """A group of four rollouts starts at once: `sticky_least_loaded` spreads them two and two and keeps each
    trace's calls on one engine. On engine A one rollout fails (the env raises) and one is cancelled mid-call
    (its group went stale): both release their session from the episode's `finally`. The next two new
    sessions then both go to A (none live there against B's two; counted, the ends would leave A and B at two
    each and the two new sessions apart). Then B's rollouts succeed and release theirs: the next new session
    goes to B, now the emptier."""
    cluster = await make_cluster(engines=2, api="vllm", time_scale=SCALE)
    gateway = await make_gateway(cluster, placement="sticky_least_loaded", api_keys=[API_KEY])
    clients = PrimeRLClients(f"{gateway.url}/v1")
    try:
        await clients.wait_for_ready()
        group = [Episode(clients, [f"trace-{i}"]) for i in range(4)]
        await asyncio.gather(*(e.turn(e.trace_ids[0]) for e in group))
        first = {e.trace_ids[0]: e.engines[e.trace_ids[0]][0] for e in group}
        assert sorted(Counter(first.values()).values()) == [2, 2], first
        await asyncio.gather(*(e.turn(e.trace_ids[0]) for e in group))
        engine_a = group[0].engine("trace-0")
        on_a = [e for e in group if e.engine(e.trace_ids[0]) == engine_a]
        on_b = [e for e in group if e.engine(e.trace_ids[0]) != engine_a]

        failing, stale = on_a
        with pytest.raises(RuntimeError, match="env exploded"):
            await failing.run(turns=3, fail_after=1)
        stale_task = asyncio.create_task(stale.run(turns=1, last_turn_tokens=4000))
        await wait_running(cluster, engine_a)
        stale_task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stale_task
        assert sorted(clients.released) == sorted([(failing.trace_ids[0], 200), (stale.trace_ids[0], 200)])

        newcomers = [Episode(clients, [f"trace-{i}"]) for i in (4, 5)]
        for e in newcomers:  # one after the other: each placed knowing the last
            await e.turn(e.trace_ids[0])
        assert [e.engine(e.trace_ids[0]) for e in newcomers] == [engine_a, engine_a]

        await asyncio.gather(*(e.run(turns=2) for e in on_b))  # they finish on their engine and release
        engine_b = on_b[0].engine(on_b[0].trace_ids[0])
        assert all(e.engine(e.trace_ids[0]) == engine_b != engine_a for e in on_b)
        late = Episode(clients, ["trace-6"])
        await late.run(turns=2)
        assert late.engine("trace-6") == engine_b  # B holds none now, A two
        for e in newcomers:
            await e.run(turns=1)
        assert {sid for sid, _ in clients.released} == {f"trace-{i}" for i in range(7)}
        assert all(status == 200 for _, status in clients.released)
    finally:
        await clients.close()


@pytest.mark.looptime
async def test_an_episode_with_several_traces_releases_them_all_at_once(
    make_cluster: MakeCluster, make_gateway: MakeGateway
) -> None:
    """A multi-agent episode: two traces, two sessions, each kept on its engine, released together by one
    `finish_sessions`. A solo rollout holds engine A busy with a long call while the pair's sessions are
    placed, so both go to B (the first where no session lives, the second to the less busy of two engines
    holding one each). Once the pair is released, a new session goes to B; counted, B's two would send it to
    A. A release without the inference key is refused (rolloutgate asks `/finish_session` for the key its
    calls need) and releases nothing: prime-rl sends the key it sends with its calls."""
    cluster = await make_cluster(engines=2, api="vllm", time_scale=SCALE)
    gateway = await make_gateway(cluster, placement="sticky_least_loaded", api_keys=[API_KEY])
    clients = PrimeRLClients(f"{gateway.url}/v1")
    try:
        solo = Episode(clients, ["solo"])
        solo_task = asyncio.create_task(solo.run(turns=1, last_turn_tokens=4000))
        for _ in range(2000):
            if any(engine.running_count for engine in cluster.engines):
                break
            await asyncio.sleep(0.01)
        engine_a = next(url for url, e in zip(cluster.urls, cluster.engines, strict=True) if e.running_count)
        pair = Episode(clients, ["planner", "coder"])
        await pair.turn("planner")
        await pair.turn("coder")
        engine_b = pair.engine("planner")
        assert engine_b != engine_a and pair.engine("coder") == engine_b
        async with httpx.AsyncClient(base_url=gateway.url) as keyless:
            refused = await keyless.post("/finish_session", params={"session_id": "planner"})
        assert refused.status_code == 401
        await pair.run(turns=2)
        assert pair.engine("planner") == pair.engine("coder") == engine_b
        assert sorted(clients.released) == [("coder", 200), ("planner", 200)]
        newcomer = Episode(clients, ["newcomer"])
        await newcomer.run(turns=2)
        assert newcomer.engine("newcomer") == engine_b
        solo_task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await solo_task
        assert sorted(sid for sid, _ in clients.released) == ["coder", "newcomer", "planner", "solo"]
    finally:
        await clients.close()
