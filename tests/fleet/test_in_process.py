"""The fleet's controller and replicas in one process, linked directly (no Ray): the whole protocol over real
loopback HTTP against simulated SGLang engines. Each engine has one owner; requests through any replica reach
the owner of their key in one hop; registration on any replica reaches the controller; a replica that dies has
its engines re-owned. In the default suite (tests/fleet/test_on_ray.py runs the same on Ray)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import httpx
import openai

from rolloutgate.fleet.assignment import EngineEntry, named_replica
from rolloutgate.fleet.controller import FleetController
from rolloutgate.fleet.links import ReplicaInfo
from rolloutgate.fleet.routing import REPLICA_HEADER, VIA_HEADER
from rolloutgate.top.fetch import GatewayReader
from rolloutgate.top.view import build_view
from tests.fleet.local_fleet import (
    ENGINES,
    REPLICAS,
    LocalFleet,
    all_joined,
    generate,
    key_owned_by,
    link_of,
    local_fleet,
    long_generate,
    wait_until,
)


async def test_the_engines_given_at_start_wait_for_every_replica_and_never_change_hands(
    fleet: LocalFleet,
) -> None:
    assert fleet.controller.moves == [
        m for m in fleet.controller.moves if m.source is None
    ]  # each engine's first owner only: no start-up hand-over
    assert sorted(len(fleet.controller.latest.engines_of(r.replica_id)) for r in fleet.replicas) == [2, 2, 2]


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


async def test_a_sessions_finish_reaches_the_replica_that_served_its_calls(fleet: LocalFleet) -> None:
    key = key_owned_by(fleet.controller.latest, "replica-1", "agent-")
    body, headers = generate(key)
    turn = await fleet.http.post(f"{fleet.replicas[0].url}/generate", json=body, headers=headers)
    assert turn.status_code == 200 and turn.headers[REPLICA_HEADER] == "replica-1"
    finish = await fleet.http.post(f"{fleet.replicas[0].url}/finish_session", params={"session_id": key})
    assert finish.status_code == 200 and finish.json() == {"session_id": key, "finished": True}
    assert (finish.headers[REPLICA_HEADER], finish.headers[VIA_HEADER]) == ("replica-1", "replica-0")


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
    # before the controller noticed: the hop to replica 2 fails and the next replica in the key's order answers
    at_once = await fleet.http.post(f"{fleet.replicas[0].url}/generate", json=body, headers=headers)
    assert at_once.status_code == 200 and at_once.headers[REPLICA_HEADER] in ("replica-0", "replica-1")
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
    old_url = fleet.replicas[2].url
    reborn = await fleet.restart(2)
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


async def test_a_fleet_wide_pause_during_a_generate_on_each_replica_charges_nobody_and_lists_everyone(
    fleet: LocalFleet,
) -> None:
    """`/admin/pause` on one replica closes every replica's gate and pauses every engine in place; the
    answer lists each replica and each engine with its owner. The generations running on every replica
    meanwhile finish, with the pause in their `paused` clock and nothing of it charged."""
    view = fleet.controller.latest
    tokens = 3_000  # ~30 simulated seconds of decode: the pause lands in the middle
    calls = []
    for replica in fleet.replicas:
        body, headers = long_generate(key_owned_by(view, replica.replica_id, "pause-"), tokens)
        calls.append(
            asyncio.create_task(fleet.http.post(f"{replica.url}/generate", json=body, headers=headers))
        )
    engines = fleet.cluster.engines
    await wait_until(lambda: sum(r.completion_tokens > 100 for e in engines for r in e.model.requests()) == 3)
    loop = asyncio.get_running_loop()
    paused = await fleet.http.post(f"{fleet.replicas[1].url}/admin/pause", json={"mode": "in_place"})
    paused_at = loop.time()
    assert paused.status_code == 200, paused.text
    answer = paused.json()
    assert answer["ok"] and answer["operation"] == "pause" and answer["missing"] == []
    assert sorted(answer["replicas"]) == ["replica-0", "replica-1", "replica-2"]
    assert answer["engines"] == dict(view.owners)  # every engine, by its owner
    for replica_id, part in answer["replicas"].items():
        assert part["status"] == 200 and sorted(part["engines"]) == sorted(view.engines_of(replica_id))
        assert part["answer"]["mode"] == "in_place"
    for replica in fleet.replicas:  # each replica's own gate is closed
        state = (await fleet.http.get(f"{replica.url}/admin/state")).json()
        assert state["gate"]["mode"] == "in_place", state["gate"]
    assert all(e.state(include_requests=False)["paused"] for e in engines)
    await wait_until(lambda: loop.time() - paused_at >= 0.3)  # 30 simulated seconds closed
    resumed = await fleet.http.post(f"{fleet.replicas[2].url}/admin/resume", json={})
    held_s = (loop.time() - paused_at) * 100.0  # simulated seconds between the two answers
    assert resumed.status_code == 200 and resumed.json()["ok"], resumed.text
    for call in calls:
        done = await call
        assert done.status_code == 200, done.text
        result = done.json()
        assert result["meta_info"]["completion_tokens"] == tokens
        timing = result["rolloutgate_timing"]
        assert timing["paused_s"] >= 0.9 * held_s, timing  # the pause, in its own clock
        assert timing["charged_s"] <= timing["wall_s"] - timing["paused_s"] + 0.05, timing  # not charged


async def test_a_fleet_wide_operation_that_misses_an_owner_fails_and_names_its_engines(
    fleet: LocalFleet,
) -> None:
    view = fleet.controller.latest
    fleet.links[2].too_slow = True
    refused = await fleet.http.post(f"{fleet.replicas[0].url}/admin/pause", json={"mode": "drain"})
    assert refused.status_code == 502, refused.text
    answer = refused.json()
    assert not answer["ok"] and answer["replicas"]["replica-2"]["ok"] is False
    assert sorted(m["engine"] for m in answer["missing"]) == sorted(view.engines_of("replica-2"))
    assert all(m["owner"] == "replica-2" for m in answer["missing"])
    assert sorted(answer["engines"]) == sorted(view.engines_of("replica-0") + view.engines_of("replica-1"))
    fleet.links[2].too_slow = False
    resumed = await fleet.http.post(f"{fleet.replicas[0].url}/admin/resume", json={})
    assert resumed.status_code == 200 and resumed.json()["ok"]
    bad = await fleet.http.post(f"{fleet.replicas[0].url}/admin/pause", json={"mode": "sideways"})
    assert bad.status_code == 400 and bad.json()["ok"] is False  # every replica refused it the same way
    assert all(p["answer"]["error"]["param"] == "mode" for p in bad.json()["replicas"].values())


async def test_abort_flush_both_metrics_and_state_reach_every_replica(fleet: LocalFleet) -> None:
    view = fleet.controller.latest
    aborted = await fleet.http.post(f"{fleet.replicas[0].url}/abort_request", json={"abort_all": True})
    assert aborted.status_code == 200 and sorted(aborted.json()["engines"]) == sorted(view.engines)
    flushed = await fleet.http.post(f"{fleet.replicas[1].url}/flush_cache")
    assert flushed.status_code == 200 and flushed.json()["ok"], flushed.text
    assert all(p["answer"] == "Cache flushed.\n" for p in flushed.json()["replicas"].values())
    scrape = await fleet.http.get(f"{fleet.replicas[2].url}/engine_metrics")
    assert scrape.status_code == 200
    up = [line for line in scrape.text.splitlines() if line.startswith("rolloutgate_engine_metrics_up{")]
    assert len(up) == ENGINES and {line.split('"')[1].split("/")[0] for line in up} == set(view.replicas)
    own = await fleet.http.get(f"{fleet.replicas[1].url}/metrics", params={"scope": "fleet"})
    up = [line for line in own.text.splitlines() if line.startswith("rolloutgate_replica_up{")]
    assert sorted(up) == [f'rolloutgate_replica_up{{replica="{r}"}} 1.0' for r in sorted(view.replicas)]
    assert 'rolloutgate_queue_depth{replica="replica-2"}' in own.text  # each replica's series, labelled
    state = (await fleet.http.get(f"{fleet.replicas[0].url}/admin/state", params={"scope": "fleet"})).json()
    assert sorted(state["replicas"]) == sorted(view.replicas)
    for replica_id, part in state["replicas"].items():
        own = part["answer"]
        assert own["fleet"]["replica_id"] == replica_id and own["fleet"]["replicas"] == dict(view.replicas)
        assert sorted(e["url"] for e in own["engines"]) == sorted(view.engines_of(replica_id))


# -- session records on two replicas (fleet/replication.py) ---------------------------------------------------


async def session_away_from(fleet: LocalFleet, replica_id: str) -> str:
    """A new session, created through replica 0, whose owner is not `replica_id`."""
    for _ in range(50):
        session_id = (await fleet.http.post(f"{fleet.replicas[0].url}/sessions")).json()["session_id"]
        if named_replica(session_id) != replica_id:
            return session_id
    raise AssertionError("every session landed on one replica")


def replica_index(replica_id: str) -> int:
    return int(replica_id.rsplit("-", 1)[1])


def held_records(fleet: LocalFleet, index: int, session_id: str) -> list[list[int]]:
    """The output ids of each turn replica `index` holds of the session (its own registry, no hop)."""
    server = fleet.replicas[index].server
    assert server is not None
    copy = server.context.extras["sessions"].registry.copy_of(session_id)
    return [] if copy is None else [list(r.output_ids) for r in copy.records]


class Agent:
    """One session's agent through the one URL (replica 0), with no client retries: a failure shows."""

    def __init__(self, fleet: LocalFleet, session_id: str) -> None:
        base = f"{fleet.replicas[0].url}/sessions/{session_id}/v1"
        self.client = openai.AsyncOpenAI(base_url=base, api_key="-", max_retries=0, timeout=60)
        self.messages: list[dict[str, str]] = [{"role": "user", "content": "hello"}]

    async def turn(self, max_tokens: int = 4) -> tuple[str, int]:
        """The replica that answered and the completion's tokens."""
        raw = await self.client.chat.completions.with_raw_response.create(
            model="sim-model",
            messages=self.messages,  # type: ignore[arg-type]
            max_tokens=max_tokens,
            extra_body={"ignore_eos": True},
        )
        reply = raw.parse()
        self.messages += [
            {"role": "assistant", "content": reply.choices[0].message.content or ""},
            {"role": "user", "content": f"turn {len(self.messages)}"},
        ]
        assert reply.usage is not None
        return raw.headers[REPLICA_HEADER], reply.usage.completion_tokens


