"""The harness of "busy is not dead" (docs/reliability.md): what each row's clients got, what the gateway's core
decided about each engine and when, and the table the rows fill.

Each row runs a gateway in front of simulated engines in this process, on a fake-time loop
(`@pytest.mark.looptime`): the engines' and the gateway's minutes pass when the loop is idle, so a 120 s
compile or a 1,000 s decode costs only the CPU it takes, and every time figure is on the gateway's own clock
(gateway seconds = simulated seconds), never on a sleep.

What is counted, per row:

- false verdicts: an engine taken out of service (quarantined as hung, or marked unhealthy) that the row did
  not break; what the row broke on purpose (the restarted engine's down time, the wedged engine) is not;
- spurious 503s: calls answered 503 (at once, or as the error a keep-alive body carries);
- lost: calls that ended without their whole answer in any other way (an error, a cut connection, fewer
  tokens than asked; an abort-mode pause's in-flight calls answered `finish_reason: abort` are what the
  trainer asked for, counted apart);
- detected: for a real failure, gateway seconds from the fault to the verdict that took the engine out.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx

from rolloutgate.core.commands import Command, Dispatch, MarkEngine
from rolloutgate.core.events import Event
from rolloutgate.server.app import GatewayServer

__all__ = ("BusyRow", "CallTally", "CoreWatch", "Verdict", "render_table")

OUT_OF_SERVICE = ("quarantined", "unhealthy")
# the status an error written after keep-alive committed a 200 stands for, by its code (errors.py)
COMMITTED_STATUS = {
    "no_engine": 503,
    "queue_timeout": 503,
    "service_unavailable": 503,
    "shutdown": 503,
    "timeout": 504,
    "stall": 504,
    "max_wall": 504,
    "queue_full": 429,
}


@dataclass(frozen=True, slots=True)
class Verdict:
    at: float  # gateway seconds
    engine_id: str
    state: str
    detail: str


class CoreWatch:
    """Every engine verdict (MarkEngine) and dispatch of the gateway's core, with its time, as the driver's
    observer sees them (the core is compiled: watching is the way in)."""

    def __init__(self, gateway: GatewayServer) -> None:
        self._driver = gateway.context.driver
        self.verdicts: list[Verdict] = []
        self.dispatches: list[tuple[float, str, str, int]] = []  # (at, engine id, request id, attempt)
        self._driver.observers.append(self._observe)

    def _observe(self, now: float, _event: Event | None, commands: list[Command]) -> None:
        for command in commands:
            if isinstance(command, MarkEngine):
                self.verdicts.append(Verdict(now, command.engine_id, command.state, command.detail))
            elif isinstance(command, Dispatch):
                self.dispatches.append((now, command.engine_id, command.request_id, command.attempt))

    def now(self) -> float:
        """The gateway's clock (seconds), the one every verdict is stamped with."""
        return self._driver.clock.now()

    def out_of_service(self, is_expected: Callable[[Verdict], bool] = lambda _v: False) -> list[Verdict]:
        """Verdicts that took an engine out of service, less those `is_expected` names (what the row broke)."""
        return [v for v in self.verdicts if v.state in OUT_OF_SERVICE and not is_expected(v)]

    def first(self, engine_id: str, state: str, after_at: float) -> Verdict | None:
        return next(
            (v for v in self.verdicts if v.engine_id == engine_id and v.state == state and v.at >= after_at),
            None,
        )


