"""`rolloutgate serve` standing where miles' tests build miles' own servers (make test-miles, docs/miles.md).

miles' fixtures build a server in two steps: an object made from an `args` namespace (`SessionServer(args,
backend_url)`, `MilesRouter(args)`, or `FastAPI()` + `setup_session_routes(app, backend, args)`), then a
server around its `.app` (`UvicornThreadServer(app, host, port).start()`, or `TestClient(app)`). The stand-ins
here take the same calls: the first turns `args` into `rolloutgate serve` flags (the docs/miles.md deployment-2
flags plus a translation of each miles setting that has a flag), the second starts the gateway as a process of
the main .venv on the host and port the fixture chose, and stops it by its PID.

Which flags exist is read from `rolloutgate serve --help` once per run: a miles setting whose flag is not there
yet is recorded as missing (the test still runs), and is passed as soon as the flag lands.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
ROLLOUTGATE = Path(os.environ.get("RG_MILES_ROLLOUTGATE", REPO / ".venv" / "bin" / "rolloutgate"))
LOG_DIR = Path(os.environ.get("RG_MILES_LOG_DIR", REPO / "out" / "miles" / "gateway-logs"))
START_TIMEOUT_S = 60.0
# The engine is given at start and is already listening (every fixture starts its mock first): an engine the
# gateway can admit is admitted on its first probe, in milliseconds. Waiting longer only slows the runs where
# it cannot be admitted; those are reported by the test's own failure.
ENGINE_ADMIT_WAIT_S = 1.0
# Deployment-2 flags (docs/miles.md) plus what a test run needs: a call that finds no engine fails in 2 s
# instead of outliving the tests' 10 s client timeouts, and a stop does not wait out the 30 s drain.
BASE_FLAGS = ("--shutdown-grace", "1", "--no-engine-grace", "2", "--log-level", "info")
SESSION_FLAGS = (
    "--session-engine-route", "chat", "--samples-weight-versions", "strings", "--session-error-shape", "miles"
)  # fmt: skip
PICKERS = ("drop_retries", "drop_same_prompt", "keep_all")


@cache
def serve_flags() -> frozenset[str]:
    """The long options `rolloutgate serve --help` lists."""
    out = subprocess.run(
        [str(ROLLOUTGATE), "serve", "--help"], capture_output=True, text=True, check=True, env=_gateway_env()
    ).stdout
    return frozenset(word.strip("[],") for word in out.split() if word.startswith(("--", "[--")))


def os_given_port(_start_port: int = 0) -> int:
    """Stands for miles' `find_available_port(start)`: the OS picks (miles scans from a fixed start port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class Launch:
    """One `rolloutgate serve` command line, made from a miles `args` namespace."""

    kind: str  # "session" (SessionServer / setup_session_routes) or "router" (MilesRouter)
    flags: list[str] = field(default_factory=list)
    engine: str | None = None
    missing: list[str] = field(default_factory=list)  # "miles_setting=value -> --flag (not in rolloutgate)"
    not_applicable: list[str] = field(default_factory=list)

    def flag(
        self, setting: str, value: Any, candidates: tuple[str, ...], rendered: str | None = None
    ) -> None:
        """Pass the first candidate flag rolloutgate has, or record the setting as missing its flag."""
        available = serve_flags()
        for candidate in candidates:
            if candidate in available:
                self.flags += [candidate] if rendered == "" else [candidate, rendered or str(value)]
                return
        self.missing.append(f"{setting}={value!r} -> {candidates[0]} (no such flag)")


def _tokenizer_dir(hf_checkpoint: str) -> str | None:
    """The local hub snapshot of a checkpoint name (HF_HUB_OFFLINE: the cache scripts/miles_env.sh laid)."""
    if os.path.isdir(hf_checkpoint):
        return hf_checkpoint
    from huggingface_hub import snapshot_download

    try:
        return str(snapshot_download(hf_checkpoint, local_files_only=True))
    except Exception:
        return None


