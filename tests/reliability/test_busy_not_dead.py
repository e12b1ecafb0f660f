"""Busy is not dead (issue 32, docs/reliability.md): the failure shapes peers' gateways took for a dead engine,
each staged on the simulator in front of a gateway at its production liveness settings (60 s stall timeout,
5 s health interval, 15 s health timeout, 3 failures, 2 s hang check, 300 s warm-up), with the wedged engine
the one real failure.

Every row runs on a fake-time loop (tests/reliability/busy.py): its minutes cost only CPU, and its figures are
gateway seconds, never sleeps. Each row asserts the goals (0 false verdicts, 0 spurious 503s, 0 lost, the
wedge caught within `stall_timeout` + `hang_check_timeout`) and files its figures; `make test-reliability
RELIABILITY_ARGS='-k busy_not_dead'` prints the table docs/reliability.md quotes. Every load is bounded in
calls and in simulated time.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from rolloutsim import SimCluster
from rolloutsim.faults import Fault
from tests.reliability.busy import BusyRow, CallTally, CoreWatch, Verdict, post
from tests.reliability.conftest import add_busy_row
from tests.server.conftest import MakeCluster, MakeGateway
from tests.server.users_path import STORM_PROMPT_TOKENS, final_timing, generate_body
from tests.sim.helpers import wait_until

pytestmark = [pytest.mark.reliability, pytest.mark.looptime]

SCALE = 20.0
STALL_TIMEOUT_S = 60.0  # the production default, which each busy shape below outlasts or approaches
POLL_S = 3.0  # the engine-level poll at the 60 s stall timeout (a twentieth, at most 3): calls answered whole
COMPILE_S = 120.0  # rllm#926 measured 108 s on its first chat request
LONG_DECODE_TOKENS = 70_000

# the engines each row runs on: SGLang with /ready, SGLang 0.5.9 (no /ready: a pause is seen in what it
# shows), vLLM (its /health generates nothing)
ENGINES: dict[str, dict[str, Any]] = {
    "sglang": {"api": "sglang"},
    "sglang-0.5.9": {"api": "sglang", "sglang_ready_route": False},
    "vllm": {"api": "vllm"},
}
ENGINE_NAMES = {"sglang": "SGLang", "sglang-0.5.9": "SGLang 0.5.9 (no /ready)", "vllm": "vLLM"}


def call(api: str, prompt_tokens: int, new_tokens: int, first_id: int) -> tuple[str, dict[str, Any]]:
    """A non-streaming call as RL frameworks send it (the gateway watches it engine-level): miles' token-in
    token-out `/generate` with logprobs on SGLang, a completions call of token ids on vLLM."""
    if api == "vllm":
        prompt = list(range(first_id, first_id + prompt_tokens))
        body = {"model": "sim-model", "prompt": prompt, "max_tokens": new_tokens, "ignore_eos": True}
        return "/v1/completions", body
    return "/generate", generate_body(prompt_tokens, new_tokens, first_id=first_id)


def streamed(prompt_words: int, new_tokens: int, first_id: int) -> dict[str, Any]:
    """A streamed completions call (its events are its progress, token by token) with a text prompt: a stream
    the client has partly read continues on another engine as prompt + partial text (server/continuation.py;
    a prompt of token ids cannot be continued so)."""
    return {
        "model": "sim-model",
        "prompt": " ".join(f"w{first_id + i}" for i in range(prompt_words)),
        "max_tokens": new_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


class Load:
    """Workers that each send calls one after another: at most `calls_each`, and none begun after `until_s`
    simulated seconds from the start (both bounds hold however the gateway behaves)."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        gateway_url: str,
        cluster: SimCluster,
        *,
        api: str,
        workers: int,
        calls_each: int,
        until_s: float,
        prompt_tokens: int = 300,
        new_tokens: int = 200,
        stream: bool = False,
    ) -> None:
        self.tally = CallTally()
        end_at = cluster.engines[0].now() + until_s

        async def worker(index: int) -> None:
            for turn in range(calls_each):
                if cluster.engines[0].now() >= end_at:
                    return
                first_id = 1 + 1_000 * index + 7 * turn
                if stream:
                    path, body = "/v1/completions", streamed(prompt_tokens, new_tokens, first_id)
                    self.tally.add_stream(await post(http, gateway_url + path, body), new_tokens)
                else:
                    path, body = call(api, prompt_tokens, new_tokens, first_id)
                    self.tally.add(await post(http, gateway_url + path, body), new_tokens)

        self._workers = [asyncio.create_task(worker(i)) for i in range(workers)]

    async def done(self) -> CallTally:
        await asyncio.gather(*self._workers)
        return self.tally


