"""SMG's RL control plane on a fleet (server/rl_plane.py composed by fleet/operations.py): `smg.rl`'s own client,
pointed at any one replica, reaches every engine of the fleet's membership, whichever replica owns it; an engine
whose owner does not answer is reported, never silently left out."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
from smg.rl import RL, FanoutError, RlError, paused

from rolloutgate.fleet.assignment import engine_fleet_id
from tests.fleet.local_fleet import LocalFleet, key_owned_by, local_fleet, long_generate, wait_until
from tests.sim.helpers import wait_until as poll_until

T = TypeVar("T")
TOKENS = 3_000  # ~30 simulated seconds of decode at the fleet's x100: the pause lands in the middle
PAUSE_S = 30.0  # simulated seconds the fleet stays paused


async def client_call(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`smg.rl` is synchronous (urllib): it runs in a thread while the loop serves the fleet."""
    return await asyncio.to_thread(fn, *args, **kwargs)


async def test_smg_client_on_one_replica_pauses_updates_and_continues_every_engine_of_the_fleet(
    fleet: LocalFleet,
) -> None:
    """Issue 34 on a fleet: `paused(rl, "engine=sglang")` around a fan-out of `update_weights_from_disk`, sent to
    one replica, reaches the 6 engines the 3 replicas own; a long logprob call on each replica runs across it,
    completes, and is charged none of the pause; every engine then lists the new version."""
    view = fleet.controller.latest
    calls = []
    for replica in fleet.replicas:
        body, headers = long_generate(key_owned_by(view, replica.replica_id, "rl-"), TOKENS)
        calls.append(
            asyncio.create_task(fleet.http.post(f"{replica.url}/generate", json=body, headers=headers))
        )
    engines = fleet.cluster.engines
    await wait_until(lambda: sum(r.completion_tokens > 100 for e in engines for r in e.model.requests()) == 3)
    rl = RL(fleet.replicas[1].url, timeout=30.0)

    def refit() -> tuple[int, dict[str, int]]:
        with paused(rl, "engine=sglang", mode="retract") as pause:
            assert not pause.failed
            time.sleep(PAUSE_S / 100.0)
            update = rl.fanout(
                "update_weights_from_disk",
                {"model_path": "/ckpt/step-7", "weight_version": "7"},
                selector="engine=sglang",
            )
        return pause.succeeded, {wid: r.status for wid, r in update.results.items()}

    pause_reached, statuses = await client_call(refit)
    fleet_ids = sorted(engine_fleet_id(url) for url in fleet.cluster.urls)
    assert pause_reached == len(fleet_ids)
    assert sorted(statuses) == fleet_ids and set(statuses.values()) == {200}
    assert {e.weight_version for e in engines} == {"7"}
    for call in calls:
        done = await call
        assert done.status_code == 200, done.text
        result = done.json()
        assert result["meta_info"]["completion_tokens"] == TOKENS
        assert result["meta_info"]["weight_version"] == "7"
        timing = result["rolloutgate_timing"]
        assert timing["paused_s"] >= PAUSE_S, timing  # told before the engines paused, on its owner
        assert timing["charged_s"] <= timing["wall_s"] - timing["paused_s"] + 0.05, timing
    workers = await client_call(RL(fleet.replicas[2].url, timeout=30.0).workers)
    assert [w.id for w in workers] == [engine_fleet_id(url) for url in sorted(fleet.cluster.urls)]
    assert {w.weight_version for w in workers} == {"7"} and {w.health for w in workers} == {"ready"}


