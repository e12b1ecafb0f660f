"""Fixtures for the adapter tests: a shared client session and a fake upstream, both on loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

from .fakes import FakeEngine
from .scripted import ScriptedServer


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client_session:
        yield client_session


@pytest.fixture
async def fake() -> AsyncIterator[FakeEngine]:
    engine = FakeEngine()
    await engine.start()
    yield engine
    await engine.close()


@pytest.fixture
async def server() -> AsyncIterator[ScriptedServer]:
    scripted = ScriptedServer()
    await scripted.start()
    yield scripted
    await scripted.close()
