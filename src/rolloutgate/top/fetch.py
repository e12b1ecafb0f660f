"""Reading a gateway for `rolloutgate top`: its `/admin/state` and `/metrics`, or every replica's in a fleet.

A replica of a fleet says so in `/admin/state` (`"fleet": {"replica_id": ..., "replicas": {id: base_url}}`):
the reader then reads every replica listed, at once, and labels each snapshot with its replica id. A gateway
that does not answer (or answers nonsense) becomes a snapshot with an `error`, never an exception: the view
shows it unreachable and the next refresh tries again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import aiohttp
import orjson

from rolloutgate.top.snapshot import GatewaySnapshot, parse_metrics

__all__ = ("GatewayReader",)


class GatewayReader:
    """Reads gateways over one aiohttp session; `clock` stamps the snapshots (real seconds)."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        *,
        admin_token: str | None = None,
        timeout_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._session = session
        self._headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._clock = clock

    async def read_all(self, url: str) -> list[GatewaySnapshot]:
        """The gateway at `url`, or, when it is a fleet replica, every replica of its fleet (by replica id)."""
        first = await self.read(url)
        fleet = _fleet_of(first.state)
        if fleet is None:
            return [first]
        own_id, replicas = fleet
        first = replace(first, replica_id=own_id)
        others = await asyncio.gather(
            *(self.read(base, replica_id=rid) for rid, base in replicas.items() if rid != own_id)
        )
        return sorted([first, *others], key=lambda s: s.key)

    async def read(self, url: str, *, replica_id: str | None = None) -> GatewaySnapshot:
        """One gateway's state and metrics, read at once."""
        base = url.rstrip("/")
        try:
            state_raw, metrics_raw = await asyncio.gather(
                self._get(base + "/admin/state"), self._get(base + "/metrics")
            )
            state = orjson.loads(state_raw)
            if not isinstance(state, dict):
                raise ValueError("/admin/state is not a JSON object")
            samples = parse_metrics(metrics_raw.decode())
        except (aiohttp.ClientError, TimeoutError, ValueError, UnicodeDecodeError) as exc:
            return GatewaySnapshot(
                url=base, replica_id=replica_id, taken_at=self._clock(), error=_describe(exc)
            )
        return GatewaySnapshot(
            url=base, replica_id=replica_id, taken_at=self._clock(), state=state, samples=samples
        )

    async def _get(self, url: str) -> bytes:
        async with self._session.get(url, headers=self._headers, timeout=self._timeout) as response:
            body = await response.read()
            if response.status != 200:
                message = _error_message(body) or body[:200].decode(errors="replace")
                raise ValueError(f"{url.rsplit('/', 1)[-1]}: HTTP {response.status}: {message}")
            return body


def _fleet_of(state: Mapping[str, Any]) -> tuple[str, dict[str, str]] | None:
    """(this replica's id, {replica id: base URL}) from a fleet replica's state; None for a lone gateway."""
    fleet = state.get("fleet")
    if not isinstance(fleet, dict):
        return None
    own_id, replicas = fleet.get("replica_id"), fleet.get("replicas")
    if not isinstance(own_id, str) or not isinstance(replicas, dict):
        return None
    return own_id, {str(rid): str(base) for rid, base in replicas.items()}


def _error_message(body: bytes) -> str | None:
    """The message of an OpenAI-shaped error body, if it is one."""
    try:
        error = orjson.loads(body).get("error", {})
        return str(error["message"]) if isinstance(error, dict) and "message" in error else None
    except (orjson.JSONDecodeError, AttributeError):
        return None


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "no answer in time"
    return str(exc) or type(exc).__name__
