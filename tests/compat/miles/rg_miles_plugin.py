"""pytest plugin (`-p rg_miles_plugin`): miles' router/session suite against rolloutgate (make test-miles).

Loaded into a run of miles' own suite, from miles' folder, with no test body edited. Two modes
(RG_MILES_MODE):

- `baseline`: nothing swapped. The suite runs on miles' own servers; the plugin only notes which tests build a
  server (and so speak HTTP to it) and writes every outcome to RG_MILES_REPORT.
- `rolloutgate`: while one of miles' server-building fixtures or helpers runs, the names it builds its server
  with (`SessionServer`, `MilesRouter`, `UvicornThreadServer`, `find_available_port`, and `FastAPI` +
  `setup_session_routes` + `TestClient` for app_client) are rolloutgate's stand-ins in that module
  (rg_miles_gateway.py): the fixture's own code runs, with miles' MockSGLangServer as the engine, and serves
  `rolloutgate serve` where it would serve miles' server. Only the tests the baseline saw speaking HTTP run
  (RG_MILES_BASELINE); the expected failures (RG_MILES_EXPECTED, expected_failures.toml) are strict xfails.
"""

from __future__ import annotations

import json
import os
import sys
import time
import tomllib
from collections.abc import Callable, Generator, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import rg_miles_gateway as gateway
import rg_miles_records

MODE = os.environ.get("RG_MILES_MODE", "baseline")
REPORT_PATH = os.environ.get("RG_MILES_REPORT")
BASELINE_PATH = os.environ.get("RG_MILES_BASELINE")
EXPECTED_PATH = os.environ.get("RG_MILES_EXPECTED")
# Diagnosis only, never in make test-miles: miles' mock also answers what a real SGLang server does and the mock
# lacks (/server_info, /v1/models, a chat answer's meta_info.prompt_tokens), to see what each test meets once
# rolloutgate admits the engine (docs/miles.md: "after admission").
MOCK_LIKE_SGLANG = os.environ.get("RG_MILES_MOCK_LIKE_SGLANG") == "1"

# The fixtures that build miles' servers (../shared/peers/README.md), by (defining module, fixture name).
SERVER_FIXTURES = {
    ("tests.fast.router.test_sessions", "router_env"),  # also re-exported by tests/fast/router/conftest.py
    ("tests.fast.router.test_sessions_v2", "router_env"),
    ("tests.fast.router.test_router", "router_env"),
    ("tests.fast.router.test_session_samples_op", "app_client"),
    ("tests.fast.router.test_session_samples_op_v2", "app_client"),
}
# The plain helpers that do the same, called from test bodies: (defining module, function name).
SERVER_HELPERS = {
    ("tests.fast.router.test_sessions", "_serve_router"),
    ("tests.fast.router.test_sessions_v2", "_serve_router"),
    ("tests.fast.router.test_session_race_conditions", "_router_env"),
    ("tests.fast.router.session_pretokenized_test_utils", "make_router_env"),
    ("tests.session_parity_utils", "_serve_session"),
}

_current_test: str | None = None
_results: dict[str, dict[str, Any]] = {}
_started = time.monotonic()
_standin_records = False
_test_gateways: dict[str, list[gateway.Gateway]] = {}  # the gateways each test talked to


def _result(nodeid: str) -> dict[str, Any]:
    return _results.setdefault(nodeid, {"outcome": None, "servers": [], "message": ""})


def _note_server(builder: str) -> None:
    if _current_test is not None:
        servers = _result(_current_test)["servers"]
        if builder not in servers:
            servers.append(builder)


def _note_gateway(launched: gateway.Gateway) -> None:
    if _current_test is not None:
        gateways = _test_gateways.setdefault(_current_test, [])
        if launched not in gateways:
            gateways.append(launched)


gateway.on_launch = _note_gateway


@contextmanager
def _standins_in(module: ModuleType) -> Iterator[None]:
    """rolloutgate's stand-ins for the server-building names `module` has, restored afterwards."""
    if MODE != "rolloutgate":
        yield
        return
    saved = {name: module.__dict__[name] for name in gateway.STANDINS if name in module.__dict__}
    module.__dict__.update({name: gateway.STANDINS[name] for name in saved})
    try:
        yield
    finally:
        module.__dict__.update(saved)


