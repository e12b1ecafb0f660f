#!/usr/bin/env bash
# Start two real vLLM engines on loopback, run the end-to-end suite against them, stop them whatever happens.
#
# Called by `make test-e2e` once .venv-e2e (the engine) and .e2e/model (the tiny model) exist; arguments are
# passed to pytest. Each engine runs in its own process group, with its log, PID file, temp and cache folders
# under the work folder; the EXIT trap stops each group by its PID (SIGTERM, then SIGKILL after 30 s), so an
# engine never outlives the run, whether pytest passed, failed or the run was interrupted. What both engines'
# scripts share: scripts/e2e_lib.sh.
#
# Environment: E2E_VENV (.venv-e2e), VENV (.venv: runs pytest, the gateway and the clients), E2E_DIR (.e2e),
# E2E_MAX_NUM_SEQS (4), E2E_MAX_MODEL_LEN (8192), E2E_START_TIMEOUT (240 s), E2E_ENGINE_NICE (10).
set -euo pipefail
cd "$(dirname "$0")/.."

E2E_VENV=${E2E_VENV:-.venv-e2e}
VENV=${VENV:-.venv}
WORK=$(mkdir -p "${E2E_DIR:-.e2e}" && cd "${E2E_DIR:-.e2e}" && pwd)
MODEL=$WORK/model
MAX_NUM_SEQS=${E2E_MAX_NUM_SEQS:-4}
MAX_MODEL_LEN=${E2E_MAX_MODEL_LEN:-8192}
START_TIMEOUT=${E2E_START_TIMEOUT:-240}
ENGINE_NICE=${E2E_ENGINE_NICE:-10}
LOG_TAG=e2e
ENGINE_PATTERN=vllm.entrypoints.openai.api_server
source scripts/e2e_lib.sh

[ -f "$MODEL/config.json" ] || { log "no model at $MODEL: run 'make e2e-model'"; exit 2; }
[ -x "$E2E_VENV/bin/python" ] || { log "no engine venv at $E2E_VENV: run 'make e2e-env'"; exit 2; }
[ -x "$VENV/bin/python" ] || { log "no project venv at $VENV: run 'make venv'"; exit 2; }
E2E_VENV=$(cd "$E2E_VENV" && pwd)
VENV=$(cd "$VENV" && pwd)
ENGINE_PYTHON=$E2E_VENV/bin/python

start_engine() {  # index port cpu
    local i=$1 port=$2 cpu=$3 dir=$WORK/engine-$1
    mkdir -p "$dir/tmp" "$dir/cache"
    env HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
        VLLM_SERVER_DEV_MODE=1 VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND="$cpu" \
        TMPDIR="$dir/tmp" VLLM_RPC_BASE_PATH="$dir/tmp" VLLM_CACHE_ROOT="$dir/cache" \
        setsid nice -n "$ENGINE_NICE" "$ENGINE_PYTHON" -m vllm.entrypoints.openai.api_server \
        --model "$MODEL" --host 127.0.0.1 --port "$port" --served-model-name tiny --dtype float32 \
        --max-model-len "$MAX_MODEL_LEN" --enforce-eager --enable-request-id-headers --enable-scale-out --max-num-seqs "$MAX_NUM_SEQS" ${E2E_ENGINE_ARGS:-} \
        </dev/null >"$WORK/engine-$i.log" 2>&1 &
    echo $! >"$WORK/run/engine-$i.pid"  # setsid and nice exec in place: this is the server, leader of its group
}

e2e_prepare
e2e_start_engines
e2e_pytest vllm "$@"
