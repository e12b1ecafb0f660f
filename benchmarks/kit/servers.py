"""The processes a benchmark runs: the simulated engines, the gateway, the SGLang Model Gateway (two releases), a
benchmark's own helper processes; pinning.

Theory of operation: every server runs in a process of its own, started here and stopped by its pid (never
by name), so that its CPU time and memory can be read from `/proc/<pid>` (proc.py) without touching the
others. With two or more CPUs each process is pinned with `taskset`; `repin` moves a running process (and its
threads) between cells so that one engine process serves every cell of a run. The SGLang Model Gateway runs
from its own venv, one per release (`ROUTERS`: `sglang-router`, the package miles installs, and `smg`, its
current release), which `make bench-tools` installs (mk/bench.mk); the benchmarks only look for them
(`installed_router`). A benchmark's own processes (`python -m benchmarks...`) get this repository on their
`PYTHONPATH` (`module_command`, `child_env`), wherever they are started from.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.kit.proc import cpu_count

__all__ = (
    "REPOSITORY",
    "ROUTERS",
    "ManagedProcess",
    "RouterKind",
    "child_env",
    "free_port",
    "installed_router",
    "module_command",
    "pin_prefix",
    "repin",
    "rolloutgate_process",
    "rolloutgate_subprocess",
    "router_version",
    "set_log_dir",
    "start_gateway",
    "start_router",
    "start_sim",
    "wait_http_ok",
)

REPOSITORY = Path(__file__).resolve().parents[2]  # the folder that holds benchmarks/


@dataclass(frozen=True, slots=True)
class RouterKind:
    """One release of the SGLang Model Gateway: its package, the venv mk/bench.mk installs it in (a stamp file
    written there once it imports), and the module that launches it (both take the same flags)."""

    name: str
    venv: Path
    module: str

    @property
    def stamp(self) -> Path:
        return self.venv / f".installed-{self.name}"


ROUTERS = {
    kind.name: kind
    for kind in (
        RouterKind("sglang-router", Path(".venv-bench-router"), "sglang_router.launch_router"),  # miles' pin
        RouterKind("smg", Path(".venv-bench-smg"), "smg.launch_router"),  # the newest release
    )
}
_log_dir: Path | None = None  # where the servers' stderr goes (None: discarded)


def module_command(module: str, *, cpus: str | None = None) -> list[str]:
    """`python -m module` (pinned to `cpus` where possible); run it with `env=child_env()`."""
    return [*pin_prefix(cpus), sys.executable, "-m", module]


def child_env() -> dict[str, str]:
    """This process's environment with the repository first on PYTHONPATH, so `-m benchmarks...` resolves."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(REPOSITORY) + (os.pathsep + path if path else "")}


def set_log_dir(path: Path | None) -> Path | None:
    """Send the stderr of every server started from now on to `path/<name>-<n>.log`; returns the folder used
    until now."""
    global _log_dir
    previous, _log_dir = _log_dir, path
    if path is not None:
        path.mkdir(parents=True, exist_ok=True)
    return previous


def _spawn(command: list[str], name: str, *, stdout: Any) -> subprocess.Popen[str]:
    """Start a server; its stderr goes to a log file of the log folder, or nowhere."""
    if _log_dir is None:
        return subprocess.Popen(command, stdout=stdout, stderr=subprocess.DEVNULL, text=True)
    index = len(list(_log_dir.glob(f"{name}-*.log")))
    with open(_log_dir / f"{name}-{index}.log", "w") as log_file:
        return subprocess.Popen(command, stdout=stdout, stderr=log_file, text=True)


def pin_prefix(cpus: str | None) -> list[str]:
    """`taskset -c CPUS` when pinning is possible and asked for, else nothing."""
    if cpus is None or shutil.which("taskset") is None or cpu_count() < 2:
        return []
    return ["taskset", "-c", cpus]


