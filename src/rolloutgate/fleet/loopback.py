"""A transport of fleet/clients.py between processes of one host: method calls over a Unix socket.

Theory of operation: each side serves its object's link methods on a Unix socket (`serve`): `POST /<method>`
with the pickled arguments, answered with the pickled result (200) or the pickled exception it raised (500).
aiohttp does the framing and the concurrency (a long poll does not hold up a ping). `LoopbackTransport`
calls it with a fresh connection per call, so a connection the server closed while idle is never mistaken
for a dead process: a refused or cut connection means the process is gone (`LinkGone`).

Pickle is safe here because only this user can reach the socket: it lives in a folder of mode 0700 made by
the parent process (fleet/processes.py), and carries only the fleet's own control calls, never a client's.
"""

from __future__ import annotations

import asyncio
import pickle
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from rolloutgate.fleet.clients import LinkGone, ReplicaClient

__all__ = ("MAX_CALL_BYTES", "LoopbackPeers", "LoopbackTransport", "serve")

MAX_CALL_BYTES = 1 << 30  # a whole session's record goes to its backup in one call (fleet/replication.py)


async def serve(
    path: Path, target: object, methods: Iterable[str], ready: asyncio.Event | None = None
) -> web.AppRunner:
    """Serve `target`'s `methods` on the Unix socket `path` until the runner is cleaned up. With `ready`, every
    call but `ping` waits for it (the object's start: as a Ray actor's calls wait for its `__init__`'s)."""
    allowed = frozenset(methods)

    async def call(request: web.Request) -> web.Response:
        method = request.match_info["method"]
        if method not in allowed:
            return web.Response(status=404, body=pickle.dumps(LookupError(f"no method {method!r}")))
        args = pickle.loads(await request.read())
        try:
            if ready is not None and method != "ping":
                await ready.wait()
            result = await getattr(target, method)(*args)
        except Exception as exc:  # the caller gets what was raised, as a Ray actor's caller does
            return web.Response(status=500, body=_pickled_error(exc))
        return web.Response(body=pickle.dumps(result))

    app = web.Application(client_max_size=MAX_CALL_BYTES)
    app.router.add_post("/{method}", call)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    await web.UnixSite(runner, str(path)).start()
    return runner


def _pickled_error(exc: Exception) -> bytes:
    try:
        return pickle.dumps(exc)
    except Exception:  # an exception that does not pickle still reaches the caller, as text
        return pickle.dumps(RuntimeError(f"{type(exc).__name__}: {exc}"))


class LoopbackTransport:
    """Calls on the object served at `path` (fleet/clients.py Transport)."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self._session: aiohttp.ClientSession | None = None

    async def call(self, method: str, *args: Any) -> Any:
        if self._session is None:
            connector = aiohttp.UnixConnector(self.path, force_close=True)
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=aiohttp.ClientTimeout(total=None)
            )
        try:
            async with self._session.post(f"http://loopback/{method}", data=pickle.dumps(args)) as response:
                body = await response.read()
        except (aiohttp.ClientConnectionError, FileNotFoundError) as exc:
            raise LinkGone(f"process gone ({type(exc).__name__})") from None
        if response.status == 200:
            return pickle.loads(body)
        raise pickle.loads(body)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class LoopbackPeers:
    """One link per socket path, kept for the process's life: a replica's links to its peers (its `peer_link`)
    and the controller's to its replicas (its `link_factory`) are asked for once per call. A respawned
    replica has a new path; the old one's entry is a few objects, holding no connection."""

    def __init__(self) -> None:
        self._clients: dict[str, tuple[ReplicaClient, LoopbackTransport]] = {}

    def replica(self, handle: object) -> ReplicaClient:
        path = str(handle)  # what a replica registers with: its socket's path
        if path not in self._clients:
            transport = LoopbackTransport(path)
            self._clients[path] = (ReplicaClient(transport), transport)
        return self._clients[path][0]

    async def close(self) -> None:
        clients, self._clients = self._clients, {}
        await asyncio.gather(*(transport.close() for _client, transport in clients.values()))