async def sim_sleep(cluster: SimCluster, seconds: float) -> None:
    """Let `seconds` of simulated time pass (free on the fake-time loop)."""
    await asyncio.sleep(seconds / cluster.time_scale)


async def start(
    make_cluster: MakeCluster, make_gateway: MakeGateway, engine: str, **cluster_args: Any
) -> tuple[SimCluster, str, CoreWatch]:
    cluster_args.setdefault("engines", 2)
    cluster = await make_cluster(time_scale=SCALE, **ENGINES[engine], **cluster_args)
    gateway = await make_gateway(
        cluster, stall_timeout=STALL_TIMEOUT_S
    )  # the other liveness settings: defaults
    return cluster, gateway.url, CoreWatch(gateway)


def file_row(
    name: str,
    tally: CallTally,
    watch: CoreWatch,
    *,
    expected: Any = lambda _verdict: False,
    detected_s: float | None = None,
    bound_s: float | None = None,
    note: str = "",
) -> list[Verdict]:
    """File the row's figures; returns its false verdicts (those `expected` does not name)."""
    false_verdicts = watch.out_of_service(expected)
    add_busy_row(
        BusyRow(
            row=name,
            calls=tally.calls,
            false_quarantines=sum(v.state == "quarantined" for v in false_verdicts),
            false_unhealthy=sum(v.state == "unhealthy" for v in false_verdicts),
            spurious_503=tally.spurious_503,
            lost=tally.lost,
            detected_s=detected_s,
            bound_s=bound_s,
            note=note,
        )
    )
    return false_verdicts


def assert_goals(tally: CallTally, false_verdicts: list[Verdict]) -> None:
    assert false_verdicts == [], false_verdicts
    assert (tally.spurious_503, tally.lost) == (0, 0), tally.failures


# --- 1. a first request that compiles ------------------------------------------------------------------------


@pytest.mark.parametrize("engine", list(ENGINES))
async def test_busy_not_dead_first_request_compile(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient, engine: str
) -> None:
    """Every engine compiles on its first client request for 120 s (the start of a run: all engines cold); four
    sessions' first turns arrive at once and more keep arriving during the compile (rllm#926: a 5 s probe
    marked its one worker dead and four sessions got a 500). SGLang's `/health` and its scheduler hang
    meanwhile, as they would if it were hung; vLLM's `/health` says 200."""
    api = ENGINES[engine]["api"]
    cluster, url, watch = await start(
        make_cluster, make_gateway, engine, faults=[Fault(kind="compile", duration_s=COMPILE_S)]
    )
    calls = [
        asyncio.create_task(post(http, url + p, b))
        for p, b in (call(api, 300, 64, 100 * i + 1) for i in range(4))
    ]
    for wave in range(3):  # during the compile: at 30, 60 and 90 s
        await sim_sleep(cluster, 30.0)
        calls += [
            asyncio.create_task(post(http, url + p, b))
            for p, b in (call(api, 300, 64, 1_000 * (wave + 1) + 100 * i + 1) for i in range(2))
        ]
    outcomes = await asyncio.gather(*calls)
    tally = CallTally()
    for outcome in outcomes:
        tally.add(outcome, 64)
    false_verdicts = file_row(
        f"first request compiles {COMPILE_S:.0f} s, {ENGINE_NAMES[engine]}", tally, watch
    )
    assert_goals(tally, false_verdicts)
    assert tally.answered == 10
    assert all(not e.faults for e in cluster.engines)  # both compiled
    first = outcomes[0]
    assert isinstance(first, httpx.Response) and final_timing(first)["wall"] >= COMPILE_S  # it did wait


# --- 2. an engine restarted under load -----------------------------------------------------------------------

DOWN_S = 20.0  # its port is closed (the process is gone)
LOADING_S = 60.0  # then it answers 503 to health and generation (loading), then serves, cold


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
async def test_busy_not_dead_engine_restarted_under_load(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient, engine: str
) -> None:
    """One of two engines dies under load and comes back: port closed for 20 s, 503 for 60 s (loading), then
    ready, and its first request compiles again for 120 s. Its calls in flight move to the other engine; the
    clients see none of it; it is back in service within a health interval of being ready (SMG kept
    answering 503 for 90-110 s after engines were ready)."""
    cluster, url, watch = await start(make_cluster, make_gateway, engine)
    load = Load(http, url, cluster, api=ENGINES[engine]["api"], workers=8, calls_each=60, until_s=300.0)
    await sim_sleep(cluster, 10.0)
    died_at = watch.now()
    cluster.engines[0].set_fault(Fault(kind="compile", duration_s=COMPILE_S))  # for its first request back
    cluster.engines[0].set_fault(Fault(kind="restart", down_s=DOWN_S, duration_s=LOADING_S))
    tally = await load.done()
    ready_at = died_at + DOWN_S + LOADING_S
    back = watch.first("engine-0", "healthy", died_at)
    back_note = "never back" if back is None else f"back in service {back.at - ready_at:.1f} s after ready"

    def expected(verdict: Verdict) -> bool:  # it was down from its death until it was ready
        return (
            verdict.engine_id == "engine-0"
            and verdict.state == "unhealthy"
            and died_at <= verdict.at < ready_at
        )

    false_verdicts = file_row(
        f"engine restarted under load, {ENGINE_NAMES[engine]}",
        tally,
        watch,
        expected=expected,
        note=back_note,
    )
    assert_goals(tally, false_verdicts)
    assert back is not None and 0 <= back.at - ready_at <= 5.0 + 1.0  # a health interval (and the check)
    assert any(engine_id == "engine-0" and at > back.at for at, engine_id, _r, _a in watch.dispatches)


