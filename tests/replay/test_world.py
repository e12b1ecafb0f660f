"""The replay's reading of the gateway's RL counters (rolloutreplay/world.py `_gateway_counters`): from its
/metrics as a scraper reads them, labels matched, 0 for a counter the gateway does not export."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from rolloutreplay.world import COUNTERS, _gateway_counters

METRICS = """\
# HELP rolloutgate_budget_tokens_saved_total Output tokens a token budget did not allow
# TYPE rolloutgate_budget_tokens_saved_total counter
rolloutgate_budget_tokens_saved_total 1234.0
# HELP rolloutgate_stale_requests_total Requests past max_staleness
# TYPE rolloutgate_stale_requests_total counter
rolloutgate_stale_requests_total{action="requeued"} 5.0
rolloutgate_stale_requests_total{action="partial"} 2.0
"""


@pytest.fixture
async def gateway_url() -> AsyncIterator[str]:
    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(text=METRICS, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield f"http://127.0.0.1:{server.port}"
    await server.close()


async def test_the_counters_are_read_from_metrics_and_an_absent_one_is_0(gateway_url: str) -> None:
    async with aiohttp.ClientSession() as http:
        counters = await _gateway_counters(http, gateway_url)
    assert set(counters) == set(COUNTERS)
    assert counters == {
        "budget_tokens_saved": 1234.0,
        "group_prefill_tokens_saved": 0.0,  # not exported by this gateway
        "stale_requeued": 5.0,
        "stale_partial": 2.0,
    }
