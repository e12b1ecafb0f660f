"""Which engine holds each session's prefix, and how much of it: the placement's memory.

Theory of operation: when the gateway dispatches a request with a routing key (session id, X-SMG-Routing-Key),
it records that the session now lives on that engine with the request's prompt in its prefix cache; when the
request completes there, the cached length grows by the output (unless the session moved meanwhile). The next turn of the session then (a) prefers that
engine (session affinity, placement/session_affinity.py) and (b) is estimated to cost only its new tokens there
(admission.py, contention). The table is an LRU bounded by `max_entries`: a session not seen for long is
forgotten, which only costs it its affinity.

Groups (the n samples of one prompt, core/group_table.py) are remembered the same way in a second LRU of the
same bound: the first sibling dispatched records the group on its engine with the shared prompt cached, so
the next siblings prefer that engine and are estimated to cost (almost) nothing to prefill there. A request's
own session entry, when it has one, wins over its group's.

Each engine's bound sessions are counted (`sessions_on`) with the history they hold there (`tokens_on`):
cache-warm placement (placement/cache_warm.py) sends a new session to the engine with the fewest. A session's
end (`release`: DELETE, its samples taken, or `/finish_session`) frees its binding at once instead of waiting for
the LRU. A session the client never ends is released once it has been idle for `idle_s` (`expire`): nothing of
it on an engine, and none of its calls dispatched or ended, for that long. A binding with calls in flight is
never idle, however long they run (`started` / `ended` count them).

Rules:
1. An entry names one engine; a session that moves is recorded on its new engine (the old cache is assumed
   useless to it).
2. Entries are never trusted for placement on their own: the policy checks the engine is still schedulable.
3. A weight update empties an engine's prefix cache (`EngineCacheFlushed`): its sessions stay (affinity costs
   nothing there) with 0 tokens cached, so their next turns count as the cold prefills they are.
4. `sessions_on` and `tokens_on` count session entries only (not groups), and always equal the sums over the
   live entries (every change goes through `_put` / `_drop`).
5. The entries' order is their last use (a dispatch, an end, a grown prefix): the LRU bound evicts from its
   front, and `expire` releases from its front while the front is idle, so a sweep costs what it releases.
"""

from __future__ import annotations

import math
from collections import OrderedDict

__all__ = ("SessionTable",)