async def test_a_dead_owners_session_goes_on_at_its_backup_with_every_record(fleet: LocalFleet) -> None:
    session_id = await session_away_from(fleet, "replica-0")
    owner = named_replica(session_id)
    assert owner is not None
    order = fleet.controller.latest.preference(session_id)
    assert order[0] == owner
    backup, third = order[1], order[2]
    agent = Agent(fleet, session_id)
    for _ in range(2):
        assert (await agent.turn())[0] == owner
    kept = held_records(fleet, replica_index(owner), session_id)
    assert held_records(fleet, replica_index(backup), session_id) == kept  # the backup had each turn first
    assert held_records(fleet, replica_index(third), session_id) == []

    await fleet.kill(replica_index(owner))
    # at once, before the controller noticed: replica 0's hop to the owner fails, the backup answers
    assert (await agent.turn())[0] == backup
    await wait_until(lambda: owner not in fleet.controller.latest.replicas and all_joined(fleet))
    assert (await agent.turn())[0] == backup
    described = (await fleet.http.get(f"{fleet.replicas[0].url}/sessions/{session_id}")).json()
    assert [r["output_token_ids"] for r in described["records"][:2]] == kept  # nothing lost, nothing changed
    assert len(described["records"]) == 4
    # the new backup (the next in the session's order) got the whole session when the view changed
    await wait_until(lambda: len(held_records(fleet, replica_index(third), session_id)) == 4)
    await agent.client.close()


