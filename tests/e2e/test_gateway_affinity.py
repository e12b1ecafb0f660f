"""Session affinity: every turn of a multi-turn session goes to the engine that served its first turn, as the
engines' own token counters confirm."""

from __future__ import annotations

import asyncio
from collections import defaultdict

import pytest
from tests.e2e.calls import Answer, openai_call, openai_client
from tests.e2e.conftest import MakeGateway
from tests.e2e.harness import EngineSet, scrape_all

pytestmark = pytest.mark.e2e

SESSIONS, TURNS, TOKENS = 4, 4, 12


async def test_session_affinity_keeps_each_session_on_one_engine(
    engines: EngineSet, gateways: MakeGateway
) -> None:
    gateway = gateways()
    client = openai_client(gateway)
    histories = {
        f"e2e-session-{i}": [{"role": "user", "content": f"Session {i}: hello."}] for i in range(SESSIONS)
    }
    served: dict[str, list[str | None]] = defaultdict(list)
    before = await scrape_all(engines.urls)
    for turn in range(TURNS):
        names = list(histories)
        answers: list[Answer] = await asyncio.gather(
            *(
                openai_call(
                    client, engines, max_tokens=TOKENS, messages=histories[n], headers={"X-Session-Id": n}
                )
                for n in names
            )
        )
        for name, answer in zip(names, answers, strict=True):
            assert answer.tokens == TOKENS
            served[name].append(answer.engine)
            histories[name] += [
                {"role": "assistant", "content": answer.text},
                {"role": "user", "content": f"Turn {turn + 1}: go on."},
            ]
    await client.close()
    after = await scrape_all(engines.urls)

    for name, where in served.items():
        assert len(set(where)) == 1 and where[0] in engines.urls, f"{name} moved: {where}"
    for url in engines.urls:
        sessions_here = sum(1 for where in served.values() if where[0] == url)
        assert after[url].generated - before[url].generated == sessions_here * TURNS * TOKENS
