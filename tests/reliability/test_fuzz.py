"""Property-based tests (hypothesis) of every endpoint's input handling against a live gateway process: the
gateway never answers 5xx to bad input, never stops serving, and a good request still succeeds afterwards.

Inputs range from raw bytes and arbitrary JSON to near-valid requests (a valid body with fields replaced or
added), headers with odd values, and raw HTTP that is not HTTP. The engines are the simulator's `fast`
profile (no simulated time passes), and the server's limits are lowered so big values are refused quickly.
"""

from __future__ import annotations

import json
import socket
import string
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.reliability.conftest import Proc, bump_figure, spawn_gateway

pytestmark = pytest.mark.reliability

EXAMPLES = 300
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,  # the same inputs on every run (CI): a failure reproduces
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
GOOD_CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
CLOSED_PORT = 9  # discard: nothing listens there, connections are refused at once


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    proc = spawn_gateway(
        ["--sim", "2", "--sim-profile", "fast", "--log-level", "warning", "--keepalive-interval", "0"],
        tmp_path_factory.mktemp("fuzz") / "gateway.log",
        env={"ROLLOUTGATE_MAX_TOKENS_LIMIT": "256", "ROLLOUTGATE_MAX_MESSAGES": "64"},
    )
    yield proc
    log = proc.log()
    proc.stop()
    assert "Traceback" not in log, log[-5000:]


@pytest.fixture(scope="module")
def http(gateway: Proc) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        yield client


def check(response: httpx.Response, what: str) -> None:
    bump_figure("bad_inputs_tried")
    assert response.status_code < 500, (what, response.status_code, response.text[:500])
    if response.status_code >= 400 and "json" in response.headers.get("content-type", ""):
        # the gateway's OpenAI error, or an engine's own error passed through (vLLM's shape)
        error = response.json()
        assert (error.get("error") or {}).get("message") or error.get("message"), response.text
    elif response.status_code >= 400:  # a proxied engine path the engine itself refused (plain text)
        assert response.text, response


def still_serving(http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions", json=GOOD_CHAT)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"]


# --- strategies ---------------------------------------------------------------------------------------------

scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=30)
json_values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5)
    ),
    max_leaves=25,
)
small_ints = st.integers(-5, 300)
# Token ids: in the engines' vocabulary and out of it. An id past SGLang 0.5.9's vocabulary, or a negative one,
# kills the engine (reference/real-sglang.md): the gateway refuses them first (server/validate.py).
VOCAB = 151_936  # the embedded simulator's (sim/tokens.py DEFAULT_VOCAB_SIZE), learned from its /server_info
token_ids = st.one_of(
    st.integers(0, VOCAB - 1),
    st.integers(-5, -1),
    st.sampled_from([VOCAB, VOCAB + 1, 999_999, 2**31, 2**63 - 1, 2**64, 2**70, -(2**63)]),
    st.floats(),
    st.booleans(),
)
id_prompts = st.one_of(
    st.lists(token_ids, min_size=1, max_size=8),
    st.lists(st.lists(token_ids, max_size=4), min_size=1, max_size=3),
    # past prompt_ids.FIELD_WISE_FROM: kept as its JSON and scanned, not parsed
    st.builds(lambda ids, pad: [7] * pad + ids, st.lists(token_ids, min_size=1, max_size=4), st.just(1500)),
)
plausible = (
    json_values | small_ints | st.sampled_from(["", "user", "assistant", "system", "tool", "sim-model"])
)
messages = st.lists(
    st.dictionaries(
        st.sampled_from(["role", "content", "name", "tool_calls", "tool_call_id"]), plausible, max_size=4
    )
    | plausible,
    max_size=6,
)


def near_valid(
    base: dict[str, Any], fields: dict[str, st.SearchStrategy[Any]]
) -> st.SearchStrategy[dict[str, Any]]:
    """`base` with some of its fields replaced, some removed and some added."""
    extra = st.dictionaries(
        st.sampled_from(sorted(fields)), st.one_of(*fields.values()) | json_values, max_size=4
    )
    removed = st.sets(st.sampled_from(sorted(base)), max_size=2)
    return st.builds(
        lambda add, drop: {**{k: v for k, v in base.items() if k not in drop}, **add}, extra, removed
    )


