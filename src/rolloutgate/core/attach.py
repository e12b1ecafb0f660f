"""The attach index: retries join the request already in flight, or find its finished result.

Theory of operation
-------------------
A client whose read timed out retries. Instead of starting a second generation, the edge computes the retry's
*attach key* (`attach_key`) and looks it up here: a live entry names the request it can join (the edge then sends
`ClientAttached`), a finished entry names the request whose result bytes the edge still holds. Keys are:

- an explicit idempotency key (`Idempotency-Key` or `X-Request-Id` from the client), or
- the session id together with a hash of the body: a session sends the same body twice only by retrying.

A bare body hash is never a key: two independent rollouts may send identical prompts (same seed, same task),
and they must both generate.

Live entries stay until the request ends (`finished`, or `discard` when it failed or was cancelled, so a retry
starts afresh). Finished entries are kept `ttl_s` after finishing and at most `max_finished` of them, least
recently used first out. A session's entry (no explicit key) goes as soon as a client has read the result in
full (`delivered`): a session retries only what it did not get, and a kept answer (~160 KB for a 5K-token
logprob `/generate`) held for every turn of a busy job for `ttl_s` was most of the gateway's memory (make
bench-rl). An explicit key keeps its result for `ttl_s` whatever happened to it, as idempotency keys do. Time comes in as `now`; `expire(now)` drops what has expired in O(expired), and
`next_expiry_at()` tells the driver when to call it. The edge stores the result bytes, keyed by request id, and
drops them when this index no longer names them (`expire` returns the dropped request ids).

Rules:
1. `register` of a key that names a live request raises ValueError: look up first.
2. A finished entry's lifetime is fixed at finishing; lookups refresh its LRU position only.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass

__all__ = ("AttachEntry", "AttachIndex", "attach_key", "is_session_key")


def attach_key(
    *, idempotency_key: str | None = None, session_id: str | None = None, body_hash: str | None = None
) -> str | None:
    """The attach key of a request, or None if it has none (never a bare body hash)."""
    if idempotency_key:
        return f"key:{idempotency_key}"
    if session_id and body_hash:
        return f"session:{session_id}:{body_hash}"
    return None


def is_session_key(key: str) -> bool:
    """True for a key made of the session and the body (no explicit idempotency key)."""
    return key.startswith("session:")


@dataclass(frozen=True, slots=True, kw_only=True)
class AttachEntry:
    request_id: str
    is_finished: bool
    expires_at: float = math.inf  # for finished entries


class AttachIndex:
    __slots__ = ("_expiries", "_finished", "_key_of", "_live", "_max_finished", "_ttl_s")

    def __init__(self, *, ttl_s: float = 60.0, max_finished: int = 10_000) -> None:
        if math.isnan(ttl_s) or ttl_s < 0:
            raise ValueError("ttl_s must be >= 0")
        if max_finished < 0:
            raise ValueError("max_finished must be >= 0")
        self._ttl_s = ttl_s
        self._max_finished = max_finished
        self._live: dict[str, str] = {}  # key -> request id
        self._key_of: dict[str, str] = {}  # live request id -> key
        self._finished: OrderedDict[str, tuple[str, float]] = OrderedDict()  # key -> (request id, expires_at)
        self._expiries: deque[tuple[float, str, str]] = (
            deque()
        )  # (expires_at, key, request id), in time order

    def register(self, key: str, request_id: str, now: float) -> None:
        """Index a new live request under `key` (replacing a finished entry). Raises ValueError if live."""
        if key in self._live:
            raise ValueError(f"attach key already names live request {self._live[key]!r}")
        self._finished.pop(key, None)
        self._live[key] = request_id
        self._key_of[request_id] = key

    def lookup(self, key: str, now: float) -> AttachEntry | None:
        """The request a retry with `key` should attach to, or None."""
        request_id = self._live.get(key)
        if request_id is not None:
            return AttachEntry(request_id=request_id, is_finished=False)
        found = self._finished.get(key)
        if found is None:
            return None
        if found[1] <= now:
            del self._finished[key]
            return None
        self._finished.move_to_end(key)
        return AttachEntry(request_id=found[0], is_finished=True, expires_at=found[1])

    def delivered(self, key: str, request_id: str) -> bool:
        """A client read the finished result of `request_id` in full: forget a session key's entry. False if
        the entry stays (an explicit key) or `key` does not name it (any more)."""
        found = self._finished.get(key)
        if not is_session_key(key) or found is None or found[0] != request_id:
            return False
        del self._finished[key]  # its expiry entry is skipped by `expire` (the key no longer names it)
        return True

    def finished(self, request_id: str, now: float) -> list[str]:
        """The request finished successfully: keep its entry for `ttl_s`. Returns request ids evicted (LRU)."""
        key = self._key_of.pop(request_id, None)
        if key is None:
            return []
        del self._live[key]
        expires_at = now + self._ttl_s
        self._finished[key] = (request_id, expires_at)
        self._expiries.append((expires_at, key, request_id))
        evicted = []
        while len(self._finished) > self._max_finished:
            evicted.append(self._finished.popitem(last=False)[1][0])
        return evicted

    def discard(self, request_id: str) -> bool:
        """Forget a live request that ended without a result to share (failed, cancelled)."""
        key = self._key_of.pop(request_id, None)
        if key is None:
            return False
        del self._live[key]
        return True

    def expire(self, now: float) -> list[str]:
        """Drop finished entries whose time is up; return their request ids."""
        dropped = []
        expiries = self._expiries
        while expiries and expiries[0][0] <= now:
            _, key, request_id = expiries.popleft()
            found = self._finished.get(key)
            if found is not None and found[0] == request_id:
                del self._finished[key]
                dropped.append(request_id)
        return dropped

    def next_expiry_at(self) -> float:
        """When `expire` next has something to do (math.inf if never)."""
        expiries = self._expiries
        while expiries:
            expires_at, key, request_id = expiries[0]
            found = self._finished.get(key)
            if found is not None and found[0] == request_id:
                return expires_at
            expiries.popleft()
        return math.inf

    @property
    def live_count(self) -> int:
        return len(self._live)

    @property
    def finished_count(self) -> int:
        return len(self._finished)

    def __repr__(self) -> str:
        return f"<AttachIndex [{len(self._live)} live, {len(self._finished)} finished, ttl {self._ttl_s:g}s]>"