# --- 3. a 70K-token decode -----------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_busy_not_dead_70k_token_decode(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient, stream: bool
) -> None:
    """A 70,000-token generation (~1,050 s at ~67 tok/s on the incident's engine), with its timeout raised to
    fit, as a user running such generations must (under the default 600 s it ends on its budget with a 504,
    tests/server/test_incident.py), while short calls come and go on the same engines. Long is not stuck:
    the engine progresses all along, nothing counts errors against it."""
    cluster, url, watch = await start(make_cluster, make_gateway, "sglang", profile="incident")
    headers = {"X-Rolloutgate-Timeout": "1800"}
    if stream:
        body = streamed(2_000, LONG_DECODE_TOKENS, first_id=1)
        long_call = asyncio.create_task(post(http, url + "/v1/completions", body, headers))
    else:
        long_call = asyncio.create_task(
            post(http, url + "/generate", generate_body(2_000, LONG_DECODE_TOKENS), headers)
        )
    load = Load(http, url, cluster, api="sglang", workers=4, calls_each=200, until_s=900.0, new_tokens=500)
    response = await long_call
    tally = await load.done()
    if stream:
        tally.add_stream(response, LONG_DECODE_TOKENS)
    else:
        tally.add(response, LONG_DECODE_TOKENS)
    false_verdicts = file_row(
        f"{LONG_DECODE_TOKENS // 1000}K-token decode, {'streamed' if stream else 'whole'}", tally, watch
    )
    assert_goals(tally, false_verdicts)


# --- 4. a 100K-token prefill storm ---------------------------------------------------------------------------


