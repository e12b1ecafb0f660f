"""verl's rollout calls through the rolloutgate router plugin, imitated, against simulated engines
(docs/frameworks/verl.md).

This test does not run verl's code: verl 0.9.1 imports torch and Ray in the modules that call the router
(`verl/__init__.py` imports `verl.protocol`, which imports torch and tensordict; `router.py` and
`llm_server.py` import ray), so `make test` cannot load them. `make test-verl` runs verl's own classes against
the same plugin (tests/compat/frameworks/test_verl_own_router.py, its own venv). Here, the calls verl makes
are made in verl's order, with its arguments, from verl 0.9.1's wheel:

- `verl/workers/rollout/router.py` `_create_plugin_extension`: the router YAML's dict (with `router_class`) is
  the constructor's second argument, `servers` (`{"host:port": actor handle}`) its first; the router lives in
  its own Ray actor, so its methods run away from the agent loop's event loop (a thread here), and what they
  return is pickled (a round trip here).
- `verl/workers/rollout/llm_server.py` `LLMServerClient`: `require_acquire_fields` and
  `require_release_fields` once, then per turn `acquire_server(request_id=...)`,
  `await server.generate.remote(request_id=<fresh uuid per turn>, prompt_ids=, sampling_params=,
  image_data=None, video_data=None)`, and `release_server(server_id=)` in `finally`, not awaited.
- `verl/experimental/agent_loop/agent_loop.py`: `sampling_params = dict(temperature, top_p, top_k,
  repetition_penalty=1.0, logprobs=calculate_log_probs)`, no `max_tokens` (the server sizes the call);
  `tool_agent_loop.py`: one `request_id` for all the turns of a trajectory, each turn's prompt the last prompt
  plus the response plus the tool's observation.
- `verl/experimental/fully_async_policy/fully_async_rollouter.py`: `remove_servers`, `add_servers`,
  `clear_sticky_cache` and `get_total_inflight` between phases.

What differs, on purpose: no Ray (threads and pickle stand in for the actor), and the test reads the engine
that served each turn from `extra_fields["rolloutgate_engine"]`, which verl carries along and ignores.
"""

from __future__ import annotations

import asyncio
import pickle
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from tests.server import conftest as server_conftest
from tests.server.conftest import MakeCluster, MakeGateway

from rolloutgate.frameworks.verl import (
    NO_SERVERS,
    GatewayEndpoint,
    GatewayError,
    RolloutgateRouter,
    close_sessions,
)

make_cluster = server_conftest.make_cluster  # the gateway tests' fixtures, reused here
make_gateway = server_conftest.make_gateway

SCALE = 100.0
PROMPT_LENGTH = 64
RESPONSE_LENGTH = 12
OBS_IDS = [13, 29, 7]  # the tool's observation, appended after each response


def router_yaml(gateway_url: str, family: str, **more: Any) -> dict[str, Any]:
    """The router YAML's dict as verl's `_load_router_yaml` hands it over."""
    return {
        "router_class": "rolloutgate.frameworks.verl.RolloutgateRouter",
        "gateway_url": gateway_url,
        "family": family,
        "prompt_length": PROMPT_LENGTH,
        "response_length": RESPONSE_LENGTH,
        "model": "sim-model",
        **more,
    }


class RouterActor:
    """The router as verl holds it: a Ray actor. Its methods run off the caller's loop (one at a time, as a
    threaded actor with one slot), and their answers cross a pickle."""

    def __init__(self, servers: dict[str, Any], config: dict[str, Any]) -> None:
        self._lock = asyncio.Lock()
        self._servers, self._config = servers, config
        self.router: RolloutgateRouter | None = None

    async def start(self) -> None:
        self.router = await asyncio.to_thread(RolloutgateRouter, self._servers, self._config)

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        assert self.router is not None
        bound: Callable[..., Any] = getattr(self.router, method)
        async with self._lock:
            answer = await asyncio.to_thread(bound, *args, **kwargs)
        return pickle.loads(pickle.dumps(answer))


