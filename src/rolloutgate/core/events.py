"""Events: what happened, told to the core (`Gateway.handle(event, now)`).

Theory of operation: the edges (HTTP front, engine adapters, health checker, admin API) translate what they
see into these past-tense facts. Events are frozen values; they validate themselves on construction and are
never subclassed. Request ids are the gateway's own ids (unique per logical request, kept across
re-dispatches); engine ids are the pool's names for engines.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

__all__ = (
    "ClientAttached",
    "ClientDisconnected",
    "ClockMode",
    "EngineCacheFlushed",
    "EngineHealthChecked",
    "EngineJoined",
    "EngineLeft",
    "EnginePaused",
    "EngineResumed",
    "Event",
    "GateClosed",
    "GateOpened",
    "GroupAborted",
    "PauseMode",
    "ProgressReported",
    "QueueAborted",
    "RequestArrived",
    "RequestLimits",
    "SessionEnded",
    "UpstreamFailed",
    "UpstreamFinished",
    "WeightsUpdated",
)

_frozen = {"frozen": True, "slots": True, "kw_only": True}
# The events and commands of every request (several per request, on the hot path) are not frozen: a frozen
# dataclass sets each field through object.__setattr__, 2.5x the cost of a plain one (docs/benchmarks.md,
# fifth session). They are never changed after construction all the same; the rest stay frozen.
_per_request = {"slots": True, "kw_only": True}


def _check_duration(name: str, value: float) -> None:
    if math.isnan(value) or value < 0:
        raise ValueError(f"{name} must be a duration >= 0 (math.inf for none), got {value!r}")


class ClockMode(enum.Enum):
    """What a request's `timeout` measures."""

    ENGINE = "engine"  # charged engine work only (rolloutgate's semantics)
    WALLCLOCK = "wallclock"  # time since submission, as the incident's proxy did


class PauseMode(enum.Enum):
    """How the gate treats in-flight work when it closes (see DESIGN.md, the gate)."""

    DRAIN = "drain"  # stop dispatching; in-flight work runs to its end
    ABORT = "abort"  # abort in-flight work on the engines and re-queue it to run after resume
    IN_PLACE = "in_place"  # engines pause with their KV cache kept; in-flight work resumes where it was
    RETRACT = "retract"  # SGLang's own default: engines pause and free the KV cache of what runs, which
    # stays theirs and is prefilled again when they continue (vLLM: keep)
    EXTERNAL = "external"  # the trainer pauses and continues the engines itself; the gateway only holds its
    # queue and charges nobody (in-flight work stays on the engines, as in place)


@dataclass(**_frozen)
class RequestLimits:
    """Per-request budgets, seconds; `math.inf` means no limit."""

    timeout_s: float = 600.0  # charged engine time
    stall_timeout_s: float = 60.0  # time without progress while the engine is progressing otherwise
    queue_timeout_s: float = math.inf  # time waiting in the gateway queue
    max_wall_s: float = math.inf  # absolute cap from arrival to the end

    def __post_init__(self) -> None:
        for name in ("timeout_s", "stall_timeout_s", "queue_timeout_s", "max_wall_s"):
            _check_duration(name, getattr(self, name))
        if self.timeout_s == 0 or self.stall_timeout_s == 0:
            raise ValueError("timeout_s and stall_timeout_s must be > 0")


# --- requests -------------------------------------------------------------------------------------------


