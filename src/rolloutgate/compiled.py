"""Which of rolloutgate's modules run compiled: the C extensions mypyc built at install (setup.py)."""

from __future__ import annotations

import importlib.machinery
import sys

__all__ = ("compiled_modules", "describe_build")


def compiled_modules() -> list[str]:
    """The loaded rolloutgate modules that are C extensions, sorted."""
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    return sorted(
        name
        for name, module in list(sys.modules.items())
        if name.startswith("rolloutgate.") and str(getattr(module, "__file__", "")).endswith(suffixes)
    )


def describe_build() -> str:
    """One line for the startup log: which modules run compiled, or that none does."""
    compiled = compiled_modules()
    if not compiled:
        return "interpreted: no module of rolloutgate is compiled (installed without its build step)"
    core = sum(1 for name in compiled if name.startswith("rolloutgate.core."))
    edge = [
        name.removeprefix("rolloutgate.") for name in compiled if not name.startswith("rolloutgate.core.")
    ]
    return f"compiled by mypyc: {core} core modules and {', '.join(edge) or 'no edge module'}"
