"""Fixtures of the end-to-end suite: the engines (real vLLM or the simulator), gateways in front of them, and a
check before every test that the engines are idle and unpaused (so one test's leftovers never pass for the
next one's effect)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Generator, Iterator
from pathlib import Path

import httpx
import pytest
from tests.e2e.harness import (
    API,
    BACKEND,
    BACKENDS,
    EngineSet,
    Gateway,
    Metrics,
    sglang_version,
    start_gateway,
    start_sim,
    stop_leftovers,
)

# LiteLLM tries to download a price map at import without this; the machine has no internet.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

MakeGateway = Callable[..., Gateway]
IDLE_TIMEOUT_S = 60.0


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "api(name): runs only on backends that speak this engine API")
    config.addinivalue_line("markers", "backend(*names): runs only on these backends")


def is_selected(item: pytest.Item) -> bool:
    api, backend = item.get_closest_marker("api"), item.get_closest_marker("backend")
    return (api is None or API in api.args) and (backend is None or BACKEND in backend.args)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    keep, drop = [], []
    for item in items:
        (keep if is_selected(item) else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(scope="session", autouse=True)
def no_process_outlives_the_run() -> Iterator[None]:
    """At the session's end, stop whatever a test started and did not stop (one cut by its timeout)."""
    yield
    if left := stop_leftovers():
        print(f"\nstopped at the session's end, left running by a cut test: {', '.join(left)}")


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gateway and simulator logs: under E2E_LOG_DIR (make test-e2e: .e2e/) or a pytest temp folder."""
    configured = os.environ.get("E2E_LOG_DIR")
    return Path(configured) / "logs" if configured else tmp_path_factory.mktemp("e2e-logs")


@pytest.fixture(scope="session")
def engines(log_dir: Path) -> Iterator[EngineSet]:
    if BACKEND in ("vllm", "sglang"):
        urls = tuple(u.rstrip("/") for u in os.environ.get("E2E_ENGINE_URLS", "").split(",") if u)
        if not urls:
            raise pytest.UsageError(f"E2E_BACKEND={BACKEND} needs E2E_ENGINE_URLS (make test-e2e* sets it)")
        model = httpx.get(urls[0] + "/v1/models", timeout=10.0).json()["data"][0]
        yield EngineSet(
            backend=BACKEND,
            urls=urls,
            model=model["id"],
            max_num_seqs=int(os.environ.get("E2E_MAX_NUM_SEQS", "4")),
            max_model_len=int(model.get("max_model_len") or 2048),
            api=API,
            version=sglang_version(urls[0]) if API == "sglang" else "",
        )
    elif BACKEND in ("sim", "sim-sglang"):
        process, engine_set = start_sim(
            log_dir,
            engines=2,
            max_num_seqs=int(os.environ.get("E2E_MAX_NUM_SEQS", "4")),
            time_scale=float(os.environ.get("E2E_SIM_TIME_SCALE", "3")),
            api=API,
        )
        try:
            yield engine_set
        finally:
            process.stop()
    else:
        raise pytest.UsageError(f"E2E_BACKEND must be one of {', '.join(BACKENDS)}, not {BACKEND!r}")


@pytest.fixture(scope="session")
def gateways(engines: EngineSet, log_dir: Path) -> Iterator[MakeGateway]:
    """`gateways(timeout=2, retry_grace=1)`: a gateway with these flags, started once per session."""
    started: dict[tuple[tuple[str, str], ...], Gateway] = {}

    def get(**flags: object) -> Gateway:
        key = tuple(sorted((k, str(v)) for k, v in flags.items()))
        gateway = started.get(key)
        if gateway is None or not gateway.process.is_alive():
            gateway = started[key] = start_gateway(engines, log_dir, flags)
        return gateway

    yield get
    for gateway in started.values():
        gateway.process.stop()


@pytest.fixture(autouse=True)
def engines_idle(engines: EngineSet) -> None:
    """Before each test: no engine paused, nothing running or waiting on any engine. SGLang 0.5.9 states no
    pause flag, so it is told to continue whatever its state (a no-op when it runs)."""
    with httpx.Client(timeout=30.0) as client:
        for url in engines.urls:
            if engines.api == "sglang":
                client.post(url + "/continue_generation", json={}).raise_for_status()
            elif client.get(url + "/is_paused").json().get("is_paused"):
                client.post(url + "/resume").raise_for_status()
        deadline = time.monotonic() + IDLE_TIMEOUT_S
        while True:
            seen = [Metrics.parse(u, client.get(u + "/metrics").text, time.monotonic()) for u in engines.urls]
            if all(m.running == 0 and m.waiting == 0 for m in seen):
                return
            if time.monotonic() > deadline:
                pytest.fail(f"engines still busy {IDLE_TIMEOUT_S} s after the previous test: {seen}")
            time.sleep(0.25)


_LOG_MARKS = pytest.StashKey[tuple[Path, dict[Path, int]]]()
LOG_LINES_ON_FAILURE = 80  # of each gateway's log, what it wrote during a failed test


@pytest.fixture(autouse=True)
def gateway_logs_marked(request: pytest.FixtureRequest, log_dir: Path) -> None:
    """Where each gateway log ends as the test starts: a failure report shows what the gateways wrote during
    the test (CI keeps no log folder)."""
    request.node.stash[_LOG_MARKS] = (log_dir, {p: p.stat().st_size for p in log_dir.glob("gateway*.log")})


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if call.when == "call" and report.failed and _LOG_MARKS in item.stash:
        folder, marks = item.stash[_LOG_MARKS]
        for path in sorted(folder.glob("gateway*.log")):
            with path.open("rb") as log:
                log.seek(marks.get(path, 0))
                lines = log.read().decode("utf-8", "replace").splitlines()[-LOG_LINES_ON_FAILURE:]
            if lines:
                report.sections.append((f"{path.name} during the test", "\n".join(lines)))
    return report
