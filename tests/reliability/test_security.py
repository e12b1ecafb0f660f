"""Security: who may call what, input limits, worker URLs, and logs that never carry a body, secret or token."""

from __future__ import annotations

import asyncio
import logging
import socket
import subprocess
from typing import Any
from unittest import mock

import httpx
import pytest
from aiohttp.test_utils import make_mocked_request

from rolloutgate.config import GatewaySettings
from rolloutgate.errors import Forbidden, Unauthorized
from rolloutgate.server.auth import check_admin, check_worker_admin
from tests.reliability.conftest import bump_figure
from tests.server.conftest import MakeCluster, MakeGateway

pytestmark = pytest.mark.reliability

ADMIN_TOKEN = "admin-9f1c2d7e4b"
API_KEY = "key-51aa6c03e8"
CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}

# Every admin and worker-management route, with a body that would be valid.
ADMIN_ROUTES: list[tuple[str, str, dict[str, Any] | None]] = [
    ("GET", "/admin/state", None),
    ("POST", "/admin/pause", {"mode": "drain"}),
    ("POST", "/admin/resume", None),
    ("POST", "/admin/update_weights", {"path": "/update_weight_version", "body": {"new_version": "v2"}}),
    ("GET", "/workers", None),
    ("POST", "/workers", {"url": "http://127.0.0.1:9"}),
    ("DELETE", "/workers/engine-99", None),
    ("POST", "/add_worker?url=http://127.0.0.1:9", None),
    ("GET", "/list_workers", None),
]
# Engine control reached through the gateway's catch-all proxy (directly or under a session) is admin too.
ENGINE_CONTROL: list[tuple[str, str, dict[str, Any] | None]] = [
    ("POST", "/pause_generation", {"mode": "abort"}),
    ("POST", "/continue_generation", None),
    ("POST", "/abort_request", {"rid": "x", "abort_all": True}),
    ("POST", "/flush_cache", None),
    ("POST", "/update_weights_from_disk", {"model_path": "/tmp/x"}),
    ("POST", "/sim/faults", {"fault": "freeze"}),
]


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def call(
    http: httpx.AsyncClient, url: str, method: str, path: str, body: Any, **kw: Any
) -> httpx.Response:
    return await http.request(method, url + path, json=body, **kw)


@pytest.mark.parametrize(("method", "path", "body"), ADMIN_ROUTES + ENGINE_CONTROL)
async def test_admin_routes_need_the_admin_token_when_one_is_set(
    make_cluster: MakeCluster,
    make_gateway: MakeGateway,
    http: httpx.AsyncClient,
    method: str,
    path: str,
    body: Any,
) -> None:
    cluster = await make_cluster(engines=1)
    gateway = await make_gateway(cluster, admin_token=ADMIN_TOKEN, api_keys=[API_KEY])
    for headers in ({}, bearer("wrong"), bearer(API_KEY)):  # an API key is not an admin token
        refused = await call(http, gateway.url, method, path, body, headers=headers)
        assert refused.status_code == 401, (headers, refused.text)
        assert refused.json()["error"]["code"] == "invalid_admin_token"
    allowed = await call(http, gateway.url, method, path, body, headers=bearer(ADMIN_TOKEN))
    assert allowed.status_code not in (401, 403), allowed.text
    assert allowed.status_code < 500 or path == "/workers" or "add_worker" in path, allowed.text
    assert not cluster.engines[0].paused or path == "/pause_generation"
    bump_figure("security.admin_route_checks", 4)


@pytest.mark.parametrize(("method", "path", "body"), ENGINE_CONTROL[:3])
async def test_engine_control_under_a_session_path_needs_the_admin_token(
    make_cluster: MakeCluster,
    make_gateway: MakeGateway,
    http: httpx.AsyncClient,
    method: str,
    path: str,
    body: Any,
) -> None:
    gateway = await make_gateway(await make_cluster(engines=1), admin_token=ADMIN_TOKEN)
    session_id = (await http.post(f"{gateway.url}/sessions")).json()["session_id"]
    refused = await call(http, gateway.url, method, f"/sessions/{session_id}{path}", body)
    assert refused.status_code == 401, refused.text
    bump_figure("security.admin_route_checks", 1)