@dataclass(**_per_request)
class RequestArrived:
    """A client's request was accepted by the front and wants an engine."""

    request_id: str
    limits: RequestLimits = field(default_factory=RequestLimits)
    routing_key: str | None = None  # session affinity key (X-SMG-Routing-Key, X-Session-Id, session id)
    priority: int = 0  # lower runs first; FIFO within a priority
    prompt_tokens: int = 0  # estimated prompt length, for placement and prefill budgets
    streaming: bool = False  # the client reads a stream: once it has seen output, that output is visible
    # the edge can go on from the output a failed attempt made (server/continuation.py): a new attempt after an
    # engine's failure continues instead of starting over (not one for new weights: that starts afresh)
    continuable: bool = False
    pinned_engine: str | None = None  # dispatch only to this engine (e.g. a proxied engine-specific call)
    group: str | None = None  # the n samples of one prompt share it: placed together (group_table.py)
    # the most weight versions its engine may be behind the newest (EngineVersionLag); None: any weights.
    # A pinned request runs on its engine whatever the weights: its caller chose the engine.
    max_version_lag: int | None = None

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("request_id must be non-empty")
        if self.prompt_tokens < 0:
            raise ValueError("prompt_tokens must be >= 0")
        if self.max_version_lag is not None and self.max_version_lag < 0:
            raise ValueError("max_version_lag must be >= 0 or None")


@dataclass(**_per_request)
class ProgressReported:
    """The engine produced something for a dispatched request: `tokens` new output tokens (0 = bytes only).

    `engine_level`: not the request's own output but its engine's, read from the engine's counters while the
    request's answer comes whole (core/engine_watch.py): it keeps the request and its engine alive, and ends
    the request's prefill only once the prefill would be over at the floor rate."""

    request_id: str
    tokens: int = 1
    cached_tokens: int | None = None  # prompt tokens the engine served from its prefix cache, when told
    attempt: int | None = None  # the Dispatch.attempt this belongs to; a stale attempt's event is ignored
    engine_level: bool = False

    def __post_init__(self) -> None:
        if self.tokens < 0:
            raise ValueError("tokens must be >= 0")


@dataclass(**_per_request)
class UpstreamFinished:
    """The engine finished the request and the whole answer is in the gateway's hands."""

    request_id: str
    attempt: int | None = None  # the Dispatch.attempt this belongs to; a stale attempt's event is ignored


@dataclass(**_frozen)
class UpstreamFailed:
    """The upstream call ended without an answer (refused, reset, garbage, engine error).

    `retryable` is the adapter's judgement that the same request may run again elsewhere (connection refused,
    reset, 5xx); a 4xx from the engine is not retryable and is the client's answer.
    """

    request_id: str
    reason: str
    retryable: bool = True
    status: int | None = None  # the engine's HTTP status, when there was one
    engine_unreachable: bool = False  # connection refused / no route: the engine is marked unhealthy
    # the engine dropped the call mid-answer (reset, closed, stream cut short), as when its process dies
    engine_lost: bool = False
    # the engine's own pause (abort mode, sent to it directly) ended the call: re-queued, not counted as a fault
    engine_paused: bool = False
    attempt: int | None = None  # the Dispatch.attempt this belongs to; a stale attempt's event is ignored


@dataclass(**_frozen)
class ClientDisconnected:
    """The client's connection closed before its answer was delivered."""

    request_id: str


@dataclass(**_frozen)
class ClientAttached:
    """A retry of a disconnected request joined it again (see `attach`), cancelling its grace timer."""

    request_id: str


# --- engines --------------------------------------------------------------------------------------------


@dataclass(**_frozen)
class EngineJoined:
    """An engine joined the pool with room for `capacity` requests in flight."""

    engine_id: str
    capacity: int
    prefill_token_budget: float = math.inf  # uncached prompt tokens in prefill at once
    healthy: bool = True

    def __post_init__(self) -> None:
        if not self.engine_id:
            raise ValueError("engine_id must be non-empty")
        if self.capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {self.capacity}")
        if math.isnan(self.prefill_token_budget) or self.prefill_token_budget <= 0:
            raise ValueError("prefill_token_budget must be > 0")


@dataclass(**_frozen)
class EngineLeft:
    """An engine was removed from the pool; its work must go elsewhere."""

    engine_id: str


@dataclass(**_frozen)
class EngineDraining:
    """The engine takes no new work while `draining` (it is being handed to another gateway): its running
    calls go on to their end, what waits for it waits for another engine. `draining=False` takes it back."""

    engine_id: str
    draining: bool = True


