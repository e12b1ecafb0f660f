"""Backends, processes and probes for the end-to-end suite (docs/e2e.md).

The same client-side test code runs against four backends, chosen by `E2E_BACKEND`:

- `vllm`: real vLLM engines started by `scripts/e2e_run.sh` (`make test-e2e`), named by `E2E_ENGINE_URLS`;
- `sim` (the default): the simulator in `--api vllm` mode, started here as a subprocess;
- `sglang`: real SGLang 0.5.9 engines started by `scripts/e2e_sglang_run.sh` (`make test-e2e-sglang`);
- `sim-sglang`: the simulator in `--api sglang` mode (`make test-e2e-sim-sglang`).

Each backend speaks one engine API (`API`: "vllm" or "sglang"); a test written for one API only carries
`@pytest.mark.api("sglang")` (or "vllm") and is deselected on the other backends (conftest.py). The engine
control a test drives directly (pause, resume, the weight version, the pause flag) goes through the helpers
below, which speak the backend's API.

Either way the gateway runs as a subprocess (`rolloutgate serve`), exactly as an operator runs it, and every
check of what an engine did reads the engine itself (its `/metrics`, `/is_paused`, `/weight_info`), never the
gateway's own account. Processes are started in their own process group and stopped by PID.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx

__all__ = (
    "API",
    "BACKEND",
    "BACKENDS",
    "METRIC_NAMES",
    "EngineSet",
    "Gateway",
    "ManagedProcess",
    "Metrics",
    "MetricsMonitor",
    "engine_is_paused",
    "engine_weight_version",
    "free_port",
    "pause_engine",
    "resume_engine",
    "scrape",
    "scrape_all",
    "sglang_version",
    "start_extra_engine",
    "start_gateway",
    "start_sim",
    "wait_for",
)

BACKEND = os.environ.get("E2E_BACKEND", "sim")
# backend -> the engine API it speaks
BACKENDS = {"vllm": "vllm", "sim": "vllm", "sglang": "sglang", "sim-sglang": "sglang"}
API = BACKENDS.get(BACKEND, "vllm")
REPO_ROOT = Path(__file__).resolve().parents[2]
SIM_CONTEXT_LEN = 8192  # as the real engines' --max-model-len
T = TypeVar("T")


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineSet:
    """The engines a test session runs against."""

    backend: str  # "vllm", "sim", "sglang" or "sim-sglang"
    urls: tuple[str, ...]
    model: str  # the served model name
    # requests each engine runs at once (vLLM --max-num-seqs, SGLang --max-running-requests)
    max_num_seqs: int
    max_model_len: int
    api: str = "vllm"  # the engine API: "vllm" or "sglang"
    version: str = ""  # SGLang: the version its /server_info states ("0.5.9" real, "0.5.23" the simulator)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# Every ManagedProcess not yet stopped: the session's end stops them (`stop_leftovers`), so a test cut before its
# `finally` (pytest-timeout) leaves no real engine running after the run.
_RUNNING: set[ManagedProcess] = set()


def stop_leftovers() -> list[str]:
    """Stop every process a test started and never stopped; their names."""
    names = sorted(process.name for process in _RUNNING)
    for process in list(_RUNNING):
        process.stop(grace_s=5.0)
    return names


class ManagedProcess:
    """A subprocess in its own process group, its output in a log file, stopped by PID (the whole group)."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        log_path: Path,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.name = name
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = log_path.open("wb")
        self.popen = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            cwd=cwd or REPO_ROOT,
            start_new_session=True,  # own group: stopping it stops its children too
        )
        _RUNNING.add(self)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM, then SIGKILL after `grace_s`. The SIGKILL is in a `finally`: a test cut by pytest-timeout
        while it waits here (the timeout raises inside `wait`) still leaves no engine behind."""
        try:
            if self.is_alive():
                self._signal(signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.popen.wait(timeout=grace_s)
        finally:
            if self.is_alive():
                self._signal(signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.popen.wait(timeout=grace_s)
            self._log.close()
            _RUNNING.discard(self)

    def _signal(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, sig)  # the group is led by our child, whose PID we hold


def _wait_sync(what: str, check: Callable[[], bool], timeout_s: float, process: ManagedProcess) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if not process.is_alive():
            raise RuntimeError(f"{what}: process exited ({process.popen.returncode}):\n{process.log_tail()}")
        if time.monotonic() > deadline:
            tail = process.log_tail()
            process.stop()  # nobody else holds it: a process never ready must not outlive the run
            raise TimeoutError(f"{what}: not ready after {timeout_s} s:\n{tail}")
        time.sleep(0.2)


def _get_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


_SIM_ENGINE = re.compile(r"^engine (\d+) (?:vllm|sglang) (http://\S+)", re.MULTILINE)


def start_sim(
    log_dir: Path, *, engines: int, max_num_seqs: int, time_scale: float, api: str = "vllm", name: str = "sim"
) -> tuple[ManagedProcess, EngineSet]:
    """`rolloutgate sim --api API` on free ports, shaped like the real engines (slots, context length)."""
    argv = [
        sys.executable, "-m", "rolloutgate", "sim",
        "--engines", str(engines), "--base-port", "0", "--api", api,
        "--profile", "default", "--time-scale", str(time_scale),
        "--max-running-requests", str(max_num_seqs), "--context-len", str(SIM_CONTEXT_LEN),
    ]  # fmt: skip
    process = ManagedProcess(name, argv, log_dir / f"{name}.log")
    found: list[str] = []

    def ready() -> bool:
        if len(found) < engines:
            found[:] = [m.group(2).rstrip("/") for m in _SIM_ENGINE.finditer(process.log_path.read_text())]
            return False
        return all(_get_ok(u + "/health") for u in found)

    try:
        _wait_sync("simulator", ready, 30.0, process)
    except BaseException:
        process.stop()
        raise
    model = httpx.get(found[0] + "/v1/models", timeout=5.0).json()["data"][0]["id"]
    return process, EngineSet(
        backend="sim" if api == "vllm" else "sim-sglang",
        urls=tuple(found),
        model=model,
        max_num_seqs=max_num_seqs,
        max_model_len=SIM_CONTEXT_LEN,
        api=api,
        version=sglang_version(found[0]) if api == "sglang" else "",
    )


def sglang_version(url: str) -> str:
    return str(httpx.get(url + "/server_info", timeout=30.0).json().get("version", ""))


def start_extra_engine(
    engines: EngineSet, log_dir: Path, name: str, *, port: int | None = None, extra_args: Sequence[str] = ()
) -> tuple[ManagedProcess, str]:
    """One more engine of the session's kind, owned by the caller (a test that kills it): a real SGLang
    launched as scripts/e2e_sglang_run.sh launches its engines (keep the two in step), or a one-engine
    simulator. Returns the process (its group holds the whole engine) and the engine's URL once healthy.
    `port`: a real engine's port (a restart on the one it had), else one the OS gives. `extra_args`: more
    server flags of a real engine (e.g. `--stream-output`)."""
    if engines.backend in ("sim", "sim-sglang"):
        process, one = start_sim(
            log_dir, engines=1, max_num_seqs=engines.max_num_seqs, time_scale=3.0, api=engines.api, name=name
        )
        return process, one.urls[0]
    if engines.backend != "sglang":
        raise NotImplementedError(f"no extra engine for backend {engines.backend!r}")
    python, model = os.environ["E2E_ENGINE_PYTHON"], os.environ["E2E_MODEL_DIR"]
    port = port or free_port()
    work = log_dir / name
    for sub in ("tmp", "cache"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    argv = [
        python, "-m", "sglang.launch_server", "--model-path", model, "--served-model-name", engines.model,
        "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--attention-backend", "torch_native",
        "--sampling-backend", "pytorch", "--disable-overlap-schedule", "--dtype", "float32",
        "--context-length", str(engines.max_model_len), "--max-running-requests", str(engines.max_num_seqs),
        "--max-total-tokens", "65536", "--enable-metrics", *extra_args,
    ]  # fmt: skip
    env = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "DO_NOT_TRACK": "1",
        "SGLANG_USE_CPU_ENGINE": "1",
        "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "0",  # as scripts/e2e_sglang_run.sh, which says why
        "OMP_NUM_THREADS": "1",
        "TMPDIR": str(work / "tmp"),
        "XDG_CACHE_HOME": str(work / "cache"),
    }
    process = ManagedProcess(name, argv, log_dir / f"{name}.log", env=env, cwd=work)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_sync(name, lambda: _get_ok(url + "/health"), 240.0, process)
    except BaseException:
        process.stop()
        raise
    return process, url


# ---- engine control, in the backend's API -----------------------------------------------------------


async def pause_engine(client: httpx.AsyncClient, engines: EngineSet, url: str, mode: str) -> httpx.Response:
    """Pause one engine directly, as a trainer does. vLLM modes: keep, abort, wait; SGLang: abort, retract,
    in_place."""
    if engines.api == "sglang":
        return await client.post(url + "/pause_generation", json={"mode": mode})
    return await client.post(url + "/pause", params={"mode": mode})


async def resume_engine(client: httpx.AsyncClient, engines: EngineSet, url: str) -> httpx.Response:
    if engines.api == "sglang":
        return await client.post(url + "/continue_generation", json={})
    return await client.post(url + "/resume")


async def engine_weight_version(client: httpx.AsyncClient, engines: EngineSet, url: str) -> str:
    """The weight version the engine states: vLLM `/weight_info`, SGLang `/model_info`."""
    path = "/model_info" if engines.api == "sglang" else "/weight_info"
    return str((await client.get(url + path)).json()["weight_version"])


async def engine_is_paused(client: httpx.AsyncClient, engines: EngineSet, url: str) -> bool | None:
    """The engine's own pause flag: vLLM `/is_paused`; SGLang `/ready` 503 (0.5.23). None where the engine
    states none: SGLang 0.5.9 has no `/ready` (404, paused or not)."""
    if engines.api != "sglang":
        return bool((await client.get(url + "/is_paused")).json()["is_paused"])
    status = (await client.get(url + "/ready")).status_code
    return None if status == 404 else status == 503


@dataclass(frozen=True, slots=True, kw_only=True)
class Gateway:
    url: str
    process: ManagedProcess
    flags: tuple[tuple[str, str], ...]

    @property
    def v1(self) -> str:
        return self.url + "/v1"


_SERVING = re.compile(r"rolloutgate serving on (http://\S+)")


def start_gateway(engines: EngineSet, log_dir: Path, flags: Mapping[str, object]) -> Gateway:
    """`rolloutgate serve` in front of the engines on a free port; ready once /health answers 200 and
    /workers lists every engine."""
    argv = [sys.executable, "-m", "rolloutgate", "serve", "--host", "127.0.0.1", "--port", "0"]
    for url in engines.urls:
        argv += ["--engine", url]
    items = tuple(sorted((k, str(v)) for k, v in flags.items()))
    for key, value in items:
        argv += [f"--{key.replace('_', '-')}", value]
    name = "gateway-" + "-".join(f"{k}{v}" for k, v in items) if items else "gateway"
    process = ManagedProcess(name, argv, log_dir / f"{name}.log")
    found: list[str] = []

    def ready() -> bool:
        if not found:
            match = _SERVING.search(process.log_path.read_text(errors="replace"))
            if not match:
                return False
            found.append(match.group(1).rstrip("/"))
        try:
            if httpx.get(found[0] + "/health", timeout=2.0).status_code != 200:
                return False
            workers = httpx.get(found[0] + "/workers", timeout=2.0).text
        except httpx.HTTPError:
            return False
        return all(url in workers for url in engines.urls)

    _wait_sync("gateway", ready, 60.0, process)
    return Gateway(url=found[0], process=process, flags=items)


# ---- Prometheus text, read from the engines themselves -------------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


# The names the suite reads, per engine API. SGLang 0.5.9's queue histogram `sglang:queue_time_seconds` has a
# 1.0 s bucket, as vLLM's has (0.0, 0.1, 0.2, 0.5, 1.0, 2.0, ...).
METRIC_NAMES = {
    "vllm": {
        "running": "vllm:num_requests_running",
        "waiting": "vllm:num_requests_waiting",
        "generated": "vllm:generation_tokens_total",
        "queue_time": "vllm:request_queue_time_seconds",
        "progress": "vllm:generation_tokens_total",  # vLLM counts every step
    },
    "sglang": {
        "running": "sglang:num_running_reqs",
        "waiting": "sglang:num_queue_reqs",
        "generated": "sglang:generation_tokens_total",
        "queue_time": "sglang:queue_time_seconds",
        # SGLang counts generation_tokens_total when a request finishes (0.5.9 measured, 0.5.23's source alike):
        # while a call runs, only realtime_tokens_total{mode="decode"} moves (each decode step)
        "progress": "sglang:realtime_tokens_total",
    },
}
_NAMES = METRIC_NAMES[API]


@dataclass(frozen=True, slots=True, kw_only=True, repr=False)
class Metrics:
    """One scrape of one engine's /metrics."""

    url: str
    at: float  # time.monotonic() when the answer arrived
    samples: tuple[tuple[str, tuple[tuple[str, str], ...], float], ...]

    @classmethod
    def parse(cls, url: str, text: str, at: float) -> Metrics:
        samples = []
        for line in text.splitlines():
            match = _SAMPLE.match(line)
            if match is None or line.startswith("#"):
                continue
            labels = tuple(sorted(_LABEL.findall(match.group(3) or "")))
            samples.append((match.group(1), labels, float(match.group(4))))
        return cls(url=url, at=at, samples=tuple(samples))

    def __repr__(self) -> str:
        return (
            f"<Metrics {self.url} running={self.running} waiting={self.waiting} generated={self.generated}"
            f" progress={self.progress}>"
        )

    def names(self) -> set[str]:
        return {name for name, _, _ in self.samples}

    def value(self, name: str, **labels: str) -> float:
        """Sum of the samples called `name` whose labels include `labels`; NaN if there is none."""
        wanted = set(labels.items())
        values = [v for n, ls, v in self.samples if n == name and wanted <= set(ls)]
        return sum(values) if values else math.nan

    @property
    def running(self) -> float:
        return self.value(_NAMES["running"])

    @property
    def waiting(self) -> float:
        return self.value(_NAMES["waiting"])

    @property
    def generated(self) -> float:
        """Generated tokens, exact once the requests have finished (SGLang counts them at the finish)."""
        return self.value(_NAMES["generated"])

    @property
    def progress(self) -> float:
        """Tokens generated so far, live while requests run: what shows that an engine works or stands still."""
        return self.value(_NAMES["progress"], mode="decode") if API == "sglang" else self.generated

    def finished(self, **labels: str) -> float:
        return self.value("vllm:request_success_total", **labels)

    def queued_over(self, seconds: float) -> float:
        """Requests that waited in the engine's own queue longer than `seconds` (a bucket bound of
        `vllm:request_queue_time_seconds` or `sglang:queue_time_seconds`), ever. Unlike the waiting gauge this
        is exact after the fact."""
        name = _NAMES["queue_time"]
        for sample, labels, value in self.samples:
            le = dict(labels).get("le")
            if sample == name + "_bucket" and le not in (None, "+Inf") and float(le) == seconds:
                return self.value(name + "_count") - value
        raise AssertionError(f"{self.url}: no {name} bucket at {seconds} s")


