"""An engine-control operation's answer, apart from HTTP: what the admin and fan-out calls return.

The operations (server/admin.py: pause, resume, update_weights; server/fan_out.py: abort_request, flush_cache;
server/engine_metrics.py: the engines' scrape) are plain coroutines of the app and the call's body or query, so
one gateway's HTTP handler and a fleet's fan-out (fleet/operations.py, each replica in its own process) run the
same code. Each answer names the engines it reached (`engines`, by URL): the fleet checks from those that an
operation reached every owner of every engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

__all__ = ("Answer",)

TEXT = "text/plain; charset=utf-8"


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    json: Any = None  # a JSON value; None with `text` (or for an empty answer)
    text: str | None = None  # a plain-text answer (SGLang's /flush_cache), or an exposition (content_type)
    content_type: str = TEXT
    engines: tuple[str, ...] = ()  # the URLs of the engines the operation reached

    def response(self) -> web.Response:
        if self.text is not None:
            return web.Response(
                status=self.status, body=self.text.encode(), headers={"Content-Type": self.content_type}
            )
        if self.json is None:
            return web.Response(status=self.status)
        return web.Response(body=orjson.dumps(self.json), status=self.status, content_type="application/json")
