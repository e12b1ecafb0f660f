"""What every engine adapter holds and does alike (sglang.py, vllm.py, openai_compat.py subclass it).

An adapter holds its engine's URL, the aiohttp session its control calls go through, the lean pool its
generations go through (engines/upstream.py), its timeouts and its family's assembly hint; it holds no request
state. A control call is one JSON POST under one of the timeouts (`control`), and a weight update passes through
as the trainer wrote it (`update_weights`), the same on every engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import aiohttp

from rolloutgate.engines.base import AssemblyHint, EngineFamily
from rolloutgate.engines.http import ControlTimeouts, post_json
from rolloutgate.engines.upstream import UpstreamPool

__all__ = ("EngineAdapter",)


class EngineAdapter:
    """The state and the calls the adapters share; each sets `family` and `reports_load`."""

    family: EngineFamily
    reports_load: bool
    ends_aborted_calls = False  # vLLM and OpenAI-compatible servers learn of an abort from the closed call

    def __init__(
        self, url: str, session: aiohttp.ClientSession, *, timeouts: ControlTimeouts | None = None
    ) -> None:
        self.url = url.rstrip("/")
        self._session = session
        self._upstream = UpstreamPool(self.url)  # generations; everything else goes through `session`
        self._timeouts = timeouts or ControlTimeouts()
        self._hint = AssemblyHint(family=self.family)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.url}>"

    async def control(
        self,
        path: str,
        body: Any,
        *,
        timeout_s: float | None,
        params: Mapping[str, str] | None = None,
        what: str | None = None,
    ) -> Any:
        """POST `body` as JSON to the engine's `path` within `timeout_s`; its JSON answer. Raises UpstreamError."""
        return await post_json(
            self._session,
            self.url + "/" + path.lstrip("/"),
            body,
            params=params,
            limits=self._timeouts.control(timeout_s),
            what=what or path.lstrip("/"),
        )

    async def post_raw(
        self, path_and_query: str, body: bytes, headers: Mapping[str, str], *, limit: int
    ) -> tuple[int, str, bytes]:
        """POST `body` as it came to the engine's `path_and_query` on the generations' lean pool; the answer's
        status, media type and at most `limit` bytes of its body (the RL control plane's fan-out: the aiohttp
        client costs ~0.25 ms of the loop per call, this a fraction). Raises OSError (connect, reset, timeout:
        no answer) and UpstreamProtocolError (not HTTP)."""
        async with self._upstream.post(path_and_query, body, headers) as answer:
            return answer.status, answer.content_type, await answer.read(limit)

    async def update_weights(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        answer = await self.control(path, body, timeout_s=self._timeouts.weights_s, what=path)
        return answer if isinstance(answer, dict) else {"answer": answer}
