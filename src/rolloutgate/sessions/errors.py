"""Errors of the session API, as leaves of the gateway's one error tree (`rolloutgate.errors`).

    GatewayError
    ├── BadRequest (400)
    │   ├── SessionDiverged          400 session_diverged         (messages do not extend the session)
    │   ├── SessionRecordLimit       400 session_record_limit     (the session holds its maximum of turns)
    │   ├── ChatTemplateError        400 chat_template_error      (the template failed or is not incremental)
    │   └── UnsupportedInSession     400 unsupported_parameter    (e.g. n > 1: a session is one linear history)
    ├── NotFound (404)
    │   └── SessionNotFound          404 session_not_found        (never existed, or deleted)
    ├── SessionConflict              409 session_busy / trajectory_not_linear
    ├── SamplesUnassemblable         422 samples_unassemblable    (the records make no training sample)
    ├── SessionGone (410)
    │   └── SessionEvicted           410 session_gone             (evicted: idle TTL, capacity or memory bound)
    ├── QueueFull (429)
    │   └── SessionsFull             429 session_limit            (max sessions or memory, none evictable)
    ├── UpstreamFailure (502)
    │   └── EngineAnswerInvalid      502 engine_answer_invalid    (the engine's answer lacks ids or logprobs)
    └── SessionStoreUnavailable      503 session_store_unavailable (--state-dir could not write; + Retry-After)

400s are not retried by the OpenAI SDK or LiteLLM (a diverged history will not heal by retrying); 409 and
429 are (a busy session frees up when its turn ends).
"""

from __future__ import annotations

from rolloutgate.errors import BadRequest, GatewayError, NotFound, QueueFull, SessionGone, UpstreamFailure

__all__ = (
    "ChatTemplateError",
    "EngineAnswerInvalid",
    "SamplesUnassemblable",
    "SessionConflict",
    "SessionDiverged",
    "SessionEvicted",
    "SessionNotFound",
    "SessionRecordLimit",
    "SessionStoreUnavailable",
    "SessionsFull",
    "TruncatedGeneration",
    "UnsupportedInSession",
)


class SessionDiverged(BadRequest):
    default_code = "session_diverged"


class SessionRecordLimit(BadRequest):
    default_code = "session_record_limit"


class ChatTemplateError(BadRequest):
    default_code = "chat_template_error"


class UnsupportedInSession(BadRequest):
    default_code = "unsupported_parameter"


class SessionNotFound(NotFound):
    default_code = "session_not_found"


class SessionConflict(GatewayError):
    default_status = 409
    openai_type = "invalid_request_error"
    default_code = "session_busy"


class TruncatedGeneration(GatewayError):
    """miles' v2 409: a tree session's turn cut off at `length` has no closed answer to extend (retry it, or
    branch from an earlier turn)."""

    default_status = 409
    openai_type = "invalid_request_error"
    default_code = "truncated_generation"


class SamplesUnassemblable(GatewayError):
    """miles' 422: the session's records cannot be assembled into a sample (a chain that does not extend)."""

    default_status = 422
    openai_type = "invalid_request_error"
    default_code = "samples_unassemblable"


class SessionEvicted(SessionGone):
    default_code = "session_gone"


class SessionsFull(QueueFull):
    default_code = "session_limit"


class EngineAnswerInvalid(UpstreamFailure):
    default_code = "engine_answer_invalid"


class SessionStoreUnavailable(GatewayError):
    """The durable store (`--state-dir`) could not write: the turn is not recorded, so the agent must retry."""

    default_status = 503
    openai_type = "service_unavailable"
    default_code = "session_store_unavailable"

    def __init__(self, message: str) -> None:
        super().__init__(message, retry_after_s=1)
