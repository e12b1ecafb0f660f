"""A prompt given as token ids is kept as the JSON it came in (server/prompt_ids.py): the exchange holds an
`orjson.Fragment` of the client's bytes, the engine gets them verbatim, the count is exact, and a continued
stream still prompts with them (server/continuation.py)."""

from __future__ import annotations

import json
import random
from typing import Any

import httpx
import orjson
import pytest

from rolloutgate.config import GatewaySettings
from rolloutgate.engines.base import Route
from rolloutgate.engines.upstream import UpstreamPool
from rolloutgate.errors import BadRequest
from rolloutgate.server.continuation import answer_of_stream, continuation_body
from rolloutgate.server.prompt_ids import FIELD_WISE_FROM, compact_json, token_ids_of
from rolloutgate.server.validate import estimate_prompt_tokens, parse_inference_body, validate_body
from tests.server.conftest import MakeCluster, MakeGateway

SETTINGS = GatewaySettings()


def random_ids(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(150_000) for _ in range(n)]


def parse(route: Route, body: dict[str, Any], raw: bytes | None = None) -> tuple[dict[str, Any], int]:
    """What the front does with a body: parse, validate, count the prompt."""
    parsed, count = parse_inference_body(orjson.dumps(body) if raw is None else raw, route, SETTINGS)
    validate_body(route, parsed, SETTINGS)
    return parsed, estimate_prompt_tokens(route, parsed) if count is None else count


@pytest.mark.parametrize(
    ("route", "field", "value", "tokens"),
    [
        (Route.GENERATE, "input_ids", random_ids(1000), 1000),
        (Route.GENERATE, "input_ids", [random_ids(500, 1), random_ids(700, 2)], 1200),  # a batch: all of them
        (Route.COMPLETIONS, "prompt", random_ids(1000), 1000),
    ],
)
def test_token_ids_are_kept_as_their_json(route: Route, field: str, value: Any, tokens: int) -> None:
    body = {field: value, "sampling_params": {"max_new_tokens": 4}, "stream": False}
    raw = orjson.dumps(body)
    assert len(raw) >= FIELD_WISE_FROM
    parsed, count = parse(route, body)
    assert isinstance(parsed[field], orjson.Fragment)
    assert count == tokens
    assert orjson.dumps(parsed) == raw  # what an adapter sends: the same bytes
    assert token_ids_of(parsed[field]) == value
    assert parsed["sampling_params"] == {"max_new_tokens": 4}
    assert parsed["stream"] is False


def test_the_clients_own_json_is_kept_whitespace_and_all() -> None:
    ids = random_ids(2000)
    raw = json.dumps({"input_ids": ids, "sampling_params": {"max_new_tokens": 4}}, indent=2).encode()
    parsed, count = parse(Route.GENERATE, {}, raw)
    assert count == 2000
    assert orjson.loads(orjson.dumps(parsed)) == orjson.loads(raw)
    assert token_ids_of(parsed["input_ids"]) == ids


@pytest.mark.parametrize(
    ("route", "body"),
    [
        (Route.GENERATE, {"text": "hello " * 2000}),
        (Route.GENERATE, {"text": ["a" * 3000, "b" * 3000]}),
        (Route.GENERATE, {"input_ids": [1, 2, 3], "text": None, "pad": "x" * 5000}),
        (Route.COMPLETIONS, {"prompt": "hello " * 2000}),
        (Route.COMPLETIONS, {"prompt": ["a" * 3000, "b" * 3000]}),
        (Route.CHAT, {"messages": [{"role": "user", "content": "hi"}], "input_ids": random_ids(1000)}),
    ],
)
def test_other_fields_are_parsed_as_orjson_would(route: Route, body: dict[str, Any]) -> None:
    raw = orjson.dumps(body)
    parsed, _ = parse_inference_body(raw, route, SETTINGS)
    assert orjson.dumps(parsed) == raw
    assert {k: token_ids_of(v) for k, v in parsed.items()} == orjson.loads(raw)
    assert not any(isinstance(v, orjson.Fragment) for v in parsed.values()) or route is not Route.CHAT


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b'{"input_ids": [1, 2, ' + b"3, " * 3000 + b"]}", "not valid JSON"),  # a trailing comma
        (b"[" + b"1, " * 3000 + b"1]", "must be a JSON object"),
        (b'{"input_ids": [' + b"1, " * 3000 + b'1], "text": "\\ud800' + b"x" * 10 + b'"}', "not valid JSON"),
        (b'{"input_ids": [' + b"1, " * 3000 + b'1], "text": "\xff\xfe"}', "not valid JSON"),
    ],
)
def test_a_bad_large_body_is_a_clear_400(raw: bytes, message: str) -> None:
    assert len(raw) >= FIELD_WISE_FROM
    with pytest.raises(BadRequest, match=message) as caught:
        parse_inference_body(raw, Route.GENERATE, SETTINGS)
    assert caught.value.status == 400


