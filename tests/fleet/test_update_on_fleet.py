"""A weight update of a whole fleet, all or none (server/weight_update.py's two steps, run by
fleet/controller.py `_update_all_or_none`): sent to any replica, it reaches every engine of the membership;
an engine that fails its update anywhere decides for the fleet, not for its own replica alone."""

from __future__ import annotations

import asyncio

import pytest

from rolloutgate.fleet.operations import UPDATE_BEGIN
from rolloutgate.server import weight_update
from tests.fleet.local_fleet import LocalFleet, key_owned_by, wait_until

UPDATE = {"path": "/update_weights_from_disk", "body": {"model_path": "/ckpt/7", "weight_version": "7"}}
ROLLBACK = {"model_path": "/ckpt/6", "weight_version": "default"}


async def served_versions(fleet: LocalFleet, calls_per_replica: int) -> set[str]:
    """The weight versions the answers of keyed calls through every replica were made under."""
    view = fleet.controller.latest
    calls = []
    for replica in fleet.replicas:
        for i in range(calls_per_replica):
            key = key_owned_by(view, replica.replica_id, f"v{i}-")
            body = {"input_ids": [1, 2, 3, 4 + i], "sampling_params": {"max_new_tokens": 8}}
            calls.append(
                fleet.http.post(f"{replica.url}/generate", json=body, headers={"X-SMG-Routing-Key": key})
            )
    answers = await asyncio.gather(*calls)
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers if a.status_code != 200]
    return {a.json()["meta_info"]["weight_version"] for a in answers}


async def test_an_engine_failing_its_update_on_one_replica_is_taken_out_of_the_fleet(
    fleet: LocalFleet,
) -> None:
    view = fleet.controller.latest
    broken = view.engines_of("replica-2")[0]
    await next(e for e in fleet.cluster.engines if e.url == broken).stop()  # its update cannot land
    answer = await fleet.http.post(
        f"{fleet.replicas[0].url}/admin/update_weights", json={**UPDATE, "on_failure": "exclude"}
    )
    assert answer.status_code == 502, answer.text  # not every engine took it: said, not hidden
    report = answer.json()
    assert report["excluded"] == [broken] and report["rolled_back"] == []
    assert report["replicas"]["replica-2"]["status"] == 502
    assert {report["replicas"][r]["status"] for r in ("replica-0", "replica-1")} == {200}
    assert broken not in fleet.controller.latest.engines  # the membership decides: nobody takes it back
    assert {e.weight_version for e in fleet.cluster.engines if e.url != broken} == {"7"}
    for replica in fleet.replicas:
        state = (await fleet.http.get(f"{replica.url}/admin/state")).json()
        assert state["gate"]["open"] and broken not in {e["url"] for e in state["engines"]}
    assert await served_versions(fleet, 3) == {"7"}


async def test_an_update_no_engine_of_the_fleet_took_takes_nothing_out(fleet: LocalFleet) -> None:
    """Every engine refuses the update (the simulator's update_fails): all still hold the same weights, so
    nothing is excluded and the fleet keeps every engine and serves on."""
    for url in fleet.cluster.urls:
        assert (await fleet.http.post(f"{url}/sim/faults", json={"fault": "update_fails"})).status_code == 200
    members = set(fleet.controller.latest.engines)
    answer = await fleet.http.post(f"{fleet.replicas[1].url}/admin/update_weights", json=UPDATE)
    assert answer.status_code == 502, answer.text
    assert (answer.json()["excluded"], answer.json()["rolled_back"]) == ([], [])
    assert set(fleet.controller.latest.engines) == members
    assert await served_versions(fleet, 2) == {"default"}


async def test_rollback_puts_every_replicas_engines_back_when_one_engine_elsewhere_failed(
    fleet: LocalFleet,
) -> None:
    """replica-0 and replica-1 took the update whole; replica-2's engine failed: all five that took it roll
    back (a per-replica rollback would leave replica-0 and -1 serving "7" beside the others' "default")."""
    view = fleet.controller.latest
    broken = view.engines_of("replica-2")[0]
    await next(e for e in fleet.cluster.engines if e.url == broken).stop()
    answer = await fleet.http.post(
        f"{fleet.replicas[1].url}/admin/update_weights",
        json={**UPDATE, "on_failure": "rollback", "rollback_body": ROLLBACK},
    )
    assert answer.status_code == 502, answer.text
    report = answer.json()
    assert report["excluded"] == [broken]
    assert report["rolled_back"] == sorted(u for u in fleet.cluster.urls if u != broken)
    assert {e.weight_version for e in fleet.cluster.engines if e.url != broken} == {"default"}
    assert await served_versions(fleet, 3) == {"default"}


async def test_a_replica_that_does_not_answer_fails_the_update_for_the_fleet(fleet: LocalFleet) -> None:
    view = fleet.controller.latest
    fleet.links[2].too_slow = True  # its engines are never reached
    answer = await fleet.http.post(
        f"{fleet.replicas[0].url}/admin/update_weights",
        json={**UPDATE, "on_failure": "rollback", "rollback_body": ROLLBACK},
    )
    assert answer.status_code == 502, answer.text
    report = answer.json()
    assert sorted(m["engine"] for m in report["missing"]) == sorted(view.engines_of("replica-2"))
    assert report["rolled_back"] == sorted(view.engines_of("replica-0") + view.engines_of("replica-1"))
    assert {e.weight_version for e in fleet.cluster.engines} == {"default"}


async def test_a_bad_update_is_refused_by_every_replica_and_nothing_moves(fleet: LocalFleet) -> None:
    answer = await fleet.http.post(
        f"{fleet.replicas[0].url}/admin/update_weights", json={**UPDATE, "on_failure": "rollback"}
    )
    assert answer.status_code == 400, answer.text  # rollback without rollback_body: the caller's error
    assert {e.weight_version for e in fleet.cluster.engines} == {"default"}
    assert not any(e.paused for e in fleet.cluster.engines)
    assert await served_versions(fleet, 1) == {"default"}


async def test_a_begun_update_never_told_to_finish_finishes_by_itself_as_failed(
    fleet: LocalFleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The controller died between the two steps: the replica does not hold its gate closed for ever, and
    does not serve the update nobody confirmed (rolled back here)."""
    monkeypatch.setattr(weight_update, "FINISH_WAIT_S", 0.2)
    replica = fleet.replicas[0]
    body = {**UPDATE, "on_failure": "rollback", "rollback_body": ROLLBACK}
    begun = await replica.operate(UPDATE_BEGIN, body, {})
    assert begun.answer.status == 200 and begun.answer.json["failed"] == []
    own = set(fleet.controller.latest.engines_of(replica.replica_id))
    assert {e.weight_version for e in fleet.cluster.engines if e.url in own} == {"7"}

    def reopened() -> bool:
        return replica.server is not None and replica.server.context.driver.core.stats().gate == "open"

    await wait_until(reopened)
    assert {e.weight_version for e in fleet.cluster.engines if e.url in own} == {"default"}
    assert not any(e.paused for e in fleet.cluster.engines if e.url in own)
