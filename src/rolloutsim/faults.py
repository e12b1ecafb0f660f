"""Faults a simulated engine can be told to have.

| kind      | params          | effect                                                                  |
| --------- | --------------- | ----------------------------------------------------------------------- |
| freeze    |                 | no progress at all (a hung GPU); HTTP still accepts, connections stay    |
|           |                 | open; the scheduler answers no control request                           |
| slow      | factor (> 1)    | every step takes `factor` times longer                                  |
| crash     |                 | the port stops accepting, open connections drop, all state is lost      |
| stall     | rid             | that one request gets no tokens; the rest of the engine runs             |
| refuse    | status (503)    | new generation requests are answered with an error status               |
| blackhole |                 | new requests are accepted and queued but never started                  |
| compile   | duration_s      | the next forward step that runs a client's request takes `duration_s`   |
|           |                 | longer (a compile on the first request: rllm#926, 108 s on SGLang); the |
|           |                 | scheduler answers no control request meanwhile                           |
| wedge     |                 | no progress and frozen gauges, like freeze, but `/health` answers 200    |
|           |                 | at once (vLLM#46811)                                                     |
| restart   | duration_s,     | the process dies (as crash); its port stays closed for `down_s`, then    |
|           | down_s          | answers 503 to health and generation for `duration_s`, then serves, empty |
|           |                 | and holding its launch weights (the checkpoint it was started with: a    |
|           |                 | new process does not have the updates the old one took)                  |
| update_fails |              | every weight update (`/update_weights_from_disk`, `/update_weight_version`, |
|           |                 | vLLM's `/update_weights`...) fails: it takes its time, then answers      |
|           |                 | `{"success": false, "message"}` (SGLang: status 400) and the engine keeps |
|           |                 | the weights it held                                                      |

Each other fault may carry `duration_s` (simulated seconds) after which it clears itself. The engine model
applies freeze, slow, stall, blackhole, compile and wedge; the HTTP layer applies refuse, crash, restart and
the health answers of wedge and restart; the engine (sim/engine.py) applies update_fails and the launch
weights of a restart.

Why compile and wedge exist: a liveness check must tell a busy engine from a dead one (docs/reliability.md,
"Busy is not dead"). From outside they look alike: during a compile the forward pass does not return, so
SGLang's `/health` (which generates a token) and its `/get_load` (a round trip to the scheduler) hang, as
they do when the GPU hangs; a wedged vLLM answers `/health` 200 while generating nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ("FAULT_KINDS", "SELF_ENDING", "UPDATE_FAILED_MESSAGE", "Fault", "parse_fault", "parse_fault_flag")

FAULT_KINDS = (
    "freeze",
    "slow",
    "crash",
    "stall",
    "refuse",
    "blackhole",
    "compile",
    "wedge",
    "restart",
    "update_fails",
)
# faults whose `duration_s` is their own length, not a timer that clears them: they end by themselves
SELF_ENDING = ("compile", "restart")
# what a weight update answers under the update_fails fault
UPDATE_FAILED_MESSAGE = "Failed to update weights: simulated fault (update_fails); the old weights are kept."


@dataclass(frozen=True, slots=True, kw_only=True)
class Fault:
    kind: str
    factor: float = 1.0  # slow
    rid: str | None = None  # stall
    status: int = 503  # refuse
    duration_s: float = math.inf  # clears itself after this many simulated seconds (compile: its length)
    down_s: float = 0.0  # restart: seconds its port stays closed before it answers again

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault {self.kind!r}; choose from {', '.join(FAULT_KINDS)}")
        if self.kind == "slow" and not (self.factor > 0 and math.isfinite(self.factor)):
            raise ValueError(f"slow needs a finite factor > 0, got {self.factor!r}")
        if self.kind == "stall" and not self.rid:
            raise ValueError("stall needs the rid of the request to stall")
        if self.kind == "refuse" and not 400 <= self.status <= 599:
            raise ValueError(f"refuse needs an error status, got {self.status!r}")
        if math.isnan(self.duration_s) or self.duration_s <= 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s!r}")
        if self.kind in SELF_ENDING and math.isinf(self.duration_s):
            raise ValueError(f"{self.kind} needs a finite duration_s (its length), got {self.duration_s!r}")
        if not (math.isfinite(self.down_s) and self.down_s >= 0):
            raise ValueError(f"down_s must be a finite duration >= 0, got {self.down_s!r}")

    @property
    def key(self) -> str:
        """Faults with the same key replace each other (one stall per rid)."""
        return f"stall:{self.rid}" if self.kind == "stall" else self.kind

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind}
        if self.kind == "slow":
            out["factor"] = self.factor
        if self.kind == "stall":
            out["rid"] = self.rid
        if self.kind == "refuse":
            out["status"] = self.status
        if math.isfinite(self.duration_s):
            out["duration_s"] = self.duration_s
        if self.kind == "restart":
            out["down_s"] = self.down_s
        return out


def parse_fault(body: dict[str, Any]) -> Fault:
    """A fault from JSON such as {"fault": "slow", "factor": 5} (`kind` is accepted for `fault`)."""
    kind = body.get("fault", body.get("kind"))
    if not isinstance(kind, str):
        raise ValueError('a fault needs "fault": one of ' + ", ".join(FAULT_KINDS))
    duration = body.get("duration_s")
    return Fault(
        kind=kind,
        factor=float(body.get("factor", 1.0)),
        rid=None if body.get("rid") is None else str(body["rid"]),
        status=int(body.get("status", 503)),
        duration_s=math.inf if duration is None else float(duration),
        down_s=float(body.get("down_s", 0.0)),
    )


def parse_fault_flag(text: str) -> tuple[str, Fault]:
    """A CLI `--fault ENGINE:KIND[:PARAM]`, e.g. `0:freeze`, `all:slow:5`, `1:stall:rid-7`, `0:refuse:429`,
    `all:compile:120` (the PARAM of any other kind is its `duration_s`).

    Returns the engine selector ("all" or an index as a string) and the fault.
    """
    parts = text.split(":", 2)
    if len(parts) < 2:
        raise ValueError(f"--fault wants ENGINE:KIND[:PARAM], got {text!r}")
    engine, kind = parts[0], parts[1]
    param = parts[2] if len(parts) == 3 else None
    body: dict[str, Any] = {"fault": kind}
    if param is not None:
        body[{"slow": "factor", "stall": "rid", "refuse": "status"}.get(kind, "duration_s")] = param
    return engine, parse_fault(body)
