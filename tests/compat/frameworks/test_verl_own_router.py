"""verl's own classes drive the rolloutgate router against simulated engines (`make test-verl`, its own venv:
docs/frameworks/verl.md). Not in `make test`: verl 0.9.1 imports torch and Ray (mk/frameworks.mk).

verl's code, unmodified, from the verl 0.9.1 wheel: `verl.workers.rollout.router.get_router_handle` reads the
router YAML (`_load_router_yaml`), imports `router_class` by its fully qualified name and starts it as a Ray
actor with `(servers, yaml_config)`; `verl.workers.rollout.llm_server.LLMServerClient.generate` (the agent
loop's every turn) and `FullyAsyncLLMServerClient.generate` (fully-async training's, which sizes and resumes
calls) acquire, call and release through it. Only the agent loop around them is the test's: the turns of
`ToolAgentLoop` (one `request_id` per trajectory, the prompt growing by response and observation) with
`AgentLoopWorker`'s sampling parameters.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.server import conftest as server_conftest
from tests.server.conftest import MakeCluster, MakeGateway

from rolloutgate.frameworks.verl import GatewayError, close_sessions

pytestmark = pytest.mark.verl

make_cluster = server_conftest.make_cluster  # the gateway tests' fixtures, reused here
make_gateway = server_conftest.make_gateway

SCALE = 100.0
PROMPT_LENGTH = 64
RESPONSE_LENGTH = 12
OBS_IDS = [13, 29, 7]


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield
    finally:
        ray.shutdown()


def write_router_yaml(path: Path, gateway_url: str, family: str, **more: Any) -> str:
    """The file `actor_rollout_ref.rollout.router_config_path` names (docs/frameworks/verl.md)."""
    lines = [
        "router_class: rolloutgate.frameworks.verl.RolloutgateRouter",
        f"gateway_url: {gateway_url}",
        f"family: {family}",
        f"prompt_length: {PROMPT_LENGTH}",
        f"response_length: {RESPONSE_LENGTH}",
        "model: sim-model",
        *(f"{k}: {v}" for k, v in more.items()),
    ]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def verl_config(family: str) -> Any:
    from omegaconf import OmegaConf

    rollout = {"name": family, "full_determinism": False, "response_length": RESPONSE_LENGTH}
    return OmegaConf.create({"actor_rollout_ref": {"rollout": rollout}})


def sampling_params() -> dict[str, Any]:
    """`AgentLoopWorker.generate_sequences`' (agent_loop.py), with `calculate_log_probs` on."""
    return {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}


async def trajectory(client: Any, index: int, turns: int) -> list[tuple[int, Any]]:
    request_id = uuid.uuid4().hex
    prompt = [1, 100 + index, *range(2, 30)]
    outputs = []
    for _ in range(turns):
        output = await client.generate(request_id, prompt_ids=prompt, sampling_params=sampling_params())
        outputs.append((len(prompt), output))
        prompt = prompt + list(output.token_ids) + OBS_IDS
    return outputs


async def settled_inflight(handle: Any) -> int:
    """verl's count once its fire-and-forget releases have landed (at most 200 polls)."""
    count = -1
    for _ in range(200):
        count = await handle.get_total_inflight.remote()
        if count == 0:
            break
        await asyncio.sleep(0.05)
    return int(count)


@pytest.mark.parametrize("family", ["sglang", "vllm"])
async def test_verl_own_router_and_clients_complete_a_step_through_rolloutgate(
    family: str, ray_cluster: None, tmp_path: Path, make_cluster: MakeCluster, make_gateway: MakeGateway
) -> None:
    """verl builds the router from the YAML (a Ray actor), which registers verl's two engines with a gateway
    started with none. A step of eight three-turn trajectories through verl's `LLMServerClient`: verl's own
    `TokenOutput`s, each sized as verl's server sizes it, with a logprob per token; each trajectory on one
    engine, both engines used; verl's in-flight count back to zero and `clear_sticky_cache` releasing the
    eight sessions. `FullyAsyncLLMServerClient` (which names `max_tokens` from `response_length`) answered
    too."""
    from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient, LLMServerClient
    from verl.workers.rollout.replica import TokenOutput
    from verl.workers.rollout.router import get_router_handle

    cluster = await make_cluster(engines=2, api=family, time_scale=SCALE)
    # verl's own balancer's policy (docs/frameworks/verl.md): a trajectory's turns on one engine
    gateway = await make_gateway(None, time_scale=SCALE, placement="sticky_least_loaded")
    servers = {url.removeprefix("http://"): None for url in cluster.urls}
    handle = get_router_handle(
        servers, router_config_path=write_router_yaml(tmp_path / "r.yaml", gateway.url, family)
    )
    try:
        assert sorted(await handle.get_all_servers.remote()) == sorted(servers)
        client = LLMServerClient(verl_config(family), load_balancer_handle=handle)
        step = await asyncio.gather(*(trajectory(client, i, turns=3) for i in range(8)))
        engines: Counter[str] = Counter()
        for turns in step:
            served = {output.extra_fields["rolloutgate_engine"] for _, output in turns}
            assert len(served) == 1, served
            engines[served.pop()] += 1
            for prompt_len, output in turns:
                assert isinstance(output, TokenOutput)
                budget = min(RESPONSE_LENGTH, PROMPT_LENGTH + RESPONSE_LENGTH - prompt_len)
                assert len(output.token_ids) == budget and len(output.log_probs or []) == budget
                assert output.stop_reason == ("completed" if family == "vllm" else "length")
        assert sorted(engines) == sorted(cluster.urls), engines
        assert await settled_inflight(handle) == 0
        status = await handle.get_status.remote()
        assert sorted(status["servers"]) == sorted(cluster.urls)
        assert (await handle.clear_sticky_cache.remote())["cleared_entries"] == 8

        fully_async = FullyAsyncLLMServerClient(verl_config(family), load_balancer_handle=handle)
        params = {k: v for k, v in sampling_params().items() if k != "logprobs"}
        output = await fully_async.generate("fa", prompt_ids=list(range(1, 20)), sampling_params=params)
        assert isinstance(output, TokenOutput) and len(output.token_ids) == RESPONSE_LENGTH
        assert output.log_probs == [] and output.stop_reason == "length"
    finally:
        await close_sessions()


async def test_verl_own_client_meets_the_gateways_engine_time_budget(
    ray_cluster: None, tmp_path: Path, make_cluster: MakeCluster, make_gateway: MakeGateway
) -> None:
    """verl's own path awaits its server actor without a bound. Through the router, the gateway's charged
    engine time (`timeout`) ends a call that runs past it: verl's `LLMServerClient.generate` raises the
    gateway's 504 (as it would a failed server call), and releases the call all the same."""
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.router import get_router_handle

    cluster = await make_cluster(engines=1, api="sglang", time_scale=SCALE)
    gateway = await make_gateway(cluster, timeout=5.0)
    path = write_router_yaml(tmp_path / "r.yaml", gateway.url, "sglang", max_model_len=100000)
    handle = get_router_handle({cluster.urls[0].removeprefix("http://"): None}, router_config_path=path)
    try:
        client = LLMServerClient(verl_config("sglang"), load_balancer_handle=handle)
        params = {**sampling_params(), "max_new_tokens": 4000}
        with pytest.raises(GatewayError, match="504"):
            await client.generate("long", prompt_ids=list(range(1, 40)), sampling_params=params)
        assert await settled_inflight(handle) == 0
    finally:
        await close_sessions()
