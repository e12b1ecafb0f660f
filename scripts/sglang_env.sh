#!/usr/bin/env bash
# Build .venv-sglang: real SGLang 0.5.9 on the CPU, for `make test-e2e-sglang` (docs/e2e.md).
#
# SGLang is not modified. What this venv holds (none of it committed: the venv is gitignored):
#   1. torch 2.13.0+cpu from the machine's local wheels (pip's find-links); sglang 0.5.9 pins torch 2.9.1, which
#      exists only as a CUDA build on the index, so it is installed first and the pin is not followed;
#   2. sglang==0.5.9 and torchvision==0.28.0 with --no-deps (their own requirements pull CUDA builds);
#   3. 0.5.9's CPU-usable dependencies, every version pinned, --no-deps (scripts/sglang_cpu/requirements.txt:
#      its requirements less the GPU ones);
#   4. STAND-IN 1, an import-only `sgl_kernel` package (scripts/sglang_cpu/sgl_kernel): not SGLang's kernels.
#      SGLang's CPU kernels are not on the index and the sgl-kernel wheels that are need a GPU to import;
#      0.5.9 with `--device cpu --attention-backend torch_native` imports the package but calls none of its
#      kernels (it registers no torch op, so SGLang's capability checks find none); any call would raise
#      NotImplementedError;
#   5. STAND-IN 2, torchvision's `_meta_registrations.py` with its `nms`/`qnms` fake registrations made
#      conditional on `torchvision.extension._has_ops()`, as its other registrations already are
#      (scripts/sglang_cpu/patch_torchvision.py): the index's torchvision is a CUDA build whose ops do not load
#      next to CPU torch, and the unconditional registrations make `import torchvision` fail, which SGLang does
#      while reading model configs.
# A stamp file (.installed-sglang-0.5.9) makes a second run a no-op; the script checks the imports last.
#
# Environment: SGLANG_VENV (.venv-sglang), PYTHON (python3).
set -euo pipefail
cd "$(dirname "$0")/.."

SGLANG_VERSION=0.5.9
TORCH=torch==2.13.0+cpu
TORCHVISION=torchvision==0.28.0
VENV=${SGLANG_VENV:-.venv-sglang}
PYTHON=${PYTHON:-python3}
STAMP=$VENV/.installed-sglang-$SGLANG_VERSION
HERE=scripts/sglang_cpu

log() { printf '[sglang-env %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

if [ -f "$STAMP" ]; then
    log "$VENV has sglang $SGLANG_VERSION (stamp $STAMP): nothing to do"
    exit 0
fi
started=$SECONDS
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PY=$VENV/bin/python
log "1/5 $TORCH from the local wheels"
"$PY" -m pip install -q "$TORCH"
log "2/5 sglang==$SGLANG_VERSION and $TORCHVISION, --no-deps"
"$PY" -m pip install -q --no-deps "sglang==$SGLANG_VERSION" "$TORCHVISION"
log "3/5 sglang $SGLANG_VERSION's CPU-usable dependencies, pinned, --no-deps"
"$PY" -m pip install -q --no-deps -r "$HERE/requirements.txt"

SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
log "4/5 stand-in: import-only sgl_kernel into $SITE (not SGLang's kernels)"
rm -rf "$SITE/sgl_kernel"
cp -r "$HERE/sgl_kernel" "$SITE/sgl_kernel"
find "$SITE/sgl_kernel" -name '__pycache__' -prune -exec rm -rf {} +
log "5/5 stand-in: torchvision's nms/qnms fake registrations made conditional"
"$PY" "$HERE/patch_torchvision.py"

# SGLang's server module imports the model runner, the scheduler and torchvision: if it imports, it starts.
"$PY" -c 'import torch, torchvision, transformers, sgl_kernel.kvcacheio, sglang.launch_server, sglang.srt.entrypoints.http_server; print("torch", torch.__version__, "transformers", transformers.__version__)'
touch "$STAMP"
log "done in $((SECONDS - started)) s; $(du -sh "$VENV" | cut -f1) in $VENV"
