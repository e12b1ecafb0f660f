"""The driver's per-attempt event sink (server/driver.py): a read's events reach the core as one progress
report and the client or assembler one by one."""

from __future__ import annotations

from typing import Any

from rolloutgate.core.events import Event, ProgressReported
from rolloutgate.engines.base import Route, UpstreamEvent
from rolloutgate.server.driver import _AttemptSink
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
