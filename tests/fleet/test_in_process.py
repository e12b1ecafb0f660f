"""The fleet's controller and replicas in one process, linked directly (no Ray): the whole protocol over real
loopback HTTP against simulated SGLang engines. Each engine has one owner; requests through any replica reach
the owner of their key in one hop; registration on any replica reaches the controller; a replica that dies has
its engines re-owned. In the default suite (tests/fleet/test_on_ray.py runs the same on Ray)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import httpx
import openai
import pytest

from rolloutgate.config import GatewaySettings
from rolloutgate.fleet.assignment import EngineEntry, named_replica
from rolloutgate.fleet.controller import FleetController
from rolloutgate.fleet.links import JoinResult, ReplicaLink, ReplicaUnreachable
from rolloutgate.fleet.replica import FleetReplica
from rolloutgate.fleet.routing import REPLICA_HEADER, VIA_HEADER
from rolloutgate.sim import SimCluster

REPLICAS = 3
ENGINES = 6


@dataclass(eq=False)
class KillableLink:
    """The controller's link to an in-process replica; `kill()` makes it answer as Ray does for a dead actor."""

    replica: FleetReplica | None = None
    dead: bool = False

    async def ping(self, timeout_s: float) -> str:
        if self.dead or self.replica is None:
            raise ReplicaUnreachable("ActorDiedError", final=True)
        return await self.replica.ping(timeout_s)

    async def joined(self, url: str, version: int, timeout_s: float) -> JoinResult:
        if self.dead or self.replica is None:
            raise ReplicaUnreachable("ActorDiedError", final=True)
        return await self.replica.joined(url, version, timeout_s)


@dataclass(eq=False)
class LocalFleet:
    cluster: SimCluster
    controller: FleetController
    replicas: list[FleetReplica]
    links: list[KillableLink]
    spare: SimCluster
    http: httpx.AsyncClient = field(default_factory=lambda: httpx.AsyncClient(timeout=60))

    async def kill(self, index: int) -> None:
        """The replica's process is gone: its link raises, its server stops answering at once."""
        self.links[index].dead = True
        replica = self.replicas[index]
        if replica._follower is not None:
            replica._follower.cancel()
        assert replica.server is not None and replica.server.runner is not None
        await replica.server.runner.cleanup()

    async def owners_by_replica(self, indices: list[int]) -> dict[str, list[str]]:
        """Each replica's own pool, read from its /admin/state."""
        out = {}
        for i in indices:
            state = (await self.http.get(f"{self.replicas[i].url}/admin/state")).json()
            out[self.replicas[i].replica_id] = sorted(e["url"] for e in state["engines"])
        return out


def link_of(handle: object) -> ReplicaLink:
    assert isinstance(handle, KillableLink)
    return handle


@pytest.fixture
async def fleet() -> AsyncIterator[LocalFleet]:
    async with SimCluster(engines=ENGINES, time_scale=100.0) as cluster, SimCluster(engines=1) as spare:
        controller = FleetController(
            [EngineEntry(url, family="sglang") for url in cluster.urls],
            link_factory=link_of,
            ping_interval_s=0.1,
        )
        await controller.start()
        settings = GatewaySettings(port=0, time_scale=100.0, stall_timeout=600.0, log_level="warning")
        replicas, links = [], []
        for i in range(REPLICAS):
            link = KillableLink()
            replica = FleetReplica(f"replica-{i}", settings, controller, handle=link)
            link.replica = replica
            await replica.start()
            replicas.append(replica)
            links.append(link)
        local = LocalFleet(cluster, controller, replicas, links, spare)
        await wait_until(lambda: all_joined(local))
        try:
            yield local
        finally:
            for replica, link in zip(replicas, links, strict=True):
                if not link.dead:
                    await replica.stop(grace_s=0)
            await controller.close()
            await local.http.aclose()


def all_joined(fleet: LocalFleet) -> bool:
    live = [r for r, link in zip(fleet.replicas, fleet.links, strict=True) if not link.dead]
    view = fleet.controller.latest
    return all(
        len(r.server.context.pool.engines) == len(view.engines_of(r.replica_id))
        and r.view.version == view.version
        for r in live
    )


