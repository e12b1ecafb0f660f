"""The one engine interface: what the gateway needs from any engine family.

Theory of operation: an adapter (sglang.py, vllm.py, openai_compat.py) translates between the gateway's
calls and one engine family's HTTP API, and nothing else: it never retries and never decides (the core does).
Every aiohttp or JSON error is mapped to `UpstreamError` at this boundary, so nothing from the network layer
leaks into the server.

A generation costs the engine no more output work than the same call sent directly: a streaming client's
call streams and its events are forwarded; any other call comes back as one whole body (or, SGLang's
`/generate`, as two chunks: the first token and the end), assembled into the answer (server/assemble.py),
while engine-level load (`load()`) shows the engine progressing (server/engine_watch.py).

Progress is cheap to watch: adapters count tokens per event without parsing the event's JSON where they can
(see engines/progress.py), so the gateway's work per request is bounded by events, not by tokens.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

__all__ = (
    "AssemblyHint",
    "EndSink",
    "EngineClient",
    "EngineFamily",
    "EngineInfo",
    "EngineLoad",
    "EventSink",
    "Readiness",
    "Route",
    "UpstreamCall",
    "UpstreamError",
    "UpstreamEvent",
    "UpstreamHandle",
)


class EngineFamily(enum.Enum):
    SGLANG = "sglang"
    VLLM = "vllm"
    OPENAI = "openai"  # any other OpenAI-compatible server


class Route(enum.Enum):
    """The client-facing API of a call; the upstream speaks the same API (no cross-API translation)."""

    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"
    GENERATE = "/generate"  # SGLang native
    TOKENS = "/inference/v1/generate"  # vLLM's token-in/token-out route (SkyRL, prime-rl)


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineInfo:
    """What a probe learned about an engine."""

    family: EngineFamily
    capacity: int | None = None  # max requests running at once, when the engine reports it
    models: tuple[str, ...] = ()
    max_model_len: int | None = None
    chunked_prefill_size: int | None = None
    weight_version: str | None = None
    # token ids it can take: every prompt id must be below (server/validate.py); None when it does not say
    # and its model folder cannot be read (rolloutgate/vocabulary.py)
    vocab_size: int | None = None
    # the endpoints it lacks (an SGLang-speaking stand-in without `/server_info` or `/v1/models`): the facts
    # they give are the gateway's defaults (server/pool.py says so once, and `/workers` lists them)
    missing: tuple[str, ...] = ()


SNAPSHOT_ANSWER_S = 1.0  # real seconds a scheduler between batches (or paused) takes to answer, at most


@dataclass(frozen=True, slots=True)
class SchedulerSnapshot:
    """What the scheduler holds (EngineClient.scheduler_snapshot): frozen while its generation is paused."""

    requests: int  # running and waiting
    tokens: int  # in use and waiting: a decode step or a prefill chunk changes it


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineLoad:
    """Engine-level load: the progress of calls that do not stream (server/engine_watch.py), and for tests.

    `generated_tokens_total`: the engine's generated-token counter (SGLang with `--enable-metrics`, vLLM), the
    signal of choice. Otherwise `gen_throughput` (SGLang `/v1/loads`), which a frozen SGLang keeps reporting
    from its last decode log: it counts only while the snapshot's `snapshot_at` moves."""

    running: int
    waiting: int
    generated_tokens_total: float | None = None
    # tokens/s the engine reports generating lately (SGLang /v1/loads, or its /metrics gauge, which keeps its
    # last decode log's value while the engine is paused)
    gen_throughput: float | None = None
    snapshot_at: float | str | None = None  # when the engine took the reading (SGLang /v1/loads `timestamp`)


@dataclass(slots=True, kw_only=True)  # not frozen: built per request (core/events.py, `_per_request`)
class UpstreamCall:
    """One attempt of a request on one engine."""

    request_id: str  # the gateway's id: SGLang `rid`, vLLM `X-Request-Id`
    route: Route
    body: dict[str, Any]  # the client's validated JSON body; the adapter copies before rewriting
    headers: dict[str, str] = field(default_factory=dict)  # client headers to pass on (routing keys)
    # a call answered whole streams its output this often (tokens), so a new attempt can continue from it
    # (server/continuation.py); 0: only the first token and the end
    checkpoint_tokens: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class AssemblyHint:
    """What server/assemble.py needs to know, beyond the events, to build a non-streaming answer exactly as
    the engine would have: its family (the answer's field set differs), SGLang's weight version (its chat and
    completions answers carry `metadata.weight_version`, its stream chunks do not), and whether SGLang's
    `/generate` stream is incremental (`--incremental-streaming-output`: each chunk's own text, ids and
    output logprobs) or incremental in its ids alone (0.5.x's `--stream-output`: text and logprobs stay
    cumulative) instead of cumulative."""

    family: EngineFamily
    weight_version: str | None = None
    is_incremental_generate: bool = False
    are_generate_ids_incremental: bool = False  # `--stream-output`; never with `is_incremental_generate`


@dataclass(slots=True)
class UpstreamEvent:
    """One SSE event from the engine (without the `[DONE]` sentinel), or a whole non-streamed body.

    `tokens` is how many new output tokens the event carries, as well as the adapter can tell without parsing
    (>= 1 for a token event, 0 for a metadata-only event such as a role-only first chunk; a usage frame
    carries the tokens the count missed so far, so the sum matches the engine's `completion_tokens` unless
    the per-event count overshot). `json()` parses lazily, once.

    `is_gateway_only`: the event exists only because the gateway asked for it (the usage frame, when a
    streaming client did not ask for `stream_options.include_usage`): do not forward it to a streaming client;
    do feed it to the assembler. `finish_reason`: set on the event that ends a choice, when the adapter can
    tell cheaply (`stop`, `length`, `abort`, `tool_calls`, ...; SGLang `/generate`: `finish_reason.type`).
    `assembly`: set by the adapter on every event of a generation (one shared object).
    """

    data: bytes  # the JSON text of the event (the part after `data: `)
    tokens: int = 1
    is_whole_body: bool = False  # the upstream answered without streaming: `data` is the full response body
    is_gateway_only: bool = False
    finish_reason: str | None = None
    assembly: AssemblyHint | None = None
    _parsed: Any = None

    def json(self) -> Any:
        if self._parsed is None:
            self._parsed = orjson.loads(self.data)
        return self._parsed


