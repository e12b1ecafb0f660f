"""SGLang 0.5.9's `--stream-output`, on the real engine: its `/generate` stream chunks carry only their new
`output_ids` while their text and logprobs stay cumulative (tokenizer_manager.py, `stream_output`). The
gateway streams every call upstream, so it must add the ids up; read as cumulative, a call answered whole
lost the ids of every chunk but the last (found on this engine: 11 ids of 12, the first token's missing).
Newer SGLang's `--incremental-streaming-output` (every field incremental) does not run on this CPU; the
simulator plays it (tests/server/test_continuation.py, tests/sim/test_http_sglang.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.e2e.harness import EngineSet, start_extra_engine, start_gateway

# one real engine of its own (30-60 s to start on this CPU) and two gateways in front of it
pytestmark = [pytest.mark.e2e, pytest.mark.backend("sglang"), pytest.mark.timeout(300)]

PROMPT_IDS = [5, 6, 7, 8, 9]


def generate(url: str, tokens: int, *, stream: bool = False) -> Any:
    body = {
        "input_ids": PROMPT_IDS,
        "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
        "stream": stream,
    }
    with httpx.Client(timeout=120.0) as client:
        if not stream:
            answer = client.post(url + "/generate", json=body)
            assert answer.status_code == 200, answer.text
            return answer.json()
        lines = client.post(url + "/generate", json=body).text.splitlines()
        return [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]


def essentials(answer: Any) -> tuple[Any, ...]:
    meta = answer["meta_info"]
    ids_of_logprobs = [entry[1] for entry in meta["output_token_logprobs"]]
    return answer["output_ids"], ids_of_logprobs, answer["text"], meta["completion_tokens"]


def test_a_call_answered_whole_has_every_id_of_an_engine_streaming_ids_alone(
    engines: EngineSet, log_dir: Path
) -> None:
    process, url = start_extra_engine(
        engines, log_dir, "engine-stream-output", extra_args=["--stream-output"]
    )
    gateways = []
    try:
        with httpx.Client(timeout=30.0) as client:
            assert client.get(url + "/server_info").json()["stream_output"] is True
        only_this = dataclasses.replace(engines, urls=(url,))
        gateways = [
            start_gateway(only_this, log_dir, {}),
            start_gateway(only_this, log_dir, {"checkpoint_tokens": 3}),  # chunks every 3 tokens too
        ]
        for tokens in (1, 2, 12):
            direct = essentials(generate(url, tokens))
            assert len(direct[0]) == tokens
            for gateway in gateways:
                assert essentials(generate(gateway.url, tokens)) == direct, (gateway.flags, tokens)
        # a streaming client gets the engine's own chunks: each with its own ids, not the output so far (how
        # many ids a chunk carries is the engine's timing: a busy tokenizer manager sends two in one)
        direct_chunks = generate(url, 5, stream=True)
        through = generate(gateways[0].url, 5, stream=True)
        assert direct_chunks[-1] == through[-1] == "[DONE]"
        direct_ids = [i for c in direct_chunks[:-1] for i in json.loads(c)["output_ids"]]
        through_ids = [i for c in through[:-1] for i in json.loads(c)["output_ids"]]
        assert len(direct_ids) == 5 and through_ids == direct_ids
    finally:
        for gateway in gateways:
            gateway.process.stop()
        process.stop()
