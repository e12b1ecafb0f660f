"""The compiled core: these same modules built into C extensions by mypyc, used when built from these sources.

Theory of operation: `make native` (scripts/build_native.py) compiles every module of the core but this one and
the package's `__init__` into `build/native/`: one shared library at its top (`rolloutgate_core__mypyc`, where
mypyc expects it) and a small extension per module under `rolloutgate/core/`, beside a manifest: the digest
of the sources it compiled and the extension suffix of the Python it compiled for. On import, the package puts
that folder first on its `__path__` (`compiled_first`; `build/native` goes on `sys.path` for the shared
library) when the manifest matches the sources here and this Python, so `rolloutgate.core.ledger` is then the
extension and the rest of the gateway does not know the difference.
A source edited since the build, or another Python, falls back to the interpreted modules with a warning
(never a compiled module older than its source); `ROLLOUTGATE_NATIVE=0` asks for the interpreted ones.

Why: the core runs three times per request (arrival, progress, end) and is ~15% of the gateway's instructions
per request interpreted; compiled, ~2x less (docs/benchmarks.md, sixth session). It is the part mypyc takes
whole: strictly typed, no I/O, no async.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import json
import os
import sys
import warnings
from pathlib import Path

__all__ = (
    "MANIFEST",
    "NATIVE_ENV",
    "compiled_first",
    "native_dir",
    "native_root",
    "source_digest",
    "uncompiled",
)

NATIVE_ENV = "ROLLOUTGATE_NATIVE"  # "0": the interpreted core even where a compiled one is built
MANIFEST = "manifest.json"


def uncompiled(core_dir: Path) -> frozenset[Path]:
    """The core's modules that always run interpreted: they choose between the two."""
    return frozenset({core_dir / "__init__.py", core_dir / "_native.py"})


def native_root(core_dir: Path) -> Path:
    """Where `make native` builds the compiled core of the sources in `core_dir` (src/rolloutgate/core)."""
    return core_dir.parents[2] / "build" / "native"


def native_dir(core_dir: Path) -> Path:
    """The compiled core package's folder: its modules' extensions and the manifest."""
    return native_root(core_dir) / "rolloutgate" / "core"


def source_digest(core_dir: Path) -> str:
    """A digest of the compiled modules' sources: their paths (relative to `core_dir`) and contents."""
    digest = hashlib.sha256()
    skip = uncompiled(core_dir)
    for path in sorted(core_dir.rglob("*.py")):
        if path in skip:
            continue
        digest.update(path.relative_to(core_dir).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def compiled_first(package_path: list[str]) -> list[str]:
    """The core package's `__path__`, with the compiled core's folder first when it was built from these
    sources for this Python; else as it is (with a warning when a build is there but does not match)."""
    if os.environ.get(NATIVE_ENV, "1") == "0" or not package_path:
        return package_path
    core_dir = Path(package_path[0])
    built = native_dir(core_dir)
    try:
        manifest = json.loads((built / MANIFEST).read_text())
    except (OSError, ValueError):
        return package_path  # not built: interpreted
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    if manifest.get("extension_suffix") != suffix:
        warnings.warn(
            f"the compiled core in {built} is for another Python ({manifest.get('extension_suffix')}, "
            f"this one loads {suffix}): running the interpreted core; `make native` rebuilds it",
            RuntimeWarning,
            stacklevel=2,
        )
        return package_path
    if manifest.get("source_digest") != source_digest(core_dir):
        warnings.warn(
            f"the compiled core in {built} was built from other sources: running the interpreted core; "
            "`make native` rebuilds it",
            RuntimeWarning,
            stacklevel=2,
        )
        return package_path
    root = str(native_root(core_dir))
    if root not in sys.path:
        sys.path.append(root)  # last: it only adds the shared library (its `rolloutgate/` has no __init__)
    return [str(built), *package_path]
