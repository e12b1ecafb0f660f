"""The driver's per-attempt event sink (server/driver.py): a read's events reach the core as one progress
report and the client or assembler one by one."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from rolloutgate.core.events import Event, ProgressReported
from rolloutgate.engines.base import Route, UpstreamEvent
from rolloutgate.server.driver import WIND_DOWN_S, Driver, _AttemptSink
from rolloutgate.server.exchange import Exchange
from rolloutgate.server.metrics import Metrics


class _Driver:
    """What the sink uses of the driver: `handle` (recorded), the metrics and its setting for unasked aborts."""

    def __init__(self) -> None:
        self.handled: list[Event] = []
        self.metrics = Metrics()
        self.rerun_engine_pause_aborts = False

    def handle(self, event: Event) -> None:
        self.handled.append(event)


def _streaming_exchange() -> Exchange:
    exchange = Exchange(request_id="r" * 32, route=Route.CHAT, body={}, client_streams=True, history=[])
    exchange.attempt = 1
    return exchange


def test_a_reads_events_are_one_progress_report_and_every_event_reaches_the_client() -> None:
    driver, exchange = _Driver(), _streaming_exchange()
    outbox = exchange.subscribe()
    sink = _AttemptSink(driver, exchange, 1)  # type: ignore[arg-type]
    events = [UpstreamEvent(data=b'{"n":%d}' % n, tokens=n) for n in (1, 2, 3)]
    assert sink(events) is True
    assert driver.handled == [ProgressReported(request_id=exchange.request_id, tokens=6, attempt=1)]
    assert driver.metrics.generated_tokens.value == 6
    assert [outbox.get_nowait() for _ in range(3)] == [b'{"n":1}', b'{"n":2}', b'{"n":3}']
    assert exchange.delivered_tokens == 6


def test_a_stale_attempt_or_an_ended_exchange_stops_the_call_without_a_report() -> None:
    driver, exchange = _Driver(), _streaming_exchange()
    event = [UpstreamEvent(data=b"{}", tokens=1)]
    assert _AttemptSink(driver, exchange, 2)(event) is False  # type: ignore[arg-type]
    exchange.ended = True
    assert _AttemptSink(driver, exchange, 1)(event) is False  # type: ignore[arg-type]
    assert driver.handled == []


def test_a_verdict_fired_by_the_report_keeps_the_reads_events_from_the_client() -> None:
    """The core hears the read's progress first; if an overdue verdict ends the exchange then, none of the
    read's events goes out (as when each event was reported before it was sent)."""
    exchange = _streaming_exchange()
    outbox = exchange.subscribe()

    class _Ending(_Driver):
        def handle(self, event: Any) -> None:
            super().handle(event)
            exchange.ended = True

    sink = _AttemptSink(_Ending(), exchange, 1)  # type: ignore[arg-type]
    assert sink([UpstreamEvent(data=b"{}", tokens=1), UpstreamEvent(data=b"{}", tokens=1)]) is False
    assert outbox.empty()


def test_an_aborted_attempt_winding_down_is_read_to_its_end_and_dropped() -> None:
    """An attempt the driver aborted on an engine that ends aborted calls itself (`Driver._wind_down`): its
    reads go on (True: the call stays open for the engine's abort answer) and nothing reaches the core or the
    client, even once its exchange ended or a later attempt runs."""
    driver, exchange = _Driver(), _streaming_exchange()
    outbox = exchange.subscribe()
    exchange.winding_down = 1
    exchange.attempt = 2  # a later attempt already runs
    sink = _AttemptSink(driver, exchange, 1)  # type: ignore[arg-type]
    assert sink([UpstreamEvent(data=b'{"finish_reason":"abort"}', tokens=1)]) is True
    exchange.ended = True
    assert sink([UpstreamEvent(data=b"[DONE]", tokens=0)]) is True
    assert driver.handled == [] and outbox.empty() and exchange.delivered_tokens == 0


class _Handle:
    def __init__(self) -> None:
        self.cancelled = False

    def done(self) -> bool:
        return self.cancelled

    def cancel(self) -> bool:
        self.cancelled = True
        return True


class _Client:
    def __init__(self, ends_aborted_calls: bool) -> None:
        self.ends_aborted_calls = ends_aborted_calls


class _WindingDriver(_Driver):
    """What `_wind_down` and `_attempt_ended` use of the driver: the pool's engines and the abort setting."""

    def __init__(self, ends_aborted_calls: bool) -> None:
        super().__init__()
        engine = SimpleNamespace(client=_Client(ends_aborted_calls))
        self.pool = SimpleNamespace(engines={"e0": engine})
        self.abort_upstream = True
        self._winding_down: set[Any] = set()

    _close_wound_down = Driver._close_wound_down


@pytest.mark.looptime
async def test_an_abort_on_sglang_leaves_the_call_to_the_engine_and_closes_it_if_unanswered() -> None:
    """SGLang: the aborted call is not closed at once (a hang-up mid-stream keeps SGLang 0.5.9's model-update
    lock, which stalls its abort-mode pause); the engine's end of it is ignored; unanswered, it is closed after
    WIND_DOWN_S. vLLM: closed at once (a closed call is how vLLM learns of an abort)."""
    driver, exchange = _WindingDriver(ends_aborted_calls=True), _streaming_exchange()
    answered, unanswered = _Handle(), _Handle()
    exchange.upstream_task = answered
    assert Driver._wind_down(driver, exchange, "e0")  # type: ignore[arg-type]
    assert exchange.upstream_task is None and exchange.winding_down == 1 and not answered.cancelled
    Driver._attempt_ended(driver, exchange, 1, None)  # type: ignore[arg-type]  # the engine's abort answer
    assert exchange.winding_down == 0 and driver.handled == []  # the core hears nothing of it

    exchange.upstream_task = unanswered
    assert Driver._wind_down(driver, exchange, "e0")  # type: ignore[arg-type]
    await asyncio.sleep(WIND_DOWN_S - 0.1)
    assert not unanswered.cancelled
    await asyncio.sleep(0.2)
    assert unanswered.cancelled and not driver._winding_down

    vllm, other = _WindingDriver(ends_aborted_calls=False), _streaming_exchange()
    other.upstream_task = _Handle()
    assert not Driver._wind_down(vllm, other, "e0")  # type: ignore[arg-type]
    assert other.winding_down == 0