async def scrape(url: str) -> Metrics:
    # A fresh connection every time: a pooled one can meet uvicorn closing it, and a scrape must not fail.
    async with httpx.AsyncClient(timeout=30.0) as client:
        response = await client.get(url + "/metrics")
        response.raise_for_status()
        return Metrics.parse(url, response.text, time.monotonic())


async def scrape_all(urls: Iterable[str]) -> dict[str, Metrics]:
    results = await asyncio.gather(*(scrape(u) for u in urls))
    return {m.url: m for m in results}


@dataclass(eq=False)
class MetricsMonitor:
    """Scrapes every engine in a loop while a test runs, keeping every sample.

    On this 2-core machine a scrape can take seconds while the engines generate (their API server competes
    for the CPU), so a monitor sees fewer samples under load; checks use what it saw, never a count of
    samples."""

    urls: tuple[str, ...]
    interval_s: float = 0.2
    samples: list[Metrics] = field(default_factory=list)
    _task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> MetricsMonitor:
        self.samples.extend((await scrape_all(self.urls)).values())
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.samples.extend((await scrape_all(self.urls)).values())

    async def _run(self) -> None:
        while True:
            for url in self.urls:
                with contextlib.suppress(httpx.HTTPError):  # a dropped scrape is a missing sample
                    self.samples.append(await scrape(url))
            await asyncio.sleep(self.interval_s)

    def of(self, url: str) -> list[Metrics]:
        return [m for m in self.samples if m.url == url]

    def max(self, attribute: str, url: str | None = None) -> float:
        chosen = self.samples if url is None else self.of(url)
        return max(getattr(m, attribute) for m in chosen)


