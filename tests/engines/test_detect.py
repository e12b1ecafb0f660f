"""Engine family detection and the adapter factory (engines/detect.py)."""

from __future__ import annotations

import socket

import aiohttp
import pytest
from aiohttp import web

from rolloutgate.engines.base import EngineFamily, UpstreamError
from rolloutgate.engines.detect import detect_family, make_client
from rolloutgate.engines.openai_compat import OpenAICompatClient
from rolloutgate.engines.sglang import SglangClient
from rolloutgate.engines.vllm import VllmClient

from .fakes import FakeEngine, models_answer, serve_like_miles_mock, sglang_server_info


async def test_sglang_is_recognised_by_its_server_args(
    fake: FakeEngine, session: aiohttp.ClientSession
) -> None:
    fake.on_json("GET", "/server_info", sglang_server_info())
    assert await detect_family(session, fake.url) is EngineFamily.SGLANG


async def test_old_sglang_answers_get_server_info(fake: FakeEngine, session: aiohttp.ClientSession) -> None:
    fake.on_json("GET", "/get_server_info", sglang_server_info())
    assert await detect_family(session, fake.url) is EngineFamily.SGLANG


async def test_vllm_dev_mode_server_info_is_not_sglang(
    fake: FakeEngine, session: aiohttp.ClientSession
) -> None:
    fake.on_json(
        "GET", "/server_info", {"vllm_config": {"scheduler_config": {"max_num_seqs": 8}}, "tp_size": 1}
    )
    fake.on_json("GET", "/version", {"version": "0.33.0"})
    assert await detect_family(session, fake.url) is EngineFamily.VLLM


async def test_vllm_by_metrics(fake: FakeEngine, session: aiohttp.ClientSession) -> None:
    async def metrics(_: web.Request) -> web.StreamResponse:
        return web.Response(text="vllm:num_requests_running 0\n")

    fake.on("GET", "/metrics", metrics)
    assert await detect_family(session, fake.url) is EngineFamily.VLLM


async def test_anything_else_is_openai(fake: FakeEngine, session: aiohttp.ClientSession) -> None:
    fake.on_json("GET", "/v1/models", models_answer())
    fake.on_json("GET", "/version", {"build": 3})
    assert await detect_family(session, fake.url) is EngineFamily.OPENAI


async def test_an_sglang_speaking_server_without_server_info_is_sglang_by_its_generate_route(
    fake: FakeEngine, session: aiohttp.ClientSession
) -> None:
    serve_like_miles_mock(fake)  # /generate, /v1/chat/completions and /health only
    assert await detect_family(session, fake.url) is EngineFamily.SGLANG
    asked = fake.last("/generate")
    assert asked.method == "GET", "the route is asked for with a GET, which a POST route never runs"


async def test_nothing_answering_raises(session: aiohttp.ClientSession) -> None:
    with socket.socket() as bound:
        bound.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{bound.getsockname()[1]}"
        with pytest.raises(UpstreamError, match="no engine answers") as caught:
            await detect_family(session, url)
    assert caught.value.retryable


@pytest.mark.parametrize(
    ("family", "kind"),
    [
        (EngineFamily.SGLANG, SglangClient),
        (EngineFamily.VLLM, VllmClient),
        (EngineFamily.OPENAI, OpenAICompatClient),
    ],
)
async def test_make_client(session: aiohttp.ClientSession, family: EngineFamily, kind: type) -> None:
    client = make_client(family, "http://127.0.0.1:1/", session)
    assert isinstance(client, kind)
    assert client.family is family and client.url == "http://127.0.0.1:1"
