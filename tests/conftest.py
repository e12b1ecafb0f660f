"""Shared fixtures. Core tests are synchronous and use `clock` (a ManualClock)."""

from __future__ import annotations

import importlib.machinery
import os
from pathlib import Path

import pytest

from rolloutgate.core.clock import ManualClock

# LiteLLM tries to download a price map at import without this; the machine has no internet.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "rolloutgate"


def stale_compiled_modules(package: Path) -> list[str]:
    """The compiled modules an editable install built beside their sources (setup.py) that are older than
    their source: Python would load the extension, not the edited source."""
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    stale = []
    for built in package.rglob(f"*{suffix}"):
        source = built.with_name(built.name.removesuffix(suffix) + ".py")
        if not source.exists() or source.stat().st_mtime > built.stat().st_mtime:
            stale.append(str(source.relative_to(package)))
    return sorted(stale)


def pytest_sessionstart(session: pytest.Session) -> None:
    stale = stale_compiled_modules(PACKAGE)
    if stale:
        pytest.exit(
            f"compiled modules older than their sources: {', '.join(stale)}; `make native` rebuilds them "
            "(`make clean-native` removes them: the interpreted modules run)",
            returncode=4,
        )


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()
