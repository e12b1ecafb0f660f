"""Prompts that engines died prefilling, refused for a while, so that a client's retry cannot take down more.

Theory of operation: the core fails a call that two engines dropped before its first token (502
`engine_lost_in_prefill`, core/on_requests.py): its prompt is what most likely killed them. Its client may well
send it again: miles' agent retries a 5xx, and so do LiteLLM and the OpenAI SDK, each as a new request with no
history, which would go on to kill two more engines. So the driver remembers the prompt (`remember`), and
`submit` (server/front.py), the one way a call enters the queue, refuses the same prompt for `ttl_s`: 400
`prompt_lost_engines`, which those clients do not retry.

The same prompt: the route and the fields that make the engine's input (`_PROMPT_FIELDS`: ids, text,
embeddings, images, messages and tools), hashed (BLAKE2b). Sampling parameters, `rid` and `stream` are left out, so a retry that changes
only those is still caught. Nothing is hashed while nothing is remembered: on the hot path the check is one
test of an empty dict. At most `capacity` prompts are kept, the oldest forgotten first.

Each gateway process remembers its own: in a fleet, the replica that owned the engines that died refuses the
prompt, and a retry placed on another replica's engines is not refused there (docs/reliability.md).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import orjson

from rolloutgate.engines.base import Route
from rolloutgate.errors import BadRequest

__all__ = ("POISON_TTL_S", "PoisonPrompts", "fingerprint")

# long enough to outlast a client's retries with backoff, short enough that a prompt wrongly suspected (one
# prefilled beside the real killer, twice) is served again within the hour
POISON_TTL_S = 3600.0
_CAPACITY = 1024
_PROMPT_FIELDS: dict[Route, tuple[str, ...]] = {
    Route.GENERATE: ("input_ids", "text", "input_embeds", "image_data"),
    Route.TOKENS: ("token_ids",),
    Route.CHAT: ("messages", "tools"),
    Route.COMPLETIONS: ("prompt",),
}


def fingerprint(route: Route, body: dict[str, Any]) -> bytes:
    """The digest of the engine input a call carries (module docstring)."""
    digest = hashlib.blake2b(route.value.encode(), digest_size=16)
    for name in _PROMPT_FIELDS[route]:
        value = body.get(name)
        if value is not None:
            digest.update(name.encode())
            digest.update(orjson.dumps(value))  # a compact id list kept as an orjson.Fragment dumps as is
    return digest.digest()


class PoisonPrompts:
    """The prompts remembered, each until its time (`clock` seconds)."""

    def __init__(
        self, clock: Callable[[], float], *, ttl_s: float = POISON_TTL_S, capacity: int = _CAPACITY
    ) -> None:
        self._clock = clock
        self._ttl_s = ttl_s
        self._capacity = capacity
        self._until: OrderedDict[bytes, tuple[float, str]] = OrderedDict()  # by when remembered

    def __len__(self) -> int:
        return len(self._until)

    def remember(self, route: Route, body: dict[str, Any], request_id: str) -> None:
        key = fingerprint(route, body)
        self._until.pop(key, None)
        self._until[key] = (self._clock() + self._ttl_s, request_id)
        while len(self._until) > self._capacity:
            self._until.popitem(last=False)

    def check(self, route: Route, body: dict[str, Any]) -> None:
        """Raises BadRequest (400 `prompt_lost_engines`) for a prompt remembered and not yet expired."""
        if not self._until:
            return
        now = self._clock()
        while self._until:  # one TTL for all: the oldest expires first
            oldest = next(iter(self._until.values()))[0]
            if oldest > now:
                break
            self._until.popitem(last=False)
        found = self._until.get(fingerprint(route, body)) if self._until else None
        if found is not None:
            until, request_id = found
            raise BadRequest(
                f"this prompt was being prefilled by two engines that died (request {request_id}), so it is "
                f"refused for {until - now:.0f} s more rather than sent to take down another; check it "
                "against the model (token ids, length, images)",
                code="prompt_lost_engines",
            )
