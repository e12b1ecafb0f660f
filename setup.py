"""The package build: setuptools, with the modules `[tool.rolloutgate] compiled` names (pyproject.toml) compiled
by mypyc into C extensions, so `pip install .` gives what `make` gives.

Those are the sans-IO core and three pure edge modules (answer assembly, SSE progress scanning, request
validation): typed, no I/O, no async, run on every request and every upstream event, ~2-4x cheaper compiled
(docs/benchmarks.md, sixth session). They share one library, `rolloutgate_native__mypyc`. An editable install
(`make`) builds them beside their sources; `make native` rebuilds them after an edit, and the test suite refuses
to run a compiled module older than its source (tests/conftest.py). Needs gcc and the Python headers.
"""

import tomllib
from pathlib import Path

from mypyc.build import mypycify
from setuptools import setup


def compiled_sources() -> list[str]:
    """The sources to compile, from pyproject.toml: a folder (all of it but its __init__) or one module."""
    entries = tomllib.loads(Path("pyproject.toml").read_text())["tool"]["rolloutgate"]["compiled"]
    found: list[Path] = []
    for entry in entries:
        path = Path("src/rolloutgate") / entry
        found += [p for p in path.rglob("*.py") if p.name != "__init__.py"] if path.is_dir() else [path]
    return sorted(p.as_posix() for p in found)


setup(ext_modules=mypycify(compiled_sources(), group_name="rolloutgate_native", opt_level="3"))
