"""Capacity read from the engine and respected: the gateway queues what the engines cannot start at once, so
the engines' own queues stay empty."""

from __future__ import annotations

import asyncio

import pytest
from tests.e2e.calls import openai_call, openai_client
from tests.e2e.conftest import MakeGateway
from tests.e2e.harness import EngineSet, MetricsMonitor, scrape_all

pytestmark = pytest.mark.e2e

TOKENS = 400  # a few seconds per wave of requests on the tiny CPU model


async def test_engine_waiting_stays_zero_while_the_gateway_queues(
    engines: EngineSet, gateways: MakeGateway
) -> None:
    gateway = gateways()  # no --capacity: the gateway reads max_num_seqs from each engine
    slots = len(engines.urls) * engines.max_num_seqs
    total = 3 * slots
    before = await scrape_all(engines.urls)
    client = openai_client(gateway)
    async with MetricsMonitor(engines.urls) as monitor:
        answers = await asyncio.gather(
            *(
                openai_call(client, engines, route="completions", stream=i % 2 == 0, max_tokens=TOKENS)
                for i in range(total)
            )
        )
    await client.close()
    assert all(a.tokens == TOKENS and a.finish_reason == "length" for a in answers)

    # The engines never queued: no request waited in an engine queue for a second (exact, from the
    # queue-time histogram), and no scrape that got through saw a waiting request or too many running.
    after = await scrape_all(engines.urls)
    for url in engines.urls:
        assert after[url].queued_over(1.0) == before[url].queued_over(1.0), f"{url} queued requests itself"
        assert monitor.max("waiting", url) == 0
        assert monitor.max("running", url) <= engines.max_num_seqs
    # The gateway did: at most `slots` requests can have started without waiting for one to end.
    waited = [a for a in answers if a.timing()["queue"] > 0]
    assert len(waited) >= total - slots
    assert sorted(a.timing()["queue"] for a in answers)[-1] > 1.0
    generated = sum(after[u].generated - before[u].generated for u in engines.urls)
    assert generated == total * TOKENS