CHAT_FIELDS = {
    "model": plausible,
    "messages": messages,
    "max_tokens": small_ints | json_values,
    "max_completion_tokens": small_ints | json_values,
    "stream": st.booleans() | json_values,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans() | json_values}) | json_values,
    "temperature": st.floats() | json_values,
    "top_p": st.floats() | json_values,
    "n": small_ints | json_values,
    "logprobs": st.booleans() | json_values,
    "top_logprobs": small_ints,
    "stop": json_values,
    "tools": json_values,
    "ignore_eos": st.booleans(),
    "continue_final_message": st.booleans() | json_values,
    "chat_template_kwargs": json_values,
}
COMPLETION_FIELDS = {
    **CHAT_FIELDS,
    "prompt": st.text(max_size=40) | st.lists(small_ints, max_size=8) | id_prompts | json_values,
    "input_ids": id_prompts,
}
GENERATE_FIELDS = {
    "text": st.text(max_size=40) | st.lists(st.text(max_size=10), max_size=3) | json_values,
    "input_ids": st.lists(small_ints, max_size=8)
    | st.lists(st.lists(small_ints, max_size=4), max_size=3)
    | id_prompts
    | json_values,
    "sampling_params": st.dictionaries(
        st.sampled_from(["max_new_tokens", "temperature", "stop", "ignore_eos", "n"]), plausible, max_size=4
    )
    | json_values,
    "stream": st.booleans() | json_values,
    "rid": json_values,
    "return_logprob": st.booleans() | json_values,
}
GOOD_COMPLETION = {"model": "sim-model", "prompt": "hi", "max_tokens": 4}
GOOD_GENERATE = {"text": "hi", "sampling_params": {"max_new_tokens": 4}}


def bodies(base: dict[str, Any], fields: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[bytes]:
    """Raw bytes, any JSON text (NaN included), or a near-valid request body."""
    return st.one_of(
        st.binary(max_size=200),
        json_values.map(lambda v: json.dumps(v).encode()),
        near_valid(base, fields).map(lambda v: json.dumps(v).encode()),
        near_valid(base, fields).map(lambda v: json.dumps(v).encode()),  # twice the weight: they go deepest
    )


header_text = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40).map(
    str.strip
)  # h11 refuses edge spaces
HEADER_NAMES = [
    "X-Rolloutgate-Timeout",
    "X-Rolloutgate-Stall-Timeout",
    "X-Rolloutgate-Queue-Timeout",
    "X-Rolloutgate-Max-Wall",
    "X-Rolloutgate-Priority",
    "X-Rolloutgate-Keepalive",
    "x-stainless-read-timeout",
    "Idempotency-Key",
    "X-Request-Id",
    "X-SMG-Routing-Key",
    "X-Session-Id",
    "Authorization",
    "Content-Type",
]
headers = st.dictionaries(st.sampled_from(HEADER_NAMES), header_text, max_size=5)


# --- the inference front ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "base", "fields"),
    [
        ("/v1/chat/completions", GOOD_CHAT, CHAT_FIELDS),
        ("/v1/completions", GOOD_COMPLETION, COMPLETION_FIELDS),
        ("/generate", GOOD_GENERATE, GENERATE_FIELDS),
    ],
    ids=["chat", "completions", "generate"],
)
def test_inference_endpoints_never_5xx(
    http: httpx.Client, path: str, base: dict[str, Any], fields: dict[str, st.SearchStrategy[Any]]
) -> None:
    @SETTINGS
    @given(body=bodies(base, fields), extra_headers=headers)
    def run(body: bytes, extra_headers: dict[str, str]) -> None:
        check(
            http.post(path, content=body, headers={"Content-Type": "application/json", **extra_headers}), path
        )

    run()
    still_serving(http)


ID_REFUSALS = {"token_id_out_of_vocabulary", "invalid_token_id", "invalid_value", "invalid_json"}


