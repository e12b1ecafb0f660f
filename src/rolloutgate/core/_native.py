"""The compiled modules: the sans-IO core and three pure edge modules, built into C extensions by mypyc, used
when built from the sources at hand.

Theory of operation: `make native` (scripts/build_native.py) compiles the modules `COMPILED` names (every module
of the core but this one and the core's `__init__`, and the edge's pure byte and dict work: SSE progress
scanning, answer assembly, request validation) into `build/native/`: one shared library at its top
(`rolloutgate_native__mypyc`, where mypyc expects it), a small extension per module under `rolloutgate/<package>/`,
and a manifest: the digest of the sources it compiled and the extension suffix of the Python it compiled for.
On import, each package with compiled modules (core, engines, server) puts its folder in the build first on its
`__path__` (`compiled_first`; `build/native` goes on `sys.path` for the shared library) when the manifest
matches the sources here and this Python, so `rolloutgate.core.ledger` is then the extension and the rest of
the gateway does not know the difference. A source edited since the build, or another Python, falls back to
the interpreted modules with a warning (never a compiled module older than its source);
`ROLLOUTGATE_NATIVE=0` asks for the interpreted ones.

Why: the core runs three times per request (arrival, progress, end) and the three edge modules on every
request and every upstream event; compiled, they cost ~2-4x less (docs/benchmarks.md, sixth session). They
are the parts mypyc takes whole: typed, no I/O, no async.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import json
import os
import sys
import warnings
from pathlib import Path

__all__ = (
    "COMPILED",
    "MANIFEST",
    "NATIVE_ENV",
    "compiled_first",
    "compiled_sources",
    "native_root",
    "source_digest",
)

NATIVE_ENV = "ROLLOUTGATE_NATIVE"  # "0": the interpreted modules even where compiled ones are built
MANIFEST = "manifest.json"
# What is compiled, relative to the rolloutgate package: a folder (all of it) or one module.
COMPILED = ("core", "engines/assemble.py", "engines/progress.py", "server/validate.py")
# The modules that choose between the two, always interpreted.
_CHOOSERS = frozenset({"core/__init__.py", "core/_native.py"})


def compiled_sources(package_dir: Path) -> list[Path]:
    """The modules `make native` compiles, under `package_dir` (src/rolloutgate), sorted."""
    found: list[Path] = []
    for entry in COMPILED:
        path = package_dir / entry
        found += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return sorted(p for p in found if p.relative_to(package_dir).as_posix() not in _CHOOSERS)


def native_root(package_dir: Path) -> Path:
    """Where `make native` builds the compiled modules of the sources under `package_dir` (src/rolloutgate)."""
    return package_dir.parents[1] / "build" / "native"


def source_digest(package_dir: Path) -> str:
    """A digest of the compiled modules' sources: their paths (relative to `package_dir`) and contents."""
    digest = hashlib.sha256()
    for path in compiled_sources(package_dir):
        digest.update(path.relative_to(package_dir).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def compiled_first(package_path: list[str]) -> list[str]:
    """A package's `__path__` (rolloutgate.core, .engines or .server), with its folder in the build first when
    the build was made from these sources for this Python; else as it is (with a warning, once, when a build
    is there but does not match)."""
    if os.environ.get(NATIVE_ENV, "1") == "0" or not package_path:
        return package_path
    package = Path(package_path[0])
    root = _usable_build(package.parent)
    if root is None:
        return package_path
    if str(root) not in sys.path:
        sys.path.append(
            str(root)
        )  # last: it only adds the shared library (its `rolloutgate/` has no __init__)
    return [str(root / "rolloutgate" / package.name), *package_path]


@functools.cache
def _usable_build(package_dir: Path) -> Path | None:
    """The build's root when its manifest matches the sources under `package_dir` and this Python."""
    root = native_root(package_dir)
    try:
        manifest = json.loads((root / MANIFEST).read_text())
    except (OSError, ValueError):
        return None  # not built: interpreted
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    if manifest.get("extension_suffix") != suffix:
        warnings.warn(
            f"the compiled modules in {root} are for another Python ({manifest.get('extension_suffix')}, "
            f"this one loads {suffix}): running the interpreted ones; `make native` rebuilds them",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    if manifest.get("source_digest") != source_digest(package_dir):
        warnings.warn(
            f"the compiled modules in {root} were built from other sources: running the interpreted ones; "
            "`make native` rebuilds them",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    return root