async def wait_for(
    what: str,
    probe: Callable[[], Awaitable[T]],
    accept: Callable[[T], bool],
    timeout_s: float,
    every_s: float = 0.2,
) -> T:
    """Poll `probe` until `accept` holds; fail with the last value seen after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = await probe()
        if accept(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s; last seen {value!r}")
        await asyncio.sleep(every_s)


async def settled(urls: Iterable[str], timeout_s: float = 10.0, every_s: float = 0.5) -> dict[str, Metrics]:
    """The engines' metrics once no engine's progress counter moved over `every_s`: a pause answers before the
    decode step in flight lands (docs/e2e.md), so a frozen-counter check starts from here. Fails after
    `timeout_s` if an engine keeps generating."""
    chosen = tuple(urls)
    deadline = time.monotonic() + timeout_s
    before = await scrape_all(chosen)
    while True:
        await asyncio.sleep(every_s)
        now = await scrape_all(chosen)
        if all(now[u].progress == before[u].progress for u in chosen):
            return now
        if time.monotonic() > deadline:
            raise AssertionError(f"the engines kept generating for {timeout_s} s: {before!r} then {now!r}")
        before = now


def json_find(value: Any, key: str) -> list[Any]:
    """Every value stored under `key` anywhere in a JSON document."""
    found: list[Any] = []
    if isinstance(value, dict):
        for k, v in value.items():
            if k == key:
                found.append(v)
            found.extend(json_find(v, key))
    elif isinstance(value, list):
        for item in value:
            found.extend(json_find(item, key))
    return found
