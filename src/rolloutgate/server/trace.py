"""Trace capture (`--record-trace FILE`): one JSON line per finished request, no text and no token ids.

Theory of operation: `TraceRecorder` only looks, through the driver's public hooks (server/driver.py): as an
observer it sees each `RequestArrived` (arrival, session, prompt length), `ClientDisconnected`, the gate
closing and opening, engines paused and resumed by the gateway, and each `MarkEngine` verdict (quarantined,
unhealthy, healthy); its `on_end` and `on_forget` callbacks write the request's line once it ended. What an
operator replays from it (`rolloutgate replay trace FILE`, rolloutreplay/trace_workload.py) is the workload:
sessions, arrivals, lengths; the gateway's timings and verdicts are there to compare.

Lines are buffered and written in batches of `FLUSH_BYTES` (and on close, at shutdown): a line costs the
request path an encoding and an append. Memory is bounded: the buffer by `FLUSH_BYTES`, the requests in
flight by `MAX_PENDING` (the oldest dropped beyond it). A failing write is logged once and tracing stops;
the gateway carries on.

Format (JSON Lines; version `TRACE_VERSION`, docs/replay.md "Trace capture and replay"): a header line
`{"rolloutgate_trace": 2, ...}`, then lines with a `"type"`: `request`, `engine` (a verdict on an engine),
`engine_pause`, `gate`. Times (`at`, `end`) are gateway seconds since the header's `started_at` (simulated
seconds in front of a time-scaled simulator), in the order the lines were written (a request's line comes
at its end). Version 2: a frozen engine is quarantined `stall_timeout` after its last progress (the pause
check asked before the verdict, core/liveness.py; version 1's came `hang_check_timeout` later), and the
header's settings carry `warmup_timeout`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

import orjson

from rolloutgate.config import GatewaySettings
from rolloutgate.core.commands import Command, MarkEngine
from rolloutgate.core.events import (
    ClientDisconnected,
    EnginePaused,
    EngineResumed,
    Event,
    GateClosed,
    GateOpened,
    RequestArrived,
)
from rolloutgate.errors import GatewayError
from rolloutgate.server.driver import Driver, max_new_tokens
from rolloutgate.server.exchange import Exchange, Finished
from rolloutgate.server.pool import EnginePool

__all__ = ("FLUSH_BYTES", "MAX_PENDING", "TRACE_VERSION", "TraceRecorder", "attach_trace")

log = logging.getLogger("rolloutgate.trace")

TRACE_VERSION = 2
FLUSH_BYTES = 64 * 1024
MAX_PENDING = 100_000
# in an engine's answer (OpenAI usage.prompt_tokens_details, SGLang meta_info): quotes are escaped inside JSON
# strings, so these never match generated text
_CACHED = re.compile(rb'"cached_tokens":\s*(\d+)')
_FINISH = re.compile(rb'"finish_reason":\s*(?:"(\w+)"|\{"type":\s*"(\w+)")')


@dataclass(slots=True)
class _Arrival:
    at: float
    session: str | None
    prompt_tokens: int
    client_left: bool = False


class TraceRecorder:
    """Writes the trace of one gateway to `sink` (module docstring). `now`: the driver's clock (gateway
    seconds); `engine_url`: an engine id's URL, if the pool knows it; `header`: the settings worth replaying
    (clock, timeouts, engines), written on the first line."""

    def __init__(
        self,
        sink: IO[bytes],
        now: Callable[[], float],
        engine_url: Callable[[str], str | None],
        header: dict[str, Any],
    ) -> None:
        self._sink: IO[bytes] | None = sink
        self._now = now
        self._engine_url = engine_url
        self._started_at = now()
        self._pending: dict[str, _Arrival] = {}
        self._buffer: list[bytes] = []
        self._buffered = 0
        self.lines = 0  # written or buffered, header included
        self._write({"rolloutgate_trace": TRACE_VERSION, "started_at": round(self._started_at, 3), **header})

    def _t(self, at: float) -> float:
        return round(at - self._started_at, 3)

    # --- the driver's hooks -----------------------------------------------------------------------------

    def observe(self, now: float, event: Event | None, commands: list[Command]) -> None:
        if isinstance(event, RequestArrived):
            if len(self._pending) >= MAX_PENDING:
                del self._pending[next(iter(self._pending))]
            self._pending[event.request_id] = _Arrival(
                at=now, session=event.routing_key, prompt_tokens=event.prompt_tokens
            )
        elif isinstance(event, ClientDisconnected):
            arrival = self._pending.get(event.request_id)
            if arrival is not None:
                arrival.client_left = True
        elif isinstance(event, GateClosed):
            self._write({"type": "gate", "at": self._t(now), "state": "closed", "mode": event.mode.value})
        elif isinstance(event, GateOpened):
            self._write({"type": "gate", "at": self._t(now), "state": "open"})
        elif isinstance(event, EnginePaused | EngineResumed):
            self._write(
                {
                    "type": "engine_pause",
                    "at": self._t(now),
                    "engine": self._engine_url(event.engine_id),
                    "paused": isinstance(event, EnginePaused),
                }
            )
        for command in commands:
            if isinstance(command, MarkEngine):
                self._write(
                    {
                        "type": "engine",
                        "at": self._t(now),
                        "engine": self._engine_url(command.engine_id),
                        "state": command.state,
                    }
                )

    def ended(self, exchange: Exchange, item: Finished | GatewayError) -> None:
        arrival = self._pending.pop(exchange.request_id, None)
        if arrival is None:
            return  # arrived before tracing began (or dropped beyond MAX_PENDING)
        timing = item.timing
        line = self._request_line(exchange, arrival)
        if isinstance(item, Finished):
            line.update(outcome="ok", status=200)
            if item.body is not None:
                line.update(_answer_facts(item.body))
        else:
            line.update(outcome=item.code, status=item.status)
        if timing is not None:
            line.update(
                output_tokens=timing.tokens,
                attempts=timing.attempts,
                timing={
                    "wall_s": round(timing.wall_s, 3),
                    "queue_s": round(timing.queue_s, 3),
                    "paused_s": round(timing.paused_s, 3),
                    "contention_s": round(timing.contention_s, 3),
                    "charged_s": round(timing.charged_s, 3),
                    "forgiven_s": round(timing.forgiven_s, 3),
                },
            )
        self._write(line)

    def forgotten(self, exchange: Exchange) -> None:
        """The client left and its generation was aborted after the retry grace: no verdict, no timing."""
        arrival = self._pending.pop(exchange.request_id, None)
        if arrival is not None:
            self._write(self._request_line(exchange, arrival) | {"outcome": "abandoned", "status": None})

    def _request_line(self, exchange: Exchange, arrival: _Arrival) -> dict[str, Any]:
        user = exchange.body.get("user")
        return {
            "type": "request",
            "id": exchange.request_id,
            "at": self._t(arrival.at),
            "end": self._t(self._now()),
            "session": arrival.session,
            "user": user if isinstance(user, str) else None,
            "route": exchange.route.value,
            "stream": exchange.client_streams,
            "prompt_tokens": arrival.prompt_tokens,
            "max_tokens": max_new_tokens(exchange.body),
            "client_left": arrival.client_left,
            "engine": exchange.engine_url,
        }

    # --- writing ----------------------------------------------------------------------------------------

    def _write(self, line: dict[str, Any]) -> None:
        if self._sink is None:
            return
        data = orjson.dumps(line) + b"\n"
        self._buffer.append(data)
        self._buffered += len(data)
        self.lines += 1
        if self._buffered >= FLUSH_BYTES:
            self.flush()

    def flush(self) -> None:
        sink = self._sink
        if sink is None or not self._buffer:
            return
        data = b"".join(self._buffer)
        self._buffer.clear()
        self._buffered = 0
        try:
            sink.write(data)
            sink.flush()
        except OSError as exc:
            log.error("cannot write the trace (%s): tracing stops", exc)
            self._sink = None

    def close(self) -> None:
        """Write what is buffered and close the file (at shutdown, after the last request ended)."""
        self.flush()
        if self._sink is not None:
            self._sink.close()
            self._sink = None


def _answer_facts(body: bytes) -> dict[str, Any]:
    """What the engine's whole answer says of the prompt cache and the finish, without parsing it."""
    facts: dict[str, Any] = {}
    cached = _CACHED.search(body)
    if cached is not None:
        facts["cached_tokens"] = int(cached.group(1))
    finish = _FINISH.search(body)
    if finish is not None:
        facts["finish"] = (finish.group(1) or finish.group(2)).decode()
    return facts


def attach_trace(settings: GatewaySettings, driver: Driver, pool: EnginePool) -> TraceRecorder:
    """A recorder writing `settings.record_trace`, hooked into `driver` (raises OSError if the file cannot be
    opened: a gateway asked to trace that cannot does not start)."""
    assert settings.record_trace is not None
    sink = open(settings.record_trace, "wb")  # noqa: SIM115 - closed by TraceRecorder.close at shutdown

    def engine_url(engine_id: str) -> str | None:
        engine = pool.engines.get(engine_id)
        return None if engine is None else engine.url

    header = {
        "clock": settings.clock,
        "time_scale": settings.time_scale,
        "settings": {
            "timeout": settings.timeout,
            "stall_timeout": settings.stall_timeout,
            "hang_check_timeout": settings.hang_check_timeout,
            "health_interval": settings.health_interval,
            "health_failures": settings.health_failures,
            "warmup_timeout": settings.warmup_timeout,
        },
        "engines": [spec.url for spec in settings.engines],
    }
    recorder = TraceRecorder(sink, driver.clock.now, engine_url, header)
    driver.observers.append(recorder.observe)
    driver.on_end.append(recorder.ended)
    driver.on_forget.append(recorder.forgotten)
    return recorder
