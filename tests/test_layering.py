"""Layering: core/ imports only the standard library and rolloutgate.core, and never time, random, asyncio,
logging or aiohttp (STYLE.md, conventions 1 and 2); the package and its siblings never import the benchmarks
beside them (benchmarks/, not in the wheel). Checked on the source's AST, so a lazy or conditional import is caught too, and
a module named in a string (importlib, the CLI's subcommand table) as well."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "rolloutgate"
CORE = PACKAGE / "core"
FORBIDDEN = {"time", "random", "asyncio", "logging", "aiohttp"}
CORE_FILES = sorted(CORE.rglob("*.py"))
PACKAGE_FILES = sorted(PACKAGE.rglob("*.py"))


def imported_modules(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                found.append("rolloutgate.core")  # relative imports stay inside the package
            elif node.module:
                found.append(node.module)
    return found


def test_core_has_modules() -> None:
    assert len(CORE_FILES) > 10


@pytest.mark.parametrize("path", CORE_FILES, ids=lambda p: str(p.relative_to(CORE)))
def test_core_imports_only_stdlib_and_core(path: Path) -> None:
    for module in imported_modules(path):
        top = module.split(".")[0]
        assert top not in FORBIDDEN, f"{path.name} imports {module}"
        if top == "rolloutgate":
            assert module == "rolloutgate.core" or module.startswith("rolloutgate.core."), (
                f"{path.name} imports {module}"
            )
        else:
            assert top in sys.stdlib_module_names or top == "__future__", (
                f"{path.name} imports non-stdlib {module}"
            )


def test_the_checker_catches_violations(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    import time\n    from rolloutgate.server import app\n")
    assert imported_modules(bad) == ["time", "rolloutgate.server"]


def named_modules(path: Path) -> list[str]:
    """What `path` imports, plus every string in it that names a module of the benchmarks (`importlib`)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    strings = [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and (node.value == "benchmarks" or node.value.startswith("benchmarks."))
    ]
    return imported_modules(path) + strings


# What the wheel ships: the gateway and its two siblings (the simulator, the incident replay).
SHIPPED_FILES = sorted(
    path
    for name in ("rolloutgate", "rolloutsim", "rolloutreplay")
    for path in (PACKAGE.parent / name).rglob("*.py")
)


@pytest.mark.parametrize("path", SHIPPED_FILES, ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_the_package_never_imports_the_benchmarks(path: Path) -> None:
    for module in named_modules(path):
        assert module.split(".")[0] != "benchmarks", f"{path.relative_to(PACKAGE.parent)} imports {module}"


def test_the_benchmark_checker_catches_a_lazy_import_and_a_named_module(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        'def f():\n    from benchmarks.kit import stats\n\nTABLE = {"bench": "benchmarks.perf.cli"}\n'
    )
    assert named_modules(bad) == ["benchmarks.kit", "benchmarks.perf.cli"]


# The parts below the edge, and what each may not import: the parts above it (server/ is the HTTP edge that
# composes them; fleet/, cli and top/ sit above that). sessions/ is pure: the edge gives it HTTP.
ABOVE = ("rolloutgate.server", "rolloutgate.fleet", "rolloutgate.cli", "rolloutgate.top")
LAYER_RULES: dict[str, tuple[str, ...]] = {
    "engines": (*ABOVE, "rolloutgate.sessions", "rolloutsim", "aiohttp.web"),
    "sessions": (*ABOVE, "rolloutgate.engines", "rolloutsim", "aiohttp"),
}
LAYERED_FILES = [(part, path) for part in LAYER_RULES for path in sorted((PACKAGE / part).rglob("*.py"))]


def _is_within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


@pytest.mark.parametrize(
    ("part", "path"), LAYERED_FILES, ids=lambda v: str(v.relative_to(PACKAGE)) if isinstance(v, Path) else v
)
def test_each_part_imports_nothing_above_it(part: str, path: Path) -> None:
    for module in imported_modules(path):
        for forbidden in LAYER_RULES[part]:
            assert not _is_within(module, forbidden), (
                f"{path.relative_to(PACKAGE)} ({part}/) imports {module}"
            )


def test_the_layer_rules_cover_real_parts() -> None:
    assert all((PACKAGE / part).is_dir() for part in LAYER_RULES)
    assert not _is_within("rolloutgate.serverless", "rolloutgate.server")
    assert _is_within("aiohttp.web", "aiohttp") and _is_within("rolloutgate.server.app", "rolloutgate.server")


# The simulator is a sibling package (src/rolloutsim): it takes from rolloutgate only two leaf modules (the loop
# clock, and the vocabulary of a model folder), and the product imports it only where it runs engines on
# purpose: `serve --sim` (server/app.py; with `--processes N`, fleet/processes.py: the parent runs them) and the
# `sim` subcommand (cli.py).
SIM = PACKAGE.parent / "rolloutsim"
SIM_MAY_IMPORT = ("rolloutgate.runtime_clock", "rolloutgate.vocabulary")
SIM_IMPORTERS = {PACKAGE / "cli.py", PACKAGE / "server" / "app.py", PACKAGE / "fleet" / "processes.py"}


@pytest.mark.parametrize("path", sorted(SIM.rglob("*.py")), ids=lambda p: str(p.relative_to(SIM)))
def test_the_simulator_takes_only_leaf_modules_of_the_gateway(path: Path) -> None:
    for module in named_modules(path) + imported_modules(path):
        if _is_within(module, "rolloutgate"):
            assert any(_is_within(module, allowed) for allowed in SIM_MAY_IMPORT), (
                f"rolloutsim/{path.name}: {module}"
            )


def test_the_gateway_imports_the_simulator_only_where_it_runs_engines() -> None:
    importers = set()
    for path in PACKAGE_FILES:
        modules = imported_modules(path) + [
            node.value
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and _is_within(node.value, "rolloutsim")
        ]
        if any(_is_within(m, "rolloutsim") for m in modules):
            importers.add(path)
    assert importers and importers <= SIM_IMPORTERS, sorted(
        str(p.relative_to(PACKAGE)) for p in importers - SIM_IMPORTERS
    )


# The incident replay is a sibling above both (src/rolloutreplay: it runs the gateway in front of the simulator).
# The gateway names it only in its subcommand table (cli.py, imported when `rolloutgate replay` runs), and the
# simulator never.
REPLAY = PACKAGE.parent / "rolloutreplay"


def _names_the_replay(path: Path) -> bool:
    modules = imported_modules(path) + [
        node.value
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    ]
    return any(_is_within(m, "rolloutreplay") for m in modules)


def test_only_the_subcommand_table_names_the_replay() -> None:
    assert REPLAY.is_dir() and not (PACKAGE / "replay").exists()
    named_by = {path for path in [*PACKAGE_FILES, *SIM.rglob("*.py")] if _names_the_replay(path)}
    assert named_by == {PACKAGE / "cli.py"}, sorted(str(p) for p in named_by)