async def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> float:
    """Seconds until `condition()` held; fails after `timeout_s`."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while not condition():
        assert loop.time() - start < timeout_s, "condition not met in time"
        await asyncio.sleep(0.02)
    return loop.time() - start


def generate(key: str) -> tuple[dict[str, object], dict[str, str]]:
    body = {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 4}}
    return body, {"X-SMG-Routing-Key": key}


async def test_each_engine_has_one_owner_and_keyed_calls_reach_it_in_one_hop(fleet: LocalFleet) -> None:
    owners = await fleet.owners_by_replica([0, 1, 2])
    engines = [url for urls in owners.values() for url in urls]
    assert sorted(engines) == sorted(fleet.cluster.urls)  # every engine once
    assert all(len(urls) == ENGINES // REPLICAS for urls in owners.values())
    view = fleet.controller.latest
    forwarded = 0
    for i in range(30):
        key = f"rollout-{i}"
        body, headers = generate(key)
        answer = await fleet.http.post(f"{fleet.replicas[0].url}/generate", json=body, headers=headers)
        assert answer.status_code == 200, answer.text
        owner = view.key_owner(key)
        assert answer.headers[REPLICA_HEADER] == owner
        assert answer.headers["X-Rolloutgate-Engine"] in owners[owner or ""]
        if owner != "replica-0":
            forwarded += 1
            assert answer.headers[VIA_HEADER] == "replica-0"
        else:
            assert VIA_HEADER not in answer.headers
    assert 0 < forwarded < 30


async def test_a_streamed_call_passes_through_the_hop(fleet: LocalFleet) -> None:
    view = fleet.controller.latest
    key = next(k for k in (f"s{i}" for i in range(100)) if view.key_owner(k) == "replica-2")
    body, headers = generate(key)
    body["stream"] = True
    events = []
    async with fleet.http.stream(
        "POST", f"{fleet.replicas[0].url}/generate", json=body, headers=headers
    ) as r:
        assert r.status_code == 200 and r.headers[REPLICA_HEADER] == "replica-2"
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line)
    assert events[-1] == "data: [DONE]" and len(events) >= 2


async def test_a_session_is_created_at_a_replica_its_id_names_and_its_turns_find_it(
    fleet: LocalFleet,
) -> None:
    created_at = set()
    for _ in range(12):
        created = await fleet.http.post(f"{fleet.replicas[0].url}/sessions")
        assert created.status_code == 200, created.text
        session_id = created.json()["session_id"]
        owner = named_replica(session_id)
        assert created.headers[REPLICA_HEADER] == owner
        created_at.add(owner)
    assert len(created_at) >= 2  # spread, not all at the replica asked
    session_id = (await fleet.http.post(f"{fleet.replicas[0].url}/sessions")).json()["session_id"]
    owner = named_replica(session_id)
    # the agent holds the one URL (replica 0): every turn reaches the owner
    client = openai.AsyncOpenAI(base_url=f"{fleet.replicas[0].url}/sessions/{session_id}/v1", api_key="-")
    messages: list[dict[str, str]] = [{"role": "user", "content": "hello"}]
    for turn in range(3):
        raw = await client.chat.completions.with_raw_response.create(
            model="sim-model",
            messages=messages,
            max_tokens=4,  # type: ignore[arg-type]
        )
        assert raw.headers[REPLICA_HEADER] == owner
        reply = raw.parse()
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content or ""},
            {"role": "user", "content": f"turn {turn}"},
        ]
    await client.close()
    for replica in fleet.replicas:  # any replica shows the records: it reads them from the owner
        record = (await fleet.http.get(f"{replica.url}/sessions/{session_id}")).json()
        assert len(record["records"]) == 3


async def test_registration_on_any_replica_reaches_the_controller(fleet: LocalFleet) -> None:
    new = fleet.spare.urls[0]
    added = await fleet.http.post(f"{fleet.replicas[1].url}/add_worker", params={"url": new})
    assert added.status_code == 201, added.text
    owner = added.json()["owner"]
    assert added.json()["url"] == new and added.json()["healthy"] in (True, False)
    owners = await fleet.owners_by_replica([0, 1, 2])
    assert [r for r, urls in owners.items() if new in urls] == [owner]
    listed = (await fleet.http.get(f"{fleet.replicas[2].url}/list_workers")).json()["urls"]
    assert sorted(listed) == sorted([*fleet.cluster.urls, new])
    workers = (await fleet.http.get(f"{fleet.replicas[0].url}/workers")).json()["workers"]
    fleet_id = next(w["id"] for w in workers if w["url"] == new)
    removed = await fleet.http.delete(f"{fleet.replicas[2].url}/workers/{fleet_id}")
    assert removed.status_code == 200 and removed.json()["removed"]["url"] == new
    await wait_until(lambda: all_joined(fleet))
    assert new not in [u for urls in (await fleet.owners_by_replica([0, 1, 2])).values() for u in urls]
    unreachable = await fleet.http.post(
        f"{fleet.replicas[0].url}/workers", json={"url": "http://127.0.0.1:9"}
    )
    assert unreachable.status_code == 502 and unreachable.json()["error"]["code"] == "worker_unreachable"
    assert "http://127.0.0.1:9" not in fleet.controller.latest.engines


async def test_a_dead_replicas_engines_are_re_owned_and_its_keys_served_elsewhere(fleet: LocalFleet) -> None:
    before = await fleet.owners_by_replica([0, 1, 2])
    view = fleet.controller.latest
    key = next(k for k in (f"d{i}" for i in range(100)) if view.key_owner(k) == "replica-2")
    await fleet.kill(2)
    body, headers = generate(key)
    refused = await fleet.http.post(f"{fleet.replicas[0].url}/generate", json=body, headers=headers)
    if refused.status_code != 200:  # the hop failed before the controller noticed: 503, retry
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
    seconds = await wait_until(
        lambda: all_joined(fleet) and "replica-2" not in fleet.controller.latest.replicas
    )
    assert seconds < 5
    after = await fleet.owners_by_replica([0, 1])
    assert sorted(u for urls in after.values() for u in urls) == sorted(fleet.cluster.urls)
    for replica_id in ("replica-0", "replica-1"):
        assert set(before[replica_id]) <= set(after[replica_id])  # sticky: survivors kept theirs
    answer = await fleet.http.post(f"{fleet.replicas[0].url}/generate", json=body, headers=headers)
    assert answer.status_code == 200 and answer.headers[REPLICA_HEADER] in ("replica-0", "replica-1")
    assert fleet.controller.departures == [("replica-2", "ActorDiedError")]


async def test_a_restarted_replica_takes_its_share_back(fleet: LocalFleet) -> None:
    await fleet.kill(2)
    await wait_until(lambda: "replica-2" not in fleet.controller.latest.replicas)
    settings = fleet.replicas[2].settings
    link = KillableLink()
    reborn = FleetReplica("replica-2", settings, fleet.controller, handle=link)
    link.replica = reborn
    old_url = fleet.replicas[2].url
    with contextlib.suppress(OSError):
        await reborn.start()
    fleet.replicas[2], fleet.links[2] = reborn, link
    await wait_until(lambda: all_joined(fleet))
    assert reborn.url == old_url  # the same port: URLs agents hold reach it again
    owners = await fleet.owners_by_replica([0, 1, 2])
    assert sorted(len(v) for v in owners.values()) == [2, 2, 2]


async def test_large_and_unsized_bodies_stream_through_the_hop_as_the_owner_answers_them(
    fleet: LocalFleet,
) -> None:
    view = fleet.controller.latest
    key = next(k for k in (f"b{i}" for i in range(100)) if view.key_owner(k) == "replica-1")
    body = (
        b'{"input_ids": [' + b",".join([b"12345"] * 400_000) + b'], "sampling_params": {"max_new_tokens": 2}}'
    )
    assert len(body) > 2 << 20  # over the whole-body limit: streamed to the owner
    headers = {"X-SMG-Routing-Key": key, "Content-Type": "application/json"}
    direct = await fleet.http.post(f"{fleet.replicas[1].url}/generate", content=body, headers=headers)
    hopped = await fleet.http.post(f"{fleet.replicas[0].url}/generate", content=body, headers=headers)
    assert hopped.headers[REPLICA_HEADER] == "replica-1" and hopped.headers[VIA_HEADER] == "replica-0"
    # 400K ids are past the simulated engine's context: its refusal, the same both ways, is the answer here
    assert hopped.status_code == direct.status_code == 400
    assert hopped.json() == direct.json()

    async def pieces() -> AsyncIterator[bytes]:  # no Content-Length: chunked, streamed as it comes
        yield b'{"input_ids": [1, 2, 3], '
        await asyncio.sleep(0.05)
        yield b'"sampling_params": {"max_new_tokens": 3}}'

    chunked = await fleet.http.post(f"{fleet.replicas[0].url}/generate", content=pieces(), headers=headers)
    assert chunked.status_code == 200, chunked.text
    assert chunked.headers[REPLICA_HEADER] == "replica-1"


async def test_a_restarted_controller_gets_every_engine_back_from_the_replicas(fleet: LocalFleet) -> None:
    new = fleet.spare.urls[0]
    added = await fleet.http.post(f"{fleet.replicas[0].url}/add_worker", params={"url": new})
    assert added.status_code == 201, added.text
    old = fleet.controller
    # Ray restarts the controller: a new process, a new epoch, only the engines it was started with
    reborn = FleetController(
        [EngineEntry(url, family="sglang") for url in fleet.cluster.urls],
        link_factory=link_of,
        ping_interval_s=0.1,
    )
    await reborn.start()
    assert new not in reborn.latest.engines
    for replica in fleet.replicas:
        replica.controller = reborn
    fleet.controller = reborn
    old._changed_view()  # what a dead controller's pending long polls do: return (Ray raises), then ask again
    await wait_until(lambda: len(reborn.latest.replicas) == REPLICAS and all_joined(fleet))
    assert reborn.latest.epoch != old.epoch
    assert sorted(reborn.latest.engines) == sorted([*fleet.cluster.urls, new])
    owners = await fleet.owners_by_replica([0, 1, 2])
    held = [u for urls in owners.values() for u in urls]
    assert sorted(held) == sorted([*fleet.cluster.urls, new])  # each engine in exactly one pool
    await old.close()
