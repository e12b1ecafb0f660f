"""Core test fixtures: `clock` (ManualClock) comes from tests/conftest.py; `rng` is seeded per test."""

from __future__ import annotations

import random

import pytest


@pytest.fixture
def rng() -> random.Random:
    return random.Random(20240917)
