# Gateway performance benchmark (docs/benchmarks.md; benchmarks/perf/, beside the package); not part of `make test`.
#   make bench                        the engine alone, rolloutgate and the SGLang Model Gateway side by side,
#                                     streams in flight, dispatch cost, RL progress watching; writes
#                                     out/bench/perf-*.json and the generated block of docs/benchmarks.md
#   make bench BENCH_ARGS='--only profile'      py-spy summaries of the gateway under load
#   make bench BENCH_ARGS='--only throughput --rounds 1'
#   make bench-rl                     the RL shape (miles' TITO calls: 20K-100K input_ids, logprobs, 2K-32K new
#                                     tokens, non-streaming) direct, through rolloutgate and the SGLang Model
#                                     Gateway, one run (~9 min); out/bench/rl-shape-*.json and a table
#   make bench-rl BENCH_RL_ARGS='--quick'       the same in seconds (the harness's smoke test)
#   make bench-rl-fanout              a fan-out through the RL control plane (/v1/rl/engine) over the slowest of
#                                     8 simulated engines: rolloutgate and SMG (`smg`, --enable-rl) side by side
#   make bench-tools                  what they drive, installed here (never by the package):
#     - wrk, with apt-get where it is missing and can be (root, Debian-like); where it cannot, the benchmarks'
#       Python load generator stands in (benchmarks/perf/load.py) and the report says which ran;
#     - the SGLang Model Gateway, two releases each in its own venv, once: `sglang-router` (the package miles
#       installs, $(ROUTER_VENV)) and `smg` (its newest release, $(SMG_VENV)); where one cannot be installed
#       (no network, no wheel) the benchmarks leave its rows out.
# py-spy comes with the `bench` extra (with the replay's and the clients' packages the benchmarks use).
BENCH_STAMP   := $(VENV)/.installed-bench
BENCH_ARGS    ?=
BENCH_RL_ARGS ?=
ROUTER_VENV   := .venv-bench-router
ROUTER_STAMP  := $(ROUTER_VENV)/.installed-sglang-router
SMG_VENV      := .venv-bench-smg
SMG_STAMP     := $(SMG_VENV)/.installed-smg

.PHONY: bench bench-cores bench-rl bench-rl-fanout bench-tools wrk

$(BENCH_STAMP): $(STAMP) pyproject.toml
	$(BIN)/python -m pip install -q -e '.[test,native,bench]'
	touch $@

# Never fails: without wrk the benchmarks run their own load generator.
wrk:
	@command -v wrk >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing wrk with apt-get ..."; \
	    export DEBIAN_FRONTEND=noninteractive; \
	    apt-get install -y -q wrk >/dev/null 2>&1 || \
	      { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q wrk >/dev/null 2>&1; }; \
	  fi; \
	  command -v wrk >/dev/null 2>&1 || echo "wrk could not be installed: the Python load generator stands in"; }

# The stamp only once the router imports; a failed install is tried again next time, and does not fail make.
$(ROUTER_STAMP):
	@{ test -x $(ROUTER_VENV)/bin/python || $(PYTHON) -m venv $(ROUTER_VENV); } && \
	  echo "installing sglang-router into $(ROUTER_VENV) (once) ..." && \
	  $(ROUTER_VENV)/bin/python -m pip install -q sglang-router && \
	  $(ROUTER_VENV)/bin/python -c 'import sglang_router' && touch $@ || \
	  echo "sglang-router could not be installed: the benchmarks leave the SGLang Model Gateway out"

# The newest release of the SGLang Model Gateway (the `smg` package), in a venv of its own beside miles' pin.
$(SMG_STAMP):
	@{ test -x $(SMG_VENV)/bin/python || $(PYTHON) -m venv $(SMG_VENV); } && \
	  echo "installing smg into $(SMG_VENV) (once) ..." && \
	  $(SMG_VENV)/bin/python -m pip install -q smg && \
	  $(SMG_VENV)/bin/python -c 'import smg.launch_router' && touch $@ || \
	  echo "smg could not be installed: the benchmarks leave its rows out"

bench-tools: wrk $(ROUTER_STAMP) $(SMG_STAMP)

bench: $(READY) $(BENCH_STAMP) bench-tools
	$(BIN)/python -m benchmarks.perf $(BENCH_ARGS)

bench-rl: $(READY) $(BENCH_STAMP) bench-tools
	$(BIN)/python -m benchmarks.perf --only rl-shape $(BENCH_RL_ARGS)

bench-cores: $(READY) $(BENCH_STAMP) bench-tools
	$(BIN)/python -m benchmarks.perf.cores $(BENCH_CORES_ARGS)

bench-rl-fanout: $(READY)
	$(BIN)/python -m benchmarks.rl_fanout $(BENCH_RL_FANOUT_ARGS)
