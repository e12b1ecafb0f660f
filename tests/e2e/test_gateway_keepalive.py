"""Keep-alive holds a client whose read timeout is short through a queue many times longer: every engine slot
is taken by long generations, the client waits in the gateway's queue, and the gateway writes to it (SSE
comments, or whitespace before the JSON body) often enough that its read timeout never fires."""

from __future__ import annotations

import asyncio
import time

import pytest
from tests.e2e.calls import Answer, cancel_all, litellm_call, openai_call, openai_client, started_streams
from tests.e2e.conftest import MakeGateway
from tests.e2e.harness import EngineSet

pytestmark = pytest.mark.e2e

CLIENT_TIMEOUT_S = 2.0
HOLD_S = 3 * CLIENT_TIMEOUT_S  # how long the queue lasts: the client would have timed out three times
BLOCKER_TOKENS = 7000  # outlast HOLD_S on every engine by far


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("client_kind", ["openai", "litellm"])
async def test_keepalive_holds_a_short_timeout_client_through_a_long_queue(
    engines: EngineSet, gateways: MakeGateway, client_kind: str, stream: bool
) -> None:
    gateway = gateways(keepalive_interval=0.5, retry_grace=0.5)
    slots = len(engines.urls) * engines.max_num_seqs
    blockers = await started_streams(gateway.url, engines, slots, max_tokens=BLOCKER_TOKENS)
    try:
        client = openai_client(gateway, read_timeout=CLIENT_TIMEOUT_S)
        started = time.monotonic()
        if client_kind == "openai":
            call = openai_call(client, engines, stream=stream, max_tokens=16)
        else:
            call = litellm_call(
                gateway, engines, stream=stream, max_tokens=16, read_timeout_s=CLIENT_TIMEOUT_S
            )
        waiting: asyncio.Task[Answer] = asyncio.create_task(call)
        await asyncio.sleep(HOLD_S)
        assert not waiting.done(), f"answered or failed while every slot was busy: {waiting}"
        await cancel_all(blockers)  # the blockers hang up; after the grace period their slots free up
        answer = await asyncio.wait_for(waiting, 60.0)
        await client.close()
    finally:
        await cancel_all(blockers)
    assert answer.tokens == 16 and answer.finish_reason == "length"
    assert time.monotonic() - started >= HOLD_S
    # (X-Rolloutgate-Timing is as of the first byte, here the first keep-alive byte: it cannot show the wait.)
