"""The compiled modules are used only when built from the sources at hand, for this Python (core/_native.py)."""

from __future__ import annotations

import importlib.machinery
import json
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

import rolloutgate
import rolloutgate.core
import rolloutgate.core.ledger
import rolloutgate.engines.base
import rolloutgate.engines.progress
import rolloutgate.server.validate
from rolloutgate.core import _native
from rolloutgate.core._native import (
    MANIFEST,
    NATIVE_ENV,
    compiled_first,
    compiled_sources,
    native_root,
    source_digest,
)

SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]


@pytest.fixture(autouse=True)
def _fresh_verdicts() -> Iterator[None]:
    _native._usable_build.cache_clear()  # each test judges its own tree
    yield
    _native._usable_build.cache_clear()


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A checkout's layout (src/rolloutgate with compiled and interpreted modules) and a build of it with its
    manifest; returns src/rolloutgate."""
    package = tmp_path / "src" / "rolloutgate"
    for name, text in {
        "core/__init__.py": "",
        "core/_native.py": "# chooses\n",
        "core/ledger.py": "x = 1\n",
        "core/placement/base.py": "y = 2\n",
        "engines/__init__.py": "",
        "engines/assemble.py": "a = 1\n",
        "engines/progress.py": "p = 1\n",
        "engines/base.py": "b = 1\n",
        "server/validate.py": "v = 1\n",
    }.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text)
    root = native_root(package)
    root.mkdir(parents=True)
    (root / MANIFEST).write_text(
        json.dumps({"source_digest": source_digest(package), "extension_suffix": SUFFIX})
    )
    monkeypatch.delenv(NATIVE_ENV, raising=False)
    monkeypatch.setattr(sys, "path", list(sys.path))  # compiled_first appends the build's root
    return package


def test_the_compiled_modules_are_the_core_and_the_three_pure_edge_modules(tree: Path) -> None:
    names = [p.relative_to(tree).as_posix() for p in compiled_sources(tree)]
    assert names == [
        "core/ledger.py",
        "core/placement/base.py",
        "engines/assemble.py",
        "engines/progress.py",
        "server/validate.py",
    ]


def test_a_build_of_these_sources_comes_first_in_each_package(tree: Path) -> None:
    root = native_root(tree)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compiled_first([str(tree / "core")]) == [
            str(root / "rolloutgate" / "core"),
            str(tree / "core"),
        ]
        assert compiled_first([str(tree / "engines")])[0] == str(root / "rolloutgate" / "engines")
    assert sys.path[-1] == str(root)


def test_an_edited_source_falls_back_to_the_interpreted_modules(tree: Path) -> None:
    (tree / "engines" / "progress.py").write_text("p = 2\n")
    with pytest.warns(RuntimeWarning, match="built from other sources"):
        assert compiled_first([str(tree / "core")]) == [str(tree / "core")]
    assert compiled_first([str(tree / "engines")]) == [str(tree / "engines")]  # one verdict, one warning
    assert str(native_root(tree)) not in sys.path


def test_a_new_core_module_makes_the_build_stale(tree: Path) -> None:
    (tree / "core" / "gate.py").write_text("")
    with pytest.warns(RuntimeWarning, match="built from other sources"):
        assert compiled_first([str(tree / "core")]) == [str(tree / "core")]


def test_interpreted_modules_are_not_part_of_the_digest(tree: Path) -> None:
    (tree / "core" / "__init__.py").write_text("# edited\n")
    (tree / "core" / "_native.py").write_text("# edited\n")
    (tree / "engines" / "base.py").write_text("b = 2\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compiled_first([str(tree / "core")])[0] == str(native_root(tree) / "rolloutgate" / "core")


def test_a_build_for_another_python_is_not_used(tree: Path) -> None:
    manifest = native_root(tree) / MANIFEST
    manifest.write_text(
        json.dumps({**json.loads(manifest.read_text()), "extension_suffix": ".cpython-39.so"})
    )
    with pytest.warns(RuntimeWarning, match="another Python"):
        assert compiled_first([str(tree / "core")]) == [str(tree / "core")]


def test_no_build_is_the_interpreted_modules_without_a_word(tree: Path) -> None:
    (native_root(tree) / MANIFEST).unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compiled_first([str(tree / "core")]) == [str(tree / "core")]


def test_the_environment_can_ask_for_the_interpreted_modules(
    tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(NATIVE_ENV, "0")
    assert compiled_first([str(tree / "core")]) == [str(tree / "core")]


def test_this_process_runs_the_modules_the_build_allows() -> None:
    """`make test` runs the suite on the compiled modules and their own tests again on the interpreted ones:
    whichever this is, the modules loaded are the ones the manifest and the environment call for."""
    package = Path(rolloutgate.__file__).parent
    path = native_root(package) / MANIFEST
    manifest = json.loads(path.read_text()) if path.is_file() else {}
    fresh = (
        manifest.get("source_digest") == source_digest(package) and manifest.get("extension_suffix") == SUFFIX
    )
    compiled = fresh and os.environ.get(NATIVE_ENV, "1") != "0"
    for module in (rolloutgate.core.ledger, rolloutgate.engines.progress, rolloutgate.server.validate):
        assert module.__file__ is not None
        assert module.__file__.endswith(SUFFIX if compiled else ".py"), module.__name__
    assert rolloutgate.engines.base.__file__ is not None
    assert rolloutgate.engines.base.__file__.endswith(".py")  # never compiled
    assert (rolloutgate.core.__path__[0] == str(native_root(package) / "rolloutgate" / "core")) == compiled