def _wrap_helper(module: ModuleType, name: str, helper: Callable[..., Any]) -> Callable[..., Any]:
    """The helper as the tests call it, building its server with the stand-ins in place."""
    builder = f"{module.__name__.rsplit('.', 1)[-1]}.{name}"
    original = getattr(helper, "__wrapped__", None)
    if original is not None:  # a @contextmanager: the server is built on entry, used, stopped on exit

        @contextmanager
        def serve(*args: Any, **kwargs: Any) -> Generator[Any, None, None]:
            _note_server(builder)
            with ExitStack() as stack:
                with _standins_in(module):
                    value = stack.enter_context(helper(*args, **kwargs))
                yield value

        serve.__wrapped__ = original  # type: ignore[attr-defined]
        return serve

    def build(*args: Any, **kwargs: Any) -> Any:
        _note_server(builder)
        with _standins_in(module):
            return helper(*args, **kwargs)

    return build


def _install_helper_wrappers() -> None:
    """Each helper replaced, in its module and wherever a test module imported it by name."""
    for module_name, name in SERVER_HELPERS:
        module = sys.modules.get(module_name)
        if module is None:
            continue
        helper = getattr(module, name)
        wrapped = _wrap_helper(module, name, helper)
        for loaded_name, loaded in list(sys.modules.items()):
            if loaded_name.startswith("tests.") and getattr(loaded, name, None) is helper:
                setattr(loaded, name, wrapped)


def _load_expected() -> dict[str, dict[str, str]]:
    """nodeid -> {cause, why, match} from expected_failures.toml; a test listed twice is an error."""
    if not EXPECTED_PATH:
        return {}
    with open(EXPECTED_PATH, "rb") as handle:
        causes = tomllib.load(handle).get("causes", {})
    expected: dict[str, dict[str, str]] = {}
    for cause, entry in causes.items():
        for nodeid in entry.get("tests", []):
            if nodeid in expected:
                raise pytest.UsageError(
                    f"{EXPECTED_PATH}: {nodeid} listed under {expected[nodeid]['cause']} and {cause}"
                )
            expected[nodeid] = {"cause": cause, "why": entry["why"].strip(), "match": entry.get("match", "")}
    return expected


_expected: dict[str, dict[str, str]] = {}


# ── hooks ───────────────────────────────────────────────────────────────────────────────────────────────────


def _mock_like_sglang() -> None:
    """Give miles' MockSGLangServer SGLang's /server_info, /v1/models and chat meta_info.prompt_tokens."""
    from fastapi.responses import JSONResponse
    from miles.utils.test_utils.mock_sglang_server import MockSGLangServer

    setup_routes = MockSGLangServer._setup_routes
    handle = MockSGLangServer._handle_generate_like_request

    def setup_with_info(self: Any) -> None:
        setup_routes(self)

        async def server_info() -> JSONResponse:
            return JSONResponse(
                {"max_running_requests": 64, "context_length": 40960, "weight_version": "default"}
            )

        async def models() -> JSONResponse:
            return JSONResponse({"object": "list", "data": [{"id": "mock-model", "max_model_len": 40960}]})

        self.app.get("/server_info")(server_info)
        self.app.get("/get_server_info")(server_info)
        self.app.get("/v1/models")(models)

    async def handle_with_prompt_tokens(self: Any, request: Any, compute: Callable[[Any], Any]) -> Any:
        # around whatever computes the answer (the tests patch that), so the count survives their patches
        def compute_with_prompt_tokens(payload: dict[str, Any]) -> dict[str, Any]:
            response: dict[str, Any] = compute(payload)
            if "choices" in response:
                prompt = payload.get("input_ids")
                if prompt is None:
                    text = self.tokenizer.apply_chat_template(
                        payload.get("messages", []),
                        tokenize=False,
                        add_generation_prompt=True,
                        tools=payload.get("tools"),
                    )
                    prompt = self.tokenizer.encode(text, add_special_tokens=False)
                for choice in response["choices"]:
                    if isinstance(choice.get("meta_info"), dict):
                        choice["meta_info"].setdefault("prompt_tokens", len(prompt))
            return response

        return await handle(self, request, compute_with_prompt_tokens)

    MockSGLangServer._setup_routes = setup_with_info  # type: ignore[method-assign]
    MockSGLangServer._handle_generate_like_request = handle_with_prompt_tokens  # type: ignore[method-assign]


def pytest_configure(config: pytest.Config) -> None:
    global _standin_records, _expected
    _standin_records = rg_miles_records.install_if_missing()
    _expected = _load_expected()
    if MOCK_LIKE_SGLANG:
        _mock_like_sglang()


