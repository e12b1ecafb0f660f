"""The compiled core is used only when built from the sources at hand, for this Python (core/_native.py)."""

from __future__ import annotations

import importlib.machinery
import json
import os
import sys
import warnings
from pathlib import Path

import pytest

import rolloutgate.core
import rolloutgate.core.ledger
from rolloutgate.core import _native
from rolloutgate.core._native import (
    MANIFEST,
    NATIVE_ENV,
    compiled_first,
    native_dir,
    native_root,
    source_digest,
)

SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A checkout's layout: src/rolloutgate/core with two modules, and a build of them with its manifest."""
    core = tmp_path / "src" / "rolloutgate" / "core"
    (core / "placement").mkdir(parents=True)
    (core / "__init__.py").write_text("")
    (core / "_native.py").write_text("# chooses\n")
    (core / "ledger.py").write_text("x = 1\n")
    (core / "placement" / "base.py").write_text("y = 2\n")
    built = native_dir(core)
    built.mkdir(parents=True)
    (built / MANIFEST).write_text(
        json.dumps({"source_digest": source_digest(core), "extension_suffix": SUFFIX})
    )
    monkeypatch.delenv(NATIVE_ENV, raising=False)
    monkeypatch.setattr(sys, "path", list(sys.path))  # compiled_first appends the build's root
    return core


def test_a_build_of_these_sources_comes_first(tree: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        path = compiled_first([str(tree)])
    assert path == [str(native_dir(tree)), str(tree)]
    assert str(native_root(tree)) == sys.path[-1]


def test_an_edited_source_falls_back_to_the_interpreted_core(tree: Path) -> None:
    (tree / "placement" / "base.py").write_text("y = 3\n")
    with pytest.warns(RuntimeWarning, match="built from other sources"):
        assert compiled_first([str(tree)]) == [str(tree)]
    assert str(native_root(tree)) not in sys.path


def test_a_new_module_makes_the_build_stale(tree: Path) -> None:
    (tree / "gate.py").write_text("")
    with pytest.warns(RuntimeWarning, match="built from other sources"):
        assert compiled_first([str(tree)]) == [str(tree)]


def test_the_modules_that_choose_are_not_part_of_the_digest(tree: Path) -> None:
    (tree / "__init__.py").write_text("# edited\n")
    (tree / "_native.py").write_text("# edited\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compiled_first([str(tree)])[0] == str(native_dir(tree))


def test_a_build_for_another_python_is_not_used(tree: Path) -> None:
    manifest = native_dir(tree) / MANIFEST
    manifest.write_text(
        json.dumps({**json.loads(manifest.read_text()), "extension_suffix": ".cpython-39.so"})
    )
    with pytest.warns(RuntimeWarning, match="another Python"):
        assert compiled_first([str(tree)]) == [str(tree)]


def test_no_build_is_the_interpreted_core_without_a_word(tree: Path) -> None:
    (native_dir(tree) / MANIFEST).unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compiled_first([str(tree)]) == [str(tree)]


def test_the_environment_can_ask_for_the_interpreted_core(
    tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(NATIVE_ENV, "0")
    assert compiled_first([str(tree)]) == [str(tree)]


def test_this_process_runs_the_core_the_build_allows() -> None:
    """`make test` runs the suite on the compiled core and tests/core again on the interpreted one: whichever
    this is, the modules loaded are the ones the manifest and the environment call for."""
    source = Path(_native.__file__).parent
    path = native_dir(source) / MANIFEST
    manifest = json.loads(path.read_text()) if path.is_file() else {}
    fresh = (
        manifest.get("source_digest") == source_digest(source) and manifest.get("extension_suffix") == SUFFIX
    )
    compiled = fresh and os.environ.get(NATIVE_ENV, "1") != "0"
    assert rolloutgate.core.ledger.__file__ is not None
    assert rolloutgate.core.ledger.__file__.endswith(SUFFIX if compiled else ".py")
    assert (rolloutgate.core.__path__[0] == str(native_dir(source))) == compiled
