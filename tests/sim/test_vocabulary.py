"""The simulator's vocabulary (sim/tokens.py, `SimEngineConfig.vocab_size`): the tokenizer's in use, not a fixed
151,936; ids at or past it answered with a 400, generated and text ids below it, and the size stated where the
gateway reads it (SGLang `/server_info` and `/model_info`, vLLM's `/v1/models` card)."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import orjson
import pytest

from rolloutgate.cli import build_parser
from rolloutsim import tokens
from rolloutsim.cli import _overrides
from rolloutsim.profiles import make_config

from .conftest import ClusterFactory
from .helpers import post_json

SCALE = 50.0
pytestmark = pytest.mark.looptime


def test_generated_and_text_ids_stay_inside_a_small_vocabulary() -> None:
    for vocab in (tokens.MIN_VOCAB_SIZE, 800, tokens.DEFAULT_VOCAB_SIZE):
        key = tokens.request_key(0, [5, 6, 7])
        ids = tokens.output_tokens(key, 0, 500, vocab)
        assert all(0 <= t < vocab for t in ids)
        assert ids == [tokens.output_token(key, i, vocab) for i in range(500)]
        assert all(0 <= t < vocab for t in tokens.tokenize("some text to cut into ids " * 20, vocab))
    # a vocabulary larger than the made-up words changes nothing
    key = tokens.request_key(3, [1])
    assert tokens.output_tokens(key, 0, 50, 248_320) == tokens.output_tokens(key, 0, 50)


def test_a_vocabulary_without_room_for_a_word_is_refused() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        make_config("default", vocab_size=tokens.MIN_VOCAB_SIZE - 1)


@pytest.mark.parametrize("api", ["sglang", "vllm"])
async def test_ids_past_the_vocabulary_get_a_400_and_the_engine_serves_on(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession, api: str
) -> None:
    cluster = await make_cluster(time_scale=SCALE, api=api, vocab_size=200_000)  # past Qwen's 151,936
    url = cluster.urls[0]
    if api == "sglang":
        status, _ = await post_json(
            session, url + "/generate", {"input_ids": [199_999], "sampling_params": {}}
        )
        assert status == 200  # a Qwen3.5- or MiniMax-sized id reaches it
        status, body = await post_json(session, url + "/generate", {"input_ids": [200_000]})
        assert status == 400 and "[0, 200000)" in str(body)
        status, body = await post_json(session, url + "/generate", {"input_ids": [[1], [-1]]})
        assert status == 400
    status, body = await post_json(
        session, url + "/v1/completions", {"model": "sim-model", "prompt": [3, 200_000], "max_tokens": 2}
    )
    assert status == 400 and "[0, 200000)" in str(body)
    status, body = await post_json(
        session, url + "/v1/completions", {"model": "sim-model", "prompt": [3, 199_999], "max_tokens": 2}
    )
    assert status == 200, body


async def test_a_small_vocabulary_generates_inside_it(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await make_cluster(time_scale=SCALE, vocab_size=800)
    status, body = await post_json(
        session,
        cluster.urls[0] + "/generate",
        {
            "text": "hello " * 40,
            "sampling_params": {"max_new_tokens": 64},
            "return_logprob": True,
            "top_logprobs_num": 3,
        },
    )
    assert status == 200
    assert all(0 <= t < 800 for t in body["output_ids"])
    assert all(0 <= alt[1] < 800 for top in body["meta_info"]["output_top_logprobs"] for alt in top)


@pytest.mark.parametrize("api", ["sglang", "vllm"])
async def test_the_vocabulary_is_stated_where_the_gateway_reads_it(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession, api: str, tmp_path: Path
) -> None:
    cluster = await make_cluster(time_scale=SCALE, api=api, vocab_size=1234, model_path=str(tmp_path))
    url = cluster.urls[0]
    async with session.get(url + "/v1/models") as response:
        card = (await response.json())["data"][0]
    if api == "vllm":
        assert (card["vocab_size"], card["root"]) == (1234, str(tmp_path))
        return
    for path in ("/server_info", "/model_info", "/get_model_info"):
        async with session.get(url + path) as response:
            info = await response.json()
        assert (info["vocab_size"], info["model_path"]) == (1234, str(tmp_path)), path


def test_sim_takes_its_vocabulary_from_the_tokenizer_in_use(tmp_path: Path) -> None:
    parser = build_parser(only="sim")
    (tmp_path / "tokenizer.json").write_bytes(
        orjson.dumps({"model": {"type": "BPE", "vocab": {"a": 0}}, "added_tokens": [{"id": 799}]})
    )
    overrides = _overrides(parser.parse_args(["sim", "--tokenizer", str(tmp_path)]))
    assert (overrides["vocab_size"], overrides["model_path"]) == (800, str(tmp_path.resolve()))
    (tmp_path / "config.json").write_bytes(orjson.dumps({"vocab_size": 1024}))  # a model folder: its table
    other = tmp_path / "model"
    other.mkdir()
    (other / "config.json").write_bytes(orjson.dumps({"vocab_size": 1024}))
    assert _overrides(parser.parse_args(["sim", "--tokenizer", str(other)]))["vocab_size"] == 1024
    explicit = _overrides(parser.parse_args(["sim", "--tokenizer", str(other), "--vocab-size", "300000"]))
    assert explicit["vocab_size"] == 300_000
    with pytest.raises(SystemExit):
        _overrides(parser.parse_args(["sim", "--tokenizer", str(tmp_path / "absent")]))