def non_loopback_address() -> str | None:
    """An address of this host that is not loopback, if it has one (CI containers usually do)."""
    try:
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=5).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    for address in out:
        if "." in address and not address.startswith("127."):
            with socket.socket() as probe:
                try:
                    probe.bind((address, 0))
                except OSError:
                    continue
            return address
    return None


def request_from(peer: str, path: str = "/admin/state") -> Any:
    """A request as the handler sees it, from `peer`."""
    transport = mock.Mock()
    transport.get_extra_info.side_effect = lambda name, default=None: (
        (peer, 40000) if name == "peername" else default
    )
    return make_mocked_request("GET", path, transport=transport)


def test_without_a_token_admin_accepts_only_loopback_unless_remote_admin_is_allowed() -> None:
    local = GatewaySettings()
    check_admin(request_from("127.0.0.1"), local)
    check_admin(request_from("::1"), local)
    with pytest.raises(Forbidden):
        check_admin(request_from("10.0.0.7"), local)
    check_admin(request_from("10.0.0.7"), GatewaySettings(allow_remote_admin=True))
    with pytest.raises(Unauthorized):  # a token, once set, is needed from everywhere
        check_admin(request_from("127.0.0.1"), GatewaySettings(admin_token=ADMIN_TOKEN))


def test_a_trusted_network_may_register_workers_and_nothing_else() -> None:
    trusting = GatewaySettings(admin_token=ADMIN_TOKEN, trusted_networks=["10.0.0.0/8", "fd00::/8"])
    check_worker_admin(request_from("10.3.4.5"), trusting)
    check_worker_admin(request_from("::ffff:10.3.4.5"), trusting)  # IPv4 seen by a dual-stack listener
    check_worker_admin(request_from("fd00::7"), trusting)
    with pytest.raises(Unauthorized):  # outside the networks: the token rule, unchanged
        check_worker_admin(request_from("192.168.1.9"), trusting)
    with pytest.raises(Unauthorized):  # every other admin call still needs the token from the trusted network
        check_admin(request_from("10.3.4.5"), trusting)
    with pytest.raises(Forbidden):  # no token, no trust: loopback only
        check_worker_admin(request_from("10.3.4.5"), GatewaySettings())
    with pytest.raises(ValueError, match="CIDR"):
        GatewaySettings(trusted_networks=["10.0.0.0/33"])