@dataclass(**_frozen)
class EngineVersionLag:
    """How many weight versions the engine's weights are behind the newest one an engine of the pool holds
    (0: it holds the newest). A request whose version policy allows a smaller lag is not started there
    (`RequestArrived.max_version_lag`); what runs on it goes on, under the staleness bound (weights.py)."""

    engine_id: str
    lag: int = 0

    def __post_init__(self) -> None:
        if self.lag < 0:
            raise ValueError("lag must be >= 0")


@dataclass(**_frozen)
class EngineHealthChecked:
    """A health check of the engine passed or failed."""

    engine_id: str
    healthy: bool


@dataclass(**_frozen)
class EngineCacheFlushed:
    """The engine's prefix cache was emptied: its weights were updated (KV computed with the old weights is
    useless, and SGLang flushes it) or its cache was flushed. Sessions placed there keep their affinity, but
    their next turn is a cold prefill again."""

    engine_id: str


@dataclass(**_frozen)
class EnginePaused:
    """One engine was paused (a staggered weight update); its requests are not charged meanwhile.

    `unannounced`: the engine paused itself (a trainer paused it directly) and the edge learned it late, from
    the engine's own flag or from what it shows (server/pool.py): the pause began at some time after the
    engine's last progress, which is all the core knows of it, so the core counts the pause from then (its
    silence since its last progress, or since it got work or was resumed, is forgiven: `paused`, not charged),
    for every request in flight there (request_clock.py `ChargeMeter.backdate_pause`).

    `last_output_at`: when the engine's last token came, as the edge read it from the engine's token counter
    when it learned the pause (server/engine_watch.py): for calls answered whole the core's last progress is
    the last reading that showed tokens, up to a poll after the last token or, when the pause was seen before
    that reading, one poll before it; the counter says when."""

    engine_id: str
    unannounced: bool = False
    last_output_at: float | None = None


@dataclass(**_frozen)
class EngineResumed:
    engine_id: str


@dataclass(**_frozen)
class GroupAborted:
    """A client aborted a group (`POST /admin/abort_group`): every live member ends now, aborted; those
    running are aborted on their engines first (group_table.py)."""

    group: str

    def __post_init__(self) -> None:
        if not self.group:
            raise ValueError("group must be non-empty")


@dataclass(**_frozen)
class SessionEnded:
    """A session ended (DELETE, or its samples taken): its engine binding is released (session_table.py)."""

    routing_key: str


@dataclass(**_frozen)
class QueueAborted:
    """A client asked to abort (SGLang `/abort_request`): the requests still waiting in the gateway end now,
    aborted; the engines answer their running ones themselves. All of them (`{"abort_all": true}`, miles' end
    of a rollout step) when `request_ids` is None, else those named (the ones a client's `rid` matched)."""

    request_ids: frozenset[str] | None = None


# --- the gate -------------------------------------------------------------------------------------------


@dataclass(**_frozen)
class GateClosed:
    """The weight-update gate closed: nothing is dispatched and nobody is charged until it opens."""

    mode: PauseMode = PauseMode.DRAIN


@dataclass(**_frozen)
class GateOpened:
    pass


@dataclass(**_frozen)
class WeightsUpdated:
    """The engines serve new weights (an update through the gate, or one the trainer made while the gate was
    closed): the gateway's weight version advances by one, and requests past the staleness bound end their
    attempt (core/weights.py). `engine_version`: the engines' own label of the new weights, when known."""

    engine_version: str | None = None


Event = (
    RequestArrived
    | ProgressReported
    | UpstreamFinished
    | UpstreamFailed
    | ClientDisconnected
    | ClientAttached
    | EngineJoined
    | EngineLeft
    | EngineDraining
    | EngineVersionLag
    | EngineHealthChecked
    | EngineCacheFlushed
    | EnginePaused
    | EngineResumed
    | QueueAborted
    | GateClosed
    | GateOpened
    | GroupAborted
    | SessionEnded
    | WeightsUpdated
)