def launch_from_args(args: Any, backend_url: str | None, *, kind: str = "session") -> Launch:
    """Translate a miles `args` namespace (SessionServer or MilesRouter settings) into `rolloutgate serve`."""
    launch = Launch(kind=kind)
    settings = dict(vars(args))
    if kind == "session":
        launch.flags += SESSION_FLAGS
    if backend_url:
        # miles' session server talks to one SGLang router or engine: the family is known, say it
        launch.engine = backend_url
        launch.flags += ["--engine", f"sglang+{backend_url}"]
    if (
        os.environ.get("RG_MILES_FIXED_TEMPLATE")
        and settings.get("tito_model")
        and not settings.get("chat_template_path")
    ):
        settings.update(
            _fixed_template(str(settings["tito_model"]), settings.get("apply_chat_template_kwargs"))
        )
    for setting, value in settings.items():
        _translate(launch, setting, value)
    return launch


def _fixed_template(tito_model: str, kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """RG_MILES_FIXED_TEMPLATE: the family's fixed template miles registers (with the kwargs it pins), where
    the test names none, as a miles user passes it with --chat-template-path: the same tests on it."""
    from miles.utils.chat_template_utils import resolve_fixed_chat_template

    path, extra = resolve_fixed_chat_template(tito_model)
    fixed: dict[str, Any] = {"apply_chat_template_kwargs": {**(kwargs or {}), **extra}}
    if path is not None:
        fixed["chat_template_path"] = path
    return fixed


def _translate(launch: Launch, setting: str, value: Any) -> None:
    """One miles setting: a flag, a missing flag, or nothing rolloutgate's server would take."""
    if value is None or value is False:
        return  # miles' default: off
    if setting == "hf_checkpoint":
        tokenizer = _tokenizer_dir(str(value))
        if tokenizer is None:
            launch.missing.append(f"hf_checkpoint={value!r}: no local snapshot for --tokenizer")
        else:
            launch.flags += ["--tokenizer", tokenizer]
    elif setting == "chat_template_path":
        launch.flag(setting, value, ("--chat-template-path", "--chat-template"))
    elif setting == "apply_chat_template_kwargs":
        if value:
            launch.flag(
                setting, value, ("--chat-template-kwargs", "--apply-chat-template-kwargs"), json.dumps(value)
            )
    elif setting == "miles_router_timeout":
        launch.flags += ["--timeout", str(value)]
    elif setting == "use_session_server":
        if value == "v2":
            launch.flags.append("--session-tree")
    elif setting == "trajectory_manager":
        if value != "linear_trajectory":
            launch.missing.append(f"trajectory_manager={value!r} (rolloutgate: linear or --session-tree)")
    elif setting == "session_sample_picker_path":
        picker = str(value).rsplit(".", 1)[-1]
        from miles.utils.misc import function_registry

        if (registered := function_registry.get(str(value))) is not None:
            # a test put its own picker in miles' function registry under that path: passed by its name when
            # rolloutgate has a picker of that name (`_keep_all_picker`: keep_all), missing otherwise
            picker = getattr(registered, "__name__", "").strip("_").removesuffix("_picker")
        if picker in PICKERS:
            launch.flags += ["--session-picker", picker]
        else:
            launch.missing.append(f"session_sample_picker_path={value!r} (pickers: {', '.join(PICKERS)})")
    elif setting == "session_sample_postprocessor_path":
        if not str(value).endswith(".default_postprocess"):
            launch.missing.append(f"session_sample_postprocessor_path={value!r} (no postprocessor hook)")
    elif setting == "use_rollout_routing_replay":
        launch.flag(
            setting, value, ("--session-routing-replay", "--routing-replay", "--return-routed-experts"), ""
        )
    elif setting == "use_rollout_indexer_replay":
        launch.flag(
            setting, value, ("--session-indexer-replay", "--indexer-replay", "--return-indexer-topk"), ""
        )
    elif setting == "pause_generation_mode":
        if value == "in_place":  # the KV stays: routing replay asks only for the rows past the checkpoint
            launch.flag(setting, value, ("--session-replay-added-rows",), "")
    elif setting == "lora_rank":
        if value:
            from miles.utils.lora import (
                LORA_ADAPTER_NAME,  # the adapter name miles' server sends as lora_path
            )

            launch.flag(setting, value, ("--session-lora-path", "--lora-path"), LORA_ADAPTER_NAME)
    elif setting == "save_debug_trajectory_data":
        launch.missing.append(f"save_debug_trajectory_data={value!r} (no such setting)")
    elif setting == "sglang_speculative_algorithm":
        launch.missing.append(f"sglang_speculative_algorithm={value!r} (no such setting)")
    elif setting == "sglang_router_ip":
        pass  # the host the fixture binds: the stand-in server passes it
    elif setting == "sglang_router_port":
        pass  # likewise the port
    elif setting == "rollout_health_check_interval":
        launch.flags += ["--health-interval", str(value)]
    elif setting == "miles_router_health_check_failure_threshold":
        launch.flags += ["--health-failures", str(value)]
    else:
        # Settings no server flag stands for: miles' TITO family (rolloutgate renders with the checkpoint's own
        # template), the instance id (rolloutgate reports its own on /health), the rollout and agent side's
        # settings the parity helper keeps on the same namespace, miles' router connection pool, R3 shapes
        # used by in-process record decoding.
        launch.not_applicable.append(f"{setting}={value!r}")


# ── the running gateway ─────────────────────────────────────────────────────────────────────────────────────

_LIVE: dict[int, Gateway] = {}
_LIVE_LOCK = threading.Lock()
_SEQUENCE = iter(range(1, 1_000_000))
# The plugin's hook: told of each gateway as it starts (the test then running gets its missing flags).
on_launch: Callable[[Gateway], None] = lambda gateway: None  # noqa: E731


def _gateway_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the miles suite's import path is not the gateway's (its own .venv)
    env["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    return env


class Gateway:
    """`rolloutgate serve` as a child process, stopped by its PID (it stays in the run's process group, so the
    driver's stop of a run that overran its time takes it too)."""

    def __init__(self, launch: Launch, host: str, port: int) -> None:
        self.launch = launch
        self.host = host
        self.port = port
        self.number = next(_SEQUENCE)
        self.log_path = LOG_DIR / f"gateway-{os.getpid()}-{self.number:03d}-{launch.kind}.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.engine_admitted: bool | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def command(self) -> list[str]:
        return [
            str(ROLLOUTGATE),
            "serve",
            "--host",
            self.host,
            "--port",
            str(self.port),
            *BASE_FLAGS,
            *self.launch.flags,
        ]

    def start(self) -> None:
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            log.write((" ".join(self.command) + "\n").encode())
            log.flush()
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=_gateway_env()
            )
        with _LIVE_LOCK:
            _LIVE[self.process.pid] = self
        on_launch(self)
        self._wait_serving()
        if self.launch.engine:
            self.engine_admitted = self._wait_engine_admitted()

    def _wait_serving(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"rolloutgate serve exited {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2.0):
                    return
            except urllib.error.HTTPError:
                return  # it answers: serving
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"rolloutgate serve did not answer in {START_TIMEOUT_S:.0f} s:\n{self.log_tail()}")

    def _wait_engine_admitted(self) -> bool:
        deadline = time.monotonic() + ENGINE_ADMIT_WAIT_S
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/workers", timeout=2.0) as answer:
                    # a registered engine that has not joined is listed too, as `pending`
                    if any(w.get("healthy") for w in json.load(answer).get("workers", [])):
                        return True
            except (OSError, ValueError):
                pass
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    def stop(self) -> None:
        process = self.process
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=10.0)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10.0)
        with _LIVE_LOCK:
            _LIVE.pop(process.pid, None)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])


