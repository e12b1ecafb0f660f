# What scripts/e2e_run.sh (vLLM) and scripts/e2e_sglang_run.sh (SGLang) share, sourced by both: two engines on
# loopback ports the OS gives, one CPU each, in their own process groups; the suite run against them; the
# engines stopped whatever happens.
#
# The sourcing script sets WORK (absolute), VENV (absolute), ENGINE_PYTHON, MODEL, MAX_NUM_SEQS, START_TIMEOUT,
# ENGINE_NICE, LOG_TAG (the log lines' prefix) and ENGINE_PATTERN (what its server's command line holds), and
# defines `start_engine INDEX PORT CPU`, which starts one engine in the background in its own session and writes
# its PID to $WORK/run/engine-INDEX.pid. Then: `e2e_prepare`, `e2e_start_engines`, `e2e_pytest BACKEND ARGS...`.

ENGINES=2

log() { printf '[%s %s] %s\n' "$LOG_TAG" "$(date +%H:%M:%S)" "$*" >&2; }

is_our_engine() {  # PID: alive and still the server we started (PIDs are reused)
    [ -r "/proc/$1/cmdline" ] && tr '\0' ' ' <"/proc/$1/cmdline" | grep -q "$ENGINE_PATTERN"
}

# Each engine group by its PID: SIGTERM, then SIGKILL after 30 s.
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
e2e_prepare() {
    mkdir -p "$WORK/run"
    stop_engines
    trap stop_engines EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
}

# Starts the engines and waits until each answers /health; sets URLS and `started` (SECONDS at the start).
# Two free loopback ports (held together while chosen, so they differ) and one CPU per engine: the engines'
# automatic binding would pin both to the same first core. Once healthy, each engine's scheduling group is
# niced (ENGINE_NICE): at full decode the CPU engines starved the gateway under test for seconds at a time
# (measured: /health took 10 s while 8 streams ran), so a client's read timeout fired for lack of CPU, not for
# lack of keep-alive; niced engines leave the gateway the CPU it needs, as a GPU engine on another machine
# would. Each engine leads its own session, so where the kernel groups sessions for scheduling
# (sched_autogroup) a plain nice value counts only inside the engine's group: the group itself is niced through
# /proc/PID/autogroup, once the engine surely leads its session (right after the fork it may still be in this
# script's group, that of the gateway and the tests).
e2e_start_engines() {
    local i pid
    read -r -a PORTS <<<"$("$VENV/bin/python" - <<'PY'
import socket
socks = [socket.socket() for _ in range(2)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
PY
)"
    read -r -a CPUS <<<"$("$VENV/bin/python" -c 'import os; c = sorted(os.sched_getaffinity(0)); print(c[0], c[1 % len(c)])')"
    started=$SECONDS
    URLS=()
    for i in $(seq 0 $((ENGINES - 1))); do
        start_engine "$i" "${PORTS[$i]}" "${CPUS[$i]}"
        log "engine $i: pid $(cat "$WORK/run/engine-$i.pid"), http://127.0.0.1:${PORTS[$i]}, cpu ${CPUS[$i]}, log $WORK/engine-$i.log"
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
}

# The suite against the engines (tests/e2e/harness.py reads these); exits with pytest's status.
e2e_pytest() {
    local backend=$1 status
    shift
    set +e
    E2E_BACKEND=$backend \
        E2E_ENGINE_URLS=$(IFS=,; echo "${URLS[*]}") \
        E2E_MAX_NUM_SEQS=$MAX_NUM_SEQS \
        E2E_ENGINE_PYTHON=$ENGINE_PYTHON \
        E2E_MODEL_DIR=$MODEL \
        E2E_LOG_DIR=$WORK \
        LITELLM_LOCAL_MODEL_COST_MAP=True \
        "$VENV/bin/python" -m pytest -m e2e tests/e2e "$@"
    status=$?
    set -e
    log "pytest exited $status after $((SECONDS - started)) s in all; stopping the engines"
    exit "$status"
}