def test_a_large_body_with_both_prompts_or_empty_ids_is_refused_by_name() -> None:
    ids = random_ids(1000)
    with pytest.raises(BadRequest, match="exactly one of 'text' and 'input_ids'"):
        parse(Route.GENERATE, {"input_ids": ids, "text": "hi"})
    with pytest.raises(BadRequest, match="'input_ids' must be a non-empty array"):
        parse(Route.GENERATE, {"input_ids": [], "pad": "x" * 5000})


def test_compact_json_is_the_json_at_its_size() -> None:
    ids = random_ids(10_000)
    fragment = compact_json(ids)
    assert orjson.dumps(fragment) == orjson.dumps(ids)
    assert token_ids_of(fragment) == ids
    assert token_ids_of(ids) is ids


def generate_chunk(text: str, ids: list[int]) -> bytes:
    meta = {"id": "r", "finish_reason": None, "prompt_tokens": 3, "completion_tokens": len(ids)}
    return orjson.dumps({"text": text, "output_ids": ids, "meta_info": meta})


def test_a_kept_generate_prompt_is_continued_with_its_ids_and_the_output_so_far() -> None:
    ids = random_ids(1000)
    body, _ = parse(
        Route.GENERATE,
        {"input_ids": ids, "stream": True, "sampling_params": {"max_new_tokens": 10, "temperature": 0}},
    )
    assert isinstance(body["input_ids"], orjson.Fragment)
    kept = orjson.dumps(body)
    history = [generate_chunk("ab", [7, 8]), generate_chunk("abc", [7, 8, 9])]
    new, stitcher = continuation_body(Route.GENERATE, body, answer_of_stream(Route.GENERATE, history), 3)
    assert token_ids_of(new["input_ids"]) == [*ids, 7, 8, 9]
    assert orjson.loads(orjson.dumps(new))["input_ids"] == [*ids, 7, 8, 9]
    assert new["sampling_params"] == {"max_new_tokens": 7, "temperature": 0}
    assert stitcher is not None and stitcher.ids == [7, 8, 9] and stitcher.text == "abc"
    assert orjson.dumps(body) == kept  # the exchange's body, for later attempts, is left as it was


async def test_the_engine_gets_the_clients_ids_and_the_exchange_keeps_a_fragment(
    make_cluster: MakeCluster, make_gateway: MakeGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = await make_cluster(engines=1)
    gateway = await make_gateway(cluster)
    sent: list[bytes] = []
    kept: list[Any] = []
    request_bytes = UpstreamPool.request_bytes

    def capture(self: UpstreamPool, path: str, body: bytes, headers: Any) -> bytes:
        if path == "/generate":
            sent.append(body)
            kept.extend(e.body.get("input_ids") for e in gateway.context.driver.exchanges.values())
        return request_bytes(self, path, body, headers)

    monkeypatch.setattr(UpstreamPool, "request_bytes", capture)
    ids = random_ids(20_000)
    async with httpx.AsyncClient(timeout=60) as http:
        response = await http.post(
            f"{gateway.url}/generate",
            json={"input_ids": ids, "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}},
        )
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["meta_info"]["completion_tokens"] == 3
    assert answer["meta_info"]["prompt_tokens"] == len(ids)
    assert len(sent) == 1
    assert orjson.dumps(ids) in sent[0]  # the same JSON text as the client's ids
    assert orjson.loads(sent[0])["input_ids"] == ids
    assert len(kept) == 1 and isinstance(kept[0], orjson.Fragment)
    assert token_ids_of(kept[0]) == ids
