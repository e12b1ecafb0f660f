"""A replica's HTTP edge: the gateway's app, with each request first sent where it belongs.

Theory of operation: `install` adds one aiohttp middleware to a replica's gateway app (server/app.py, through
`GatewayServer.configure_app`). For each request it asks `routing.decide` (a pure function of the request and
the replica's current view) and carries the answer out: serve it here (the gateway's own handler), forward it
one hop to its owner (fleet/forward.py), or answer it through the controller (fleet/registration.py). Every
answer is stamped with the replica that served it (`X-Rolloutgate-Replica`, `-Replica-Url`): a forwarded one
keeps its owner's stamp and gains `X-Rolloutgate-Via`.

What it costs a request served here: one middleware frame and one `decide` (a few dict lookups; for a keyed
request one blake2b hash per replica). A middleware makes aiohttp resume two more coroutine frames for each
handler step (server/guard.py explains why the gateway itself has none): docs/fleet.md measures it with the
hop.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Handler

from rolloutgate.errors import Unavailable
from rolloutgate.fleet.assignment import FleetView
from rolloutgate.fleet.forward import HopFailed, forward, hop_session
from rolloutgate.fleet.links import ControllerLink, ControllerUnreachable
from rolloutgate.fleet.operations import OPERATIONS, operation_named
from rolloutgate.fleet.registration import serve_registration
from rolloutgate.fleet.routing import (
    FINISH_SESSION,
    FLEET_RL,
    FORWARDED_HEADER,
    REPLICA_HEADER,
    REPLICA_URL_HEADER,
    Decision,
    FleetWide,
    Forward,
    Here,
    decide,
    session_of_path,
)
from rolloutgate.server.auth import check_admin, check_worker_admin
from rolloutgate.server.context import CONTEXT
from rolloutgate.server.front import routing_key_of
from rolloutgate.server.guard import error_response, guarded
from rolloutgate.server.rl_plane import RlCall
from rolloutgate.server.validate import parse_body

__all__ = ("FleetMember", "install")

log = logging.getLogger("rolloutgate.fleet")


@dataclass(eq=False)
class _HopPool:
    session: aiohttp.ClientSession | None = None  # opened with the app (it needs the loop)


class FleetMember(Protocol):
    """What the edge needs of its replica (fleet/replica.py)."""

    @property
    def replica_id(self) -> str: ...

    @property
    def url(self) -> str: ...

    @property
    def view(self) -> FleetView: ...

    @property
    def controller(self) -> ControllerLink: ...

    def suspect(self, replica_id: str) -> None:
        """A hop to `replica_id` failed: have the controller check it now."""
        ...

    async def sessions_ready(self) -> None:
        """Returns once the replica may serve sessions (it holds their latest records)."""
        ...


def install(app: web.Application, member: FleetMember) -> None:
    """Route every request of `app` through the fleet (module docstring). Call before the app starts."""
    nonces = itertools.count()
    hops = _HopPool()
    registration = guarded(lambda request: serve_registration(request, member.controller))

    async def fleet_wide(request: web.Request, name: str) -> web.StreamResponse:
        settings = request.app[CONTEXT].settings
        access = operation_named(name).access
        if access == "admin":
            check_admin(request, settings)
        elif access == "worker":
            check_worker_admin(request, settings)
        raw = await request.read()
        if name == FLEET_RL:  # the trainer's call goes to each engine as it was sent
            body: dict[str, Any] = {"call": RlCall.of(request, raw)}
        else:
            body = parse_body(raw, settings) if raw.strip() else {}
        try:
            answer = await member.controller.operate(name, body, dict(request.query))
        except ControllerUnreachable as exc:
            raise Unavailable(
                f"the fleet's controller did not answer ({exc}); retry it (each operation is safe to repeat)",
                retry_after_s=1,
                code="controller_unavailable",
            ) from None
        return answer.response()

    fleet_wide_calls = {name: guarded(functools.partial(fleet_wide, name=name)) for name in OPERATIONS}

    def where(request: web.Request, view: FleetView) -> Decision:
        return decide(
            request.method,
            request.path,
            routing_key=(
                request.query.get("session_id") if request.path == FINISH_SESSION else routing_key_of(request)
            ),
            forwarded_by=request.headers.get(FORWARDED_HEADER),
            view=view,
            self_id=member.replica_id,
            nonce=f"{member.replica_id}:{next(nonces)}",
            scope=request.query.get("scope"),
        )

    async def here(request: web.Request, handler: Handler) -> web.StreamResponse:
        if session_of_path(request.path) is not None:
            await member.sessions_ready()  # a replica that just joined first takes its sessions' records
        return await handler(request)

    async def hop(request: web.Request, decision: Forward) -> web.StreamResponse:
        """Forward; if the owner did not answer and the body was kept, once more to the next replica in the
        key's order (this one included, over loopback)."""
        assert hops.session is not None, "the hop pool opens with the app"
        try:
            return await forward(request, decision.url, self_id=member.replica_id, session=hops.session)
        except HopFailed as exc:
            log.warning("replica %s did not take a forwarded %s: %s", decision.replica_id, request.path, exc)
            member.suspect(decision.replica_id)
            failed = exc
        retry = where(request, member.view.without(decision.replica_id)) if failed.replayable else None
        if isinstance(retry, Here | Forward):  # here too over loopback: the body was read off the stream
            url = retry.url if isinstance(retry, Forward) else member.url
            with contextlib.suppress(HopFailed):
                log.info("replica %s: %s sent on to %s instead", member.replica_id, request.path, url)
                return await forward(
                    request, url, self_id=member.replica_id, session=hops.session, resume=failed.resume
                )
        if failed.resume is not None:  # the client's answer is under way: cut it, as the owner's would be
            if request.transport is not None:
                request.transport.abort()
            return failed.resume
        return error_response(
            request,
            Unavailable(
                f"replica {decision.replica_id}, which owns this request, did not answer; retry it",
                retry_after_s=1,
                code="replica_unavailable",
            ),
        )

    @web.middleware
    async def fleet_edge(request: web.Request, handler: Handler) -> web.StreamResponse:
        decision = where(request, member.view)
        if isinstance(decision, Here):
            return await here(request, handler)
        if isinstance(decision, FleetWide):
            return await fleet_wide_calls[decision.name](request)
        if isinstance(decision, Forward):
            return await hop(request, decision)
        return await registration(request)

    async def stamp(_request: web.Request, response: web.StreamResponse) -> None:
        response.headers.setdefault(REPLICA_HEADER, member.replica_id)
        response.headers.setdefault(REPLICA_URL_HEADER, member.url)

    async def hop_pool(_app: web.Application) -> AsyncIterator[None]:
        hops.session = hop_session()
        try:
            yield
        finally:
            await hops.session.close()

    app.middlewares.append(fleet_edge)
    app.on_response_prepare.append(stamp)
    app.cleanup_ctx.append(hop_pool)
