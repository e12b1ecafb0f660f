"""Compile the sans-IO core with mypyc into build/native/ (`make native`; src/rolloutgate/core/_native.py).

Every module of src/rolloutgate/core but `__init__` and `_native` becomes a C extension in one shared library,
`rolloutgate_core__mypyc` (at the top of build/native, where mypyc derives its modules' `__file__` from); the manifest written last records what was compiled, so the core package uses
the build only while it matches its sources. ~30 s on 2 cores; needs gcc and the Python headers.

    python scripts/build_native.py            # build (replaces build/native whole)
"""

from __future__ import annotations

import importlib.machinery
import json
import shutil
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "src" / "rolloutgate" / "core"
sys.path.insert(0, str(ROOT / "src"))

from rolloutgate.core._native import MANIFEST, native_dir, native_root, source_digest, uncompiled  # noqa: E402

GROUP = "rolloutgate_core"  # the shared library: build/native/rolloutgate_core__mypyc.*.so


def main() -> None:
    from mypyc.build import mypycify
    from setuptools import setup

    # setuptools reads the project's pyproject.toml and warns that its [tool.setuptools] table is beta
    warnings.filterwarnings("ignore", message=".*tool.setuptools.*")

    started = time.monotonic()
    out = native_root(CORE)
    temp = ROOT / "build" / "native-build"
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(temp, ignore_errors=True)
    digest = source_digest(
        CORE
    )  # of the sources as compiled: taken before, so an edit meanwhile is seen stale
    skip = uncompiled(CORE)
    sources = [str(p.relative_to(ROOT)) for p in sorted(CORE.rglob("*.py")) if p not in skip]
    extensions = mypycify(sources, group_name=GROUP, target_dir=str(temp / "c"), opt_level="3")
    setup(
        name="rolloutgate-native-core",
        ext_modules=extensions,
        script_args=["-q", "build_ext", f"--build-lib={out}", f"--build-temp={temp / 'o'}"],
    )
    built = native_dir(CORE)
    assert built.is_dir(), f"mypyc wrote nothing to {built}"
    manifest = {
        "source_digest": digest,
        "extension_suffix": importlib.machinery.EXTENSION_SUFFIXES[0],
        "modules": len(sources),
    }
    (built / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    shutil.rmtree(temp, ignore_errors=True)
    print(f"compiled {len(sources)} core modules into {built} in {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
