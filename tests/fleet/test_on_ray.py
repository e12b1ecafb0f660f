"""A fleet on a local Ray cluster (`make test-fleet`): 3 replica actors, 7 simulated SGLang engines (`rolloutgate
sim` in a subprocess; 6 given at start, 1 registered over HTTP). Each engine has exactly one owner; calls and a
session's turns through replica 0 reach the owner in one hop; registration on another replica reaches the
controller; a fleet-wide pause over Ray charges no generation on any replica; a replica SIGKILLed comes back under Ray's restart policy on its old URL with its session records and takes its share back;
one killed for good has its engines re-owned by the others within 10 s.

The tests share one fleet and run in order (each leaves it whole, but the last)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray

from rolloutgate.config import GatewaySettings
from rolloutgate.fleet import Fleet
from rolloutgate.fleet.assignment import named_replica
from rolloutgate.fleet.routing import REPLICA_HEADER, VIA_HEADER
from tests.fleet.local_fleet import key_owned_by, long_generate
from tests.fleet.on_ray import fleet_on_ray, pools, pools_hold, simulated_engines, wait_for

pytestmark = pytest.mark.fleet

REPLICAS = 3
ENGINES = 6  # given at start; one more is registered over HTTP
TIME_SCALE = 100.0
REOWN_LIMIT_S = 10.0


@pytest.fixture(scope="module")
def engines() -> Iterator[list[str]]:
    with simulated_engines(ENGINES + 1, TIME_SCALE) as urls:
        yield urls


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fleet-state")


@pytest.fixture(scope="module")
def fleet(engines: list[str], state_dir: Path) -> Iterator[Fleet]:
    settings = GatewaySettings(
        time_scale=TIME_SCALE, stall_timeout=600.0, log_level="warning", state_dir=str(state_dir)
    )
    with fleet_on_ray(REPLICAS, engines[:ENGINES], settings, "rolloutgate-test") as started:
        yield started


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=60) as client:
        yield client


def generate(http: httpx.Client, url: str, key: str) -> httpx.Response:
    body: dict[str, Any] = {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 4}}
    return http.post(f"{url}/generate", json=body, headers={"X-SMG-Routing-Key": key})


def test_each_engine_is_owned_by_exactly_one_replica(
    fleet: Fleet, engines: list[str], http: httpx.Client
) -> None:
    held = pools(fleet)
    assert sorted(u for urls in held.values() for u in urls) == sorted(engines[:ENGINES])
    assert sorted(len(urls) for urls in held.values()) == [2, 2, 2]
    for url in fleet.urls:  # every replica tells the same fleet-wide list, with each engine's owner
        workers = http.get(f"{url}/workers").json()["workers"]
        assert {w["url"]: w["owner"] for w in workers} == {
            u: owner for owner, urls in held.items() for u in urls
        }


def test_calls_through_replica_0_reach_their_keys_owner_in_one_hop(fleet: Fleet, http: httpx.Client) -> None:
    view = fleet.view()
    held = pools(fleet)
    seen = set()
    for i in range(24):
        key = f"rollout-{i}"
        answer = generate(http, fleet.url, key)
        assert answer.status_code == 200, answer.text
        owner = view.key_owner(key)
        assert answer.headers[REPLICA_HEADER] == owner
        assert answer.headers["X-Rolloutgate-Engine"] in held[owner or ""]
        assert answer.headers.get(VIA_HEADER) == (None if owner == "replica-0" else "replica-0")
        seen.add(owner)
    assert seen == set(view.replicas)


def test_a_sessions_turns_reach_its_replica_through_the_one_url_and_its_own(
    fleet: Fleet, http: httpx.Client
) -> None:
    created = http.post(f"{fleet.url}/sessions")
    session_id = created.json()["session_id"]
    owner = named_replica(session_id)
    assert created.headers[REPLICA_HEADER] == owner
    own_url = created.headers["X-Rolloutgate-Replica-Url"]
    assert own_url == fleet.view().replicas[owner or ""]
    messages: list[dict[str, str]] = [{"role": "user", "content": "hi"}]
    # through the one URL (a hop unless it is the owner), then directly at the URL its creation named
    for turn, base in enumerate((fleet.url, fleet.url, own_url)):
        body = {"model": "sim-model", "messages": messages, "max_tokens": 4}
        answer = http.post(f"{base}/sessions/{session_id}/v1/chat/completions", json=body)
        assert answer.status_code == 200, answer.text
        assert answer.headers[REPLICA_HEADER] == owner
        if base == own_url:
            assert VIA_HEADER not in answer.headers
        reply = answer.json()["choices"][0]["message"]["content"]
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"turn {turn}"}]
    records = http.get(f"{fleet.url}/sessions/{session_id}").json()["records"]
    assert len(records) == 3


def test_registration_on_another_replica_reaches_the_controller(
    fleet: Fleet, engines: list[str], http: httpx.Client
) -> None:
    new = engines[ENGINES]
    added = http.post(f"{fleet.urls[1]}/add_worker", params={"url": new})
    assert added.status_code == 201, added.text
    owner = added.json()["owner"]
    held = pools(fleet)
    assert [r for r, urls in held.items() if new in urls] == [owner]
    assert pools_hold(fleet, ENGINES + 1)
    assert sorted(http.get(f"{fleet.urls[2]}/list_workers").json()["urls"]) == sorted(engines)


def test_a_fleet_wide_pause_over_ray_during_a_generate_on_each_replica_charges_nobody(
    fleet: Fleet, http: httpx.Client
) -> None:
    """The fleet-wide operations over Ray handles: `/admin/pause` on replica 1 closes every replica's gate
    while a /generate runs on each; the answer lists every replica and engine; `/admin/resume` on replica 2
    opens them; each generation completes with the pause in its `paused` clock, none of it charged."""
    view = fleet.view()
    tokens = 20_000  # ~2.5 s of real time at x100: the pause lands in the middle
    with ThreadPoolExecutor(REPLICAS) as pool:
        calls = []
        for replica_id, url in view.replicas.items():
            body, headers = long_generate(key_owned_by(view, replica_id, "ray-pause-"), tokens)
            calls.append(pool.submit(http.post, f"{url}/generate", json=body, headers=headers))
        time.sleep(0.5)
        paused = http.post(f"{fleet.urls[1]}/admin/pause", json={"mode": "in_place"})
        paused_at = time.monotonic()
        assert paused.status_code == 200, paused.text
        answer = paused.json()
        assert (
            answer["ok"] and answer["missing"] == [] and sorted(answer["replicas"]) == sorted(view.replicas)
        )
        assert answer["engines"] == dict(view.owners)
        state = http.get(f"{fleet.urls[0]}/admin/state", params={"scope": "fleet"}).json()
        assert all(p["answer"]["gate"]["mode"] == "in_place" for p in state["replicas"].values()), state
        time.sleep(0.6)
        resumed = http.post(f"{fleet.urls[2]}/admin/resume", json={})
        held_s = (time.monotonic() - paused_at) * TIME_SCALE
        assert resumed.status_code == 200 and resumed.json()["ok"], resumed.text
        for call in calls:
            done = call.result(timeout=60)
            assert done.status_code == 200, done.text
            result = done.json()
            assert result["meta_info"]["completion_tokens"] == tokens
            timing = result["rolloutgate_timing"]
            assert timing["paused_s"] >= 0.8 * held_s, timing
            assert timing["charged_s"] <= timing["wall_s"] - timing["paused_s"] + 0.5, timing
    metrics = http.get(f"{fleet.url}/metrics", params={"scope": "fleet"}).text
    up = [line for line in metrics.splitlines() if line.startswith("rolloutgate_replica_up{")]
    assert len(up) == REPLICAS and all(line.endswith(" 1.0") for line in up), up


def test_a_sigkilled_replica_comes_back_on_its_url_and_takes_its_share(
    fleet: Fleet, http: httpx.Client, state_dir: Path
) -> None:
    """... with its sessions: each replica journals its own under `--state-dir`/<replica id> and reopens it
    when Ray restarts it, so a session's records and its next turn survive its replica's SIGKILL."""
    own_url = fleet.view().replicas["replica-2"]
    created = (http.post(f"{fleet.url}/sessions").json()["session_id"] for _ in range(60))
    session_id = next(s for s in created if named_replica(s) == "replica-2")  # new sessions are spread
    chat = f"{own_url}/sessions/{session_id}/v1/chat/completions"
    first = [{"role": "user", "content": "before the kill"}]
    answer = http.post(chat, json={"model": "sim-model", "messages": first, "max_tokens": 4})
    assert answer.status_code == 200, answer.text
    reply = answer.json()["choices"][0]["message"]["content"]
    assert (state_dir / "replica-2").is_dir() and (state_dir / "replica-0").is_dir()
    before = fleet.describe()["replica-2"]
    killed = fleet.view().incarnations["replica-2"]
    os.kill(before["pid"], signal.SIGKILL)

    def restarted() -> bool:
        # Either the controller's ping sees it go first, or Ray restarts it so fast that its new incarnation
        # registers first (the controller departs the old one inside register_replica): both end here.
        view = fleet.view()
        return "replica-2" in view.replicas and view.incarnations.get("replica-2") not in (None, killed)

    wait_for(restarted, "Ray restarted it and the controller took its new incarnation", 60)
    wait_for(lambda: pools_hold(fleet, ENGINES + 1), "every engine in exactly one pool")
    after = fleet.describe()["replica-2"]
    assert after["pid"] != before["pid"] and after["url"] == before["url"]
    assert sorted(len(urls) for urls in pools(fleet).values()) == [2, 2, 3]
    assert generate(http, fleet.url, "after-restart").status_code == 200
    records = http.get(f"{fleet.url}/sessions/{session_id}").json()["records"]
    assert len(records) == 1  # through the one URL: its owner, restarted, has it
    second = [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "after it"}]
    answer = http.post(chat, json={"model": "sim-model", "messages": second, "max_tokens": 4})
    assert answer.status_code == 200, answer.text
    assert len(http.get(f"{own_url}/sessions/{session_id}").json()["records"]) == 2


def test_a_replica_killed_for_good_has_its_engines_re_owned_by_the_others(
    fleet: Fleet, http: httpx.Client
) -> None:
    view = fleet.view()
    key = next(k for k in (f"gone-{i}" for i in range(200)) if view.key_owner(k) == "replica-2")
    survivors = ["replica-0", "replica-1"]
    kept = pools(fleet, survivors)
    ray.kill(fleet.replicas["replica-2"], no_restart=True)
    started = time.monotonic()
    wait_for(lambda: pools_hold(fleet, ENGINES + 1, survivors), "its engines re-owned", REOWN_LIMIT_S)
    reowned_s = time.monotonic() - started
    print(f"\nfleet figure: engines of a killed replica re-owned in {reowned_s:.2f} s")
    assert reowned_s < REOWN_LIMIT_S
    held = pools(fleet, survivors)
    assert all(set(kept[r]) <= set(held[r]) for r in survivors)  # sticky: the survivors kept theirs
    answer = generate(http, fleet.url, key)  # its keys are served by a survivor now
    assert answer.status_code == 200 and answer.headers[REPLICA_HEADER] in survivors
