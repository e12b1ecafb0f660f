"""What the framework client tests share about the simulated engines behind the gateway."""

from __future__ import annotations

import asyncio
from typing import Any


async def wait_running(cluster: Any, engine_url: str) -> None:
    """Until the simulated engine at `engine_url` runs a call (at most 2,000 polls)."""
    engine = cluster.engines[cluster.urls.index(engine_url)]
    for _ in range(2000):
        if engine.running_count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"nothing ran on {engine_url}")
