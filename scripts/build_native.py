"""Compile the modules core/_native.py names with mypyc into build/native/ (`make native`).

They become C extensions in one shared library, `rolloutgate_native__mypyc` (at the top of build/native, where
mypyc derives its modules' `__file__` from), with a small extension per module under build/native/rolloutgate/;
the manifest written last records what was compiled, so the packages use the build only while it matches their
sources. ~30 s on 2 cores; needs gcc and the Python headers. A build already made from the same sources, by
this script as it is now, for this Python, is kept (the manifest is touched, for make).

    python scripts/build_native.py            # build (replaces build/native whole) unless up to date
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import json
import shutil
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "rolloutgate"
sys.path.insert(0, str(ROOT / "src"))

from rolloutgate.core._native import MANIFEST, compiled_sources, native_root, source_digest  # noqa: E402

GROUP = "rolloutgate_native"  # the shared library: build/native/rolloutgate_native__mypyc.*.so


def main() -> None:
    from mypyc.build import mypycify
    from setuptools import setup

    # setuptools reads the project's pyproject.toml and warns that its [tool.setuptools] table is beta
    warnings.filterwarnings("ignore", message=".*tool.setuptools.*")
    started = time.monotonic()
    out = native_root(PACKAGE)
    digest = source_digest(PACKAGE)  # of the sources as compiled: taken first, so an edit meanwhile is stale
    builder = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    if _manifest(out) == {"source_digest": digest, "builder": builder, "extension_suffix": suffix}:
        (out / MANIFEST).touch()  # make depends on every source: an edit elsewhere needs no new build
        print(f"compiled modules in {out} are up to date")
        return
    temp = ROOT / "build" / "native-build"
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(temp, ignore_errors=True)
    sources = [str(p.relative_to(ROOT)) for p in compiled_sources(PACKAGE)]
    extensions = mypycify(sources, group_name=GROUP, target_dir=str(temp / "c"), opt_level="3")
    setup(
        name="rolloutgate-native",
        ext_modules=extensions,
        script_args=["-q", "build_ext", f"--build-lib={out}", f"--build-temp={temp / 'o'}"],
    )
    manifest = {"source_digest": digest, "builder": builder, "extension_suffix": suffix, "modules": sources}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    shutil.rmtree(temp, ignore_errors=True)
    print(f"compiled {len(sources)} modules into {out} in {time.monotonic() - started:.0f} s")


def _manifest(out: Path) -> dict[str, str]:
    """What the existing build was made from (its digest, builder and suffix); {} when there is none."""
    try:
        manifest = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    return {key: manifest.get(key) for key in ("source_digest", "builder", "extension_suffix")}


if __name__ == "__main__":
    main()