async def test_a_call_to_one_engine_through_any_replica_reaches_it_at_its_owner(fleet: LocalFleet) -> None:
    view = fleet.controller.latest
    url = view.engines_of("replica-2")[0]
    rl = RL(fleet.replicas[0].url, timeout=30.0)  # not its owner
    info = await client_call(rl.call, engine_fleet_id(url), "server_info", method="GET")
    assert info.status == 200 and info.url == url and info.worker_id == engine_fleet_id(url)
    one = await client_call(rl.worker, engine_fleet_id(url))
    assert one.base_url == url
    with pytest.raises(RlError) as caught:
        await client_call(rl.call, "e-000000000000", "flush_cache")
    assert caught.value.code == "worker_not_found"
    with pytest.raises(RlError) as invalid:
        await client_call(rl.fanout, "pause_generation", {}, selector="engine==sglang")
    assert invalid.value.code == "invalid_selector"  # judged alike by every replica: the caller's error
    assert not any(e.paused for e in fleet.cluster.engines)


async def test_an_engine_whose_owner_does_not_answer_is_a_failure_of_the_fan_out_and_named(
    fleet: LocalFleet,
) -> None:
    view = fleet.controller.latest
    fleet.links[2].too_slow = True
    rl = RL(fleet.replicas[0].url, timeout=30.0)
    with pytest.raises(FanoutError) as caught:
        await client_call(rl.fanout, "flush_cache", selector="engine=sglang")
    result = caught.value.result
    silent = sorted(engine_fleet_id(url) for url in view.engines_of("replica-2"))
    assert result.total == len(fleet.cluster.urls) and result.succeeded == result.total - len(silent)
    assert sorted(f.worker_id for f in result.failed) == silent
    assert {f.error for f in result.failed} == {"upstream_unreachable"}
    listed = (await fleet.http.get(f"{fleet.replicas[0].url}/v1/rl/workers")).json()
    assert sorted(u["id"] for u in listed["unreached"]) == silent
    assert listed["total"] == len(fleet.cluster.urls) - len(silent)
    with pytest.raises(RlError) as gone:
        await client_call(rl.call, silent[0], "flush_cache")
    assert gone.value.code == "upstream_unreachable"


async def test_each_replica_judges_its_engines_lag_against_the_whole_fleets_newest_weights() -> None:
    """The update reaches the engines of replica-0 and replica-1 only (replica-2's stay on `default`, as ones
    whose update failed). replica-2 holds no newer engine itself, yet learns the fleet's newest from the
    controller: under latest-only a call it serves waits for its engines to hold "7" instead of running on
    the old weights; with `any` the same replica answers on them at once."""
    async with local_fleet(version_policy="latest-only") as fleet:
        view = fleet.controller.latest
        behind = sorted(engine_fleet_id(url) for url in view.engines_of("replica-2"))
        rl = RL(fleet.replicas[0].url, timeout=30.0)
        update = {"model_path": "/ckpt/7", "weight_version": "7"}
        selector = f"id notin ({','.join(behind)})"
        await client_call(rl.fanout, "update_weights_from_disk", update, selector=selector)

        async def lags() -> dict[str, int]:
            listed = (await fleet.http.get(f"{fleet.replicas[1].url}/v1/rl/workers")).json()["workers"]
            return {w["id"]: w["version_lag"] for w in listed}

        async def replica_2_knows() -> bool:
            return {i for i, lag in (await lags()).items() if lag} == set(behind)

        await poll_until(replica_2_knows, "replica-2 knows its engines lag")
        body, headers = long_generate(key_owned_by(view, "replica-2", "lag-"), 20)
        replica_2 = fleet.replicas[2].url
        old = await fleet.http.post(
            f"{replica_2}/generate", json=body, headers={**headers, "x-smg-version-policy": "any"}
        )
        assert old.status_code == 200 and old.json()["meta_info"]["weight_version"] == "default"
        waiting = asyncio.create_task(fleet.http.post(f"{replica_2}/generate", json=body, headers=headers))
        await client_call(
            rl.fanout, "update_weights_from_disk", update, selector=f"id in ({','.join(behind)})"
        )
        answer = await waiting
        assert answer.status_code == 200 and answer.json()["meta_info"]["weight_version"] == "7"
        assert set((await lags()).values()) == {0}
