"""Each engine's prefix-cache hits, read from the answers it gives: the metric cache-warm placement keeps high.

Theory of operation: an engine says how much of each prompt it served from its prefix cache: SGLang in
`meta_info` (`prompt_tokens`, `cached_tokens`), vLLM and SGLang's OpenAI routes in `usage` (`prompt_tokens`,
`prompt_tokens_details.cached_tokens`). When a call ends with an answer, its prompt and cached tokens are
added to `rolloutgate_engine_prompt_tokens_total{engine}` and `rolloutgate_engine_cached_tokens_total{engine}`;
their ratio is the engine's hit rate. The numbers sit at the end of an answer (after the text and ids), so they
are found by a reverse search for the key, not by parsing an answer that may hold 100K token ids.

Rules:
1. Only answers count (a failed call has no usage); a stream is read from its last event.
2. An answer that reports no prompt tokens counts nothing; one that reports prompt tokens but no cached ones
   counts them as all uncached.
"""

from __future__ import annotations

from rolloutgate.errors import GatewayError
from rolloutgate.server.exchange import Exchange, Finished
from rolloutgate.server.metrics import Metrics

__all__ = ("observe_cache_hits", "prompt_cache_usage")

_PROMPT_KEY = b'"prompt_tokens"'
_CACHED_KEY = b'"cached_tokens"'
_DIGITS = frozenset(b"0123456789")


def _last_int(data: bytes, key: bytes) -> int | None:
    """The integer after the last `key:` in `data` (JSON), or None (absent, or not an integer)."""
    at = data.rfind(key)
    if at < 0:
        return None
    i = at + len(key)
    end = len(data)
    while i < end and data[i] in b" \t\r\n:":
        i += 1
    start = i
    while i < end and data[i] in _DIGITS:
        i += 1
    return int(data[start:i]) if i > start else None


def prompt_cache_usage(answer: bytes) -> tuple[int, int] | None:
    """(prompt tokens, of which cached) as one answer or stream event reports them, or None."""
    prompt = _last_int(answer, _PROMPT_KEY)
    if prompt is None:
        return None
    cached = _last_int(answer, _CACHED_KEY) or 0
    return prompt, min(cached, prompt)


def observe_cache_hits(metrics: Metrics, exchange: Exchange, outcome: Finished | GatewayError) -> None:
    """`Driver.on_end`: count the prompt and cached tokens of an answered call against its engine."""
    if not isinstance(outcome, Finished) or exchange.engine_id is None:
        return
    if outcome.body is not None:
        usage = prompt_cache_usage(outcome.body)
    else:  # a stream: its last events (the final chunk may be followed by a usage frame or [DONE])
        usage = next(filter(None, map(prompt_cache_usage, reversed((exchange.history or [])[-3:]))), None)
    if usage is None:
        return
    prompt, cached = usage
    metrics.child(metrics.engine_prompt_tokens, exchange.engine_id).inc(prompt)
    metrics.child(metrics.engine_cached_tokens, exchange.engine_id).inc(cached)
