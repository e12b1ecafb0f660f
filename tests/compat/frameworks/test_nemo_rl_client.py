"""NeMo RL's router calls, imitated, against rolloutgate in front of simulated SGLang engines
(docs/frameworks/nemo-rl.md).

This test does not run NeMo RL's code (it needs sglang, sglang_router, torch and Ray; `nemo-rl` on the package
index is a 0.0.0 placeholder). It makes, on the wire, the calls NeMo RL's SGLang generation backend makes to its
router and to its engines, in its order. Sources: NVIDIA-NeMo/RL 7ea279ab (2026-08-22), and the SGLang refit of
NVIDIA-NeMo/RL#3612 (its head b86aa8e4, 2026-08-18):

- `nemo_rl/models/generation/sglang/sglang_worker.py` `SGLangGenerationWorker._launch_server_process`: the
  engine's own health first (`_wait_server_healthy`: `GET /health_generate` until 200, then `GET /flush_cache`
  until 200, 2 s apart), then `POST /workers {"url", "worker_type": "regular"}` on the router with
  `raise_for_status`, then `_wait_for_router_registration` (`GET /workers` every 0.5 s, at most 30 s, until an
  entry's `url` is its own); `shutdown` (`GET /workers`, `DELETE /workers/{id}`).
- `nemo_rl/models/generation/sglang/sglang_generation.py`: `_build_sampling_params` (temperature, top_p,
  max_new_tokens, no_stop_trim, spaces_between_special_tokens; top_k, stop_token_ids, stop when set),
  `generate` (every sample of the batch at once under a semaphore), `generate_one_sample` (`POST /generate
  {"sampling_params", "return_logprob": true, "input_ids"}` on the router; it reads
  `meta_info.output_token_logprobs` and `meta_info.finish_reason.type == "length"` as truncated).
- `nemo_rl/models/generation/sglang/utils/http_utils.py` `HttpClient`: `httpx.AsyncClient(timeout=None)`,
  3 tries 1 s apart on any error.
- #3612 `nemo_rl/weight_sync/sglang_weight_synchronizer.py` `_refit`, through `sglang_worker.py`: on each engine
  directly, `POST /pause_generation {"mode": <pause_generation_mode>}` (`retract` in its example config,
  `in_place` refused), `GET /flush_cache` (`invalidate_kv_cache`: a non-200 raises), the transfer,
  `POST /continue_generation {}` in a `finally`.

What differs, on purpose: the transfer (`/update_weights_from_distributed` or `_from_tensor` between NeMo RL's
`/begin_weight_update` and `/end_weight_update`, which the simulator does not serve) is played by the
simulator's `/update_weights_from_disk`, which stands for the engine's time in the update. The imitation reads
rolloutgate's timing breakdown and state, which NeMo RL does not, to see what was charged.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from tests.compat.frameworks.sim_engines import wait_running
from tests.compat.frameworks.wire_clients import NemoRL
from tests.compat.frameworks.wire_clients import nemo_sampling_params as sampling_params
from tests.server import conftest as server_conftest
from tests.server.conftest import MakeCluster, MakeGateway
from tests.server.users_path import final_timing, quarantines
from tests.sim.helpers import wait_until

make_cluster = server_conftest.make_cluster  # the gateway tests' fixtures, reused here
make_gateway = server_conftest.make_gateway

SCALE = 20.0
ADMIN_TOKEN = "trainer-only-7c31"  # NeMo RL sends none; the admin API stays behind it
CLUSTER_NETWORK = ["127.0.0.0/8"]  # `--trust-network`: the engines' network, loopback here


@pytest.mark.looptime
async def test_nemo_rl_registers_healthy_workers_generates_a_batch_and_removes_them(
    make_cluster: MakeCluster, make_gateway: MakeGateway
) -> None:
    """Each worker checks its own engine, registers it (201: it joins at once, healthy) and waits until the
    router lists it; a batch sent right after is served by both engines, each sample with as many logprobs
    as tokens and truncated at its budget (no EOS on this engine profile); the workers then remove
    themselves."""
    cluster = await make_cluster(engines=2, api="sglang", time_scale=SCALE)
    gateway = await make_gateway(
        engines=[], admin_token=ADMIN_TOKEN, trusted_networks=CLUSTER_NETWORK, capacity=4
    )
    nemo = NemoRL(gateway.url, time_scale=SCALE)
    try:
        assert [await nemo.launch_and_register(url) for url in cluster.urls] == [201, 201]
        workers = (await nemo.client.get(f"{gateway.url}/workers")).json()["workers"]
        assert [(w["url"], w["state"]) for w in workers] == [(url, "healthy") for url in cluster.urls]

        batch = [[1, 100 + i, *range(2, 50)] for i in range(8)]
        results = await nemo.generate(batch, 32)
        for tokens, logprobs, truncated in results:
            assert len(tokens) == len(logprobs) == 32 and truncated
        assert sorted(nemo.served_by) == sorted(cluster.urls * 4)  # both engines serve, capacity 4 each
        assert nemo.retries == 0

        assert [await nemo.shutdown(url) for url in cluster.urls] == [200, 200]
        assert (await nemo.client.get(f"{gateway.url}/workers")).json()["workers"] == []
    finally:
        await nemo.close()


@pytest.mark.looptime
async def test_a_refit_with_retract_pause_during_a_generation_is_not_charged_and_not_judged(
    make_cluster: MakeCluster, make_gateway: MakeGateway
) -> None:
    """#3612's refit while a long generation runs (an async rollout): the trainer pauses the engine in
    `retract` mode, never telling the router, and flushes. The engine refuses the flush while the retracted
    call waits in it (as SGLang does), so `_refit` stops there and continues the engine from its `finally`.
    Meanwhile a sample submitted during the pause waits in the gateway, not on the paused engine; afterwards
    the running sample completes with all its tokens, the pause under `paused` and not charged, and the
    engine is never quarantined."""
    cluster = await make_cluster(engines=1, api="sglang", time_scale=SCALE)
    gateway = await make_gateway(
        cluster, stall_timeout=60.0, admin_token=ADMIN_TOKEN, trusted_networks=CLUSTER_NETWORK
    )
    nemo = NemoRL(gateway.url, time_scale=SCALE)
    engines = list(cluster.urls)
    try:
        body = {
            "sampling_params": sampling_params(3_000),
            "return_logprob": True,
            "input_ids": list(range(1, 2_000)),
        }
        long_call = asyncio.create_task(nemo.client.post(f"{gateway.url}/generate", json=body))
        await wait_running(cluster, engines[0])
        await nemo.pause(engines, "retract")
        await wait_until(lambda: gateway.context.pool.engines["engine-0"].paused_by_engine)
        late = asyncio.create_task(nemo.generate_one_sample([1, 7, 8, 9], 16))
        await asyncio.sleep(30 / SCALE)
        assert not late.done() and cluster.engines[0].running_count == 0  # waiting in the gateway
        assert await nemo.flush(engines) == [400]  # SGLang: not flushed, requests pending; `_refit` raises
        await nemo.resume(engines)  # its `finally`

        response = await long_call
        assert response.status_code == 200, response.text
        meta = response.json()["meta_info"]
        assert meta["finish_reason"]["type"] == "length" and len(meta["output_token_logprobs"]) == 3_000
        timing = final_timing(response)
        assert timing["paused"] >= 30 - 8, timing
        assert timing["charged"] < timing["wall"] - 30 + 8, timing
        tokens, logprobs, truncated = await late
        assert len(tokens) == len(logprobs) == 16 and truncated
        assert await quarantines(nemo.client, gateway.url) == 0
    finally:
        await nemo.close()


async def refit_with_abort_pause(gateway_url: str, cluster: Any) -> tuple[list[int], list[float], bool]:
    """A NeMo RL sample running while the refit pauses its engine in abort mode (`pause_generation_mode:
    abort`, allowed by #3612's config), flushes, transfers the weights and resumes: the sample as
    `generate_one_sample` reads it."""
    nemo = NemoRL(gateway_url, time_scale=SCALE)
    engines = list(cluster.urls)
    try:
        sample = asyncio.create_task(nemo.generate_one_sample(list(range(1, 500)), 2_000))
        await wait_running(cluster, engines[0])
        await nemo.pause(engines, "abort")
        assert await nemo.flush(engines) == [200]  # nothing left running: the abort ended it
        await nemo.transfer(engines, "step-1")
        await nemo.resume(engines)
        return await sample
    finally:
        await nemo.close()


@pytest.mark.looptime
async def test_a_refit_with_abort_pause_gives_nemo_rl_whole_samples_with_rerun(
    make_cluster: MakeCluster, make_gateway: MakeGateway
) -> None:
    """With `--engine-pause-aborts rerun` the sample the pause aborted runs again after the refit: NeMo RL
    gets its whole budget, truncated at `max_new_tokens` as it expects."""
    cluster = await make_cluster(engines=1, api="sglang", time_scale=SCALE)
    gateway = await make_gateway(
        cluster, admin_token=ADMIN_TOKEN, trusted_networks=CLUSTER_NETWORK, engine_pause_aborts="rerun"
    )
    tokens, logprobs, truncated = await refit_with_abort_pause(gateway.url, cluster)
    assert len(tokens) == len(logprobs) == 2_000 and truncated


@pytest.mark.looptime
async def test_without_rerun_an_abort_pause_hands_nemo_rl_the_partial_sample(
    make_cluster: MakeCluster, make_gateway: MakeGateway
) -> None:
    """The default (`pass`): the engine's abort answer is the answer, and `generate_one_sample`, which reads
    only whether the finish reason is "length", takes the partial output as a finished sample: why
    docs/frameworks/nemo-rl.md asks for `rerun` with an abort-mode refit."""
    cluster = await make_cluster(engines=1, api="sglang", time_scale=SCALE)
    gateway = await make_gateway(cluster, admin_token=ADMIN_TOKEN, trusted_networks=CLUSTER_NETWORK)
    tokens, logprobs, truncated = await refit_with_abort_pause(gateway.url, cluster)
    assert 0 < len(tokens) == len(logprobs) < 2_000 and not truncated