@dataclass
class CallTally:
    """What the row's clients got."""

    answered: int = 0
    answered_abort: int = 0  # in flight when an abort-mode pause came: answered `abort`, as the trainer asked
    spurious_503: int = 0
    lost: int = 0
    failures: list[str] = field(default_factory=list)  # what each 503 or lost call got, for the assertion

    @property
    def calls(self) -> int:
        return self.answered + self.answered_abort + self.spurious_503 + self.lost

    def add(
        self, response: httpx.Response | BaseException, want_tokens: int, *, abort_ok: bool = False
    ) -> None:
        """Classify one call's outcome (module docstring)."""
        if isinstance(response, BaseException):
            self.lost += 1
            self.failures.append(f"{type(response).__name__}: {response}")
            return
        status, error, answer = _outcome(response)
        if error is not None:
            if status == 503:
                self.spurious_503 += 1
            else:
                self.lost += 1
            self.failures.append(f"{status} {json.dumps(error)[:300]}")
            return
        tokens, finish = _tokens_and_finish(answer)
        if tokens == want_tokens:
            self.answered += 1
        elif abort_ok and finish == "abort":
            self.answered_abort += 1
        else:
            self.lost += 1
            self.failures.append(f"{status}: {tokens} of {want_tokens} tokens, finish {finish}")

    def add_stream(self, response: httpx.Response | BaseException, want_tokens: int) -> None:
        """Classify a streamed OpenAI call with `ignore_eos`: whole when it ends with `[DONE]` after a choice
        that finished on its length (a stream continued on another engine asks that engine for the rest of
        the budget, and its usage frame counts that attempt only); an error event carries its code."""
        if isinstance(response, BaseException) or response.status_code != 200:
            self.add(response, want_tokens)
            return
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        frames = [json.loads(e) for e in events if e != "[DONE]"]
        errors = [f["error"] for f in frames if "error" in f]
        if errors:
            status = COMMITTED_STATUS.get(str(errors[-1].get("code")), 502)
            if status == 503:
                self.spurious_503 += 1
            else:
                self.lost += 1
            self.failures.append(f"stream {status} {json.dumps(errors[-1])[:300]}")
            return
        finishes = [
            c.get("finish_reason") for f in frames for c in f.get("choices") or () if c.get("finish_reason")
        ]
        if events[-1:] == ["[DONE]"] and finishes == ["length"]:
            self.answered += 1
        else:
            self.lost += 1
            self.failures.append(f"stream of {want_tokens} tokens: finished {finishes}, ended {events[-1:]}")


def _outcome(response: httpx.Response) -> tuple[int, dict[str, Any] | None, Any]:
    """(status, error or None, answer). An error after keep-alive committed a 200 is the body's first JSON
    value (docs/clients.md); its status is the one its code stands for."""
    text = response.text.lstrip()
    try:
        first, _end = json.JSONDecoder().raw_decode(text)
    except json.JSONDecodeError:
        return response.status_code, {"unparsed": text[:200]}, None
    if response.status_code != 200 or (isinstance(first, dict) and "error" in first):
        error = first.get("error", first) if isinstance(first, dict) else {"body": first}
        status = response.status_code
        if status == 200 and isinstance(error, dict):
            status = COMMITTED_STATUS.get(str(error.get("code")), 502)
        return status, error if isinstance(error, dict) else {"error": error}, None
    return response.status_code, None, first


def _tokens_and_finish(answer: Any) -> tuple[int, str | None]:
    """Generated tokens and finish reason of an SGLang `/generate` or an OpenAI answer."""
    if isinstance(answer, dict) and "meta_info" in answer:
        meta = answer["meta_info"]
        finish = meta.get("finish_reason") or {}
        return int(meta["completion_tokens"]), finish.get("type") if isinstance(finish, dict) else str(finish)
    choice = answer["choices"][0]
    return int(answer["usage"]["completion_tokens"]), choice.get("finish_reason")


async def post(
    http: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> httpx.Response | BaseException:
    """One call; a transport failure is returned, not raised (it is a lost call, counted)."""
    try:
        return await http.post(url, json=body, headers=headers, timeout=None)
    except httpx.HTTPError as error:
        return error


async def gather_calls(calls: Iterable[asyncio.Task[httpx.Response | BaseException]]) -> list[Any]:
    return list(await asyncio.gather(*calls))


@dataclass(frozen=True, slots=True)
class BusyRow:
    """One row of the table, as measured."""

    row: str
    calls: int
    false_quarantines: int
    false_unhealthy: int
    spurious_503: int
    lost: int
    detected_s: float | None = None  # the real failure's verdict, gateway seconds after the fault
    bound_s: float | None = None  # what detection must stay within
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "calls": self.calls,
            "false_quarantines": self.false_quarantines,
            "false_unhealthy": self.false_unhealthy,
            "spurious_503": self.spurious_503,
            "lost": self.lost,
            "detected_s": self.detected_s,
            "bound_s": self.bound_s,
            "note": self.note,
        }


def render_table(rows: dict[str, dict[str, Any]]) -> list[str]:
    """The table of docs/reliability.md ("Busy is not dead"), one line per row, in the order measured."""
    lines = [
        "| row | calls | false quarantines / unhealthy | spurious 503s | lost | real failure caught after |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, row in rows.items():
        detected = "-"
        if row["detected_s"] is not None:
            detected = f"{row['detected_s']:.1f} s (bound {row['bound_s']:.0f} s)"
        note = f" ({row['note']})" if row["note"] else ""
        lines.append(
            f"| {name}{note} | {row['calls']} | {row['false_quarantines']} / {row['false_unhealthy']} "
            f"| {row['spurious_503']} | {row['lost']} | {detected} |"
        )
    return lines
