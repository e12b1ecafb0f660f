"""A replica SIGKILLed mid-rollout (`make test-fleet`), the issue's scenario: a local Ray cluster, 3 replica
actors, 6 simulated SGLang engines (`rolloutgate sim`, x100), no `--state-dir` (the records live on two
replicas, fleet/replication.py), and the replay's agents (rolloutreplay/agents.py: LiteLLM with its default
retries, non-streamed turns) through the one URL, the fleet's shared port that every replica listens on: six on
the session API (`/sessions/{id}/v1`), three with a routing key (`X-Session-Id` on `/v1`). Once replica 0 has
turns running, its process is SIGKILLed: it was the owner of some calls and the forwarder of others. The agents
go on until Ray has restarted it and it has served again.

It must show: no turn failed that the agents saw (a forwarder's hop sends a call whose owner died, before or
after keep-alive spaces, on to the next replica in its key's order, which holds the session's records; a call
whose connection was to the dead replica itself is retried by LiteLLM onto the shared port, where a live
replica takes it); every
session's records are there, one per answered turn, through the one URL; every engine has one live owner again
within 10 s; and the engine-seconds lost with the killed replica's generations (the engines aborted them when
its connections closed) are printed."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import replace

import aiohttp
import httpx
import pytest

from rolloutgate.config import GatewaySettings
from rolloutgate.fleet import Fleet
from rolloutreplay.agents import AgentFleet, TurnRecord, import_litellm
from rolloutreplay.scenario import ReplayConfig, agent_plan
from rolloutreplay.world import warm_up
from tests.fleet.on_ray import fleet_on_ray, pools_hold, simulated_engines, wait_for
from tests.ports import port_of, reserved_port

pytestmark = pytest.mark.fleet

REPLICAS = 3
ENGINES = 6
TIME_SCALE = 100.0
VICTIM = "replica-0"  # the replica whose own URL would be the one URL without the shared port
REOWN_LIMIT_S = 10.0
CONFIG = ReplayConfig(
    time_scale=TIME_SCALE,
    sessions=True,
    history_tokens=(2_000, 4_000),
    opening_tokens=(800, 1_500),
    medium_tokens=(1_500, 3_000),
    long_tokens=(4_000, 6_000),
    long_share=0.3,
    turns_per_session=4,
    tool_tokens=200,
    reply_kept_tokens=200,
    tool_time_s=(1.0, 5.0),
    start_spread_s=20.0,
)


@pytest.fixture(scope="module")
def engines() -> Iterator[list[str]]:
    with simulated_engines(ENGINES, TIME_SCALE) as urls:
        yield urls


@pytest.fixture(scope="module")
def fleet(engines: list[str]) -> Iterator[Fleet]:
    settings = GatewaySettings(time_scale=TIME_SCALE, stall_timeout=600.0, log_level="warning")
    with (
        reserved_port() as reservation,  # the replicas' shared port, held for the fleet's life
        fleet_on_ray(
            REPLICAS, engines, settings, "rolloutgate-death", shared_port=port_of(reservation)
        ) as started,
    ):
        yield started


def running_at(fleet: Fleet, replica_id: str) -> int:
    """Calls the replica has on its engines now (its /admin/state)."""
    try:
        state = httpx.get(f"{fleet.view().replicas[replica_id]}/admin/state", timeout=5).json()
    except (httpx.HTTPError, KeyError):
        return 0
    return sum(state["in_flight"].values())


def aborted_generations(engines: list[str]) -> tuple[int, float, int]:
    """(generations, engine-seconds, tokens) the engines aborted: each ran from its admission to its abort."""
    count, seconds, tokens = 0, 0.0, 0
    for url in engines:
        for request in httpx.get(f"{url}/sim/state", timeout=10).json()["requests"].values():
            finish = request["finish_reason"] or {}  # SGLang's meta_info.finish_reason
            if finish.get("type") == "abort" and request["started_at"] is not None:
                count += 1
                seconds += request["finished_at"] - request["started_at"]
                tokens += request["completion_tokens"]
    return count, seconds, tokens


def session_of(agents: AgentFleet) -> dict[str, str]:
    """Agent session name -> the gateway's session id (each attempt carries its turn's routing key)."""
    by_tag = {t.tag: t.session for t in agents.turns}
    return {by_tag[a.tag]: a.routing_key for a in agents.attempts if a.tag in by_tag}


async def test_a_replica_sigkilled_mid_rollout_costs_no_turn_and_no_record(
    fleet: Fleet, engines: list[str]
) -> None:
    litellm = import_litellm()
    await warm_up(litellm)
    origin = time.monotonic()

    def now() -> float:
        return (time.monotonic() - origin) * TIME_SCALE

    async with aiohttp.ClientSession() as http:
        with_sessions = AgentFleet(CONFIG, fleet.url, now, litellm, http)
        keyed = AgentFleet(replace(CONFIG, sessions=False), fleet.url, now, litellm, http)
        for i in range(6):
            with_sessions.start_agent(agent_plan(CONFIG, i), f"s{i}")
        for i in range(3):
            keyed.start_agent(agent_plan(keyed.config, 10 + i), f"k{i}")
        try:
            await asyncio.to_thread(
                wait_for, lambda: running_at(fleet, VICTIM) >= 2, "turns at the victim", 60
            )
            pid = (await asyncio.to_thread(fleet.describe))[VICTIM]["pid"]
            killed = fleet.view().incarnations[VICTIM]
            killed_at, killed_real = now(), time.monotonic()
            os.kill(pid, signal.SIGKILL)

            def re_owned() -> bool:
                view = fleet.view()
                return view.incarnations.get(VICTIM) != killed and pools_hold(fleet, ENGINES)

            reown_s = await asyncio.to_thread(wait_for, re_owned, "every engine owned again", REOWN_LIMIT_S)
            back = await asyncio.to_thread(
                wait_for, lambda: running_at(fleet, VICTIM) >= 1, "the restarted replica serving", 60
            )
            await asyncio.sleep(2.0)  # a few more turns everywhere
        finally:
            await with_sessions.stop()
            await keyed.stop()

    turns: list[TurnRecord] = with_sessions.turns + keyed.turns
    failed = [(t.tag, t.error, t.message) for t in turns if t.ok is False]
    across = [
        t for t in turns if t.started_at <= killed_at and (t.ended_at is None or t.ended_at > killed_at)
    ]
    answered = [t for t in turns if t.ok]
    count, seconds, tokens = aborted_generations(engines)
    print(
        f"\nfleet figure: {len(answered)} turns answered, {len(failed)} failed, {len(across)} running at the "
        f"kill; engines re-owned {reown_s:.2f} s after it, the replica serving again {back:.1f} s after that "
        f"({time.monotonic() - killed_real:.1f} s in all); wasted with the killed replica: {seconds:.1f} "
        f"engine-seconds, {tokens} tokens, in {count} aborted generations"
    )
    assert failed == []
    assert across and all(t.ok for t in across if t.ended_at is not None)
    assert reown_s < REOWN_LIMIT_S
    assert count >= 1  # the kill landed on running generations

    # every session's records, through the one URL: one per answered turn (a turn the agents' stop cut off
    # may have been recorded after it: one more at most)
    ids = session_of(with_sessions)
    async with httpx.AsyncClient(timeout=30) as client:
        for name, session_id in ids.items():
            described = await client.get(f"{fleet.url}/sessions/{session_id}")
            assert described.status_code == 200, (name, described.text)
            records = len(described.json()["records"])
            ok = sum(1 for t in with_sessions.turns if t.session == name and t.ok)
            cut = any(t.session == name and t.ok is None for t in with_sessions.turns)
            assert ok <= records <= ok + int(cut), (name, session_id, ok, records)
    assert len(ids) >= 6