async def test_a_turn_running_when_its_owner_dies_is_answered_by_the_backup(fleet: LocalFleet) -> None:
    session_id = await session_away_from(fleet, "replica-0")
    owner = named_replica(session_id)
    assert owner is not None
    backup = fleet.controller.latest.preference(session_id)[1]
    agent = Agent(fleet, session_id)
    await agent.turn()
    owner_sessions = fleet.replicas[replica_index(owner)].server.context.extras["sessions"]  # type: ignore[union-attr]
    long_turn = asyncio.create_task(agent.turn(max_tokens=20_000))
    await wait_until(lambda: not owner_sessions.registry.get(session_id, 0.0).is_idle)
    await asyncio.sleep(0.5)  # keep-alive spaces reach the client (15 simulated s at x100)
    assert not long_turn.done()
    await fleet.kill(replica_index(owner))
    _, tokens = await long_turn  # the answer under way was finished by the backup: whole, no client retry
    assert tokens == 20_000
    assert len(held_records(fleet, replica_index(backup), session_id)) == 2
    await agent.client.close()


async def test_a_returning_owner_takes_back_the_turns_its_backup_served(fleet: LocalFleet) -> None:
    session_id = await session_away_from(fleet, "replica-0")
    owner = named_replica(session_id)
    assert owner is not None
    index = replica_index(owner)
    agent = Agent(fleet, session_id)
    await agent.turn()
    await fleet.kill(index)
    assert (await agent.turn())[0] != owner  # served at the backup while the owner is away
    await wait_until(lambda: owner not in fleet.controller.latest.replicas)
    reborn = await fleet.restart(index)  # no --state-dir: it comes back empty and pulls its sessions
    await wait_until(lambda: all_joined(fleet))
    assert (await agent.turn())[0] == owner
    assert len(held_records(fleet, index, session_id)) == 3
    assert reborn.replication is not None and reborn.replication.counts["pulled"] >= 1
    await agent.client.close()


