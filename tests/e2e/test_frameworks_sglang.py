"""slime's and NeMo RL's own calls, in their order, through rolloutgate in front of the real SGLang engines
(issue 36).

The clients are the wire imitations of tests/compat/frameworks (wire_clients.py; their sources are named in
test_slime_client.py and test_nemo_rl_client.py, docs/frameworks/slime.md and nemo-rl.md). Both frameworks
start their router with no engine and have each engine register itself (`POST /workers`), so each test starts
its own rolloutgate with no `--engine` (the harness's `start_gateway` with an empty engine list: it is ready
once `/health` answers, which it does with no engine) behind `--trust-network` and an admin token, as
docs/frameworks/ say, and the engines the suite runs register with it.

One deviation from the frameworks' bodies: `"ignore_eos": true` is added to their sampling parameters. The tiny
model is random and may sample its EOS anywhere; the frameworks take an early stop as a finished sample, but the
checks here count tokens exactly. What is checked is what the engines show over HTTP: the answers, rolloutgate's
answer headers and `/metrics`, each engine's own counters.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import httpx
import pytest
from tests.compat.frameworks.wire_clients import NemoRL, Sample, Slime, nemo_sampling_params
from tests.e2e.harness import EngineSet, Gateway, Metrics, scrape_all, settled, start_gateway, wait_for
from tests.e2e.sglang_facts import facts_for
from tests.server.users_path import final_timing, quarantines

pytestmark = [pytest.mark.e2e, pytest.mark.api("sglang")]

ADMIN_TOKEN = "trainer-only-e2e-36"  # neither framework sends one; the admin API stays behind it
CLUSTER_NETWORK = "127.0.0.1"  # `--trust-network`: the engines' and the rollout's host, loopback here
NO_EOS = {"ignore_eos": True}  # the one deviation (module docstring)
BATCH_TOKENS = 48
SLIME_BUDGET = 2_500  # ~9 s alone on real 0.5.9 here: every call still runs when the step ends
NEMO_LONG = 3_000  # ~11 s alone on real 0.5.9 here
PAUSE_S = 20.0  # the refit's pause: most of the long call's wall time
NO_ANSWER = 0  # a read whose connection the engine closed without an answer
# `GET /flush_cache` right after a retract pause, the retracted call pending: real 0.5.9 flushes (its
# `Scheduler._is_no_request` does not look at the waiting queue, where retraction put the call); the simulator's
# 0.5.23 refuses (400: not flushed, requests pending), which is what NeMo RL's `_refit` stops at.
FLUSH_AFTER_RETRACT = {"0.5.9": 200, "0.5.23": 400}
PROGRESS_BEFORE_ABORT = 20  # decode steps each running call has made before the step ends


def own_gateway(engines: EngineSet, log_dir: Path) -> Gateway:
    """A rolloutgate with no engine, as slime's and NeMo RL's routers start; the test stops it."""
    flags = {"trust_network": CLUSTER_NETWORK, "admin_token": ADMIN_TOKEN}
    return start_gateway(dataclasses.replace(engines, urls=()), log_dir, flags)


class SlimeHere(Slime):
    """slime, with its step-end load read as this engine answers it. slime reads `GET /v1/loads?include=core`
    on each engine (`server_control.abort_server_until_idle`); SGLang 0.5.9 in this venv fails it (its handler
    raises with the starlette its pins resolve to: sglang_facts, test_sglang_contract.py): a 500, or the
    connection closed with no answer, which is what the step-end reads here met. slime's `get` raises on
    either, so its step-end abort fails after the engines' `abort_all` went out. The read is sent as slime
    sends it, its outcome kept, and where it failed the engine's load is read from `/get_load` (`num_reqs`,
    `num_waiting_reqs`), which 0.5.9 serves."""

    def __init__(self, router_url: str, engines: int, *, consistent_hashing: bool) -> None:
        super().__init__(router_url, engines, consistent_hashing=consistent_hashing)
        self.loads_statuses: list[int] = []  # slime's `/v1/loads?include=core` reads, as the engines answered

    async def abort_server_until_idle(self, url: str) -> int:
        for attempt in range(1, 21):
            await self.post(f"{url}/abort_request", {"abort_all": True})
            held = await self.engine_load(url)
            if held <= 0:
                return attempt
            await asyncio.sleep(self.abort_retry_interval_s)
        raise AssertionError(f"{url} never idle")

    async def engine_load(self, url: str) -> int:
        """slime's load read, its outcome kept (0: the connection closed with no answer); `/get_load` where it
        failed."""
        async with httpx.AsyncClient(timeout=30.0, trust_env=False) as fresh:  # 0.5.9 closes the connection
            try:
                loads = await fresh.get(f"{url}/v1/loads?include=core")
            except httpx.TransportError:
                self.loads_statuses.append(NO_ANSWER)
            else:
                self.loads_statuses.append(loads.status_code)
                if loads.status_code == 200:
                    return sum(s["num_running_reqs"] + s["num_waiting_reqs"] for s in loads.json()["loads"])
        async with httpx.AsyncClient(timeout=30.0, trust_env=False) as fresh:
            load = (await fresh.get(f"{url}/get_load")).json()
        return sum(s["num_reqs"] + s["num_waiting_reqs"] for s in load)


def decoded_since(before: dict[str, Metrics], now: dict[str, Metrics]) -> bool:
    """Every running call has made `PROGRESS_BEFORE_ABORT` decode steps at least (each step of an engine adds
    one token per running call to its live decode counter)."""
    return (
        all(now[u].progress - before[u].progress >= PROGRESS_BEFORE_ABORT * now[u].running for u in now)
        and sum(m.running for m in now.values()) == 4
    )


@pytest.mark.timeout(600)
async def test_slime_registers_generates_aborts_at_step_end_and_resumes_its_partial_samples(
    engines: EngineSet, log_dir: Path
) -> None:
    """slime's step on the real engines: each engine registers itself (`POST /workers`, 201) from the trusted
    network with no token; a batch of 2 groups x 2 samples (`/generate` with logprobs, each sample's session as
    `X-SMG-Routing-Key`) runs to its budget, and the engines' own counters made exactly those tokens. Four
    over-sampled calls still run when the step ends: slime lists the workers, aborts each engine until idle
    (`abort_all` on the engine itself), and every pending call is answered 200, finish reason abort, with the
    tokens and logprobs made so far, which slime keeps; the engines then run nothing. The next step resumes each
    partial sample (its prompt plus those tokens, the rest of the budget) and ends at exactly the budget. The
    engines then remove themselves (`DELETE /workers/{id}`, 200)."""
    facts = facts_for(engines.version)
    gateway = own_gateway(engines, log_dir)
    slime = SlimeHere(gateway.url, engines=len(engines.urls), consistent_hashing=True)
    slime.extra_sampling_params = NO_EOS
    try:
        assert [await slime.register(url) for url in engines.urls] == [201] * len(engines.urls)
        workers = await slime.get(f"{gateway.url}/workers")
        assert [w["url"] for w in workers["workers"]] == list(engines.urls)

        before = await scrape_all(engines.urls)
        groups = [[Sample([1, 100 + g, *range(2, 60)]) for _ in range(2)] for g in range(2)]
        done = await asyncio.gather(*(slime.generate(s, BATCH_TOKENS) for group in groups for s in group))
        for sample in done:
            assert sample.status == "truncated" and sample.response_length == BATCH_TOKENS
            assert len(sample.log_probs) == BATCH_TOKENS and sample.tokens[:60] == sample.prompt_ids
            assert isinstance(sample.response, str) and len(sample.weight_versions) == 1
        after = await scrape_all(engines.urls)
        assert sum(after[u].generated - before[u].generated for u in engines.urls) == 4 * BATCH_TOKENS

        partial = [Sample([1, 200 + i, *range(2, 40)]) for i in range(4)]
        started = await scrape_all(engines.urls)
        slime.submit(partial, SLIME_BUDGET)
        await wait_for(
            "the four calls decoding",
            lambda: scrape_all(engines.urls),
            lambda now: decoded_since(started, now),
            60.0,
        )
        aborted = await asyncio.wait_for(slime.abort(), 120.0)
        assert len(aborted) == 4
        for sample in aborted:
            assert sample.status == "aborted"
            assert 0 < sample.response_length < SLIME_BUDGET  # the prefix made before the abort, kept
            assert len(sample.tokens) == len(sample.prompt_ids) + sample.response_length
            assert len(sample.log_probs) == sample.response_length
        # the engines' gauges follow their scheduler's stats, which can lag the abort by a few seconds (seen on
        # 0.5.9: running 2 on each engine just after `/get_load` said none), so they are waited for, bounded
        await wait_for(
            "every engine idle",
            lambda: scrape_all(engines.urls),
            lambda ms: all(m.running == 0 and m.waiting == 0 for m in ms.values()),
            15.0,
        )
        # slime's own load read: 0.5.9 here answers 500 or closes the connection with no answer (slime's `get`
        # raises either way); 0.5.23 answers 200
        expected = {200} if facts.loads_status == 200 else {facts.loads_status, NO_ANSWER}
        print(f"slime's /v1/loads?include=core reads (0: no answer): {slime.loads_statuses}")
        assert slime.loads_statuses and set(slime.loads_statuses) <= expected, slime.loads_statuses

        resumed = await asyncio.gather(*(slime.generate(s, SLIME_BUDGET) for s in aborted))
        for sample in resumed:
            assert sample.status == "truncated" and sample.response_length == SLIME_BUDGET
            assert len(sample.log_probs) == SLIME_BUDGET
            assert len(sample.tokens) == len(sample.prompt_ids) + SLIME_BUDGET
        assert slime.retries == 0

        assert [await slime.unregister(url) for url in engines.urls] == [200] * len(engines.urls)
        assert (await slime.get(f"{gateway.url}/workers"))["workers"] == []
    finally:
        await slime.close()
        gateway.process.stop()


@pytest.mark.timeout(600)
async def test_nemo_rl_registers_healthy_workers_generates_and_a_retract_refit_is_not_charged(
    engines: EngineSet, log_dir: Path
) -> None:
    """NeMo RL's SGLang backend on the real engines. Each worker checks its own engine (`/health_generate`, then
    `GET /flush_cache`, both 200), registers it (201) and waits until the router lists it, healthy. A batch of
    eight samples right after is served four by each engine (their capacity, read from the engines), each with
    as many logprobs as tokens and truncated at its budget; each engine's own counter made its four.

    Then #3612's refit during a long generation: the trainer pauses every engine in `retract` mode, never telling
    the router. For the pause's 20 s no engine makes a token, the long call and a sample sent during the pause
    are held; `GET /flush_cache` on the engine holding the retracted call answers 200 on real 0.5.9 (it flushes:
    `FLUSH_AFTER_RETRACT`), 400 on the simulator's 0.5.23 (not flushed, a request pending: `_refit` raises);
    either way the engines are continued (`_refit`'s `finally`; the transfer is left out: the tiny model has no
    weight-transfer engine). Then the long call completes
    with all its tokens, charged within 1 s of its wall time less the pause (both as the test saw them), the
    late sample completes, and no engine was quarantined."""
    gateway = own_gateway(engines, log_dir)
    nemo = NemoRL(gateway.url)
    nemo.extra_sampling_params = NO_EOS
    urls = list(engines.urls)
    try:
        assert [await nemo.launch_and_register(url) for url in urls] == [201] * len(urls)
        workers = (await nemo.client.get(f"{gateway.url}/workers")).json()["workers"]
        assert [(w["url"], w["state"]) for w in workers] == [(url, "healthy") for url in urls]

        before = await scrape_all(urls)
        per_engine = engines.max_num_seqs
        batch = [[1, 100 + i, *range(2, 50)] for i in range(per_engine * len(urls))]
        results = await nemo.generate(batch, 32)
        for tokens, logprobs, truncated in results:
            assert len(tokens) == len(logprobs) == 32 and truncated
        assert sorted(nemo.served_by) == sorted(urls * per_engine)
        after = await scrape_all(urls)
        assert {u: after[u].generated - before[u].generated for u in urls} == {
            u: 32 * per_engine for u in urls
        }

        body = {
            "sampling_params": {**nemo_sampling_params(NEMO_LONG), **NO_EOS},
            "return_logprob": True,
            "input_ids": list(range(1, 200)),
        }
        quiet = await scrape_all(urls)
        sent_at = time.monotonic()
        long_call = asyncio.create_task(nemo.client.post(f"{gateway.url}/generate", json=body))
        found = await wait_for(
            "the long call decoding",
            lambda: scrape_all(urls),
            lambda ms: any(m.running > 0 and m.progress > quiet[u].progress for u, m in ms.items()),
            60.0,
        )
        busy = next(u for u, m in found.items() if m.running > 0)
        late: asyncio.Task[tuple[list[int], list[float], bool]] | None = None
        await nemo.pause(urls, "retract")
        paused_at = time.monotonic()
        try:
            frozen = await settled(urls)  # the decode step in flight lands after the pause answered
            late = asyncio.create_task(nemo.generate_one_sample([1, 7, 8, 9], 16))
            await asyncio.sleep(PAUSE_S - (time.monotonic() - paused_at))
            still = await scrape_all(urls)
            assert all(still[u].progress == frozen[u].progress for u in urls), (
                "an engine generated while paused"
            )
            assert not long_call.done() and not late.done(), "a call ended during the pause"
            flushed = await nemo.flush(urls)
            print(f"nemo-rl GET /flush_cache after the retract pause (the call's engine {busy}): {flushed}")
            assert flushed[urls.index(busy)] == FLUSH_AFTER_RETRACT[engines.version], flushed
        finally:
            await nemo.resume(urls)  # `_refit`'s finally
        paused_s = time.monotonic() - paused_at

        response = await asyncio.wait_for(long_call, 300.0)
        call_wall_s = time.monotonic() - sent_at
        assert response.status_code == 200, response.text
        meta = response.json()["meta_info"]
        assert meta["finish_reason"]["type"] == "length" and len(meta["output_token_logprobs"]) == NEMO_LONG
        timing = final_timing(response)
        engine_work_s = call_wall_s - paused_s  # (the simulator's `e2e_latency` runs on its own clock)
        print(f"nemo-rl retract refit {paused_s:.1f} s: engine work {engine_work_s:.2f} s, gateway {timing}")
        assert abs(timing["charged"] - engine_work_s) <= 1.0, (engine_work_s, paused_s, timing)
        assert late is not None
        tokens, logprobs, truncated = await asyncio.wait_for(late, 120.0)
        assert len(tokens) == len(logprobs) == 16 and truncated
        async with httpx.AsyncClient(
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30.0
        ) as admin:
            assert await quarantines(admin, gateway.url) == 0
        assert nemo.retries == 0

        assert [await nemo.shutdown(url) for url in urls] == [200] * len(urls)
        assert (await nemo.client.get(f"{gateway.url}/workers")).json()["workers"] == []
    finally:
        await nemo.close()
        gateway.process.stop()