class VerlClient:
    """`LLMServerClient.generate` as it reaches the router and the server (module docstring)."""

    def __init__(self, actor: RouterActor) -> None:
        self.actor = actor
        self.fields: tuple[list[str], list[str]] | None = None
        self.releases: list[asyncio.Task[Any]] = []

    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any]
    ) -> Any:
        if self.fields is None:
            acquire, release = await asyncio.gather(
                self.actor.call("require_acquire_fields"), self.actor.call("require_release_fields")
            )
            self.fields = (list(acquire), list(release))
        extra = {"prompt_ids": prompt_ids, "sampling_params": sampling_params}
        declared = {name: extra[name] for name in self.fields[0] if name in extra}
        server_id, server = await self.actor.call("acquire_server", request_id=request_id, **declared)
        try:
            output = await server.generate.remote(
                request_id=uuid.uuid4().hex,
                prompt_ids=prompt_ids,
                sampling_params=sampling_params,
                image_data=None,
                video_data=None,
            )
            steps = output.extra_fields.get("global_steps")
            output.extra_fields.setdefault("min_global_steps", steps)
            output.extra_fields.setdefault("max_global_steps", steps)
            return output
        finally:
            pool = {"request_id": request_id}
            fields = {name: pool[name] for name in self.fields[1] if name in pool}
            self.releases.append(
                asyncio.create_task(self.actor.call("release_server", server_id=server_id, **fields))
            )

    async def settle(self) -> None:
        await asyncio.gather(*self.releases)


def sampling_params() -> dict[str, Any]:
    """`AgentLoopWorker`'s, with `calculate_log_probs` on."""
    return {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}


async def trajectory(client: VerlClient, index: int, turns: int) -> list[tuple[int, Any]]:
    """`ToolAgentLoop`'s turns: one request id, the prompt growing by response and observation each turn.
    Each turn's (prompt length, output)."""
    request_id = uuid.uuid4().hex
    prompt = [1, 100 + index, *range(2, 30)]
    outputs = []
    for _ in range(turns):
        output = await client.generate(request_id, prompt_ids=prompt, sampling_params=sampling_params())
        outputs.append((len(prompt), output))
        prompt = prompt + list(output.token_ids) + OBS_IDS
    return outputs


async def workers(gateway_url: str) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(timeout=30) as http:
        resp = await http.get(f"{gateway_url}/workers")
        resp.raise_for_status()
        return list(resp.json()["workers"])


@pytest.mark.parametrize("family", ["sglang", "vllm"])
async def test_a_verl_step_through_the_rolloutgate_router_completes_on_simulated_engines(
    family: str, make_cluster: MakeCluster, make_gateway: MakeGateway
) -> None:
    """A gateway with no engines; verl builds the router with its two servers, which registers them. Eight
    trajectories of three turns run at once (a step's agent loops): every turn is answered with the budget
    verl's own server would give it (response_length, capped by what the prompt leaves), a logprob per token,
    verl's stop reason; every turn of a trajectory runs on its first turn's engine, and both engines work.
    After the step verl's count of calls in flight is zero, and `clear_sticky_cache` releases the eight
    sessions at the gateway."""
    cluster = await make_cluster(engines=2, api=family, time_scale=SCALE)
    # verl's own balancer's policy (docs/frameworks/verl.md): a trajectory's turns on one engine
    gateway = await make_gateway(None, time_scale=SCALE, placement="sticky_least_loaded")
    servers = {url.removeprefix("http://"): None for url in cluster.urls}
    actor = RouterActor(servers, router_yaml(gateway.url, family))
    await actor.start()
    client = VerlClient(actor)
    try:
        assert sorted(w["url"] for w in await workers(gateway.url)) == sorted(cluster.urls)
        assert await actor.call("get_all_servers") == list(servers)
        step = await asyncio.gather(*(trajectory(client, i, turns=3) for i in range(8)))
        await client.settle()

        engines = Counter()
        for turns in step:
            served = {output.extra_fields["rolloutgate_engine"] for _, output in turns}
            assert len(served) == 1, served
            engines[served.pop()] += 1
            for prompt_len, output in turns:
                budget = min(RESPONSE_LENGTH, PROMPT_LENGTH + RESPONSE_LENGTH - prompt_len)
                assert len(output.token_ids) == budget, (prompt_len, output)
                assert output.log_probs is not None and len(output.log_probs) == budget
                assert output.stop_reason == ("completed" if family == "vllm" else "length")
                assert "min_global_steps" in output.extra_fields
        assert sorted(engines) == sorted(cluster.urls), engines  # both engines took trajectories
        assert step[0][-1][0] > step[0][0][0]  # the prompt grew over the turns

        assert await actor.call("get_total_inflight") == 0
        status = await actor.call("get_status")
        assert sorted(status["servers"]) == sorted(cluster.urls) and status["total_inflight"] == 0
        cleared = await actor.call("clear_sticky_cache")
        assert cleared["cleared_entries"] == 8
        assert (await actor.call("clear_sticky_cache"))["cleared_entries"] == 0
    finally:
        await close_sessions()


