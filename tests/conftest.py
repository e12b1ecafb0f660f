"""Shared fixtures. Core tests are synchronous and use `clock` (a ManualClock)."""

from __future__ import annotations

import os

import pytest

from rolloutgate.core.clock import ManualClock

# LiteLLM tries to download a price map at import without this; the machine has no internet.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()
