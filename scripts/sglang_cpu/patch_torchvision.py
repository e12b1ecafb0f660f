"""Make torchvision's `nms`/`qnms` fake registrations conditional, in the venv this interpreter runs.

Run by rolloutgate's scripts/sglang_env.sh with .venv-sglang's Python (docs/e2e.md). The torchvision wheel on
the package index is built for CUDA torch; next to the CPU torch its compiled ops do not load, and its
`_meta_registrations.py` still registers fakes for `torchvision::nms` and `torchvision::qnms` unconditionally,
so `import torchvision` fails ("operator torchvision::nms does not exist"). SGLang imports torchvision while it
reads model configs. Its other registrations are already guarded by `torchvision.extension._has_ops()`; this
guards these two the same way, and changes nothing else. Idempotent: a patched file is left as it is.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

MARK = "# rolloutgate: registered only when torchvision's ops loaded"
GUARD = "(torch.library.register_fake({op!r}) if torchvision.extension._has_ops() else (lambda fn: fn))"


def main() -> int:
    spec = importlib.util.find_spec("torchvision")  # finds the package without importing it (that fails)
    if spec is None or not spec.submodule_search_locations:
        print("torchvision is not installed here", file=sys.stderr)
        return 2
    path = Path(next(iter(spec.submodule_search_locations))) / "_meta_registrations.py"
    text = path.read_text()
    if MARK in text:
        print(f"{path}: already patched", file=sys.stderr)
        return 0
    for op in ("torchvision::nms", "torchvision::qnms"):
        old = f'@torch.library.register_fake("{op}")\n'
        if text.count(old) != 1:
            print(f"{path}: expected one {old.strip()!r}; this torchvision differs, patch by hand", file=sys.stderr)
            return 1
        text = text.replace(old, f"{MARK}\n@{GUARD.format(op=op)}\n")
    path.write_text(text)
    print(f"{path}: nms/qnms fake registrations made conditional", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
