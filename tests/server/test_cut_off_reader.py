"""A streaming client that falls `client_buffer_bytes` behind is cut off by its exchange (server/exchange.py),
from inside the delivery of an upstream event. Its generation must then be wound up like any abandoned one,
on either engine family: aborted on the engine after the retry grace, its slot freed once the engine is done.
vLLM learns of the abort from the closed call, so its connection is closed, never pooled; SGLang ends a call
aborted by its id with its abort answer, which the gateway reads to the end (server/driver.py `_wind_down`), so
that connection goes back to the pool whole.

The app's watchdog (`client_write_timeout`) is set far out of reach, so only the exchange's cut-off can end the
generation here; every wait is on an observable state, not on time.
"""

from __future__ import annotations

import contextlib

import httpx
import pytest

from tests.server.conftest import MakeCluster, MakeGateway
from tests.server.slow_reader import open_slow_reader
from tests.sim.helpers import wait_until

# far more than the sockets hold (~11K tokens on loopback): the reader really falls behind
MAX_TOKENS = 30_000


@pytest.mark.parametrize("api", ["sglang", "vllm"])
@pytest.mark.looptime
async def test_a_reader_cut_off_for_falling_behind_has_its_generation_wound_up(
    make_cluster: MakeCluster, make_gateway: MakeGateway, api: str
) -> None:
    cluster = await make_cluster(engines=1, time_scale=200.0, api=api)
    gateway = await make_gateway(
        cluster,
        client_buffer_bytes=64 * 1024,  # the smallest allowed
        client_write_timeout=3600.0,  # the watchdog stays out of it
        retry_grace=1.0,
        keepalive_interval=0,
    )
    engine = cluster.engines[0]
    ctx = gateway.context
    (handle,) = ctx.pool.engines.values()
    upstream = handle.client._upstream  # the engine's pool of generation connections

    def aborts_sent() -> float:
        labels = {"reason": "client_gone"}
        return ctx.metrics.registry.get_sample_value("rolloutgate_aborts_sent_total", labels) or 0.0

    sock = open_slow_reader(gateway.url, MAX_TOKENS)
    try:
        await wait_until(lambda: engine.running_count == 1, "generation started", timeout_s=30)
        # The reader falls behind, is cut off, and after the grace its generation is aborted on the engine.
        await wait_until(lambda: aborts_sent() == 1, "abort of the abandoned generation", timeout_s=60)
        await wait_until(lambda: engine.running_count == 0, "the engine stopped generating", timeout_s=30)
        assert engine.generated_tokens_total < MAX_TOKENS
        # The slot is freed (the engine is done) and nothing of the exchange is left in the driver ...
        await wait_until(
            lambda: not any(ctx.driver.core.stats().in_flight.values()), "slot freed", timeout_s=30
        )
        await wait_until(lambda: not ctx.driver.exchanges, "exchange dropped", timeout_s=30)
        # ... and the cut-off answer's connection: vLLM's closed, SGLang's read to its abort answer and pooled.
        assert upstream.idle_count == (1 if api == "sglang" else 0)
    finally:
        with contextlib.suppress(OSError):
            sock.close()
    # The engine serves the next request, and that one's connection is pooled.
    async with httpx.AsyncClient(timeout=30) as http:
        ok = await http.post(
            f"{gateway.url}/v1/chat/completions",
            json={"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        )
    assert ok.status_code == 200, ok.text
    assert upstream.idle_count == 1