class SessionTable:
    """LRU maps: routing key -> (engine id, cached prompt tokens), and group id -> the same."""

    __slots__ = (
        "_entries",
        "_groups",
        "_idle_s",
        "_in_flight",
        "_max_entries",
        "_sessions_on",
        "_tokens_on",
        "_used_at",
    )

    def __init__(self, max_entries: int, idle_s: float = math.inf) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        if not idle_s > 0:
            raise ValueError("idle_s must be > 0 (math.inf: never)")
        self._max_entries = max_entries
        self._idle_s = idle_s
        self._used_at: dict[str, float] = {}  # each bound session's last use (rule 5)
        self._in_flight: dict[str, int] = {}  # each routing key's calls on engines now, bound or not
        self._entries: OrderedDict[str, tuple[str, int]] = OrderedDict()
        self._groups: OrderedDict[str, tuple[str, int]] = OrderedDict()
        self._sessions_on: dict[str, int] = {}
        self._tokens_on: dict[str, int] = {}

    def get(self, routing_key: str | None, group: str | None = None) -> tuple[str, int] | None:
        """The session's engine and cached tokens, else its group's, or None (no key, or unknown/forgotten)."""
        if routing_key is not None:
            entry = self._entries.get(routing_key)
            if entry is not None:
                return entry
        if group is None:
            return None
        return self._groups.get(group)

    def is_new_session(self, routing_key: str | None) -> bool:
        """A request with a routing key the table does not know: its session's first placement."""
        return routing_key is not None and routing_key not in self._entries

    def record(
        self,
        routing_key: str | None,
        engine_id: str,
        cached_tokens: int,
        group: str | None = None,
        *,
        now: float,
    ) -> None:
        """The session (and the group) now live on `engine_id` with `cached_tokens` of prefix (most recent)."""
        if routing_key is not None:
            self._put(routing_key, engine_id, cached_tokens, now)
        if group is not None:
            groups = self._groups
            groups[group] = (engine_id, cached_tokens)
            groups.move_to_end(group)
            if len(groups) > self._max_entries:
                groups.popitem(last=False)

    def grow(self, routing_key: str | None, engine_id: str, cached_tokens: int, *, now: float) -> None:
        """A request of the session finished on `engine_id`: its prefix there grew. Ignored if the session has
        moved to another engine meanwhile (an older turn finishing late must not pull it back)."""
        if routing_key is None:
            return
        entry = self._entries.get(routing_key)
        if entry is None or entry[0] == engine_id:
            self._put(routing_key, engine_id, cached_tokens, now)

    def release(self, routing_key: str) -> bool:
        """The session ended (DELETE, samples taken): forget its binding. False if it was not bound."""
        if routing_key not in self._entries:
            return False
        self._drop(routing_key)
        return True

    def started(self, routing_key: str | None) -> None:
        """A call of the session was dispatched (`record` marked it used): in use until its calls end."""
        if routing_key is None:
            return
        self._in_flight[routing_key] = self._in_flight.get(routing_key, 0) + 1

    def ended(self, routing_key: str | None, now: float) -> None:
        """A call of the session left its engine (finished, failed, or moved): its idle time counts from now."""
        if routing_key is None:
            return
        left = self._in_flight[routing_key] - 1
        if left:
            self._in_flight[routing_key] = left
        else:
            del self._in_flight[routing_key]
        self._use(routing_key, now)

    def in_flight(self, routing_key: str) -> int:
        """The session's calls on engines now."""
        return self._in_flight.get(routing_key, 0)

    def expire(self, now: float) -> int:
        """Release the sessions idle for over `idle_s` at `now` (module docstring); how many were released."""
        entries, released = self._entries, 0
        while entries:
            key = next(iter(entries))
            if now - self._used_at[key] <= self._idle_s:
                break
            if key in self._in_flight:  # in use however long ago it began (a long call): not idle
                self._use(key, now)
                continue
            self._drop(key)
            released += 1
        return released

    def _use(self, routing_key: str, now: float) -> None:
        if routing_key in self._entries:
            self._entries.move_to_end(routing_key)
            self._used_at[routing_key] = now

    def forget_cached(self, engine_id: str) -> None:
        """`engine_id`'s prefix cache was emptied: its sessions and groups stay there (affinity) with nothing
        cached."""
        for table in (self._entries, self._groups):
            for key, (engine, cached) in table.items():
                if engine == engine_id and cached:
                    table[key] = (engine, 0)  # a value update: the LRU order stays as it is
        if engine_id in self._tokens_on:
            self._tokens_on[engine_id] = 0

    def uncached(
        self, routing_key: str | None, prompt_tokens: int, engine_id: str, group: str | None = None
    ) -> int:
        """Estimated prompt tokens `engine_id` must prefill for this request."""
        entry = self.get(routing_key, group)
        if entry is None or entry[0] != engine_id:
            return prompt_tokens
        return max(0, prompt_tokens - entry[1])

    def sessions_on(self, engine_id: str) -> int:
        """Sessions bound to `engine_id`."""
        return self._sessions_on.get(engine_id, 0)

    def tokens_on(self, engine_id: str) -> int:
        """Prefix tokens the sessions bound to `engine_id` are believed to hold in its cache."""
        return self._tokens_on.get(engine_id, 0)

    @property
    def groups(self) -> int:
        return len(self._groups)

    def _put(self, routing_key: str, engine_id: str, cached_tokens: int, now: float) -> None:
        entries = self._entries
        if routing_key in entries:
            self._drop(routing_key)
        entries[routing_key] = (engine_id, cached_tokens)
        self._used_at[routing_key] = now
        self._sessions_on[engine_id] = self._sessions_on.get(engine_id, 0) + 1
        self._tokens_on[engine_id] = self._tokens_on.get(engine_id, 0) + cached_tokens
        if len(entries) > self._max_entries:
            self._drop(next(iter(entries)))

    def _drop(self, routing_key: str) -> None:
        engine_id, cached = self._entries.pop(routing_key)
        del self._used_at[routing_key]
        left = self._sessions_on[engine_id] - 1
        if left:
            self._sessions_on[engine_id] = left
            self._tokens_on[engine_id] -= cached
        else:
            del self._sessions_on[engine_id]
            del self._tokens_on[engine_id]

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        groups = f", {len(self._groups)} groups" if self._groups else ""
        return f"<SessionTable [{len(self._entries)}/{self._max_entries} sessions{groups}]>"
