"""How far one request walks through the gateway's code (docs/DESIGN.md, "Three walks").

Starts a simulated SGLang engine and a gateway in this process, sends each walk once to warm up, then again
under a profile hook that records every call into a rolloutgate function (the simulator is the sibling package
rolloutsim): the distinct functions ("stays"), the files they live in ("rooms") and the calls made. The package's
compiled modules are bypassed (their calls are invisible to a profile hook), so the interpreted code is what is
counted. What the engines' health loops and the engine-level progress watch call meanwhile is left out
(`BACKGROUND`): they run per engine on their own schedule, so their share of a walk was a matter of timing.

    .venv/bin/python -m benchmarks.walk            # the walks: a whole /generate, a session turn
    .venv/bin/python -m benchmarks.walk --list     # and each walk's functions, in first-call order
    PYTHONPATH=<old checkout>/src .venv/bin/python -m benchmarks.walk   # an older commit's walks
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any


class _SourceOnly(importlib.abc.MetaPathFinder):
    """Imports rolloutgate's modules from their sources even where a compiled module sits beside them."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith("rolloutgate."):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.origin is None or spec.origin.endswith(".py"):
            return spec
        source = Path(spec.origin).with_name(fullname.rsplit(".", 1)[-1] + ".py")
        loader = importlib.machinery.SourceFileLoader(fullname, str(source))
        return importlib.util.spec_from_file_location(fullname, source, loader=loader)


sys.meta_path.insert(0, _SourceOnly())

import httpx  # noqa: E402

import rolloutgate  # noqa: E402
from rolloutgate.config import EngineSpec, GatewaySettings  # noqa: E402
from rolloutgate.server.app import GatewayServer  # noqa: E402

try:
    from rolloutsim import SimCluster
except ImportError:  # a checkout from before the simulator left the package (`PYTHONPATH=<old>/src`)
    from rolloutgate.sim import SimCluster  # type: ignore[import-not-found,no-redef]

assert rolloutgate.__file__ is not None
PACKAGE = Path(rolloutgate.__file__).parent
NOT_THE_GATEWAY = (PACKAGE / "sim", PACKAGE / "bench")  # where an old checkout kept the simulator, benchmarks
# The engines' health loops and the engine-level progress watch run on their own schedule, per engine, whatever
# the calls: what they call while a walk is recorded is not the request's walk.
BACKGROUND = frozenset({"EngineHealth.loop", "EnginePool._health_loop", "EngineWatcher._poll"})


def _in_background(frame: FrameType | None) -> bool:
    while frame is not None:
        if frame.f_code.co_qualname in BACKGROUND:
            return True
        frame = frame.f_back
    return False


class Walk:
    """The rolloutgate functions called while it is on, in first-call order, with their call counts."""

    def __init__(self) -> None:
        self.calls: dict[tuple[str, str], int] = {}

    def _hook(self, frame: FrameType, event: str, _arg: Any) -> None:
        if event != "call":
            return
        path = Path(frame.f_code.co_filename)
        if PACKAGE not in path.parents or any(part in path.parents for part in NOT_THE_GATEWAY):
            return  # the simulator (rolloutsim, beside it) is the engine, not the gateway
        if _in_background(frame):
            return
        key = (str(path.relative_to(PACKAGE.parent)), frame.f_code.co_qualname)
        self.calls[key] = self.calls.get(key, 0) + 1

    async def record(self, step: Callable[[], Awaitable[None]]) -> None:
        sys.setprofile(self._hook)
        try:
            await step()
        finally:
            sys.setprofile(None)

    def summary(self) -> str:
        rooms = {path for path, _ in self.calls}
        return f"{len(self.calls)} functions in {len(rooms)} files, {sum(self.calls.values())} calls"


async def main(show: bool) -> None:
    async with SimCluster(engines=1, api="sglang", profile="default", time_scale=100.0) as cluster:
        settings = GatewaySettings(
            host="127.0.0.1",
            port=0,
            engines=[EngineSpec(url=url, family="sglang") for url in cluster.urls],
            time_scale=cluster.time_scale,
            keepalive_interval=0,
        )
        gateway = GatewayServer(settings)
        await gateway.start()
        try:
            async with httpx.AsyncClient(timeout=60.0) as http:
                body = {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 8}}

                async def generate() -> None:
                    answer = await http.post(gateway.url + "/generate", json=body)
                    assert answer.status_code == 200, answer.text

                session_url = ""

                async def turn() -> None:
                    answer = await http.post(session_url + "/generate", json=body)
                    assert answer.status_code == 200, answer.text

                walks: list[tuple[str, Callable[[], Awaitable[None]]]] = [("a whole /generate", generate)]
                opened = await http.post(gateway.url + "/sessions")
                if opened.status_code == 200:
                    session_url = f"{gateway.url}/sessions/{opened.json()['session_id']}"
                    walks.append(("a session turn (/sessions/{id}/generate)", turn))
                for name, step in walks:
                    await step()  # warm: first-time paths (imports, pools, caches) are not the walk
                    walk = Walk()
                    await walk.record(step)
                    print(f"{name}: {walk.summary()}")
                    if show:
                        for (path, function), count in walk.calls.items():
                            print(f"    {path}:{function} x{count}")
        finally:
            await gateway.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--list", action="store_true", help="each walk's functions, in first-call order")
    asyncio.run(main(parser.parse_args().list))