@SETTINGS
@given(
    where=st.sampled_from(
        [("/generate", "input_ids"), ("/v1/completions", "prompt"), ("/v1/chat/completions", "input_ids")]
    ),
    ids=id_prompts,
)
def test_ids_outside_the_vocabulary_are_refused_before_any_engine(
    http: httpx.Client, where: tuple[str, str], ids: list[Any]
) -> None:
    path, field = where
    base = {"/generate": GOOD_GENERATE, "/v1/completions": GOOD_COMPLETION}.get(path, GOOD_CHAT)
    body = {k: v for k, v in base.items() if k not in ("text", "prompt")} | {field: ids}
    response = http.post(
        path, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    check(response, path)

    def fits(prompt: Any) -> bool:
        return (
            isinstance(prompt, list)
            and bool(prompt)
            and all(type(t) is int and 0 <= t < VOCAB for t in prompt)
        )

    is_batch = all(isinstance(item, list) for item in ids)
    if not (all(fits(p) for p in ids) if is_batch else fits(ids)):
        # the gateway's own refusal, not an engine's (the simulator's 400 has no such code)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["code"] in ID_REFUSALS, response.text


@SETTINGS
@given(extra_headers=headers, body=near_valid(GOOD_CHAT, {"stream": st.booleans()}))
def test_headers_never_5xx(http: httpx.Client, extra_headers: dict[str, str], body: dict[str, Any]) -> None:
    check(http.post("/v1/chat/completions", json=body, headers=extra_headers), "headers")


# --- workers and admin --------------------------------------------------------------------------------------

worker_urls = st.one_of(
    st.text(max_size=40),
    st.builds(
        lambda scheme, host, port, path: f"{scheme}{host}:{port}{path}",
        st.sampled_from(["http://", "https://", "ftp://", "file://", "", "http:/", "HTTP://"]),
        st.sampled_from(["127.0.0.1", "[::1]", "localhost", "", "256.1.1.1", "a b"]),
        st.sampled_from([str(CLOSED_PORT), "0", "70000", "-1", "x"]),
        st.sampled_from(["", "/", "/v1", "?q=1", "#f"]),
    ),
)


@SETTINGS
@given(
    body=st.one_of(
        st.binary(max_size=100).map(lambda b: (b, None)),
        st.fixed_dictionaries(
            {"url": worker_urls | json_values},
            optional={"family": plausible, "capacity": small_ints | json_values},
        ).map(lambda v: (json.dumps(v).encode(), v)),
    ),
    worker_id=st.text(max_size=20),
    miles_url=worker_urls,
)
def test_worker_endpoints_never_5xx_on_bad_input(
    http: httpx.Client, body: tuple[bytes, Any], worker_id: str, miles_url: str
) -> None:
    raw, value = body
    response = http.post("/workers", content=raw, headers={"Content-Type": "application/json"})
    check(response, "/workers")
    if response.status_code in (200, 202) and response.json()["state"] == "pending":
        # a well-formed http URL nobody listens on: kept pending until it answers (server/pool.py register)
        assert isinstance(value, dict) and str(value.get("url", "")).startswith("http")
    check(http.delete(f"/workers/{quote(worker_id, safe='')}"), "DELETE /workers")
    check(http.post("/add_worker", params={"url": miles_url}), "/add_worker")
    workers = http.get("/workers").json()["workers"]
    assert len([w for w in workers if w["state"] != "pending"]) == 2  # nothing bad ever joined


@SETTINGS
@given(
    path=st.sampled_from(["/admin/pause", "/admin/update_weights"]),
    body=st.one_of(
        st.binary(max_size=100),
        st.fixed_dictionaries(
            {},
            optional={
                "mode": st.sampled_from(["drain", "abort", "in_place", "retract", ""]) | json_values,
                "path": st.sampled_from(["/update_weight_version", "/update_weights_from_disk", "/x"])
                | json_values,
                "body": json_values,
                "staggered": st.booleans() | json_values,
                "drain_timeout": st.floats() | small_ints | json_values,
            },
        ).map(lambda v: json.dumps(v).encode()),
    ),
)
def test_admin_endpoints_never_5xx_on_bad_input(http: httpx.Client, path: str, body: bytes) -> None:
    try:
        response = http.post(path, content=body, headers={"Content-Type": "application/json"})
        if path == "/admin/update_weights" and response.status_code == 502:
            # the engines' own verdict on a well-formed update (a 502 report listing each engine's error)
            assert "engines" in response.json(), response.text
            bump_figure("bad_inputs_tried")
        else:
            check(response, path)
    finally:
        assert http.post("/admin/resume").status_code == 200  # reopen the gate a valid pause closed


# --- sessions -----------------------------------------------------------------------------------------------


@SETTINGS
@given(
    body=bodies({"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]}, CHAT_FIELDS),
    session_id=st.text(max_size=40),
    extra_headers=headers,
)
def test_session_endpoints_never_5xx(
    http: httpx.Client, body: bytes, session_id: str, extra_headers: dict[str, str]
) -> None:
    live = http.post("/sessions").json()["session_id"]
    quoted = quote(session_id, safe="")
    for sid in (live, quoted):
        check(
            http.post(
                f"/sessions/{sid}/v1/chat/completions",
                content=body,
                headers={"Content-Type": "application/json", **extra_headers},
            ),
            "session chat",
        )
        check(http.get(f"/sessions/{sid}"), "GET session")
        check(http.get(f"/sessions/{sid}/trajectory"), "trajectory")
    check(http.get(f"/sessions/{live}", params={"prompt_ids": session_id}), "GET session ?prompt_ids")
    check(http.delete(f"/sessions/{quoted}"), "DELETE session")
    assert http.delete(f"/sessions/{live}").status_code == 204


# --- raw HTTP -----------------------------------------------------------------------------------------------

request_lines = st.one_of(
    st.binary(max_size=300),
    st.builds(
        lambda method, target, version, head: f"{method} {target} {version}\r\n{head}\r\n".encode(),
        st.sampled_from(["GET", "POST", "PUT", "DELETE", "BREW", "", "G\x00T", "POST POST"]),
        st.text(string.printable, max_size=60),
        st.sampled_from(["HTTP/1.1", "HTTP/1.0", "HTTP/2", "HTTP/9.9", "", "http/1.1"]),
        st.text(string.printable, max_size=200),
    ),
)


@SETTINGS
@given(data=request_lines)
def test_raw_http_garbage_never_5xx(gateway: Proc, http: httpx.Client, data: bytes) -> None:
    host, port = gateway.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except (ConnectionResetError, TimeoutError):
            pass
    bump_figure("bad_inputs_tried")
    for line in answer.split(b"\r\n"):
        if line.startswith(b"HTTP/1."):
            status = int(line.split()[1])
            assert status < 500, answer[:500]


def test_the_gateway_serves_on_after_everything(gateway: Proc, http: httpx.Client) -> None:
    still_serving(http)
    assert gateway.is_alive()
    assert http.get("/health").json()["healthy_engines"] == 2