async def test_the_gateways_engine_time_budget_ends_a_verl_call_that_runs_too_long(
    make_cluster: MakeCluster, make_gateway: MakeGateway
) -> None:
    """verl's own path has no bound at all (a Ray actor call awaited until the engine answers). Through the
    router, rolloutgate's `--timeout` (charged engine time) applies: a call asking for far more tokens than the
    budget allows fails with the gateway's 504, which verl's agent loop sees as the server call's error. With
    the rollout's lengths (64 + 12) the same call is clamped as verl's server clamps it, and answered beside a
    short one."""
    cluster = await make_cluster(engines=1, api="sglang", time_scale=SCALE)
    gateway = await make_gateway(cluster, timeout=5.0)
    actor = RouterActor({cluster.urls[0].removeprefix("http://"): None}, router_yaml(gateway.url, "sglang"))
    await actor.start()
    client = VerlClient(actor)
    try:
        long_params = {**sampling_params(), "max_new_tokens": 4000}
        long_call = asyncio.create_task(
            client.generate("long", prompt_ids=list(range(1, 40)), sampling_params=long_params)
        )
        short = await client.generate(
            "short", prompt_ids=list(range(1, 40)), sampling_params=sampling_params()
        )
        assert len(short.token_ids) == RESPONSE_LENGTH
        # 4,000 tokens would not fit the 64 + 12 context verl's server allows: clamped, like verl's server
        assert len((await long_call).token_ids) == PROMPT_LENGTH + RESPONSE_LENGTH - 39 - 1
        huge = RouterActor(
            {cluster.urls[0].removeprefix("http://"): None},
            router_yaml(gateway.url, "sglang", max_model_len=100_000, register_servers=False),
        )
        await huge.start()
        with pytest.raises(GatewayError, match="504"):
            await VerlClient(huge).generate(
                "huge", prompt_ids=list(range(1, 40)), sampling_params=long_params
            )
        await client.settle()
    finally:
        await close_sessions()


async def test_verls_scaling_calls_change_the_gateways_pool(
    make_cluster: MakeCluster, make_gateway: MakeGateway
) -> None:
    """Fully-async weight sync and elastic scaling: `remove_servers` takes an engine out of the gateway's pool
    (the next trajectories all run on the other), `remove_servers` of the last leaves verl's error that
    `FullyAsyncLLMServerClient` retries on, and `add_servers` brings them back."""
    cluster = await make_cluster(engines=2, api="vllm", time_scale=SCALE)
    gateway = await make_gateway(None, time_scale=SCALE)
    first, second = (url.removeprefix("http://") for url in cluster.urls)
    actor = RouterActor({first: None, second: None}, router_yaml(gateway.url, "vllm"))
    await actor.start()
    client = VerlClient(actor)
    try:
        await actor.call("remove_servers", [first])
        assert [w["url"] for w in await workers(gateway.url)] == [f"http://{second}"]
        step = await asyncio.gather(*(trajectory(client, i, turns=2) for i in range(4)))
        assert {o.extra_fields["rolloutgate_engine"] for turns in step for _, o in turns} == {
            f"http://{second}"
        }
        await actor.call("remove_servers", [second])
        with pytest.raises(RuntimeError, match=NO_SERVERS):
            await actor.call("acquire_server", request_id="r")
        await actor.call("add_servers", {first: None, second: None})
        assert sorted(w["url"] for w in await workers(gateway.url)) == sorted(cluster.urls)
        await client.settle()
    finally:
        await close_sessions()


def test_the_router_yaml_is_checked_and_the_endpoint_pickles() -> None:
    """A typo in the YAML is refused (verl would pass it through silently), and so is a family verl does not
    run; the endpoint verl receives survives Ray's pickling with its session."""
    with pytest.raises(ValueError, match="gatway_url"):
        RolloutgateRouter({}, {"gatway_url": "http://x", "family": "vllm"})
    with pytest.raises(ValueError, match="family"):
        RolloutgateRouter({}, router_yaml("http://127.0.0.1:1", "trtllm"))
    router = RolloutgateRouter({}, router_yaml("http://127.0.0.1:1", "vllm", register_servers=False))
    router.add_servers({"10.0.0.1:8000": None})
    server_id, endpoint = router.acquire_server(request_id="traj-1")
    copy = pickle.loads(pickle.dumps(endpoint))
    assert isinstance(copy, GatewayEndpoint) and copy == endpoint and copy.session_id == "traj-1"
    assert router.get_total_inflight() == 1
    router.release_server(server_id)
    assert router.get_total_inflight() == 0


def test_the_plugin_imports_without_verl_ray_or_torch() -> None:
    """verl names the class from its YAML; importing it must not drag verl, Ray or torch into rolloutgate."""
    code = (
        "import sys, rolloutgate.frameworks.verl as m; "
        "print(sorted({'verl', 'ray', 'torch'} & {k.split('.')[0] for k in sys.modules}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