@pytest.hookimpl(tryfirst=True)  # before -k/-m deselect: the list is checked against the whole run
def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    _install_helper_wrappers()
    if MODE != "rolloutgate":
        return
    if BASELINE_PATH:
        # Only what can be pointed at another server: the tests the baseline saw building one (and the skips,
        # which skip before building it).
        baseline = json.loads(Path(BASELINE_PATH).read_text())["tests"]
        keep = {
            nodeid
            for nodeid, result in baseline.items()
            if result["servers"] or result["outcome"] == "skipped"
        }
        deselected = [item for item in items if item.nodeid not in keep]
        items[:] = [item for item in items if item.nodeid in keep]
        config.hook.pytest_deselected(items=deselected)
        for item in deselected:
            _result(item.nodeid)["outcome"] = "not_transferable"
    # a listed test that does not exist or does not run here (not transferable) is a mistake in the list
    stale = sorted(set(_expected) - {item.nodeid for item in items})
    if stale:
        raise pytest.UsageError(f"{EXPECTED_PATH} lists tests that do not run against rolloutgate: {stale}")
    for item in items:
        entry = _expected.get(item.nodeid)
        if entry:
            # strict: a listed test that passes fails the run, so the list is shrunk as causes are fixed
            item.add_marker(pytest.mark.xfail(reason=f"{entry['cause']}: {entry['why']}", strict=True))


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest) -> Any:
    module_name = getattr(fixturedef.func, "__module__", "")
    if (module_name, fixturedef.argname) not in SERVER_FIXTURES:
        return (yield)
    with _standins_in(sys.modules[module_name]):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    global _current_test
    _current_test = item.nodeid
    # Every router_env and app_client of the suite is a server-building fixture (class-scoped ones built by an
    # earlier test serve this one too).
    for name in sorted({name for _, name in SERVER_FIXTURES} & set(item.fixturenames)):
        _note_server(f"{name} fixture")
    for live in gateway.live_gateways():
        _note_gateway(live)
    try:
        return (yield)
    finally:
        _current_test = None


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
    # tryfirst wrapper: outermost, so this sees the report after pytest's xfail handling has made it
    report: pytest.TestReport = yield
    entry = _expected.get(item.nodeid)
    if call.excinfo is not None and not _result(item.nodeid)["message"]:
        _result(item.nodeid)["message"] = call.excinfo.exconly().strip().splitlines()[0][:400]
    if (
        entry
        and entry["match"]
        and getattr(report, "wasxfail", None) is not None
        and call.excinfo is not None
    ):
        failure = str(call.excinfo.getrepr(style="short"))
        logs = "\n".join(used.log_text() for used in _test_gateways.get(item.nodeid, []))
        if entry["match"] not in failure and entry["match"] not in logs:
            # listed, but failing for another reason than its cause: not the expected failure any more
            report.outcome = "failed"
            del report.wasxfail
            report.longrepr = (
                f"[expected-fail cause {entry['cause']!r} no longer matches: {entry['match']!r} is neither in the "
                f"failure nor in the gateway's log]\n{failure}"
            )
    if report.failed or getattr(report, "wasxfail", None) is not None:
        logs = [live.log_tail(25) for live in gateway.live_gateways()]
        if logs:
            report.sections.append(("rolloutgate log (tail)", "\n---\n".join(logs)))
    return report


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    result = _result(report.nodeid)
    result["duration_s"] = round(result.get("duration_s", 0.0) + report.duration, 2)
    if report.when == "call" or report.outcome != "passed":
        if getattr(report, "wasxfail", None) is not None:
            outcome = "xfailed" if report.skipped else "xpassed"
        elif (
            report.failed
            and isinstance(report.longrepr, str)
            and report.longrepr.startswith("[XPASS(strict)]")
        ):
            outcome = "xpassed_strict"
        elif report.failed and report.when != "call":
            outcome = "error"
        else:
            outcome = report.outcome
        if result["outcome"] in (None, "passed") or outcome in ("failed", "error", "xpassed_strict"):
            result["outcome"] = outcome
        if report.failed and not result["message"]:
            result["message"] = str(report.longrepr).strip().splitlines()[-1][:400] if report.longrepr else ""
        if report.skipped and not result["message"] and isinstance(report.longrepr, tuple):
            result["message"] = str(report.longrepr[2])[:400]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    gateway.stop_all()
    if not REPORT_PATH:
        return
    for nodeid, result in _results.items():
        if nodeid in _expected:
            result["expected_cause"] = _expected[nodeid]["cause"]
        gateways = _test_gateways.get(nodeid, [])
        if gateways:
            result["missing_flags"] = sorted({flag for used in gateways for flag in used.launch.missing})
            result["engine_not_admitted"] = any(used.engine_admitted is False for used in gateways)
    payload = {
        "mode": MODE,
        "exitstatus": int(exitstatus),
        "duration_s": round(time.monotonic() - _started, 1),
        "records_standin": _standin_records,
        "tests": _results,
    }
    Path(REPORT_PATH).parent.mkdir(parents=True, exist_ok=True)
    Path(REPORT_PATH).write_text(json.dumps(payload, indent=1, sort_keys=True))
