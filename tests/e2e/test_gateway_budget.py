"""A request over its budget (charged engine time, `--timeout`) is aborted on the engine: the engine's running
gauge drops and its generated-token counter stops, long before the generation could have ended."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest
from tests.e2e.calls import openai_call, openai_client
from tests.e2e.conftest import MakeGateway
from tests.e2e.harness import EngineSet, scrape_all, wait_for

pytestmark = pytest.mark.e2e

BUDGET_S = 2.0
LONG = 7000  # tokens: ~25 s alone on the tiny CPU model, far beyond the budget


def total_generated(metrics: dict[str, object]) -> float:
    return sum(m.generated for m in metrics.values())  # type: ignore[attr-defined]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_request_over_budget_is_aborted_on_the_engine(
    engines: EngineSet, gateways: MakeGateway, stream: bool
) -> None:
    gateway = gateways(timeout=BUDGET_S)
    before = await scrape_all(engines.urls)
    client = openai_client(gateway)
    started = time.monotonic()
    with pytest.raises(openai.APIError) as caught:
        await openai_call(client, engines, stream=stream, max_tokens=LONG)
    failed_after = time.monotonic() - started
    await client.close()
    print(f"over budget: {type(caught.value).__name__} after {failed_after:.2f} s: {caught.value}")
    assert failed_after >= BUDGET_S

    idle = await wait_for(
        "engines idle after the abort",
        lambda: scrape_all(engines.urls),
        lambda ms: all(m.running == 0 for m in ms.values()),
        15.0,
    )
    await asyncio.sleep(1.0)
    later = await scrape_all(engines.urls)
    assert total_generated(later) == total_generated(idle), "tokens still generated after the abort"
    assert total_generated(later) - total_generated(before) < LONG, "the generation ran to its end"
