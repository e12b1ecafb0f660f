"""Aborting a group: `POST /admin/abort_group?group=ID` (or the body `{"group": "ID"}`), admin credentials.

Every live member of the group (the calls sent with that `X-Rolloutgate-Group` header or `rolloutgate_group`
field, core/group_table.py) ends at once, queued or running: a running one is aborted on its engine first,
and each is answered as aborted (a `/generate` with SGLang's abort answer, finish reason `abort`; a chat or
completion with a 400 `aborted`). The answer says how many members it ended: `{"group": ID, "aborted": N}`
(0 when the group has already ended, or never existed: aborting is idempotent).
"""

from __future__ import annotations

from aiohttp import web

from rolloutgate.errors import BadRequest
from rolloutgate.server.answer import Answer
from rolloutgate.server.auth import check_admin
from rolloutgate.server.context import CONTEXT
from rolloutgate.server.guard import guarded
from rolloutgate.server.validate import parse_body

__all__ = ("abort_group", "add_routes")


async def abort_group(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    check_admin(request, ctx.settings)
    group: object = request.query.get("group")
    if group is None:
        raw = await request.read()
        body = parse_body(raw, ctx.settings) if raw.strip() else {}
        group = body.get("group")
    if not isinstance(group, str) or not group.strip():
        raise BadRequest("'group' must be a non-empty string", param="group", code="invalid_group")
    group = group.strip()
    return Answer(200, {"group": group, "aborted": ctx.driver.abort_group(group)}).response()


def add_routes(app: web.Application) -> None:
    app.router.add_post("/admin/abort_group", guarded(abort_group))
