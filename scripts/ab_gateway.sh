#!/usr/bin/env bash
# A/B of the gateway's hot path: the code at <base> (a commit) against the working tree, in turns, on the same
# simulated engine, in the same minutes. Prints req/s, p50 and the gateway's CPU per request for each run and
# the medians; the CPU per request is the measure the machine's other load moves least.
#
#   scripts/ab_gateway.sh <base> [plain|stream] [connections] [seconds] [rounds] [prompt ids]
#   scripts/ab_gateway.sh HEAD~3 stream 1 4 4
#   scripts/ab_gateway.sh HEAD~1 plain 4 4 3 60000    # miles' prompt size: 60K ids below Qwen's vocabulary
#
# Pinning as in `make bench`: each gateway alone on CPU 0, the engine (the simulator's `fast` profile) and
# wrk on CPU 1. Each side runs its compiled modules: the base is built in its worktree (setup.py build_ext
# --inplace; scripts/build_native.py before 2026-12-02), the working tree is as `make native` left it. Needs wrk, taskset and gcc; the project's .venv (make test).
# Servers bind to 127.0.0.1.
set -euo pipefail

base=${1:?usage: scripts/ab_gateway.sh <base-commit> [plain|stream] [connections] [seconds] [rounds] [prompt ids]}
mode=${2:-plain}
conns=${3:-32}
secs=${4:-4}
rounds=${5:-3}
prompt_ids=${6:-16}
root=$(cd "$(dirname "$0")/.." && pwd)
python=$root/.venv/bin/python
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; git -C "$root" worktree remove --force "$work/base" >/dev/null 2>&1 || true; rm -rf "$work"' EXIT

git -C "$root" worktree add --detach -q "$work/base" "$base"
# Both sides run compiled: the base gets its own build, by the means its code has.
if [ -f "$work/base/setup.py" ]; then
	(cd "$work/base" && "$python" setup.py -q build_ext --inplace >/dev/null)
elif [ -f "$work/base/scripts/build_native.py" ]; then
	(cd "$work/base" && "$python" scripts/build_native.py >/dev/null)
fi

stream=false
[ "$mode" = stream ] && stream=true
ids=$("$python" -c "import random; random.seed(0); print(','.join(str(random.randrange(11, 151936)) for _ in range($prompt_ids)))")
[ "$prompt_ids" = 16 ] && ids=11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26
body="{\"input_ids\":[$ids],\"sampling_params\":{\"max_new_tokens\":16},\"stream\":$stream}"
printf 'wrk.method="POST"\nwrk.headers["Content-Type"]="application/json"\nwrk.body=[==[%s]==]\n' "$body" >"$work/post.lua"

taskset -c 1 "$python" -m rolloutgate sim --api sglang --profile fast --engines 1 --base-port 0 >"$work/sim.out" 2>&1 &
for _ in $(seq 100); do grep -q "^engine 0" "$work/sim.out" && break; sleep 0.2; done
engine=$(grep -oE "http://[^ ]+" "$work/sim.out" | head -1)

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

run_once() {  # <label> <source tree>
	local label=$1 tree=$2 port gateway ticks0 ticks1 out count
	# Port 0: the kernel picks a free one (a random fixed port can collide with the ephemeral ports in use).
	# A tree built by scripts/build_native.py keeps its shared library in build/native: ahead of the one an
	# editable install of this checkout puts on the path, whose name is the same.
	PYTHONPATH=$tree/build/native:$tree/src taskset -c 0 "$python" -m rolloutgate serve --host 127.0.0.1 --port 0 \
		--engine "sglang+$engine" --log-level warning >"$work/gw.out" 2>&1 &
	gateway=$!
	for _ in $(seq 150); do grep -q "serving on" "$work/gw.out" && break; sleep 0.2; done
	port=$(grep -oE "serving on http://[0-9.]+:[0-9]+" "$work/gw.out" | grep -oE "[0-9]+$")
	for _ in $(seq 150); do curl -sf "http://127.0.0.1:$port/ready" >/dev/null && break; sleep 0.2; done
	taskset -c 1 wrk -t1 -c"$conns" -d1s -s "$work/post.lua" "http://127.0.0.1:$port/generate" >/dev/null
	ticks0=$(cpu_ticks $gateway)
	out=$(taskset -c 1 wrk -t1 -c"$conns" -d"${secs}s" --latency -s "$work/post.lua" "http://127.0.0.1:$port/generate")
	ticks1=$(cpu_ticks $gateway)
	kill -INT $gateway
	wait $gateway 2>/dev/null || true
	count=$(echo "$out" | grep -oE "^ +[0-9]+ requests" | grep -oE "[0-9]+")
	printf '%s %s req/s %s p50 %s cpu_us_per_req %s\n' "$label" "$mode/$conns" \
		"$(echo "$out" | awk '/Requests\/sec/ {print $2}')" "$(echo "$out" | awk '$1 == "50%" {print $2}')" \
		"$(((ticks1 - ticks0) * 1000000 / $(getconf CLK_TCK) / count))"
}

for _ in $(seq "$rounds"); do
	run_once base "$work/base" | tee -a "$work/results"
	run_once tree "$root" | tee -a "$work/results"
done
echo "medians of CPU us per request:"
for label in base tree; do
	grep "^$label " "$work/results" | awk '{print $NF}' | sort -n | awk -v l="$label" \
		'{a[NR]=$1} END {print l, (NR % 2 ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2)}'
done
