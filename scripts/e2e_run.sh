#!/usr/bin/env bash
# Start two real vLLM engines on loopback, run the end-to-end suite against them, stop them whatever happens.
#
# Called by `make test-e2e` once .venv-e2e (the engine) and .e2e/model (the tiny model) exist; arguments are
# passed to pytest. Each engine runs in its own process group, with its log, PID file, temp and cache folders
# under the work folder; the EXIT trap stops each group by its PID (SIGTERM, then SIGKILL after 30 s), so an
# engine never outlives the run, whether pytest passed, failed or the run was interrupted.
#
# Environment: E2E_VENV (.venv-e2e), VENV (.venv: runs pytest, the gateway and the clients), E2E_DIR (.e2e),
# E2E_MAX_NUM_SEQS (4), E2E_MAX_MODEL_LEN (8192), E2E_START_TIMEOUT (240 s).
set -euo pipefail
cd "$(dirname "$0")/.."

E2E_VENV=${E2E_VENV:-.venv-e2e}
VENV=${VENV:-.venv}
WORK=$(mkdir -p "${E2E_DIR:-.e2e}" && cd "${E2E_DIR:-.e2e}" && pwd)
MODEL=$WORK/model
MAX_NUM_SEQS=${E2E_MAX_NUM_SEQS:-4}
MAX_MODEL_LEN=${E2E_MAX_MODEL_LEN:-8192}
START_TIMEOUT=${E2E_START_TIMEOUT:-240}
ENGINES=2
# The engines share this machine's cores with the gateway and the test clients under test: at full decode their
# busy CPU workers starved the gateway for seconds at a time (measured: /health took 10 s while 8 streams ran),
# so a client's 2 s read timeout fired for lack of CPU, not for lack of keep-alive. Niced engines leave the
# gateway the CPU it needs, as a GPU engine on another machine would. Each engine runs in its own session
# (setsid), so where the kernel groups sessions for scheduling (sched_autogroup) a plain nice value counts only
# inside the engine's group: the group itself is niced through /proc/PID/autogroup.
ENGINE_NICE=${E2E_ENGINE_NICE:-10}

