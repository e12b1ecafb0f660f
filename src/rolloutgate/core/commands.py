"""Commands: what the core asks the edges to do, returned by `Gateway.handle(event, now)`.

Theory of operation: the core decides, the edges act. The driver executes commands in the order returned.
Commands are imperative, frozen values, never subclassed. Every abort and failure carries a reason literal so
that logs, metrics and client errors can say which rule fired.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from rolloutgate.core.timing import TimingBreakdown

__all__ = (
    "Abort",
    "AbortReason",
    "CheckEngine",
    "Command",
    "Complete",
    "Dispatch",
    "Fail",
    "FailReason",
    "GroupOutcome",
    "MarkEngine",
    "RecordGroup",
)

_frozen = {"frozen": True, "slots": True, "kw_only": True}
_per_request = {"slots": True, "kw_only": True}  # not frozen: built for every request (see core/events.py)


class AbortReason(enum.Enum):
    """Why a generation is being stopped on its engine."""

    TIMEOUT = "timeout"  # charged engine time ran out
    MAX_WALL = "max_wall"  # the absolute wall cap ran out
    STUCK = "stuck"  # no progress for this request while its engine progressed: retried elsewhere
    ENGINE_HUNG = "engine_hung"  # its engine made no progress at all: moved elsewhere
    CLIENT_GONE = "client_gone"  # the client left and no retry attached within the grace period
    REQUEUE = "requeue"  # the gate closed in abort mode: it runs again after resume
    ENGINE_LEFT = "engine_left"  # its engine was removed from the pool
    GROUP_ABORTED = "group_aborted"  # a client aborted its group (GroupAborted): it ends, answered as aborted
    STALE = "stale"  # past the staleness bound at a weight update: re-queued from scratch (weights.py)
    STALE_PARTIAL = "stale_partial"  # past the bound: the engine answers it with its partial output


class FailReason(enum.Enum):
    """Why a request ends with an error. The edge maps each to one HTTP status and OpenAI error code."""

    TIMEOUT = "timeout"  # charged engine time passed `timeout`            -> 504
    STALL = "stall"  # stuck again after its one retry elsewhere           -> 504
    QUEUE_TIMEOUT = "queue_timeout"  # waited longer than `queue_timeout`  -> 503 + Retry-After
    MAX_WALL = "max_wall"  # wall time passed `max_wall`                    -> 504
    NO_ENGINE = "no_engine"  # no healthy engine for a while              -> 503 + Retry-After
    QUEUE_FULL = "queue_full"  # the wait queue is at its limit            -> 429 + Retry-After
    UPSTREAM = "upstream"  # the engine failed and no retry is possible  -> 502
    ATTEMPTS_EXHAUSTED = "attempts_exhausted"  # failed on every engine tried -> 502
    ENGINE_LOST_IN_PREFILL = "engine_lost_in_prefill"  # dropped in prefill by two engines (poison) -> 502
    ABORTED = "aborted"  # waiting when a client aborted everything (QueueAborted) -> SGLang's abort answer


@dataclass(**_per_request)
class Dispatch:
    """Send the request to `engine_id` now; the engine has a free slot, so it starts at once.

    `attempt` counts from 1. `delivered_tokens` > 0 means earlier attempts made that many tokens the request
    keeps (a streaming client has seen them, or a `continuable` call lost its engine): the edge continues from
    them where the engine API allows; else a streaming client fails, and a call answered whole starts over.
    """

    request_id: str
    engine_id: str
    attempt: int = 1
    delivered_tokens: int = 0


@dataclass(**_frozen)
class Abort:
    """Stop the request's generation on `engine_id` (the engine's abort API, or closing the connection)."""

    request_id: str
    engine_id: str
    reason: AbortReason


@dataclass(**_frozen)
class Fail:
    """End the request with an error for its client. Any generation has already been aborted by then."""

    request_id: str
    reason: FailReason
    timing: TimingBreakdown
    retry_after_s: float = math.inf  # math.inf: no Retry-After header
    detail: str = ""


@dataclass(**_per_request)
class Complete:
    """The request finished: deliver its answer. The timing breakdown is final."""

    request_id: str
    timing: TimingBreakdown


@dataclass(**_frozen)
class CheckEngine:
    """The engine was silent for its whole stall window: read whether it is paused (a pause nobody announced,
    which the health loop may not have seen yet). `EnginePaused` within the core's `hang_check_s` spares it;
    otherwise it is judged hung then."""

    engine_id: str


@dataclass(**_frozen)
class MarkEngine:
    """An engine changed state (e.g. quarantined as hung, recovered); for logs, metrics and health checks."""

    engine_id: str
    state: str  # one of rolloutgate.core.engine_state.EngineState values
    detail: str = ""


class GroupOutcome(enum.Enum):
    """How a group ended (core/group_table.py): the worst of its members' ends."""

    FINISHED = "finished"  # every member completed
    FAILED = "failed"  # a member failed (and none was aborted)
    ABORTED = "aborted"  # a member was aborted (its group, abort_request) or its client left


@dataclass(**_frozen)
class RecordGroup:
    """A group's last live member ended: record the group's outcome (metrics; group_table.py).

    `completion_s`: from its first member's arrival to its last member's end (its slowest sibling).
    `prefill_tokens_saved`: prompt tokens its members were placed to find cached by a sibling (estimated)."""

    group: str
    outcome: GroupOutcome
    completion_s: float
    members: int
    prefill_tokens_saved: int = 0


Command = Dispatch | Abort | Fail | Complete | CheckEngine | MarkEngine | RecordGroup
