#!/usr/bin/env bash
# Instructions the gateway executes per request (user space), counted by valgrind: a measure the machine's
# other load cannot move, for judging a change to the hot path (docs/benchmarks.md, fifth session).
#
#   scripts/count_instructions.sh [commit-or-tree] [plain|stream] [connections]
#   scripts/count_instructions.sh fd559c9          # the code at that commit (a temporary worktree)
#   scripts/count_instructions.sh .                # the working tree
#
# Two runs of the gateway under `valgrind --tool=cachegrind --cache-sim=no` in front of the simulator's `fast`
# profile: 200 requests, then 2,200, over 32 keep-alive connections from a small aiohttp client; the
# difference of their totals over 2,000 is the count per request (start-up and shutdown cancel out). Two runs
# of the same code agree within ~0.5% on a quiet machine, but were up to ~5% apart in a busier hour (the
# requests batched per loop iteration vary): take several, in turns (docs/benchmarks.md, sixth session).
# The compiled modules run where built: a commit's worktree gets its own build (setup.py build_ext --inplace,
# or scripts/build_native.py before 2026-12-02; ~60 s more). ~40 s. Needs valgrind, gcc and the project's
# .venv (make test).
set -euo pipefail

target=${1:-.}
mode=${2:-plain}
conns=${3:-32}
root=$(cd "$(dirname "$0")/.." && pwd)
python=$root/.venv/bin/python
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; git -C "$root" worktree remove --force "$work/tree" >/dev/null 2>&1 || true; rm -rf "$work"' EXIT

if [ -d "$target" ]; then
	tree=$(cd "$target" && pwd)
else
	git -C "$root" worktree add --detach -q "$work/tree" "$target"
	if [ -f "$work/tree/setup.py" ]; then
		(cd "$work/tree" && "$python" setup.py -q build_ext --inplace >/dev/null)
	elif [ -f "$work/tree/scripts/build_native.py" ]; then
		(cd "$work/tree" && "$python" scripts/build_native.py >/dev/null)
	fi
	tree=$work/tree
fi

cat >"$work/drive.py" <<'EOF'
"""POST /generate `n` times over `conns` keep-alive connections; prints how many got a 200."""
import asyncio
import sys

import aiohttp


async def main(url: str, n: int, conns: int, stream: bool) -> None:
    body = {"input_ids": list(range(11, 27)), "sampling_params": {"max_new_tokens": 16}, "stream": stream}
    left, ok = n, 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=conns)) as session:

        async def worker() -> None:
            nonlocal left, ok
            while left > 0:
                left -= 1
                async with session.post(url, json=body) as response:
                    await response.read()
                    ok += response.status == 200

        await asyncio.gather(*[worker() for _ in range(conns)])
    print(ok)


asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "stream"))
EOF

taskset -c 1 "$python" -m rolloutgate sim --api sglang --profile fast --engines 1 --base-port 0 >"$work/sim.out" 2>&1 &
for _ in $(seq 100); do grep -q "^engine 0" "$work/sim.out" && break; sleep 0.2; done
engine=$(grep -oE "http://[^ ]+" "$work/sim.out" | head -1)

count() {  # <requests> -> "<answered> <instructions>"
	PYTHONPATH=$tree/build/native:$tree/src PYTHONHASHSEED=0 taskset -c 0 valgrind --tool=cachegrind --cache-sim=no \
		--cachegrind-out-file="$work/cg.out" "$python" -m rolloutgate serve --host 127.0.0.1 --port 0 \
		--engine "sglang+$engine" --log-level warning >"$work/gw.out" 2>&1 &
	local gateway=$! port answered
	for _ in $(seq 600); do grep -q "serving on" "$work/gw.out" && break; sleep 0.5; done
	port=$(grep -oE "serving on http://[0-9.]+:[0-9]+" "$work/gw.out" | grep -oE "[0-9]+$")
	for _ in $(seq 600); do curl -sf "http://127.0.0.1:$port/ready" >/dev/null && break; sleep 0.5; done
	answered=$(taskset -c 1 "$python" "$work/drive.py" "http://127.0.0.1:$port/generate" "$1" "$conns" "$mode")
	kill -INT "$gateway"
	wait "$gateway" || true
	echo "$answered $(awk '/^summary:/ {print $2}' "$work/cg.out")"
}

read -r small_ok small < <(count 200)
read -r large_ok large < <(count 2200)
if [ "$small_ok" != 200 ] || [ "$large_ok" != 2200 ]; then
	echo "not every request was answered: $small_ok/200, $large_ok/2200" >&2
	exit 1
fi
echo "$mode, $conns connections: $(((large - small) / 2000)) instructions per request ($target)"