def stop_all() -> None:
    """Every gateway still running (a fixture torn down early, an interrupted run)."""
    with _LIVE_LOCK:
        live = list(_LIVE.values())
    for gateway in live:
        gateway.stop()


# ── stand-ins for miles' server-building names, swapped in while a fixture builds its server ─────────────────


class GatewayApp:
    """What `SessionServer(...).app` / `MilesRouter(...).app` / a `FastAPI()` with session routes stand for."""

    def __init__(self, launch: Launch | None = None) -> None:
        self.launch = launch
        self.gateway: Gateway | None = None  # the gateway serving it, once a server stand-in made one


class SessionServerStandIn:
    """miles' `SessionServer(args, backend_url)`: only its `.app` is read by the fixtures."""

    def __init__(self, args: Any, backend_url: str) -> None:
        self.app = GatewayApp(launch_from_args(args, backend_url))


class MilesRouterStandIn:
    """miles' `MilesRouter(args)` as the tests' `router_env` builds it: `.app`, served by the stand-in below."""

    def __init__(self, args: Any, verbose: bool = False) -> None:
        self.app = GatewayApp(launch_from_args(args, None, kind="router"))

    @property
    def worker_request_counts(self) -> dict[str, int]:
        """miles' per-worker count of requests in flight, as the gateway serving this router lists them
        (`GET /workers`: each worker, joined or pending, with its `in_flight`)."""
        if self.app.gateway is None:
            raise AttributeError("MilesRouter.worker_request_counts: the router is not served yet")
        with urllib.request.urlopen(f"{self.app.gateway.url}/workers", timeout=5.0) as answer:
            return {worker["url"]: worker["in_flight"] for worker in json.load(answer)["workers"]}

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"MilesRouter.{name}: the test reads miles' router object in process; rolloutgate runs as its own "
            "process (see GET /workers for its workers)"
        )


