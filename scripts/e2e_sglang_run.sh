#!/usr/bin/env bash
# Start two real SGLang 0.5.9 engines on loopback, run the end-to-end suite against them, stop them whatever
# happens (`make test-e2e-sglang`, docs/e2e.md). The SGLang twin of scripts/e2e_run.sh (vLLM).
#
# Called once .venv-sglang (scripts/sglang_env.sh) and the tiny model (built with that venv's transformers 4.57)
# exist; arguments are passed to pytest. Each engine runs in its own process group and its own working folder
# (SGLang writes `sglang_storage` beside itself), with its log, PID file, temp and cache folders under the work
# folder; the EXIT trap stops each group by its PID (SIGTERM, then SIGKILL after 30 s). Ports are the OS's:
# never SGLang's default 30000.
#
# Environment: SGLANG_VENV (.venv-sglang), VENV (.venv: runs pytest, the gateway and the clients), E2E_DIR
# (.e2e-sglang), E2E_MAX_NUM_SEQS (4), E2E_MAX_MODEL_LEN (8192), E2E_START_TIMEOUT (240 s), E2E_ENGINE_NICE (10).
set -euo pipefail
cd "$(dirname "$0")/.."

SGLANG_VENV=${SGLANG_VENV:-.venv-sglang}
VENV=${VENV:-.venv}
WORK=$(mkdir -p "${E2E_DIR:-.e2e-sglang}" && cd "${E2E_DIR:-.e2e-sglang}" && pwd)
MODEL=$WORK/model
MAX_NUM_SEQS=${E2E_MAX_NUM_SEQS:-4}
MAX_MODEL_LEN=${E2E_MAX_MODEL_LEN:-8192}
START_TIMEOUT=${E2E_START_TIMEOUT:-240}
ENGINE_NICE=${E2E_ENGINE_NICE:-10}  # as in scripts/e2e_run.sh: the engines must not starve the gateway
ENGINES=2

log() { printf '[e2e-sglang %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

[ -f "$MODEL/config.json" ] || { log "no model at $MODEL: run 'make e2e-sglang-model'"; exit 2; }
[ -x "$SGLANG_VENV/bin/python" ] || { log "no engine venv at $SGLANG_VENV: run 'make e2e-sglang-env'"; exit 2; }
[ -x "$VENV/bin/python" ] || { log "no project venv at $VENV: run 'make venv'"; exit 2; }
SGLANG_VENV=$(cd "$SGLANG_VENV" && pwd)
VENV=$(cd "$VENV" && pwd)

is_our_engine() {  # PID: alive and still the SGLang server we started (PIDs are reused)
    [ -r "/proc/$1/cmdline" ] && tr '\0' ' ' <"/proc/$1/cmdline" | grep -q 'sglang.launch_server'
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

read -r -a PORTS <<<"$("$VENV/bin/python" - <<'PY'
import socket
socks = [socket.socket() for _ in range(2)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
PY
)"
read -r -a CPUS <<<"$("$VENV/bin/python" -c 'import os; c = sorted(os.sched_getaffinity(0)); print(c[0], c[1 % len(c)])')"

# The launch command the suite's own extra engine uses too (tests/e2e/harness.py start_sglang_engine): keep
# both in step. Flags from reference/real-sglang.md; --served-model-name so both backends serve "tiny".
start_engine() {  # index port cpu
    local i=$1 port=$2 cpu=$3 dir=$WORK/engine-$1
    mkdir -p "$dir/tmp" "$dir/cache"
    (
        cd "$dir"
        env HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 DO_NOT_TRACK=1 SGLANG_USE_CPU_ENGINE=1 \
            OMP_NUM_THREADS=1 TMPDIR="$dir/tmp" XDG_CACHE_HOME="$dir/cache" \
            setsid nice -n "$ENGINE_NICE" taskset -c "$cpu" "$SGLANG_VENV/bin/python" -m sglang.launch_server \
            --model-path "$MODEL" --served-model-name tiny --host 127.0.0.1 --port "$port" \
            --device cpu --attention-backend torch_native --sampling-backend pytorch --disable-overlap-schedule \
            --dtype float32 --context-length "$MAX_MODEL_LEN" --max-running-requests "$MAX_NUM_SEQS" \
            --max-total-tokens 65536 --enable-metrics ${E2E_ENGINE_ARGS:-} \
            </dev/null >"$WORK/engine-$i.log" 2>&1 &
        echo $! >"$WORK/run/engine-$i.pid"  # setsid, nice and taskset exec in place: this is the server
    )
    log "engine $i: pid $(cat "$WORK/run/engine-$i.pid"), http://127.0.0.1:$port, cpu $cpu, log $WORK/engine-$i.log"
}

started=$SECONDS
URLS=()
for i in $(seq 0 $((ENGINES - 1))); do
    start_engine "$i" "${PORTS[$i]}" "${CPUS[$i]}"
    URLS+=("http://127.0.0.1:${PORTS[$i]}")
done

for i in $(seq 0 $((ENGINES - 1))); do
    while ! curl -sf -o /dev/null --max-time 10 "${URLS[$i]}/health"; do
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

for i in $(seq 0 $((ENGINES - 1))); do
    pid=$(cat "$WORK/run/engine-$i.pid")
    if [ -w "/proc/$pid/autogroup" ] && [ "$(ps -o sid= -p "$pid" | tr -d ' ')" = "$pid" ]; then
        echo "$ENGINE_NICE" >"/proc/$pid/autogroup" 2>/dev/null || log "engine $i: could not nice its autogroup"
    fi
done

set +e
E2E_BACKEND=sglang \
    E2E_ENGINE_URLS=$(IFS=,; echo "${URLS[*]}") \
    E2E_MAX_NUM_SEQS=$MAX_NUM_SEQS \
    E2E_ENGINE_PYTHON=$SGLANG_VENV/bin/python \
    E2E_MODEL_DIR=$MODEL \
    E2E_LOG_DIR=$WORK \
    LITELLM_LOCAL_MODEL_COST_MAP=True \
    "$VENV/bin/python" -m pytest -m e2e tests/e2e "$@"
status=$?
set -e
log "pytest exited $status after $((SECONDS - started)) s in all; stopping the engines"
exit "$status"