async def test_an_engine_registers_from_a_trusted_network_over_a_real_connection(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    """As miles' engines do: `POST /workers` from their own host with no token, then remove themselves."""
    address = non_loopback_address()
    if address is None:
        pytest.skip("this host has no non-loopback IPv4 address (the mocked-request test covers the rule)")
    cluster = await make_cluster(engines=1)
    gateway = await make_gateway(
        engines=[], host=address, admin_token=ADMIN_TOKEN, trusted_networks=[f"{address}/32"]
    )
    added = await http.post(f"{gateway.url}/workers", json={"url": cluster.urls[0]})
    assert added.status_code == 201, added.text
    assert (await http.get(f"{gateway.url}/list_workers")).json() == {"urls": cluster.urls}
    assert (await http.get(f"{gateway.url}/admin/state")).status_code == 401  # admin: the token, still
    removed = await http.post(f"{gateway.url}/remove_worker", params={"url": cluster.urls[0]})
    assert removed.status_code == 200, removed.text
    untrusted = await make_gateway(engines=[], host=address, admin_token=ADMIN_TOKEN)
    refused = await http.post(f"{untrusted.url}/workers", json={"url": cluster.urls[0]})
    assert refused.status_code == 401, refused.text


@pytest.mark.parametrize("allow_remote", [False, True])
async def test_admin_over_a_real_non_loopback_connection(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient, allow_remote: bool
) -> None:
    address = non_loopback_address()
    if address is None:
        pytest.skip("this host has no non-loopback IPv4 address (the mocked-request test covers the rule)")
    cluster = await make_cluster(engines=1)
    gateway = await make_gateway(cluster, host=address, allow_remote_admin=allow_remote)
    remote = await http.get(f"{gateway.url}/admin/state")
    assert remote.status_code == (200 if allow_remote else 403), remote.text
    inference = await http.post(f"{gateway.url}/v1/chat/completions", json=CHAT)
    assert inference.status_code == 200  # inference is not admin
    bump_figure("security.admin_route_checks", 1)


async def test_api_keys_guard_inference_sessions_and_the_proxy_but_not_health(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    gateway = await make_gateway(await make_cluster(engines=1), api_keys=[API_KEY, "second-key"])
    url = gateway.url
    guarded = [
        ("POST", "/v1/chat/completions", CHAT),
        ("POST", "/v1/completions", {"model": "sim-model", "prompt": "hi", "max_tokens": 4}),
        ("POST", "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4}}),
        ("GET", "/get_model_info", None),
    ]
    for method, path, body in guarded:
        for headers in ({}, bearer("nope"), {"Authorization": API_KEY}, bearer(ADMIN_TOKEN)):
            response = await call(http, url, method, path, body, headers=headers)
            assert response.status_code == 401, (path, headers, response.text)
            assert response.json()["error"]["type"] == "authentication_error"
        for key in (API_KEY, "second-key"):
            ok = await call(http, url, method, path, body, headers=bearer(key))
            assert ok.status_code == 200, (path, ok.text)
        bump_figure("security.api_key_checks", 6)
    assert (await http.post(f"{url}/sessions")).status_code == 401
    session_id = (await http.post(f"{url}/sessions", headers=bearer(API_KEY))).json()["session_id"]
    turn = f"{url}/sessions/{session_id}/v1/chat/completions"
    assert (await http.post(turn, json=CHAT)).status_code == 401
    assert (await http.post(turn, json=CHAT, headers=bearer(API_KEY))).status_code == 200
    assert (await http.get(f"{url}/health")).status_code == 200
    assert (await http.get(f"{url}/metrics")).status_code == 200


# --- limits ----------------------------------------------------------------------------------------------------


async def test_request_limits_answer_clear_4xx(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    gateway = await make_gateway(
        await make_cluster(engines=1),
        max_body_bytes=64 * 1024,
        max_messages=16,
        max_tokens_limit=1000,
        max_header_bytes=2048,
        max_headers=32,
    )
    url = f"{gateway.url}/v1/chat/completions"
    big_body = {**CHAT, "messages": [{"role": "user", "content": "x" * 100_000}]}
    cases: list[tuple[str, httpx.Response, int]] = [
        ("body size", await http.post(url, json=big_body), 413),
        ("messages", await http.post(url, json={**CHAT, "messages": CHAT["messages"] * 17}), 400),
        ("max_tokens", await http.post(url, json={**CHAT, "max_tokens": 1001}), 400),
        ("max_completion_tokens", await http.post(url, json={**CHAT, "max_completion_tokens": 10**9}), 400),
        (
            "max_new_tokens",
            await http.post(
                f"{gateway.url}/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 5000}}
            ),
            400,
        ),
    ]
    for name, response, status in cases:
        assert response.status_code == status, (name, response.text)
        assert response.json()["error"]["message"], name
    for name, headers in (
        ("header size", {"X-Big": "a" * 4096}),
        ("header count", {f"X-H{i}": "1" for i in range(40)}),
    ):
        response = await http.post(url, json=CHAT, headers=headers)
        assert response.status_code == 400, (name, response.text)
        assert any(word in response.text for word in ("bytes", "headers")), response.text
    assert (await http.post(url, json=CHAT)).status_code == 200  # and it keeps serving
    bump_figure("security.limit_checks", 7)


@pytest.mark.parametrize(
    "bad_url",
    [
        "file:///etc/passwd",
        "ftp://127.0.0.1/x",
        "gopher://127.0.0.1:70",
        "javascript:alert(1)",
        "127.0.0.1:8000",
        "unix:///var/run/engine.sock",
        "",
        "http//127.0.0.1",
    ],
)
async def test_worker_urls_must_be_http(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient, bad_url: str
) -> None:
    gateway = await make_gateway(await make_cluster(engines=1))
    ours = await http.post(f"{gateway.url}/workers", json={"url": bad_url})
    miles = await http.post(f"{gateway.url}/add_worker", params={"url": bad_url})
    for response in (ours, miles):
        assert response.status_code == 400, response.text
        assert response.json()["error"]["code"] == "invalid_worker"
    assert len((await http.get(f"{gateway.url}/workers")).json()["workers"]) == 1
    bump_figure("security.worker_url_checks", 2)


# --- logs --------------------------------------------------------------------------------------------------------


async def test_logs_never_carry_bodies_secrets_or_tokens(
    make_cluster: MakeCluster,
    make_gateway: MakeGateway,
    http: httpx.AsyncClient,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Everything the gateway logs at debug level while it serves good, bad, failing and malformed requests
    that all carry secrets: none of the secrets appears."""
    caplog.set_level(logging.DEBUG)
    secret_prompt = "PROMPT-SECRET-7c41"
    secret_answer_probe = "BODY-SECRET-a9e2"
    cluster = await make_cluster(engines=2)
    gateway = await make_gateway(cluster, admin_token=ADMIN_TOKEN, api_keys=[API_KEY], max_tokens_limit=100)
    url = gateway.url
    key = bearer(API_KEY)
    chat = {**CHAT, "messages": [{"role": "user", "content": secret_prompt}]}
    await http.post(f"{url}/v1/chat/completions", json=chat, headers=key)
    await http.post(f"{url}/v1/chat/completions", json={**chat, "stream": True}, headers=key)
    await http.post(
        f"{url}/v1/completions", json={"model": "m", "prompt": secret_prompt, "max_tokens": 4}, headers=key
    )
    await http.post(
        f"{url}/generate", json={"text": secret_prompt, "sampling_params": {"max_new_tokens": 4}}, headers=key
    )
    # bad input that echoes a secret, wrong credentials, an oversized header holding a token
    await http.post(f"{url}/v1/chat/completions", content=b"{" + secret_answer_probe.encode(), headers=key)
    await http.post(f"{url}/v1/chat/completions", json={**chat, "max_tokens": 10**6}, headers=key)
    await http.post(f"{url}/v1/chat/completions", json=chat, headers=bearer("wrong-" + API_KEY))
    await http.get(f"{url}/admin/state", headers=bearer("wrong-" + ADMIN_TOKEN))
    await http.get(f"{url}/admin/state", headers=bearer(ADMIN_TOKEN))
    await http.post(
        f"{url}/v1/chat/completions", json=chat, headers={"Authorization": f"Bearer {API_KEY}" + "x" * 9000}
    )
    # a session turn, and an engine that fails mid-request (its error relayed, retried elsewhere)
    session_id = (await http.post(f"{url}/sessions", headers=key)).json()["session_id"]
    await http.post(f"{url}/sessions/{session_id}/v1/chat/completions", json=chat, headers=key)
    from rolloutsim.faults import Fault

    cluster.engines[0].set_fault(Fault(kind="refuse", status=500))
    await asyncio.gather(*(http.post(f"{url}/v1/chat/completions", json=chat, headers=key) for _ in range(4)))
    await gateway.stop()
    logged = caplog.text + "".join(str(r.args) for r in caplog.records)
    assert caplog.records, "nothing was logged: the capture is broken"
    for secret in (secret_prompt, secret_answer_probe, API_KEY, ADMIN_TOKEN):
        assert secret not in logged, f"{secret} leaked into the logs"
    bump_figure("security.log_lines_checked", len(caplog.records))
