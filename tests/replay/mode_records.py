"""A mode's records as JSON (rolloutreplay/world.py `ModeRecords`), built by hand for measure tests: empty but for
what a test gives."""

from __future__ import annotations

from typing import Any

from rolloutreplay.scenario import ReplayConfig


def mode_records(config: ReplayConfig, engines: int, **fields: Any) -> dict[str, Any]:
    """An engine-time mode's records over `engines` engines, ended at 2,400 s, with `fields` over the defaults."""
    out: dict[str, Any] = {
        "mode": "engine",
        "config": config.to_json(),
        "engine_urls": [f"http://e{i}" for i in range(engines)],
        "events": [],
        "turns": [],
        "attempts": [],
        "ends": [],
        "marks": [],
        "generations": [],
        "holds": [],
        "ended_at": 2400.0,
        "real_s": 100.0,
        "cpu_s": 50.0,
        "loop_lags": [],
    }
    out.update(fields)
    return out
