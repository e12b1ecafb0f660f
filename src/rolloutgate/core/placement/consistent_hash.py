"""Consistent hashing: a session's calls go to the engine its key hashes to, whatever the load there.

Theory of operation: vllm-router's `consistent_hash` (prime-rl's and SkyRL's default before
`sticky_least_loaded`, and verl's session routing) maps each routing key to one engine by hashing. Here by
rendezvous hashing: the key goes to the eligible engine with the highest score `crc32(key \\0 engine id)`, so an
engine that leaves moves only its own keys and one that joins takes about its share. The engine is chosen
whether or not it has room: a call whose engine is full waits in that engine's lane (dispatcher.py), as a
call waits in its engine's queue behind such a router. A call without a key goes to the least loaded engine.
It is here to be measured against (docs/rl.md: session-count placement against consistent hashing), and for
a pool that must place keys exactly as such a router would.

Rules:
1. Pure: no mutation; the hash is stable across processes (crc32, not Python's salted `hash`).
2. Pinned requests go only to their engine (`choose_pinned`); avoided engines only as a last resort
   (`eligible`): a call that failed on its engine tries the next by score.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import ClassVar

from rolloutgate.core.placement.base import (
    EngineView,
    PlacementRequest,
    choose_pinned,
    eligible,
    least_loaded,
)

__all__ = ("ConsistentHash", "rendezvous_score")


def rendezvous_score(routing_key: str, engine_id: str) -> int:
    """The key's score on an engine; the key goes where it is highest."""
    return zlib.crc32(f"{routing_key}\0{engine_id}".encode())


class ConsistentHash:
    name: ClassVar[str] = "consistent_hash"

    __slots__ = ()

    def choose(self, request: PlacementRequest, engines: Sequence[EngineView]) -> str | None:
        if request.pinned_engine is not None:
            return choose_pinned(request, engines)
        key = request.routing_key
        candidates = eligible(request, engines)
        if key is None or not candidates:
            return least_loaded(request, candidates)
        return max(candidates, key=lambda e: (rendezvous_score(key, e.engine_id), e.engine_id)).engine_id

    def __repr__(self) -> str:
        return "<ConsistentHash>"
