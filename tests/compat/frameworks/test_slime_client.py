"""slime's router calls, imitated, against rolloutgate in front of simulated SGLang engines
(docs/frameworks/slime.md).

This test does not run slime's code (it needs sglang, sglang_router, Megatron, torch and Ray; it is not on the
package index). It makes, on the wire, the calls slime makes to its router and, through the router's worker
list, to its engines, in slime's order. Sources: THUDM/slime 624b824a (2026-08-21):

- `slime/backends/sglang_utils/sglang_engine.py`: `SGLangEngine._register_to_router` (`POST /workers
  {"url", "worker_type": "regular"}`, `raise_for_status`); `shutdown` (`GET /workers`, the worker whose `url`
  is its own, `DELETE /workers/{id}`).
- `slime/utils/http_utils.py`: `init_http_client` (one `httpx.AsyncClient`, no timeout, `trust_env=False`,
  `sglang_server_concurrency` x engines connections); `_post` (any error retried, 60 tries, 1 s apart; the
  body parsed as JSON); `get` (`raise_for_status`, JSON).
- `slime/rollout/sglang_rollout.py`: `GenerateState` (the sampling parameters), `generate` (`POST /generate
  {"sampling_params", "return_logprob": true, "input_ids"}`, `X-SMG-Routing-Key: <session id>` under
  `--router-policy consistent_hashing`, `max_new_tokens` less the response already generated (slime#2261), the
  answer's `meta_info.output_token_logprobs` and `text` appended), `generate_and_rm_group` (a uuid4 session id
  per sample), `abort` (`GET /workers` on the router, then `abort_servers_until_idle` on every URL, then every
  pending task awaited; with `--partial-rollout` the aborted samples go back to the buffer).
- `slime/backends/sglang_utils/server_control.py`: `abort_server_until_idle` (`POST /abort_request
  {"abort_all": true}` on the engine, `GET /v1/loads?include=core`, `num_requests_from_load`, again every 3 s
  until the engine holds no request).
- `slime/utils/types.py` `Sample.append_response_tokens` / `_apply_meta_info`: the status from
  `meta_info.finish_reason.type` (length: truncated, abort: aborted, stop: completed), `weight_version`.
- `slime/rollout/sglang_streaming_rollout.py` `generate_streaming`: the same body with `"stream": true`, each
  SSE `data:` chunk taken as the call's cumulative state so far (what an abort leaves on the sample).
- `slime/agent/adapters/common.py` `call_sglang_generate`: the agent adapters' turn, with its own `rid`
  (uuid4 hex), `aiohttp.ClientTimeout(total=None, sock_read=900)`, and on cancellation `POST /abort_request
  {"rid": rid}` to the same URL.

What differs, on purpose: the imitation reads rolloutgate's answers and state (`X-Rolloutgate-Engine`, the
simulated engines' counters), which slime does not, to see where each call ran. The step-end abort in
`test_..._waiting_in_the_gateway` is slime's with the patch of docs/frameworks/slime.md (the router first).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import uuid
from typing import Any

import aiohttp
import pytest
from tests.compat.frameworks.sim_engines import wait_running
from tests.compat.frameworks.wire_clients import Sample, Slime
from tests.compat.frameworks.wire_clients import slime_sampling_params as sampling_params
from tests.server import conftest as server_conftest
from tests.server.conftest import MakeCluster, MakeGateway
from tests.sim.helpers import wait_until

from rolloutsim import SimCluster

make_cluster = server_conftest.make_cluster  # the gateway tests' fixtures, reused here
make_gateway = server_conftest.make_gateway

SCALE = 100.0
ADMIN_TOKEN = "trainer-only-51e0"  # the admin API stays behind a token; slime sends none
CLUSTER_NETWORK = ["127.0.0.0/8"]  # `--trust-network`: the engines' and the rollout's network, loopback here
# slime's own waits, on the simulator's time scale (an engine second lasts 1/SCALE here)
ABORT_RETRY_INTERVAL_S = 3 / SCALE  # server_control.ABORT_RETRY_INTERVAL_SECONDS
POST_RETRY_INTERVAL_S = 1 / SCALE  # http_utils._post's sleep between tries
SLIME_WAITS = {
    "post_retry_interval_s": POST_RETRY_INTERVAL_S,
    "abort_retry_interval_s": ABORT_RETRY_INTERVAL_S,
}


async def running_calls(cluster: SimCluster) -> int:
    return sum(engine.running_count for engine in cluster.engines)


@pytest.mark.looptime
async def test_a_slime_rollout_step_registers_generates_aborts_and_resumes_its_partial_samples(
    make_cluster: MakeCluster, make_gateway: MakeGateway
) -> None:
    """The engines register from the cluster network with no token; a batch of groups runs (each sample its
    own session, sent as `X-SMG-Routing-Key`); over-sampled calls still run when the step ends: slime lists the
    workers, aborts each engine until idle, and every pending call is answered 200, finish reason abort, with
    the tokens and logprobs generated so far, which slime keeps. The next step resumes each partial sample from
    its prompt plus those tokens with the rest of the budget, and it ends at exactly the budget. The engines
    then remove themselves."""
    cluster = await make_cluster(engines=2, api="sglang", time_scale=SCALE)
    gateway = await make_gateway(engines=[], admin_token=ADMIN_TOKEN, trusted_networks=CLUSTER_NETWORK)
    slime = Slime(gateway.url, engines=2, consistent_hashing=True, **SLIME_WAITS)
    try:
        assert [await slime.register(url) for url in cluster.urls] == [201, 201]
        workers = await slime.get(f"{gateway.url}/workers")
        assert [w["url"] for w in workers["workers"]] == cluster.urls

        # -- a batch: 2 groups x 2 samples, each run to its budget (no EOS on this engine profile)
        groups = [[Sample([1, 100 + g, *range(2, 60)]) for _ in range(2)] for g in range(2)]
        done = await asyncio.gather(*(slime.generate(s, 48) for group in groups for s in group))
        for sample in done:
            assert sample.status == "truncated" and sample.response_length == 48
            assert len(sample.log_probs) == 48 and sample.tokens[:60] == sample.prompt_ids
            assert isinstance(sample.response, str) and len(sample.weight_versions) == 1

        # -- over-sampled work still running at the step's end (4 calls: no engine is full, none waits)
        budget = 2_000
        partial = [Sample([1, 200 + i, *range(2, 40)]) for i in range(4)]
        slime.submit(partial, budget)

        async def all_running() -> bool:
            return await running_calls(cluster) == 4

        await wait_until(all_running)
        aborted = await slime.abort()
        assert len(aborted) == 4
        for sample in aborted:
            assert sample.status == "aborted"
            assert 0 < sample.response_length < budget  # the prefix generated before the abort, kept
            assert len(sample.tokens) == len(sample.prompt_ids) + sample.response_length
            assert len(sample.log_probs) == sample.response_length
        assert await running_calls(cluster) == 0

        # -- the next step resumes them (partial rollout): prompt + kept tokens, the rest of the budget
        resumed = await asyncio.gather(*(slime.generate(s, budget) for s in aborted))
        for sample in resumed:
            assert sample.status == "truncated" and sample.response_length == budget
            assert len(sample.log_probs) == budget
        assert slime.retries == 0

        # -- shutdown: each engine removes itself
        assert [await slime.unregister(url) for url in cluster.urls] == [200, 200]
        assert (await slime.get(f"{gateway.url}/workers"))["workers"] == []
    finally:
        await slime.close()


@pytest.mark.looptime
async def test_slimes_step_end_abort_with_the_router_first_also_ends_the_calls_waiting_in_the_gateway(
    make_cluster: MakeCluster, make_gateway: MakeGateway
) -> None:
    """Eight calls on two engines held at two each: four run, four wait in the gateway. slime's abort with the
    router first (docs/frameworks/slime.md's patch) answers all eight at once: the running ones with their
    prefix, the waiting ones with SGLang's own answer for a call aborted in its queue (no tokens), which slime
    keeps as aborted samples with their whole budget left. Nothing runs afterwards."""
    cluster = await make_cluster(engines=2, api="sglang", time_scale=SCALE)
    gateway = await make_gateway(
        cluster, admin_token=ADMIN_TOKEN, trusted_networks=CLUSTER_NETWORK, capacity=2
    )
    slime = Slime(gateway.url, engines=2, **SLIME_WAITS)
    try:
        samples = [Sample([1, 300 + i, *range(2, 40)]) for i in range(8)]
        slime.submit(samples, 5_000)

        async def four_running() -> bool:
            return await running_calls(cluster) == 4

        await wait_until(four_running)
        aborted = await slime.abort(router_first=True)
        # the four that waited never reached an engine: no token (dispatched after the engines' abort, they
        # would have run until slime's next round or to their end)
        assert sorted(s.response_length > 0 for s in aborted) == [False] * 4 + [True] * 4
        assert all(s.status == "aborted" and len(s.log_probs) == s.response_length < 5_000 for s in aborted)
        assert await running_calls(cluster) == 0
        assert slime.retries == 0
    finally:
        await slime.close()


@pytest.mark.looptime
async def test_slimes_streaming_rollout_keeps_the_cumulative_prefix_an_abort_leaves(
    make_cluster: MakeCluster, make_gateway: MakeGateway
) -> None:
    """`generate_streaming`: `/generate` with `"stream": true` through the gateway; each `data:` chunk is the
    call's state so far (SGLang's cumulative stream: every chunk repeats and extends the last). The step-end
    abort on the engine ends the stream with a chunk whose finish reason is abort, and the sample holds what
    that chunk carried: tokens and logprobs of equal length, text, resumable."""
    cluster = await make_cluster(engines=1, api="sglang", time_scale=SCALE)
    gateway = await make_gateway(cluster, admin_token=ADMIN_TOKEN, trusted_networks=CLUSTER_NETWORK)
    slime = Slime(gateway.url, engines=1, **SLIME_WAITS)
    chunks: list[dict[str, Any]] = []

    async def generate_streaming(sample: Sample) -> Sample:
        payload = {
            "sampling_params": sampling_params(3_000),
            "return_logprob": True,
            "stream": True,
            "input_ids": sample.prompt_ids,
        }
        async with slime.client.stream("POST", f"{gateway.url}/generate", json=payload) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line[5:].strip() in ("", "[DONE]"):
                    continue
                chunks.append(json.loads(line[5:]))
        last = chunks[-1]
        triples = last["meta_info"]["output_token_logprobs"]
        sample.tokens = list(sample.prompt_ids)
        sample.append_response_tokens(
            [t[1] for t in triples], [t[0] for t in triples], last["meta_info"], last["text"]
        )
        return sample

    try:
        sample = Sample([1, 400, *range(2, 40)])
        task = asyncio.create_task(generate_streaming(sample))
        await wait_until(lambda: len(chunks) >= 3)
        (engine_url,) = cluster.urls
        await slime.abort_server_until_idle(engine_url)
        await task
        assert sample.status == "aborted" and 0 < sample.response_length < 3_000
        assert len(sample.log_probs) == sample.response_length
        ids = [[t[1] for t in c["meta_info"]["output_token_logprobs"]] for c in chunks]
        for before, after in itertools.pairwise(ids):
            assert after[: len(before)] == before and len(after) >= len(before)  # cumulative
        assert ids[-1] == sample.tokens[len(sample.prompt_ids) :]
    finally:
        await slime.close()


@pytest.mark.looptime
async def test_an_agent_adapters_timed_out_turn_is_aborted_on_the_engine_by_its_rid(
    make_cluster: MakeCluster, make_gateway: MakeGateway
) -> None:
    """`call_sglang_generate`: a turn with the adapter's own `rid` and a 900 s read timeout; the agent gives up
    (the task is cancelled), and the adapter posts `/abort_request {"rid": rid}` to the router. The engine
    stops generating at once, though the gateway would wait 600 s (its retry grace here) for a retry of a
    call whose client left: the rid names the call."""
    cluster = await make_cluster(engines=1, api="sglang", time_scale=SCALE)
    gateway = await make_gateway(
        cluster, admin_token=ADMIN_TOKEN, trusted_networks=CLUSTER_NETWORK, retry_grace=600.0
    )
    rid = uuid.uuid4().hex
    body = {
        "rid": rid,
        "input_ids": list(range(1, 50)),
        "sampling_params": sampling_params(5_000),
        "return_logprob": True,
    }
    timeout = aiohttp.ClientTimeout(total=None, sock_read=900)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def turn() -> Any:
            async with session.post(
                f"{gateway.url}/generate", json=body, headers={"X-SMG-Routing-Key": "agent-7"}
            ) as response:
                return await response.json(content_type=None)

        task = asyncio.create_task(turn())
        (engine_url,) = cluster.urls
        await wait_running(cluster, engine_url)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s2,
            s2.post(f"{gateway.url}/abort_request", json={"rid": rid}) as aborted,
        ):
            assert aborted.status == 200
        loop = asyncio.get_running_loop()
        started = loop.time()
        await wait_until(lambda: cluster.engines[0].running_count == 0, timeout_s=5.0)
        assert loop.time() - started < 5.0  # far below the 600 s grace
