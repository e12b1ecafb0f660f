"""`sgl_kernel.kvcacheio` of rolloutgate's import-only stand-in (see the package docstring): every attribute
raises NotImplementedError when called. SGLang 0.5.9's host KV pool imports its transfer functions at load."""

from __future__ import annotations

from typing import Any

from sgl_kernel import _missing


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return _missing(f"sgl_kernel.kvcacheio.{name}")