def repin(pid: int, cpus: str | None) -> None:
    """Move a running process and all its threads to `cpus` (no-op where pinning is unavailable)."""
    if not pin_prefix(cpus):
        return
    subprocess.run(["taskset", "-a", "-p", "-c", str(cpus), str(pid)], capture_output=True, check=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(eq=False)
class ManagedProcess:
    """A server process this benchmark started; `stop()` ends it (SIGTERM, then SIGKILL) by its pid."""

    name: str
    popen: subprocess.Popen[str]
    url: str
    extra_urls: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def stop(self) -> None:
        if self.popen.poll() is not None:
            return
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(timeout=10)


def _read_until(popen: subprocess.Popen[str], pattern: str, what: str, timeout_s: float = 60.0) -> list[str]:
    """Lines of `popen`'s stdout up to the first matching `pattern`; the match groups of every match seen."""
    assert popen.stdout is not None
    deadline = time.monotonic() + timeout_s
    found: list[str] = []
    while time.monotonic() < deadline:
        line = popen.stdout.readline()
        if not line:
            break
        match = re.search(pattern, line)
        if match:
            found.append(match.group(1))
            return found
    popen.kill()
    raise RuntimeError(f"{what} did not start (exit code {popen.poll()})")


def start_sim(
    cpus: str | None,
    *,
    engines: int = 1,
    profile: str = "fast",
    overrides: list[str] | None = None,
    api: str = "sglang",
) -> ManagedProcess:
    """`rolloutgate sim` (SGLang flavour unless `api`) on ephemeral ports; waits for every engine's line."""
    command = [
        *pin_prefix(cpus),
        sys.executable,
        "-m",
        "rolloutgate",
        "sim",
        "--api",
        api,
        "--profile",
        profile,
        "--engines",
        str(engines),
        "--base-port",
        "0",
        *(overrides or []),
    ]
    popen = _spawn(command, "sim", stdout=subprocess.PIPE)
    assert popen.stdout is not None
    urls: list[str] = []
    deadline = time.monotonic() + 60
    while len(urls) < engines and time.monotonic() < deadline:
        line = popen.stdout.readline()
        if not line:
            break
        match = re.match(r"engine \d+ \w+ (http://\S+)", line)
        if match:
            urls.append(match.group(1))
    if len(urls) < engines:
        popen.kill()
        raise RuntimeError("the simulated engines did not start")
    return ManagedProcess("sim", popen, urls[0], urls)


def start_gateway(
    cpus: str | None, engine_urls: list[str], *, extra_args: list[str] | None = None
) -> ManagedProcess:
    """`rolloutgate serve` in front of `engine_urls` (SGLang family, no detection), ready when it prints."""
    command = [*pin_prefix(cpus), sys.executable, "-m", "rolloutgate", "serve", "--port", "0"]
    for url in engine_urls:
        command += ["--engine", f"sglang+{url}"]
    command += ["--log-level", "warning", *(extra_args or [])]
    popen = _spawn(command, "rolloutgate", stdout=subprocess.PIPE)
    url = _read_until(popen, r"rolloutgate serving on (http://\S+)", "the gateway")[0]
    _drain_in_background(popen)
    wait_http_ok(url + "/ready", timeout_s=60)
    return ManagedProcess("rolloutgate", popen, url)


def _drain_in_background(popen: subprocess.Popen[str]) -> None:
    """Keep reading a child's stdout so it never blocks on a full pipe."""

    def drain() -> None:
        assert popen.stdout is not None
        for _ in popen.stdout:
            pass

    threading.Thread(target=drain, daemon=True).start()


def installed_router(kind: RouterKind, *, log: Callable[[str], None] = print) -> Path | None:
    """The python of a release of the SGLang Model Gateway, installed by `make bench-tools`; None (and a line
    on `log`) when it is not there."""
    python = kind.venv / "bin" / "python"
    if kind.stamp.exists() and python.exists():
        return python
    log(f"{kind.name} is not installed in {kind.venv} (`make bench-tools`): its rows are left out")
    return None


def router_version(python: Path, kind: RouterKind) -> str:
    """The installed version of `kind`'s package, for the reports."""
    found = subprocess.run(
        [str(python), "-c", f"from importlib.metadata import version; print(version({kind.name!r}))"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return found.stdout.strip() or "unknown"


def start_router(
    cpus: str | None,
    engine_urls: list[str],
    python: Path,
    policy: str = "round_robin",
    kind: RouterKind = ROUTERS["sglang-router"],
) -> ManagedProcess:
    """A release of the SGLang Model Gateway (`kind`), bound to loopback, Prometheus moved off its default
    0.0.0.0:29000; ready once `/readiness` answers 200 (a worker has been accepted). `policy`: its routing
    policy; `manual` sticks each `X-SMG-Routing-Key` to a worker (new keys to the worker with the fewest),
    `cache_aware` is its default prefix-tree policy."""
    port, prometheus_port = free_port(), free_port()
    command = [
        *pin_prefix(cpus),
        str(python),
        "-m",
        kind.module,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        *engine_urls,
        "--policy",
        policy,
        *(["--assignment-mode", "min_group"] if policy == "manual" else []),
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(prometheus_port),
        "--log-level",
        "warn",
    ]
    popen = _spawn(command, kind.name, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(url + "/readiness", timeout_s=90, process=popen)
    except RuntimeError:
        popen.kill()
        raise
    return ManagedProcess(kind.name, popen, url)


def wait_http_ok(url: str, *, timeout_s: float, process: subprocess.Popen[str] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if 200 <= response.status < 300:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer 2xx within {timeout_s:g} s")


@contextmanager
def rolloutgate_process(args: list[str], marker: str, count: int) -> Iterator[list[str]]:
    """A `rolloutgate` subprocess; yields the last word of its first `count` stdout lines starting `marker`."""
    with rolloutgate_subprocess(args, marker, count) as (_proc, found):
        yield found


@contextmanager
def rolloutgate_subprocess(
    args: list[str], marker: str, count: int
) -> Iterator[tuple[subprocess.Popen[str], list[str]]]:
    """`rolloutgate_process` with the process itself (to kill it)."""
    proc = subprocess.Popen([sys.executable, "-m", "rolloutgate", *args], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        found: list[str] = []
        deadline = time.monotonic() + 60
        while len(found) < count and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith(marker):
                found.append(line.split()[-1])
        if len(found) < count:
            raise RuntimeError(f"rolloutgate {args[0]} did not start")
        yield proc, found
    finally:
        proc.terminate()
        proc.wait(timeout=30)
