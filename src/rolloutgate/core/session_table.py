"""Which engine holds each session's prefix, and how much of it: the placement's memory.

Theory of operation: when the gateway dispatches a request with a routing key (session id, X-SMG-Routing-Key),
it records that the session now lives on that engine with the request's prompt in its prefix cache; when the
request completes there, the cached length grows by the output (unless the session moved meanwhile). The next turn of the session then (a) prefers that
engine (session affinity, placement/session_affinity.py) and (b) is estimated to cost only its new tokens there
(admission.py, contention). The table is an LRU bounded by `max_entries`: a session not seen for long is
forgotten, which only costs it its affinity.

Rules:
1. An entry names one engine; a session that moves is recorded on its new engine (the old cache is assumed
   useless to it).
2. Entries are never trusted for placement on their own: the policy checks the engine is still schedulable.
3. A weight update empties an engine's prefix cache (`EngineCacheFlushed`): its sessions stay (affinity costs
   nothing there) with 0 tokens cached, so their next turns count as the cold prefills they are.
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ("SessionTable",)


class SessionTable:
    """LRU map: routing key -> (engine id, cached prompt tokens)."""

    __slots__ = ("_entries", "_max_entries")

    def __init__(self, max_entries: int) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        self._max_entries = max_entries
        self._entries: OrderedDict[str, tuple[str, int]] = OrderedDict()

    def get(self, routing_key: str | None) -> tuple[str, int] | None:
        """The session's engine and cached tokens, or None (no key, or unknown/forgotten session)."""
        if routing_key is None:
            return None
        return self._entries.get(routing_key)

    def record(self, routing_key: str | None, engine_id: str, cached_tokens: int) -> None:
        """The session now lives on `engine_id` with `cached_tokens` of prefix (most recently used)."""
        if routing_key is None:
            return
        entries = self._entries
        entries[routing_key] = (engine_id, cached_tokens)
        entries.move_to_end(routing_key)
        if len(entries) > self._max_entries:
            entries.popitem(last=False)

    def grow(self, routing_key: str | None, engine_id: str, cached_tokens: int) -> None:
        """A request of the session finished on `engine_id`: its prefix there grew. Ignored if the session has
        moved to another engine meanwhile (an older turn finishing late must not pull it back)."""
        entry = self.get(routing_key)
        if entry is None or entry[0] == engine_id:
            self.record(routing_key, engine_id, cached_tokens)

    def forget_cached(self, engine_id: str) -> None:
        """`engine_id`'s prefix cache was emptied: its sessions stay there (affinity) with nothing cached."""
        entries = self._entries
        for key, (engine, cached) in entries.items():
            if engine == engine_id and cached:
                entries[key] = (engine, 0)  # a value update: the LRU order stays as it is

    def uncached(self, routing_key: str | None, prompt_tokens: int, engine_id: str) -> int:
        """Estimated prompt tokens `engine_id` must prefill for this request."""
        entry = self.get(routing_key)
        if entry is None or entry[0] != engine_id:
            return prompt_tokens
        return max(0, prompt_tokens - entry[1])

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"<SessionTable [{len(self._entries)}/{self._max_entries} sessions]>"