async def test_rolloutgate_top_on_any_replica_shows_the_whole_fleet(fleet: LocalFleet) -> None:
    """`rolloutgate top` given one replica's URL reads every replica and shows each engine by its owner."""
    async with aiohttp.ClientSession() as session:
        snapshots = await GatewayReader(session).read_all(fleet.replicas[1].url)
    assert [(s.replica_id, s.error) for s in snapshots] == [(f"replica-{i}", None) for i in range(REPLICAS)]
    view = build_view([snapshots])
    owners = fleet.controller.latest.owners
    assert sorted((row.replica, row.url) for row in view.engines) == sorted((o, u) for u, o in owners.items())
    assert [row.key for row in view.gateways] == [f"replica-{i}" for i in range(REPLICAS)]


async def test_an_engine_handed_over_while_its_owner_lives_finishes_its_calls_there(
    fleet: LocalFleet,
) -> None:
    """A replica that comes back takes engines from the others; each is handed over drained: the calls its
    old owner runs there finish there, whole, on their first attempt (none aborted and re-queued)."""
    await fleet.kill(2)
    await wait_until(lambda: "replica-2" not in fleet.controller.latest.replicas and all_joined(fleet))
    view = fleet.controller.latest
    before = set((await fleet.owners_by_replica([0]))["replica-0"])
    keys = [k for k in (f"drain-{i}" for i in range(500)) if view.key_owner(k) == "replica-0"][:6]
    tokens = 8_000  # ~1 s of real time at x100: the hand-over lands while they run
    calls = []
    for key in keys:
        body, headers = long_generate(key, tokens)
        calls.append(
            asyncio.create_task(
                fleet.http.post(f"{fleet.replicas[0].url}/generate", json=body, headers=headers)
            )
        )
    await asyncio.sleep(0.3)  # every call running on replica 0's engines
    await fleet.restart(2)
    assert not any(call.done() for call in calls)  # the hand-over begins while they run
    await wait_until(lambda: all_joined(fleet))  # the drained engines have left replica 0's pool
    moved = before - set((await fleet.owners_by_replica([0]))["replica-0"])
    assert moved  # the returning replica took its share, some from replica 0
    answers = await asyncio.gather(*calls)
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    on_moved = [a for a in answers if a.headers["X-Rolloutgate-Engine"] in moved]
    assert on_moved  # the hand-over had calls to drain
    for answer in answers:
        result = answer.json()
        assert result["meta_info"]["completion_tokens"] == tokens
        assert result["rolloutgate_timing"]["attempts"] == 1, result["rolloutgate_timing"]


