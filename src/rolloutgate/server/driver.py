"""The driver: the one place where the sans-IO core meets time and I/O.

Theory of operation: every fact the edges learn (a request arrived, an upstream event, a failure, a health
check, a disconnect) goes through `Driver.handle(event)`, which asks the core for its verdict with the
current time and executes the commands it returns, in order. A single timer, re-armed to the core's
`next_deadline()`, lets the core fire its own deadlines (timeouts, stalls, grace periods). The driver holds the
only clock of the gateway: gateway seconds, which run `time_scale` times faster than real ones in front of a
time-scaled simulator.

Commands:
- Dispatch: start (or restart) the exchange's upstream call on the chosen engine (`EngineClient.start`); a
  call whose answer comes whole (its client does not stream) is watched at engine level (engine_watch.py).
- Abort: close the upstream connection and call the engine's abort API with the attempt's upstream id
  (a stale request's partial abort only calls the API: the engine answers the open call with its output).
- Complete / Fail: put the terminal item into the exchange's outbox (the handler writes it).
- MarkEngine: log the engine's new state (the core keeps it).
- RecordGroup: count the group's outcome, completion time and prefill saved (metrics).

Observers: `Driver.observers` are called with every verdict of the core, before its commands run:
`observer(now, event, commands)` with the gateway time, the event the core was told (None for one of its own
deadlines firing) and the commands it returned (often none). They only look (the incident replay records
when a request arrived and when an engine was marked, rolloutreplay/gateway.py); with none registered the cost
is one check per verdict. The way to watch the core: it is compiled by mypyc, its methods cannot be replaced.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from functools import partial
from typing import Any

import orjson

from rolloutgate.core.commands import (
    Abort,
    AbortReason,
    CheckEngine,
    Command,
    Complete,
    Dispatch,
    Fail,
    FailReason,
    MarkEngine,
    RecordGroup,
)
from rolloutgate.core.events import (
    ClientAttached,
    ClientDisconnected,
    Event,
    GroupAborted,
    ProgressReported,
    QueueAborted,
    RequestArrived,
    UpstreamFailed,
    UpstreamFinished,
)
from rolloutgate.core.gateway import Gateway
from rolloutgate.engines.base import Route, UpstreamCall, UpstreamError, UpstreamEvent, UpstreamHandle
from rolloutgate.errors import GatewayError, UpstreamFailure, from_fail_reason
from rolloutgate.runtime_clock import LoopClock
from rolloutgate.server.assemble import ResponseAssembler, aborted_in_queue
from rolloutgate.server.continuation import (
    CannotContinue,
    answer_of_stream,
    can_continue_whole,
    continuation_body,
)
from rolloutgate.server.engine_watch import EngineWatcher
from rolloutgate.server.exchange import Exchange, Finished
from rolloutgate.server.metrics import Metrics
from rolloutgate.server.poison import PoisonPrompts
from rolloutgate.server.pool import EnginePool

__all__ = ("Driver", "Observer", "upstream_id")

log = logging.getLogger("rolloutgate.driver")

Observer = Callable[[float, Event | None, list[Command]], None]  # (gateway time, event or None, commands)
_STALE_ACTIONS = {AbortReason.STALE: "requeued", AbortReason.STALE_PARTIAL: "partial"}  # metric labels
# The longest an aborted call on an engine that ends aborted calls itself is read before it is closed anyway
# (an engine that does not answer its abort: hung, or gone).
WIND_DOWN_S = 10.0


def upstream_id(request_id: str, attempt: int, client_rid: str | None = None) -> str:
    """The id an attempt carries upstream (SGLang rid / vLLM X-Request-Id).

    Gateway ids have a fixed length, so with a fixed-width suffix no upstream id is a prefix of another
    (SGLang's abort matches by prefix). A client's own `rid` leads, so the client's prefix aborts sent to the
    engines directly (miles' multi-LoRA `{"rid": "<adapter>::", "prefix": true}`) still match its calls.
    """
    own = f"{request_id}-{attempt:02d}"
    return own if client_rid is None else f"{client_rid}@{own}"


def max_new_tokens(body: dict[str, Any]) -> int | None:
    """The most output tokens the call may generate, when its body says (OpenAI `max_tokens` or
    `max_completion_tokens`, SGLang `sampling_params.max_new_tokens`)."""
    limit = body.get("max_tokens") or body.get("max_completion_tokens")
    if limit is None:
        params = body.get("sampling_params")
        limit = params.get("max_new_tokens") if isinstance(params, dict) else None
    return limit if isinstance(limit, int) and not isinstance(limit, bool) else None


def _remaining_engine_s(exchange: Exchange, core: Gateway, now: float) -> float:
    """Engine seconds an abandoned generation would still have taken, at its own observed token rate."""
    limit = max_new_tokens(exchange.body)
    try:
        timing = core.timing(exchange.request_id, now)
    except KeyError:
        return 0.0
    if limit is None or timing.tokens <= 0 or timing.charged_s <= 0:
        return 0.0
    return max(0, limit - timing.tokens) * timing.charged_s / timing.tokens


class Driver:
    def __init__(
        self,
        core: Gateway,
        clock: LoopClock,
        metrics: Metrics,
        abort_upstream: bool = True,
        engine_poll_s: float = 3.0,
        checkpoint_tokens: int = 0,
        rerun_engine_pause_aborts: bool = False,
    ) -> None:
        self.core = core
        # settings.engine_pause_aborts: a call an engine's own abort-mode pause ended runs again
        self.rerun_engine_pause_aborts = rerun_engine_pause_aborts
        self.checkpoint_tokens = (
            checkpoint_tokens  # a call answered whole sends its output this often (0: end)
        )
        self.clock = clock
        self.metrics = metrics
        self.poison_prompts = PoisonPrompts(clock.now)  # refused at submit (server/poison.py)
        self.pool: EnginePool | None = None
        self.exchanges: dict[str, Exchange] = {}
        # engine-level progress for the calls whose answer comes whole (real seconds between readings)
        self.engine_watch = EngineWatcher(self.handle, clock.now, engine_poll_s)
        self.abort_upstream = abort_upstream
        self.on_end: list[Callable[[Exchange, Finished | GatewayError], None]] = []
        self.on_forget: list[Callable[[Exchange], None]] = []  # abandoned: the client left for good
        self.observers: list[Observer] = []  # every verdict of the core (module docstring)
        self._disconnected: set[str] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self._flush_soon = False  # a `_flush` is scheduled for the end of this loop iteration
        self._background: set[asyncio.Task[Any]] = set()
        self._winding_down: set[UpstreamHandle] = set()  # aborted calls read to their end (`_wind_down`)

    # --- intake -----------------------------------------------------------------------------------------

    def submit(self, exchange: Exchange, arrived: RequestArrived) -> None:
        self.exchanges[exchange.request_id] = exchange
        if self.abort_upstream:
            exchange.on_abandoned = self.client_disconnected  # its last reader was cut off (too slow)
        self.handle(arrived)

    def handle(self, event: Event) -> None:
        now = self.clock.now()
        if now >= self._timer_at:  # an overdue deadline fires before the core hears anything newer
            self._on_timer()
        # The deadlines this event moved are recomputed once per loop iteration for every event of it
        # (`_flush`): at 32 connections an iteration brings several arrivals, progress reports and ends on
        # the same engine, and recomputing an engine's deadlines was a tenth of the core's time per request.
        commands = self.core.handle(event, now, defer_deadlines=True)
        if self.observers:
            for observer in self.observers:
                observer(now, event, commands)
        if not self._flush_soon:
            self._flush_soon = True
            asyncio.get_running_loop().call_soon(self._flush)
        if commands:
            self._execute(commands)

    def _flush(self) -> None:
        self._flush_soon = False
        self.core.flush_deadlines(self.clock.now())
        self._arm_timer()

    def timing_header(self, request_id: str) -> str:
        """The request's live timing breakdown as the `X-Rolloutgate-Timing` value; "" once it is unknown."""
        try:
            return self.core.timing(request_id, self.clock.now()).header_value()
        except KeyError:
            return ""

    def client_disconnected(self, exchange: Exchange) -> None:
        if not exchange.ended and exchange.request_id not in self._disconnected:
            self._disconnected.add(exchange.request_id)
            self.handle(ClientDisconnected(request_id=exchange.request_id))

    def client_attached(self, exchange: Exchange) -> None:
        self._disconnected.discard(exchange.request_id)
        self.handle(ClientAttached(request_id=exchange.request_id))

    def _sweep_forgotten(self) -> None:
        """Drop exchanges whose client left and that the core forgot after the grace period."""
        now = self.clock.now()
        for request_id in [r for r in self._disconnected if not self._is_known(r, now)]:
            self._disconnected.discard(request_id)
            exchange = self.exchanges.pop(request_id, None)
            if exchange is not None:
                exchange.cancel_upstream()
                self.engine_watch.remove(request_id)
                for callback in self.on_forget:
                    callback(exchange)

    def _is_known(self, request_id: str, now: float) -> bool:
        try:
            self.core.timing(request_id, now)
        except KeyError:
            return False
        return True

    # --- the timer --------------------------------------------------------------------------------------

    def _arm_timer(self) -> None:
        deadline = self.core.next_deadline()
        if deadline >= self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = deadline
        if math.isinf(deadline):
            self._timer = None
            return
        delay = max(0.0, self.clock.real_seconds(deadline - self.clock.now()))
        self._timer = asyncio.get_running_loop().call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()  # when called early (from handle), the scheduled call is not needed
            self._timer = None
        self._timer_at = math.inf
        now = self.clock.now()
        commands = self.core.on_time(now)
        if self.observers:
            for observer in self.observers:
                observer(now, None, commands)
        if commands:
            self._execute(commands)
        if self._disconnected:
            self._sweep_forgotten()
        self._arm_timer()

    # --- commands ---------------------------------------------------------------------------------------

    def _execute(self, commands: list[Command]) -> None:
        for command in commands:
            if isinstance(command, Dispatch):
                self._dispatch(command)
            elif isinstance(command, Complete):
                self._complete(command)
            elif isinstance(command, Fail):
                self._fail(command)
            elif isinstance(command, Abort):
                self._abort(command)
            elif isinstance(command, MarkEngine):
                self._mark_engine(command)
            elif isinstance(command, CheckEngine):
                if self.pool is not None:
                    self.pool.health.read_pause(command.engine_id)
            elif isinstance(command, RecordGroup):
                self._record_group(command)

    def _dispatch(self, command: Dispatch) -> None:
        exchange = self.exchanges.get(command.request_id)
        assert self.pool is not None
        engine = self.pool.engines.get(command.engine_id)
        if exchange is None or engine is None:
            # the core raced with a removal; tell it the attempt failed so it re-dispatches or fails
            asyncio.get_running_loop().call_soon(
                self.handle,
                UpstreamFailed(request_id=command.request_id, reason="engine gone", retryable=True),
            )
            return
        exchange.cancel_upstream()
        exchange.attempt = command.attempt
        exchange.engine_id = engine.engine_id
        exchange.engine_url = engine.url
        if command.attempt > 1:
            self.metrics.redispatches.inc()
        body = exchange.body
        if command.delivered_tokens > 0:
            # An earlier attempt made output the gateway holds: ask the next one for the rest.
            try:
                body = self._continuation(exchange)
            except (CannotContinue, ValueError, KeyError, IndexError) as exc:
                self.handle(
                    UpstreamFailed(
                        request_id=exchange.request_id,
                        reason=f"cannot continue a partially delivered stream: {exc}",
                        retryable=False,
                        attempt=command.attempt,
                    )
                )
                return
        exchange.assembler = None if exchange.client_streams else ResponseAssembler(exchange.route)
        call = UpstreamCall(
            request_id=upstream_id(exchange.request_id, command.attempt, exchange.client_rid),
            route=exchange.route,
            body=body,
            headers=exchange.forward_headers,
            checkpoint_tokens=self.checkpoint_tokens,
        )
        sink = _AttemptSink(self, exchange, command.attempt)
        if not exchange.client_streams and engine.client.reports_load:  # answered whole: engine-level watch
            self.engine_watch.add(
                engine.engine_id, engine.client, exchange.request_id, command.attempt, max_new_tokens(body)
            )
        exchange.upstream_task = engine.client.start(
            call, sink, partial(self._attempt_ended, exchange, command.attempt)
        )

    def _continuation(self, exchange: Exchange) -> dict[str, Any]:
        """The next attempt's body: the rest of the generation after the output earlier attempts made (the
        client's stream, or the chunks of a call answered whole), or the whole call again where there is no
        such output or a non-streaming call cannot be continued. Raises CannotContinue (and the parse errors)
        for a stream that cannot: its client already read part of it."""
        if exchange.client_streams:
            shape = exchange.stream_shape
            if shape is not None and shape.are_generate_ids_incremental:
                # its chunks' text and logprobs are cumulative, their ids not: no stitcher writes both
                raise CannotContinue("the engine streams with --stream-output")
            answer = answer_of_stream(exchange.route, exchange.history or [], shape)
            body, exchange.stitcher = continuation_body(
                exchange.route, exchange.body, answer, exchange.delivered_tokens
            )
            self.metrics.continuations.labels(outcome="continued").inc()
            return body
        answer = self._output_so_far(exchange)
        if answer is None or not can_continue_whole(exchange.route, exchange.body):
            exchange.stitcher = None
            self.metrics.continuations.labels(outcome="started_over").inc()
            return exchange.body
        body, exchange.stitcher = continuation_body(exchange.route, exchange.body, answer, 0)
        self.metrics.continuations.labels(outcome="continued").inc()
        return body

    @staticmethod
    def _output_so_far(exchange: Exchange) -> Any | None:
        """A call answered whole: its answer so far (the last attempt's newest chunk after what earlier
        attempts made), or None when no attempt has sent a token."""
        stitcher, assembler = exchange.stitcher, exchange.assembler
        try:
            newest = None if assembler is None else assembler.result()
        except ValueError:  # no chunk yet
            newest = None
        if newest is not None:
            answer = orjson.loads(newest if stitcher is None else stitcher.stitch(newest))
            return answer if isinstance(answer, dict) and answer.get("output_ids") else None
        if stitcher is not None:
            return {"text": stitcher.text, "output_ids": stitcher.ids, "meta_info": stitcher.meta}
        return None

    def _attempt_ended(self, exchange: Exchange, attempt: int, error: UpstreamError | None) -> None:
        """An attempt's upstream call returned (`error` None) or failed; what a stale attempt says is ignored."""
        if exchange.winding_down == attempt:  # an aborted call the engine ended (`_wind_down`)
            exchange.winding_down = 0
            return
        if exchange.attempt != attempt or exchange.ended:
            return
        if error is None:
            if exchange.engine_abort_attempt == attempt:  # aborted unasked: by the engine's own pause?
                self._spawn(self._judge_engine_abort(exchange, attempt))
                return
            self.handle(UpstreamFinished(request_id=exchange.request_id, attempt=attempt))
            return
        if not error.retryable:
            exchange.upstream_error = error
        if (
            error.lost
        ):  # the request's id in the log: the suspects when an engine died prefilling (core/on_requests.py)
            self.metrics.calls_lost.labels(engine=exchange.engine_id or "").inc()
            log.warning(
                "engine %s dropped request %s (attempt %d): %s",
                exchange.engine_id,
                exchange.request_id,
                attempt,
                error.message,
                extra={"engine": exchange.engine_id, "request_id": exchange.request_id},
            )
        self.handle(
            UpstreamFailed(
                request_id=exchange.request_id,
                reason=error.message,
                retryable=error.retryable,
                status=error.status,
                attempt=attempt,
                engine_unreachable=error.unreachable,
                engine_lost=error.lost,
            )
        )

    async def _judge_engine_abort(self, exchange: Exchange, attempt: int) -> None:
        """An attempt the engine answered with finish reason abort, unasked: ask the engine whether it is
        paused (its flag, read now). Paused: its own abort-mode pause ended the call, which runs again (afresh,
        a streaming client's from what it was sent) once an engine takes work. Not paused (someone's
        /abort_request to the engine): the engine's answer is the answer."""
        assert self.pool is not None
        engine_id = exchange.engine_id or ""
        paused = await self.pool.health.paused_now(engine_id)
        if exchange.attempt != attempt or exchange.ended:
            return
        held, exchange.held = exchange.held, None
        exchange.engine_abort_attempt = 0
        self.metrics.engine_pause_aborts.labels(action="rerun" if paused else "passed").inc()
        if paused:
            log.info(
                "%s's own pause aborted request %s: it runs again once an engine takes work",
                engine_id,
                exchange.request_id,
                extra={"engine": engine_id, "request_id": exchange.request_id},
            )
            self.handle(
                UpstreamFailed(
                    request_id=exchange.request_id,
                    reason=f"{engine_id}'s own pause aborted it",
                    engine_paused=True,
                    attempt=attempt,
                )
            )
            return
        if held:
            exchange.send_events(held)
        self.handle(UpstreamFinished(request_id=exchange.request_id, attempt=attempt))

    def _complete(self, command: Complete) -> None:
        exchange = self.exchanges.pop(command.request_id, None)
        if exchange is None:
            return
        body = None
        if exchange.assembler is not None:
            try:
                body = exchange.assembler.result()
                if exchange.stitcher is not None:  # a continued call: its earlier output first
                    body = exchange.stitcher.stitch(body)
            except ValueError as exc:  # an engine stream we cannot assemble is the engine's failure
                log.warning("cannot assemble the engine's answer", extra={"request_id": command.request_id})
                self._end(exchange, UpstreamFailure(f"the engine's answer could not be read: {exc}"))
                return
        self.metrics.observe_timing(command.timing, outcome="ok")
        self._end(exchange, Finished(timing=command.timing, body=body, engine_url=exchange.engine_url))

    def _fail(self, command: Fail) -> None:
        exchange = self.exchanges.pop(command.request_id, None)
        self.metrics.observe_timing(command.timing, outcome=command.reason.value)
        self.metrics.failures.labels(reason=command.reason.value).inc()
        if exchange is None:
            return
        exchange.cancel_upstream()
        if command.reason is FailReason.ENGINE_LOST_IN_PREFILL:
            self.poison_prompts.remember(exchange.route, exchange.body, exchange.request_id)
        if command.reason is FailReason.ABORTED and exchange.route is Route.GENERATE:
            answer = aborted_in_queue(exchange.body, exchange.request_id)
            if exchange.client_streams:
                exchange.send_events([answer])
            self._end(
                exchange, Finished(timing=command.timing, body=None if exchange.client_streams else answer)
            )
            return
        upstream = exchange.upstream_error
        if command.reason is FailReason.UPSTREAM and upstream is not None and upstream.status:
            error: GatewayError = GatewayError(
                upstream.message, status=upstream.status, raw_body=upstream.body, code="engine_error"
            )
        else:
            error = from_fail_reason(
                command.reason,
                timing=command.timing,
                retry_after_s=command.retry_after_s,
                detail=command.detail,
            )
        self._end(exchange, error)

    def _end(self, exchange: Exchange, item: Finished | GatewayError) -> None:
        self._disconnected.discard(exchange.request_id)
        self.engine_watch.remove(exchange.request_id)
        exchange.finish(item)
        for callback in self.on_end:
            callback(exchange, item)
        exchange.release_request()

    def _abort(self, command: Abort) -> None:
        self.metrics.aborts.labels(reason=command.reason.value).inc()
        if command.reason in _STALE_ACTIONS:
            self.metrics.stale_requests.labels(action=_STALE_ACTIONS[command.reason]).inc()
        exchange = self.exchanges.get(command.request_id)
        if exchange is None:
            return
        if command.reason is AbortReason.STALE_PARTIAL:  # the call stays open: the engine answers it, partial
            exchange.abort_ordered = True
            if self.abort_upstream:
                self._abort_on_engine(exchange, command.engine_id, exchange.attempt)
            return
        if command.reason is AbortReason.CLIENT_GONE:
            self.metrics.engine_seconds_saved.inc(_remaining_engine_s(exchange, self.core, self.clock.now()))
        attempt = exchange.attempt
        if not self._wind_down(exchange, command.engine_id):
            exchange.cancel_upstream()
        self.engine_watch.remove(exchange.request_id)
        if self.abort_upstream:
            self._abort_on_engine(exchange, command.engine_id, attempt)

    def _wind_down(self, exchange: Exchange, engine_id: str | None) -> bool:
        """An aborted call on an engine whose abort API ends the call with an abort answer (SGLang): read it
        to that end, dropping what it sends, instead of closing it now; closed anyway after `WIND_DOWN_S`.
        Why: SGLang 0.5.9 sometimes keeps the model-update read lock of a stream its client hung up on
        mid-answer (why only sometimes is not known), and an abort-mode `/pause_generation` waits for that
        lock, so a gateway that hung up could leave the engine's pause, and every call after it, waiting for
        minutes (seen in tests/e2e/test_gateway_weights.py). False when the call is to be closed at once."""
        handle = exchange.upstream_task
        engine = None if self.pool is None else self.pool.engines.get(engine_id or "")
        if (
            not self.abort_upstream
            or engine is None
            or not engine.client.ends_aborted_calls
            or handle is None
            or handle.done()
        ):
            return False
        exchange.upstream_task = None
        exchange.winding_down = exchange.attempt
        self._winding_down.add(handle)
        asyncio.get_running_loop().call_later(WIND_DOWN_S, self._close_wound_down, handle)
        return True

    def _close_wound_down(self, handle: UpstreamHandle) -> None:
        self._winding_down.discard(handle)
        if not handle.done():
            handle.cancel()

    def _mark_engine(self, command: MarkEngine) -> None:
        if command.state == "quarantined":
            self.metrics.quarantines.labels(engine=command.engine_id).inc()
        log.warning(
            "engine %s is %s %s",
            command.engine_id,
            command.state,
            command.detail,
            extra={"engine": command.engine_id, "state": command.state},
        )

    def _abort_on_engine(self, exchange: Exchange, engine_id: str | None, attempt: int) -> None:
        """Call the engine's abort API for the exchange's attempt (by its upstream id), in the background."""
        assert self.pool is not None
        engine = self.pool.engines.get(engine_id or "")
        if engine is not None and attempt:
            self._spawn(engine.client.abort(upstream_id(exchange.request_id, attempt, exchange.client_rid)))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _record_group(self, command: RecordGroup) -> None:
        metrics = self.metrics
        metrics.groups.labels(outcome=command.outcome.value).inc()
        metrics.group_completion_seconds.observe(command.completion_s)
        metrics.group_prefill_tokens_saved.inc(command.prefill_tokens_saved)

    def abort_group(self, group: str) -> int:
        """A client aborts a group: every live member ends now, answered as aborted (SGLang's abort answer
        on /generate), those running aborted on their engines first (the core's `GroupAborted`). Returns
        how many members it ended."""
        members = len(self.core.group_members(group))
        if members:
            self.handle(GroupAborted(group=group))
        return members

    def abort_client_rid(self, rid: str, *, prefix: bool) -> int:
        """A client's `/abort_request {"rid"}`, with the client's own rid: its calls still waiting end now with
        the abort answer; those running are aborted on their engines by the id they carry there (the engine
        answers them, finish reason abort). Returns how many calls matched."""
        matched = [
            e
            for e in self.exchanges.values()
            if e.client_rid is not None
            and not e.ended
            and (e.client_rid.startswith(rid) if prefix else e.client_rid == rid)
        ]
        if not matched:
            return 0
        self.handle(QueueAborted(request_ids=frozenset(e.request_id for e in matched)))
        for exchange in matched:
            if not exchange.ended:
                exchange.abort_ordered = True
                self._abort_on_engine(exchange, exchange.engine_id, exchange.attempt)
        return len(matched)

    def abort_all_ordered(self) -> None:
        """An `/abort_request {"abort_all": true}` through the gateway, about to reach every engine: the abort
        answers of the calls they run are what their clients get (never re-run as a pause's)."""
        for exchange in self.exchanges.values():
            exchange.abort_ordered = True

    def fail_all(self, make_error: Callable[[], GatewayError]) -> int:
        """Shutdown: end every open exchange with `make_error()` (its client reads it) and abort the generations
        still running upstream, so no engine works for a gateway that is gone. Returns how many ended."""
        exchanges = list(self.exchanges.values())
        self.exchanges.clear()
        for exchange in exchanges:
            running = exchange.upstream_task is not None and not exchange.upstream_task.done()
            exchange.cancel_upstream()
            if running:
                self._abort_on_engine(exchange, exchange.engine_id, exchange.attempt)
            self._end(exchange, make_error())
        return len(exchanges)

    async def close(self) -> None:
        await self.engine_watch.close()
        if self._timer is not None:
            self._timer.cancel()
        for exchange in list(self.exchanges.values()):
            exchange.cancel_upstream()
        for handle in list(self._winding_down):
            self._close_wound_down(handle)
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)


class _AttemptSink:
    """What to do with the events of one attempt, called with each read's events as they arrive
    (engines/generation.py): progress to the core, once per read (the tokens of every event in it), then each
    event to the streaming client or the assembler. Returns False once the attempt is stale or its exchange
    ended (the upstream call is closed then). A slotted object rather than a closure: one is held by every
    stream in flight (a closure and its cells are five times the size)."""

    __slots__ = ("_driver", "_exchange", "attempt")

    def __init__(self, driver: Driver, exchange: Exchange, attempt: int) -> None:
        self._driver = driver
        self._exchange = exchange
        self.attempt = attempt

    def __call__(self, events: list[UpstreamEvent]) -> bool:
        exchange, attempt = self._exchange, self.attempt
        if exchange.winding_down == attempt:
            return True  # aborted: read to the engine's end of it, and dropped (`Driver._wind_down`)
        if exchange.attempt != attempt or exchange.ended:
            return False
        driver = self._driver
        tokens = events[0].tokens if len(events) == 1 else sum(event.tokens for event in events)
        # One report for the read: the core sees the same tokens at the same instant as it would event by
        # event, and its verdicts come before any of the read's events reaches the client.
        driver.handle(ProgressReported(request_id=exchange.request_id, tokens=tokens, attempt=attempt))
        driver.metrics.generated_tokens.inc(tokens)
        if exchange.has_ended():
            return False  # an overdue verdict fired in `handle` and ended it (release_request ran)
        # an abort nobody asked for (settings.engine_pause_aborts rerun): from it on, a streaming client is
        # sent nothing until the driver has asked the engine whether its own pause did it (attempt's end)
        watch_aborts = driver.rerun_engine_pause_aborts and not exchange.abort_ordered
        holding = watch_aborts and exchange.engine_abort_attempt == attempt
        if not exchange.client_streams:
            assert exchange.assembler is not None
            for event in events:
                exchange.assembler.add(event)
                if watch_aborts and event.finish_reason == "abort":
                    exchange.engine_abort_attempt = attempt
            return True
        forwarded: list[bytes] = []
        stitcher = exchange.stitcher
        for event in events:
            if event.is_gateway_only:
                continue  # e.g. the usage frame the gateway asked for and the client did not
            shape = event.assembly
            if shape is not None and (shape.is_incremental_generate or shape.are_generate_ids_incremental):
                exchange.stream_shape = shape
            # an incremental chunk carries only its own output: the client has the earlier part already
            cumulative = exchange.stream_shape is None
            data = event.data if stitcher is None or not cumulative else stitcher.stitch(event.data)
            if watch_aborts and not holding and event.finish_reason == "abort":
                holding, exchange.engine_abort_attempt, exchange.held = True, attempt, []
            if holding:
                assert exchange.held is not None
                exchange.held.append(data)
                continue
            exchange.delivered_tokens += event.tokens
            forwarded.append(data)
        if forwarded:
            exchange.send_events(forwarded)
        return not exchange.ended
