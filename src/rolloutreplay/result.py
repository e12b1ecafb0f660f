"""What a replay shows: both modes' figures, and the verdicts the replay must hold (`ReplayResult`).

Its own module so that the run (run.py) and its reports (report.py, plot.py) all take it from here.
"""

from __future__ import annotations

from typing import Any

from rolloutreplay.scenario import ReplayConfig
from rolloutreplay.world import ModeRecords, gateway_settings

__all__ = ("ReplayResult", "verdicts")


class ReplayResult:
    """The measured figures of each mode, the verdicts, and where the files went."""

    def __init__(
        self, config: ReplayConfig, figures: dict[str, dict[str, Any]], records: dict[str, ModeRecords]
    ):
        self.config = config
        self.figures = figures
        self.records = records
        self.verdicts = verdicts(config, figures)

    @property
    def passed(self) -> bool:
        return all(v["ok"] for v in self.verdicts)

    def summary(self) -> dict[str, Any]:
        figures = {mode: {k: v for k, v in f.items() if k != "kills"} for mode, f in self.figures.items()}
        return {"config": self.config.to_json(), "modes": figures, "verdicts": self.verdicts}


def verdicts(config: ReplayConfig, figures: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """What the replay must show, each with the measured value and whether it holds."""
    out: list[dict[str, Any]] = []

    def check(mode: str, claim: str, ok: bool, measured: Any) -> None:
        out.append({"mode": mode, "claim": claim, "ok": bool(ok), "measured": measured})

    engine, wall = figures.get("engine"), figures.get("wallclock")
    if engine is not None:
        check("engine", "0 spurious timeouts", engine["spurious_timeouts"] == 0, engine["spurious_timeouts"])
        check(
            "engine",
            "0 client-visible failures among progressing requests",
            engine["client_visible_failures_progressing"] == 0,
            engine["client_visible_failures_progressing"],
        )
        if wall is not None:
            limit = 0.01 * wall["wasted_engine_seconds"]
            check(
                "engine",
                "wasted engine-seconds <= 1% of wallclock's",
                engine["wasted_engine_seconds"] <= limit,
                f"{engine['wasted_engine_seconds']:.0f} <= {limit:.0f}",
            )
        detection = engine["detection"]
        after = detection.get("detected_after_s")
        allowance = detection.get("prefill_allowance_s") or 0.0
        lag = detection.get("loop_lag_s") or 0.0
        # the pause check's time comes on top by design (core/liveness.py): the claim is about the stall window
        check_s = gateway_settings(config, "engine", []).hang_check_timeout
        bound = 1.1 * config.stall_timeout_s + check_s + allowance + lag
        extra = f" + {allowance:.0f} s of prefill allowance" if allowance else ""
        extra += f" + {lag:.0f} s the run's event loop was late meanwhile" if lag else ""
        check(
            "engine",
            "frozen engine detected within stall_timeout + 10% + the pause check"
            f" ({1.1 * config.stall_timeout_s + check_s:.0f} s{extra})",
            after is not None and after <= bound,
            None if after is None else round(after, 1),
        )
        if config.version_faults:
            weights = engine["weights"]
            check(
                "engine",
                "0 tokens served under a version the policy (latest-only) forbids",
                weights["forbidden_tokens_served"] == 0,
                weights["forbidden_tokens_served"],
            )
            check(
                "engine",
                "0 requests dispatched to a half-updated engine",
                weights["half_updated_dispatches"] == 0,
                weights["half_updated_dispatches"],
            )
        frozen = engine["frozen_engine_requests"]
        caught = frozen.get("caught", 0)
        elsewhere = frozen.get("answered_by_other_engines", 0)
        moving = frozen.get("still_running_elsewhere_at_end", 0)
        check(
            "engine",
            "the frozen engine's requests answered by the other engines (or still running there at the end)",
            elsewhere + moving == caught and frozen.get("failed", 0) == 0,
            f"{elsewhere}/{caught}" + (f" + {moving} running" if moving else ""),
        )
    if wall is not None:
        events = wall["events"]
        check(
            "wallclock",
            "timeouts in bursts after prefill storms and the weight update",
            bool(events) and all(e["fitting_killed"] > 0 for e in events),
            ", ".join(f"{e['kind']} {e['fitting_killed']}/{e['fitting_in_flight']}" for e in events),
        )
        chain = wall["failed_turn_chain_s_median"]
        three = wall["failed_turn_attempts"].get("3", wall["failed_turn_attempts"].get(3, 0))
        expected = 3 * config.client_timeout_s
        check(
            "wallclock",
            f"3-attempt retry chains of about 3 x the client timeout ({expected:.0f} s)",
            chain is not None and three > 0 and abs(chain - expected) <= 0.15 * expected,
            None if chain is None else f"{three} chains, median {chain:.0f} s",
        )
    return out
