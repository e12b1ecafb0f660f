"""Ending a session's binding: `POST /finish_session?session_id=ID`, as vllm-router's clients call it.

prime-rl and SkyRL release each rollout's session through vllm-router's `/finish_session` when it succeeds, fails
or is cancelled (prime-rl#3563, vllm-project/router#235), so that placement by sessions (core/placement/
cache_warm.py: a new session goes where the fewest live) counts only live ones. Here the id is the routing key
the session's calls carried (`X-Session-Id` or `X-SMG-Routing-Key`): its engine binding is released at once
(core/session_table.py `release`); its calls still queued or running run on. Idempotent: an id that is not bound
(never seen, released, or expired after `--session-binding-idle`) answers the same. An inference key is
needed where the gateway has them, as for the calls themselves.
"""

from __future__ import annotations

from collections.abc import Mapping

from aiohttp import web

from rolloutgate.core.events import SessionEnded
from rolloutgate.errors import BadRequest
from rolloutgate.server.answer import Answer
from rolloutgate.server.auth import check_api_key
from rolloutgate.server.context import CONTEXT
from rolloutgate.server.guard import guarded

__all__ = ("FINISH_SESSION_PATH", "add_routes", "finish_session", "session_id_of")

FINISH_SESSION_PATH = "/finish_session"


def session_id_of(query: Mapping[str, str]) -> str:
    """The call's session id (its `session_id` query field); raises BadRequest when it is missing or blank."""
    value = query.get("session_id", "").strip()
    if not value:
        raise BadRequest(
            "'session_id' must be given in the query", param="session_id", code="invalid_session_id"
        )
    return value


async def finish_session(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    check_api_key(request, ctx.settings)
    session_id = session_id_of(request.query)
    ctx.driver.handle(SessionEnded(routing_key=session_id))
    return Answer(200, {"session_id": session_id, "finished": True}).response()


def add_routes(app: web.Application) -> None:
    app.router.add_post(FINISH_SESSION_PATH, guarded(finish_session))
