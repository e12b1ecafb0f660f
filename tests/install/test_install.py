"""`pip install .` into a fresh venv runs the modules `make` compiles (setup.py; make test-install).

The tree as a fresh clone has it (tracked and untracked-but-not-ignored files: no build of this checkout) is
copied, installed with pip's build isolation as a user would install it, and asked which of its modules are C
extensions once the whole gateway is imported, and what the wheel holds: the package and its siblings (the
simulator, the replay), never the benchmarks beside it (benchmarks/) or the tests.
"""

from __future__ import annotations

import importlib.machinery
import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "rolloutgate"

pytestmark = pytest.mark.install

_REPORT = (
    "import json, rolloutgate.server.app, rolloutgate.compiled as c; "
    "print(json.dumps({'modules': c.compiled_modules(), 'line': c.describe_build(), "
    "'file': rolloutgate.server.app.__file__}))"
)


def expected_modules() -> list[str]:
    """The modules pyproject.toml's [tool.rolloutgate] compiled names, as module names."""
    entries = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["rolloutgate"]["compiled"]
    found: list[Path] = []
    for entry in entries:
        path = PACKAGE / entry
        found += [p for p in path.rglob("*.py") if p.name != "__init__.py"] if path.is_dir() else [path]
    return sorted(".".join(("rolloutgate", *p.relative_to(PACKAGE).with_suffix("").parts)) for p in found)


def fresh_clone(target: Path) -> Path:
    listed = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    return target


@pytest.mark.timeout(900)
def test_pip_install_runs_the_compiled_modules(tmp_path: Path) -> None:
    tree = fresh_clone(tmp_path / "tree")
    assert not list((tree / "src").rglob("*.so")), "the copy must not carry this checkout's build"
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", str(tree)], check=True, cwd=tmp_path)
    report = json.loads(
        subprocess.run([str(python), "-c", _REPORT], check=True, capture_output=True, cwd=tmp_path).stdout
    )
    assert str(venv) in report["file"], report  # the installed package, not this checkout
    expected = expected_modules()
    assert report["modules"] == expected
    assert report["line"].startswith(
        f"compiled by mypyc: {sum('.core.' in m for m in expected)} core modules"
    )
    # and what `make` built beside the sources here, when it did, is the same set
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    built = sorted(
        ".".join(("rolloutgate", *p.relative_to(PACKAGE).parts)).removesuffix(suffix)
        for p in PACKAGE.rglob(f"*{suffix}")
    )
    assert not built or built == expected, built
    # the wheel holds the package alone: no benchmarks (benchmarks/ stays in the repository), no tests
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    (record,) = site.glob("rolloutgate-*.dist-info/RECORD")
    installed = {line.split(",", 1)[0].split("/", 1)[0] for line in record.read_text().splitlines()}
    assert {"rolloutgate", "rolloutsim", "rolloutreplay"} <= installed, sorted(installed)  # the siblings too
    assert not installed & {"benchmarks", "tests"}, sorted(installed)
    for command in ("sim", "replay"):  # each sibling's subcommand runs from the installed wheel
        shown = subprocess.run(
            [str(venv / "bin" / "rolloutgate"), command, "--help"],
            capture_output=True,
            text=True,
            cwd=tmp_path,
        )
        assert shown.returncode == 0 and "usage: rolloutgate" in shown.stdout, shown.stderr
    assert not (site / "benchmarks").exists() and not (site / "rolloutgate" / "bench").exists()
