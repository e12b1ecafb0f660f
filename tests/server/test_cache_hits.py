"""Each engine's prefix-cache hits from its answers (server/cache_hits.py), and a session's end releasing its
engine binding (the session API's DELETE and samples)."""

from __future__ import annotations

import httpx
import openai
import orjson
import pytest

from rolloutgate.server.cache_hits import prompt_cache_usage
from tests.server.conftest import MakeCluster, MakeGateway


@pytest.mark.parametrize(
    ("answer", "usage"),
    [
        (  # SGLang /generate: meta_info, after the ids
            {"text": "x", "output_ids": [1, 2], "meta_info": {"prompt_tokens": 900, "cached_tokens": 512}},
            (900, 512),
        ),
        (  # OpenAI usage (vLLM, SGLang's chat route)
            {"choices": [], "usage": {"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 32}}},
            (40, 32),
        ),
        ({"usage": {"prompt_tokens": 40, "prompt_tokens_details": None}}, (40, 0)),  # none cached
        ({"text": 'the "prompt_tokens": 5 of a text', "meta_info": {}}, None),  # escaped in a string: not it
        ({"meta_info": {"prompt_tokens": 10, "cached_tokens": 99}}, (10, 10)),  # never more than the prompt
    ],
)
def test_the_prompt_and_cached_tokens_are_read_from_the_end_of_an_answer(
    answer: dict[str, object], usage: tuple[int, int] | None
) -> None:
    assert prompt_cache_usage(orjson.dumps(answer)) == usage


async def test_a_deleted_session_releases_its_engine_binding(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    cluster = await make_cluster(engines=2)
    gateway = await make_gateway(cluster, placement="cache_warm")
    core = gateway.context.driver.core
    ids = [(await http.post(f"{gateway.url}/sessions")).json()["session_id"] for _ in range(2)]
    for session_id in ids:
        client = openai.AsyncOpenAI(base_url=f"{gateway.url}/sessions/{session_id}/v1", api_key="unused")
        await client.chat.completions.create(
            model="sim-model", messages=[{"role": "user", "content": "hello"}], max_tokens=3
        )
        await client.close()
    placed = [core.session_placement(s) for s in ids]
    assert all(p is not None for p in placed)
    assert len({p[0] for p in placed if p is not None}) == 2  # new sessions spread by bound sessions
    assert (await http.delete(f"{gateway.url}/sessions/{ids[0]}")).status_code in (200, 204)
    assert core.session_placement(ids[0]) is None and core.session_placement(ids[1]) is not None
    metrics = (await http.get(f"{gateway.url}/metrics")).text
    assert "rolloutgate_engine_prompt_tokens_total{" in metrics
    assert "rolloutgate_engine_cached_tokens_total{" in metrics