async def test_the_shared_port_is_one_url_that_outlives_any_replica(fleet: LocalFleet) -> None:
    """Every replica also listens on the fleet's shared port (SO_REUSEPORT): new connections there reach a live
    replica, whichever one died."""
    shared = f"http://127.0.0.1:{fleet.replicas[0].shared_port}"
    view = fleet.controller.latest
    keys = [key_owned_by(view, f"replica-{i}", f"shared-{i}-") for i in range(REPLICAS)]

    async def calls() -> set[str]:
        served = set()
        for round_ in range(4):
            for key in keys:
                body, headers = generate(key)
                async with httpx.AsyncClient(timeout=30) as fresh:  # a new connection each call
                    answer = await fresh.post(f"{shared}/generate", json=body, headers=headers)
                assert answer.status_code == 200, (round_, answer.text)
                served.add(answer.headers[REPLICA_HEADER])
        return served

    assert await calls() == set(view.replicas)  # each key at its owner, from whichever replica took it
    await fleet.kill(0)
    assert await calls() <= {"replica-1", "replica-2"}  # at once: before the controller noticed, too


async def test_a_call_whose_owner_died_goes_on_here_when_this_replica_is_next_in_its_order(
    fleet: LocalFleet,
) -> None:
    """The forwarder read the body off the stream for the hop; taking the call itself, it sends it to its own
    URL (the gateway's handler would find the stream empty)."""
    view = fleet.controller.latest
    key = next(
        k for k in (f"next-{i}" for i in range(500)) if view.preference(k)[:2] == ["replica-2", "replica-0"]
    )
    await fleet.kill(2)
    body, headers = long_generate(key, 8)
    answer = await fleet.http.post(f"{fleet.replicas[0].url}/generate", json=body, headers=headers)
    assert answer.status_code == 200, answer.text
    assert answer.headers[REPLICA_HEADER] == "replica-0"
    assert answer.json()["meta_info"]["completion_tokens"] == 8


async def test_engines_given_at_start_go_to_the_replicas_there_when_the_others_do_not_come() -> None:
    class Answering:
        async def ping(self, timeout_s: float) -> str:
            return "only"

    controller = FleetController(
        [EngineEntry(f"http://127.0.0.1:{30000 + i}") for i in range(4)],
        link_factory=lambda handle: handle,  # type: ignore[arg-type, return-value]
        expected_replicas=2,
        startup_grace_s=0.2,
    )
    await controller.start()
    try:
        view = await controller.register_replica(
            ReplicaInfo("replica-0", "http://127.0.0.1:1", "only"), Answering()
        )
        assert view.engines == {}  # held: one more replica is expected
        await wait_until(lambda: len(controller.latest.engines_of("replica-0")) == 4, timeout_s=5)
    finally:
        await controller.close()


async def test_each_replica_records_the_requests_it_served_in_a_trace_of_its_own(tmp_path: Path) -> None:
    """One `--record-trace FILE` for the fleet: each replica writes `FILE.<replica id>`, never one file twice."""
    trace = tmp_path / "trace.jsonl"
    async with local_fleet(record_trace=str(trace)) as fleet:
        await wait_until(lambda: all_joined(fleet))
        served: dict[str, int] = {}
        for index in range(REPLICAS):
            body, headers = generate(key_owned_by(fleet.controller.latest, f"replica-{index}", "trace-"))
            answer = await fleet.http.post(f"{fleet.replicas[0].url}/generate", json=body, headers=headers)
            assert answer.status_code == 200, answer.text
            served[answer.headers[REPLICA_HEADER]] = served.get(answer.headers[REPLICA_HEADER], 0) + 1
    assert sorted(served) == [f"replica-{i}" for i in range(REPLICAS)]
    for replica_id, count in served.items():
        header, *requests = trace_lines(Path(f"{trace}.{replica_id}"))
        assert "rolloutgate_trace" in header and len(requests) == count, (replica_id, requests)
    assert not trace.exists()


def trace_lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


async def test_the_controller_says_when_an_engine_is_in_its_owners_pool(fleet: LocalFleet) -> None:
    """What `serve --processes N` waits for before it says it serves (fleet/processes.py)."""
    url = fleet.cluster.urls[0]
    joined = await fleet.controller.owner_joined(url, 10.0)
    assert joined.ok and joined.worker is not None and joined.worker["url"] == url
    unknown = await fleet.controller.owner_joined("http://127.0.0.1:1", 1.0)
    assert not unknown.ok and unknown.error == "no replica is live to own it yet"
