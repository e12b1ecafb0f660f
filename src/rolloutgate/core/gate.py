"""The weight-update gate: open, or closed in one of five modes.

Theory of operation: closing the gate stops all dispatch and all charging (every meter goes PAUSED, see
request_clock.py). What happens to in-flight work depends on the mode: DRAIN lets it run to its end (uncharged);
ABORT has the gateway abort it and put it back at the front of the queue, to run again after the gate opens;
IN_PLACE leaves it on the engines, which the edge pauses with their KV cache kept, so engine liveness is
suspended while the gate is closed in that mode; so do RETRACT (SGLang's own mode: the engines free the KV
cache and prefill again on continue) and EXTERNAL (the trainer pauses the engines itself). In DRAIN mode engine liveness keeps running (a hung engine
would block the drain forever; its work is re-queued to run after the gate opens), while the stuck-request rule,
which is measured in charged time, rests with the charge. Opening the gate restarts every stall window and
dispatches what fits.

Rules:
1. Closing an already-closed gate only changes its mode (the gateway applies the new mode's effect).
2. Opening an open gate is a no-op (returns False).
"""

from __future__ import annotations

import math

from rolloutgate.core.events import PauseMode

__all__ = ("Gate",)

_ENGINES_PAUSED = frozenset({PauseMode.IN_PLACE, PauseMode.RETRACT, PauseMode.EXTERNAL})


class Gate:
    __slots__ = ("closed_at", "closures", "mode")

    def __init__(self) -> None:
        self.mode: PauseMode | None = None  # None: open
        self.closed_at = math.inf
        self.closures = 0

    @property
    def is_closed(self) -> bool:
        return self.mode is not None

    @property
    def is_liveness_suspended(self) -> bool:
        """Engines are paused in place by the edge: no progress is expected from them."""
        return self.mode in _ENGINES_PAUSED

    def close(self, mode: PauseMode, now: float) -> bool:
        """Close (or change the mode of) the gate; True if it was open."""
        was_open = self.mode is None
        if was_open:
            self.closed_at = now
            self.closures += 1
        self.mode = mode
        return was_open

    def open(self) -> bool:
        """Open the gate; True if it was closed."""
        if self.mode is None:
            return False
        self.mode = None
        self.closed_at = math.inf
        return True

    def __repr__(self) -> str:
        return (
            "<Gate open>"
            if self.mode is None
            else f"<Gate closed {self.mode.value} since {self.closed_at:.3f}>"
        )