async def test_busy_not_dead_100k_token_prefill_storm(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    """Eight sessions' 100K-token histories arrive at once on two engines that are decoding eight calls (the
    incident: each prefill takes ~35 s, and prefill-first scheduling gives the decodes a trickle meanwhile)."""
    cluster, url, watch = await start(make_cluster, make_gateway, "sglang", profile="incident")
    decodes = [
        asyncio.create_task(
            post(http, url + "/generate", generate_body(2_000, 3_000, first_id=1 + 3_000 * i))
        )
        for i in range(8)
    ]
    await sim_sleep(cluster, 20.0)
    storm = [
        asyncio.create_task(
            post(
                http, url + "/generate", {**generate_body(0, 8), "input_ids": [11 + i] * STORM_PROMPT_TOKENS}
            )
        )
        for i in range(8)
    ]
    tally = CallTally()
    for outcome in await asyncio.gather(*decodes):
        tally.add(outcome, 3_000)
    for outcome in await asyncio.gather(*storm):
        tally.add(outcome, 8)
    false_verdicts = file_row(
        "100K-token prefill storm (8 histories on 2 engines decoding 8 calls)", tally, watch
    )
    assert_goals(tally, false_verdicts)


# --- 5. a trainer's pause of each mode -----------------------------------------------------------------------

PAUSE_S = {"abort": 30.0, "retract": 120.0, "in_place": 30.0}


@pytest.mark.parametrize("engine", ["sglang", "sglang-0.5.9"])
@pytest.mark.parametrize("mode", list(PAUSE_S))
async def test_busy_not_dead_trainers_pause(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient, engine: str, mode: str
) -> None:
    """A trainer pauses both engines directly (miles' weight update), tells the gateway nothing, and continues
    them later: 30 s in place, 120 s retracted, or aborted (the engines answer what runs, `abort`) for 30 s;
    more calls arrive meanwhile. The pause outlasts or approaches the stall timeout; SGLang 0.5.9 shows it
    only as its `/health` hanging while its scheduler answers."""
    cluster, url, watch = await start(make_cluster, make_gateway, engine)
    running = [
        asyncio.create_task(
            post(http, url + "/generate", generate_body(2_000, 3_000, first_id=1 + 3_000 * i))
        )
        for i in range(4)
    ]
    await wait_until(lambda: all(e.running_count == 2 for e in cluster.engines), "both engines decoding")
    await sim_sleep(cluster, 10.0)
    for engine_url in cluster.urls:
        assert (await http.post(f"{engine_url}/pause_generation", json={"mode": mode})).status_code == 200
    await sim_sleep(cluster, 5.0)
    late = [
        asyncio.create_task(
            post(http, url + "/generate", generate_body(500, 200, first_id=50_000 + 1_000 * i))
        )
        for i in range(2)
    ]
    await sim_sleep(cluster, PAUSE_S[mode] - 5.0)
    for engine_url in cluster.urls:
        assert (await http.post(f"{engine_url}/continue_generation", json={})).status_code == 200
    tally = CallTally()
    for outcome in await asyncio.gather(*running):
        tally.add(outcome, 3_000, abort_ok=mode == "abort")
    for outcome in await asyncio.gather(*late):
        tally.add(outcome, 200)
    false_verdicts = file_row(
        f"trainer's {mode} pause of {PAUSE_S[mode]:.0f} s, {ENGINE_NAMES[engine]}",
        tally,
        watch,
        note=f"{tally.answered_abort} answered abort, as asked" if mode == "abort" else "",
    )
    assert_goals(tally, false_verdicts)
    assert tally.answered_abort == (4 if mode == "abort" else 0)


# --- 6. a wedged engine whose /health says 200 ---------------------------------------------------------------

WEDGE_S = 180.0  # then it comes back by itself


@pytest.mark.parametrize(
    ("engine", "stream"), [("sglang", False), ("sglang-0.5.9", False), ("vllm", False), ("sglang", True)]
)
async def test_busy_not_dead_wedged_engine_is_caught(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient, engine: str, stream: bool
) -> None:
    """The one real failure: an engine wedges with work on it, generates nothing, its gauges freeze, and its
    `/health` keeps saying 200 (vLLM#46811); three minutes later it comes back. It must be caught within
    `stall_timeout` of its last progress as the gateway can see it: a streamed call's last token, or, for calls
    answered whole, the engine's token counter, read every `engine_poll_interval` (3 s); so within
    `stall_timeout` + one poll of the wedge. Its calls move and are answered; it stays out of service while it
    cannot generate (its `/health` 200 is not enough), and takes work again once it can; calls keep coming
    throughout."""
    cluster, url, watch = await start(make_cluster, make_gateway, engine)
    load = Load(
        http,
        url,
        cluster,
        api=ENGINES[engine]["api"],
        workers=8,
        calls_each=100,
        until_s=300.0,
        new_tokens=1_000,
        stream=stream,
    )
    await wait_until(lambda: all(e.generated_tokens_total > 0 for e in cluster.engines), "both engines warm")
    await sim_sleep(cluster, 30.0)
    wedged_at = watch.now()
    cluster.engines[0].set_fault(Fault(kind="wedge", duration_s=WEDGE_S))
    tally = await load.done()
    cleared_at = wedged_at + WEDGE_S
    caught = watch.first("engine-0", "quarantined", wedged_at)
    assert caught is not None, watch.verdicts
    detected_s = caught.at - wedged_at
    bound_s = STALL_TIMEOUT_S + (0.0 if stream else POLL_S)
    # put back in service while it still generated nothing (its /health said 200): every call placed there
    # then waits a stall window again
    readmitted = [
        v for v in watch.verdicts if v.engine_id == "engine-0" and v.state == "healthy" and v.at < cleared_at
    ]
    back = watch.first("engine-0", "healthy", cleared_at)
    if back is not None:
        back_note = f"back in service {back.at - cleared_at:.1f} s after it could generate"
    else:
        back_note = "in service already when it could generate" if readmitted else "never back"

    def expected(verdict: Verdict) -> bool:  # quarantined while wedged
        return verdict.engine_id == "engine-0" and wedged_at <= verdict.at < cleared_at

    false_verdicts = file_row(
        f"wedged engine (/health 200) for {WEDGE_S:.0f} s, {ENGINE_NAMES[engine]}, calls "
        f"{'streamed' if stream else 'answered whole'}",
        tally,
        watch,
        expected=expected,
        detected_s=detected_s,
        bound_s=bound_s,
        note=f"put back in service {len(readmitted)} times while wedged; {back_note}",
    )
    assert_goals(tally, false_verdicts)
    assert detected_s <= bound_s + 0.01, (detected_s, caught)
    assert readmitted == [] and back is not None, watch.verdicts
    assert any(engine_id == "engine-0" and at > back.at for at, engine_id, _r, _a in watch.dispatches)