# The events of one socket read, in order -> keep going (False: stop the call). Never called with [].
EventSink = Callable[[list["UpstreamEvent"]], bool]
EndSink = Callable[["UpstreamError | None"], None]  # a call's outcome: None when it ended well


class UpstreamHandle(Protocol):
    """A running generation: `cancel()` closes its connection (nothing is reported after it)."""

    def done(self) -> bool: ...

    def cancel(self) -> bool | None: ...


class UpstreamError(Exception):
    """An upstream call failed. `retryable`: the same request may run again elsewhere.

    `status` is the engine's HTTP status when it answered with an error; `body` its error body (JSON bytes),
    passed to the client as-is for non-retryable client errors (e.g. a 400 for a bad parameter).
    `unreachable`: no connection could be made at all (refused, DNS): the engine itself is down.
    `lost`: the engine dropped the call without finishing its answer (connection reset or closed, a stream
    cut short): what a client sees when the engine process dies under it.
    """

    def __init__(
        self,
        message: str,
        *,
        retryable: bool,
        status: int | None = None,
        body: bytes | None = None,
        unreachable: bool = False,
        lost: bool = False,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.retryable = retryable
        self.status = status
        self.body = body
        self.unreachable = unreachable
        self.lost = lost


class Readiness(enum.Enum):
    """What an engine says of its own generation (`EngineClient.readiness`)."""

    READY = "ready"
    PAUSED = "paused"  # its generation is paused, by whoever paused it (a trainer, directly)
    NOT_READY = "not_ready"  # neither: starting, unhealthy, or (SGLang) paused after a failed health probe


class EngineClient(Protocol):
    """One engine. Implementations share one aiohttp session per gateway and hold no request state."""

    url: str
    family: EngineFamily
    # True when `load()` reports the engine's generated tokens: a non-streaming client's call is then answered
    # whole and watched through it (server/engine_watch.py); False: the adapter streams every call, whose
    # events are the only progress there is
    reports_load: bool
    # True when `abort()` makes the engine end the call itself with an abort answer (SGLang): an aborted call is
    # then read to that end rather than closed (server/driver.py `_wind_down` says why)
    ends_aborted_calls: bool

    async def probe(self) -> EngineInfo:
        """Read the engine's family facts (capacity, models). Raises UpstreamError if unreachable."""
        ...

    async def health(self) -> bool:
        """True if the engine answers its health endpoint with success."""
        ...

    async def generates(self, model: str | None) -> bool:
        """True if the engine answers a one-token generation (of `model`, when the family names one): the
        proof an engine caught hung gives before it takes work again, where `health` may say 200 from an
        engine that generates nothing (vLLM's `/health`, vLLM#46811). False for anything else; never
        raises."""
        ...

    async def readiness(self) -> Readiness | None:
        """Whether the engine says its generation is paused, from cheap flag endpoints that never block on
        a pause (None: this engine cannot say, or did not answer)."""
        ...

    async def scheduler_snapshot(self) -> SchedulerSnapshot | None:
        """The scheduler's own count of what it holds, asked with a control request that generates nothing
        (SGLang `/get_load`: requests, and tokens in use and waiting), when it answers within
        `SNAPSHOT_ANSWER_S`: a scheduler answers between batches and at once while generation is paused, not
        while it is inside a forward pass. Two equal snapshots a while apart, with requests held, tell a
        pause on an engine without a pause flag (server/pool.py). None: no answer in time, or the family has
        no such request."""
        ...

    def start(self, call: UpstreamCall, on_events: EventSink, on_end: EndSink) -> UpstreamHandle:
        """Run the call: the events of each socket read go to `on_events` as the engine sends them (False
        stops the call and closes its connection); its outcome to `on_end` once, None when the answer ended
        well, else the UpstreamError (connection failures, resets, non-2xx answers, unparseable streams).
        `cancel()` on the handle closes the upstream connection and reports nothing (engines/push_call.py)."""
        ...

    async def abort(self, request_id: str) -> None:
        """Stop the request's generation on the engine (best effort; never raises)."""
        ...

    async def load(self) -> EngineLoad:
        """Engine-level running/waiting counts. Raises UpstreamError if unavailable."""
        ...

    async def pause(self, mode: str) -> None:
        """Pause generation (`abort`, `drain`/`wait`, `in_place`/`keep`, `retract`, mapped to the family's
        modes; see each adapter). Raises ValueError for an unknown mode, UpstreamError if the engine refuses
        or has no pause API."""
        ...

    async def resume(self) -> None:
        """Undo `pause`. Raises UpstreamError if the engine refuses or has no pause API."""
        ...

    async def update_weights(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """Forward a weight-update call (e.g. `/update_weights_from_disk`) and return the engine's answer."""
        ...

    async def post_raw(
        self, path_and_query: str, body: bytes, headers: Mapping[str, str], *, limit: int
    ) -> tuple[int, str, bytes]:
        """POST `body` as it came (a trainer's call through the RL control plane); the engine's status, media
        type and at most `limit` bytes of its answer. Raises OSError when it answers nothing."""
        ...