class UvicornThreadServerStandIn:
    """miles' `UvicornThreadServer(app, host, port)`: `.start()`, `.stop()`, `.url`."""

    def __init__(self, app: Any, host: str, port: int) -> None:
        if not isinstance(app, GatewayApp) or app.launch is None:
            raise TypeError(f"not a stood-in miles server app: {app!r}")
        self.host = host
        self.port = port
        self.gateway = app.gateway = Gateway(app.launch, host, port)

    @property
    def url(self) -> str:
        return self.gateway.url

    def start(self) -> None:
        self.gateway.start()

    def stop(self) -> None:
        self.gateway.stop()


def fastapi_standin(*_args: Any, **_kwargs: Any) -> GatewayApp:
    """`FastAPI()` in a fixture that adds miles' session routes to it (test_session_samples_op*.py)."""
    return GatewayApp()


def setup_session_routes_standin(app: GatewayApp, backend: Any, args: Any) -> None:
    """`setup_session_routes(app, backend, args)`: the app becomes a session gateway from `args`.

    The backend those fixtures pass never answers (collect_samples must not proxy): no engine is given.
    """
    app.launch = launch_from_args(args, None)


class TestClientStandIn:
    """`TestClient(app)` over a stood-in app: the gateway on an OS-given port, an httpx client bound to it."""

    __test__ = False  # not a test class, whatever pytest's name patterns say

    def __init__(self, app: GatewayApp, *_args: Any, **_kwargs: Any) -> None:
        if app.launch is None:
            raise TypeError("TestClient over an app without miles' session routes")
        self.gateway = Gateway(app.launch, "127.0.0.1", os_given_port())
        self.client: Any = None

    def __enter__(self) -> Any:
        import httpx  # miles' TestClient is an httpx.Client: the tests call it the same way

        self.gateway.start()
        self.client = httpx.Client(base_url=self.gateway.url, timeout=10.0)
        return self.client

    def __exit__(self, *exc_info: object) -> None:
        if self.client is not None:
            self.client.close()
        self.gateway.stop()


# Each name a miles fixture builds its server with, and what stands for it while the fixture runs.
STANDINS: dict[str, Any] = {
    "SessionServer": SessionServerStandIn,
    "MilesRouter": MilesRouterStandIn,
    "UvicornThreadServer": UvicornThreadServerStandIn,
    "find_available_port": os_given_port,
    "FastAPI": fastapi_standin,
    "setup_session_routes": setup_session_routes_standin,
    "TestClient": TestClientStandIn,
}


def live_gateways() -> Iterator[Gateway]:
    with _LIVE_LOCK:
        yield from list(_LIVE.values())


if __name__ == "__main__":  # a quick look at what a namespace translates to
    from types import SimpleNamespace

    print(
        launch_from_args(
            SimpleNamespace(**json.loads(sys.argv[1])), sys.argv[2] if len(sys.argv) > 2 else None
        )
    )