log() { printf '[e2e %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

[ -f "$MODEL/config.json" ] || { log "no model at $MODEL: run 'make e2e-model'"; exit 2; }
[ -x "$E2E_VENV/bin/python" ] || { log "no engine venv at $E2E_VENV: run 'make e2e-env'"; exit 2; }
[ -x "$VENV/bin/python" ] || { log "no project venv at $VENV: run 'make venv'"; exit 2; }
E2E_VENV=$(cd "$E2E_VENV" && pwd)
VENV=$(cd "$VENV" && pwd)

is_our_engine() {  # PID: alive and still the vLLM server we started (PIDs are reused)
    [ -r "/proc/$1/cmdline" ] && tr '\0' ' ' <"/proc/$1/cmdline" | grep -q 'vllm.entrypoints.openai.api_server'
}

stop_engines() {
    local pidfile pid waited
    for pidfile in "$WORK"/run/engine-*.pid; do
        [ -f "$pidfile" ] || continue
        pid=$(cat "$pidfile")
        if is_our_engine "$pid"; then
            kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
        fi
    done
    for pidfile in "$WORK"/run/engine-*.pid; do
        [ -f "$pidfile" ] || continue
        pid=$(cat "$pidfile")
        waited=0
        while kill -0 -- "-$pid" 2>/dev/null && [ "$waited" -lt 60 ]; do sleep 0.5; waited=$((waited + 1)); done
        if kill -0 -- "-$pid" 2>/dev/null; then
            log "engine group $pid ignored SIGTERM for 30 s: SIGKILL"
            kill -KILL -- "-$pid" 2>/dev/null || true
        fi
        rm -f "$pidfile"
    done
}

# A previous run killed with SIGKILL cannot have run its trap: stop what its PID files name first.
mkdir -p "$WORK/run"
stop_engines
trap stop_engines EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Two free loopback ports (held together while chosen, so they differ) and one CPU per engine: vLLM's
# automatic binding would pin both engines' workers to the same first core.
read -r -a PORTS <<<"$("$VENV/bin/python" - <<'EOF'
import socket
socks = [socket.socket() for _ in range(2)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
EOF
)"
read -r -a CPUS <<<"$("$VENV/bin/python" -c 'import os; c = sorted(os.sched_getaffinity(0)); print(c[0], c[1 % len(c)])')"

start_engine() {  # index port cpu
    local i=$1 port=$2 cpu=$3 dir=$WORK/engine-$1
    mkdir -p "$dir/tmp" "$dir/cache"
    env HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
        VLLM_SERVER_DEV_MODE=1 VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND="$cpu" \
        TMPDIR="$dir/tmp" VLLM_RPC_BASE_PATH="$dir/tmp" VLLM_CACHE_ROOT="$dir/cache" \
        setsid nice -n "$ENGINE_NICE" "$E2E_VENV/bin/python" -m vllm.entrypoints.openai.api_server \
        --model "$MODEL" --host 127.0.0.1 --port "$port" --served-model-name tiny --dtype float32 \
        --max-model-len "$MAX_MODEL_LEN" --enforce-eager --enable-request-id-headers --max-num-seqs "$MAX_NUM_SEQS" ${E2E_ENGINE_ARGS:-} \
        </dev/null >"$WORK/engine-$i.log" 2>&1 &
    echo $! >"$WORK/run/engine-$i.pid"  # setsid and nice exec in place: this is the server, leader of its group
    log "engine $i: pid $!, http://127.0.0.1:$port, cpu $cpu, log $WORK/engine-$i.log"
}

started=$SECONDS
URLS=()
for i in $(seq 0 $((ENGINES - 1))); do
    start_engine "$i" "${PORTS[$i]}" "${CPUS[$i]}"
    URLS+=("http://127.0.0.1:${PORTS[$i]}")
done

for i in $(seq 0 $((ENGINES - 1))); do
    while ! curl -sf -o /dev/null "${URLS[$i]}/health"; do
        if ! is_our_engine "$(cat "$WORK/run/engine-$i.pid")"; then
            log "engine $i exited during startup; last lines of its log:"
            tail -n 40 "$WORK/engine-$i.log" >&2
            exit 1
        fi
        if [ $((SECONDS - started)) -ge "$START_TIMEOUT" ]; then
            log "engine $i not healthy after ${START_TIMEOUT} s; last lines of its log:"
            tail -n 40 "$WORK/engine-$i.log" >&2
            exit 1
        fi
        sleep 1
    done
done
log "both engines healthy after $((SECONDS - started)) s"

# Nice each engine's scheduling group once the engine surely leads its own session (right after the fork,
# /proc/PID/autogroup may still be this script's group, that of the gateway and the tests).
for i in $(seq 0 $((ENGINES - 1))); do
    pid=$(cat "$WORK/run/engine-$i.pid")
    if [ -w "/proc/$pid/autogroup" ] && [ "$(ps -o sid= -p "$pid" | tr -d ' ')" = "$pid" ]; then
        echo "$ENGINE_NICE" >"/proc/$pid/autogroup" 2>/dev/null || log "engine $i: could not nice its autogroup"
    fi
done

set +e
E2E_BACKEND=vllm \
    E2E_ENGINE_URLS=$(IFS=,; echo "${URLS[*]}") \
    E2E_MAX_NUM_SEQS=$MAX_NUM_SEQS \
    E2E_ENGINE_PYTHON=$E2E_VENV/bin/python \
    E2E_LOG_DIR=$WORK \
    LITELLM_LOCAL_MODEL_COST_MAP=True \
    "$VENV/bin/python" -m pytest -m e2e tests/e2e "$@"
status=$?
set -e
log "pytest exited $status after $((SECONDS - started)) s in all; stopping the engines"
exit "$status"
