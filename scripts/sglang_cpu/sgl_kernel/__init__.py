"""An import-only stand-in for SGLang's `sgl_kernel` package: NOT SGLang's kernels.

Written into .venv-sglang by rolloutgate's scripts/sglang_env.sh (docs/e2e.md). SGLang's CPU kernels are not on
the package index and the `sgl-kernel` wheels that are need a GPU to import. SGLang 0.5.9 started with
`--device cpu --attention-backend torch_native` imports this package (e.g. `sglang.srt.mem_cache` imports
`sgl_kernel.kvcacheio`) but calls none of its kernels: it looks for `torch.ops.sgl_kernel.*`, finds none (this
package registers no torch op) and takes its torch-native paths. Every attribute is a function that raises
NotImplementedError, so a kernel call, should one ever happen, fails loudly instead of computing anything.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

__version__ = "0.0.0+rolloutgate.standin"


def _missing(qualname: str) -> Callable[..., NoReturn]:
    def kernel(*_args: Any, **_kwargs: Any) -> NoReturn:
        raise NotImplementedError(
            f"{qualname}: sgl_kernel here is rolloutgate's import-only stand-in (no SGLang kernel is installed)"
        )

    kernel.__name__ = qualname.rsplit(".", 1)[-1]
    kernel.__qualname__ = qualname
    return kernel


def __getattr__(name: str) -> Any:
    if name.startswith("__"):  # module protocol look-ups (__path__, __wrapped__, ...) must stay absent
        raise AttributeError(name)
    return _missing(f"sgl_kernel.{name}")
