"""A client that disconnects and does not come back: its generation keeps running for the retry grace period
(a retry could still attach to it), then the gateway aborts it on the engine."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from tests.e2e.calls import PROMPT
from tests.e2e.conftest import MakeGateway
from tests.e2e.harness import EngineSet, scrape_all, wait_for

pytestmark = pytest.mark.e2e

GRACE_S = 4.0
LONG = 7000  # tokens: ~25 s alone on the tiny CPU model, far beyond grace and detection


def total_generated(metrics: dict[str, object]) -> float:
    """Tokens generated so far, live (SGLang's finished-request counter would stand still mid-call)."""
    return sum(m.progress for m in metrics.values())  # type: ignore[attr-defined]


async def leave_early(url: str, payload: dict[str, object], stream: bool) -> str | None:
    """Send the request, wait until it generates (stream) or a little (whole answer), then hang up. Returns
    the engine serving it where the gateway said so already (a stream's headers)."""
    async with httpx.AsyncClient(timeout=60.0) as client:
        if stream:
            async with client.stream("POST", url, json=payload) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        return response.headers.get("x-rolloutgate-engine")
        else:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(client.post(url, json=payload), 2.0)
    return None


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_disconnect_without_retry_is_aborted_after_the_grace_period(
    engines: EngineSet, gateways: MakeGateway, stream: bool
) -> None:
    gateway = gateways(retry_grace=GRACE_S)
    before = await scrape_all(engines.urls)
    payload = {
        "model": engines.model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": LONG,
        "ignore_eos": True,
        "stream": stream,
    }
    serving = await leave_early(gateway.v1 + "/chat/completions", payload, stream)
    left_at = time.monotonic()

    # Within the grace period the generation goes on: a retry may still attach to it. (Only the serving
    # engine is scraped where known: a busy engine's /metrics is slow, and every second counts here.)
    watched = (serving,) if serving in engines.urls else engines.urls
    first = await scrape_all(watched)
    await asyncio.sleep(0.5)
    second = await scrape_all(watched)
    if time.monotonic() - left_at < GRACE_S:
        assert total_generated(second) > total_generated(first), "aborted before the grace period ended"
    else:
        print("scrapes too slow to observe the grace period on this machine")

    idle = await wait_for(
        "engines idle after the grace period",
        lambda: scrape_all(engines.urls),
        lambda ms: all(m.running == 0 for m in ms.values()),
        GRACE_S + 15.0,
    )
    idle_after = time.monotonic() - left_at
    await asyncio.sleep(1.0)
    later = await scrape_all(engines.urls)
    assert total_generated(later) == total_generated(idle), "tokens still generated after the abort"
    assert total_generated(later) - total_generated(before) < LONG, "the generation ran to its end"
    assert idle_after >= GRACE_S * 0.9, f"aborted {idle_after:.2f} s after the disconnect, inside the grace"
    print(f"disconnect -> engine idle after {idle_after:.2f} s (grace {GRACE_S} s, scrape latency included)")
