"""Errors a client can see, and their one mapping to HTTP status, OpenAI error type and code.

    GatewayError
    ├── BadRequest            400 invalid_request_error   (malformed JSON, wrong types, bad overrides)
    │   └── PayloadTooLarge   413 invalid_request_error
    ├── Unauthorized          401 authentication_error
    ├── Forbidden             403 permission_error
    ├── NotFound              404 not_found_error
    ├── SessionGone           410 invalid_request_error
    ├── QueueFull             429 rate_limit_error        (+ Retry-After)
    ├── UpstreamError         502 upstream_error          (the engine failed and no retry helped)
    ├── Unavailable           503 service_unavailable     (no healthy engine, queue timeout; + Retry-After)
    └── Timeout               504 timeout_error           (a clock ran out; the message names it)

The core never raises these: it returns `Fail(reason=...)`, which `from_fail_reason` maps here, at the edge.
"""

from __future__ import annotations

import math
from typing import ClassVar

import orjson

from rolloutgate.core.commands import FailReason
from rolloutgate.core.timing import TimingBreakdown

__all__ = (
    "BadRequest",
    "Forbidden",
    "GatewayError",
    "NotFound",
    "PayloadTooLarge",
    "QueueFull",
    "SessionGone",
    "Timeout",
    "Unauthorized",
    "Unavailable",
    "UpstreamFailure",
    "from_fail_reason",
)


class GatewayError(Exception):
    default_status: ClassVar[int] = 500
    openai_type: ClassVar[str] = "internal_error"
    default_code: ClassVar[str] = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        raw_body: bytes | None = None,
        code: str | None = None,
        param: str | None = None,
        retry_after_s: float = math.inf,
        timing: TimingBreakdown | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status or self.default_status
        self.raw_body = raw_body  # an engine's own error body, passed through unchanged
        self.code = code or self.default_code
        self.param = param
        self.retry_after_s = retry_after_s
        self.timing = timing

    def payload(self) -> dict[str, object]:
        """The OpenAI-shaped error object: `{"error": {message, type, param, code}}` (+ our timing)."""
        error: dict[str, object] = {
            "message": self.message,
            "type": self.openai_type,
            "param": self.param,
            "code": self.code,
        }
        if self.timing is not None:
            error["rolloutgate_timing"] = self.timing.as_dict()
        return {"error": error}

    def body(self) -> bytes:
        return self.raw_body if self.raw_body is not None else orjson.dumps(self.payload())

    def headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if math.isfinite(self.retry_after_s):
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
        if self.timing is not None:
            headers["X-Rolloutgate-Timing"] = self.timing.header_value()
        return headers


class BadRequest(GatewayError):
    default_status = 400
    openai_type = "invalid_request_error"
    default_code = "invalid_request"


class PayloadTooLarge(BadRequest):
    default_status = 413
    default_code = "payload_too_large"


class Unauthorized(GatewayError):
    default_status = 401
    openai_type = "authentication_error"
    default_code = "invalid_api_key"


class Forbidden(GatewayError):
    default_status = 403
    openai_type = "permission_error"
    default_code = "forbidden"


class NotFound(GatewayError):
    default_status = 404
    openai_type = "not_found_error"
    default_code = "not_found"


class SessionGone(GatewayError):
    default_status = 410
    openai_type = "invalid_request_error"
    default_code = "session_gone"


class QueueFull(GatewayError):
    default_status = 429
    openai_type = "rate_limit_error"
    default_code = "queue_full"


class UpstreamFailure(GatewayError):
    default_status = 502
    openai_type = "upstream_error"
    default_code = "upstream_error"


class Unavailable(GatewayError):
    default_status = 503
    openai_type = "service_unavailable"
    default_code = "service_unavailable"


class Timeout(GatewayError):
    default_status = 504
    openai_type = "timeout_error"
    default_code = "timeout"


_FAIL_REASONS: dict[FailReason, tuple[type[GatewayError], str]] = {
    FailReason.TIMEOUT: (Timeout, "charged engine time passed the request's timeout"),
    FailReason.STALL: (Timeout, "no progress from the engine for stall_timeout, on a retry too"),
    FailReason.MAX_WALL: (Timeout, "wall time passed the request's max_wall"),
    FailReason.QUEUE_TIMEOUT: (Unavailable, "waited in the gateway queue longer than queue_timeout"),
    FailReason.NO_ENGINE: (Unavailable, "no healthy engine is available"),
    FailReason.QUEUE_FULL: (QueueFull, "the gateway queue is full"),
    FailReason.UPSTREAM: (UpstreamFailure, "the engine failed the request"),
    FailReason.ATTEMPTS_EXHAUSTED: (UpstreamFailure, "the request failed on every engine tried"),
    FailReason.ENGINE_LOST_IN_PREFILL: (
        UpstreamFailure,
        "two engines dropped the request before its first token; it is not sent to another, as it may be what "
        "brought them down",
    ),
    # /generate gets SGLang's own abort answer instead (server/driver.py); other routes this error
    FailReason.ABORTED: (BadRequest, "aborted by an abort_request before it started"),
}


def from_fail_reason(
    reason: FailReason, *, timing: TimingBreakdown | None, retry_after_s: float = math.inf, detail: str = ""
) -> GatewayError:
    """The client-facing error for a core verdict; the code names the rule (e.g. `timeout`, `queue_timeout`)."""
    cls, message = _FAIL_REASONS[reason]
    if detail:
        message = f"{message}: {detail}"
    return cls(message, code=reason.value, timing=timing, retry_after_s=retry_after_s)
