# Gateway performance benchmark (docs/benchmarks.md); not part of `make test`.
#   make bench                        the engine alone, rolloutgate and the SGLang Model Gateway side by side,
#                                     streams in flight, dispatch cost, RL progress watching; writes
#                                     out/bench/perf-*.json and the generated block of docs/benchmarks.md
#   make bench BENCH_ARGS='--only profile'      py-spy summaries of the gateway under load
#   make bench BENCH_ARGS='--only throughput --rounds 1'
#   make bench-rl                     the RL shape (miles' TITO calls: 20K-100K input_ids, logprobs, 2K-32K new
#                                     tokens, non-streaming) direct, through rolloutgate and the SGLang Model
#                                     Gateway, one run (~9 min); out/bench/rl-shape-*.json and a table
#   make bench-rl BENCH_RL_ARGS='--quick'       the same in seconds (the harness's smoke test)
# The SGLang Model Gateway is installed by the bench into its own venv (.venv-bench-router, once); wrk with
# apt-get when missing (a Python load generator otherwise); py-spy comes with the `bench` extra.
BENCH_STAMP := $(VENV)/.installed-bench
BENCH_ARGS  ?=
BENCH_RL_ARGS ?=

.PHONY: bench bench-rl

$(BENCH_STAMP): $(STAMP) pyproject.toml
	$(BIN)/python -m pip install -q -e '.[test,native,bench]'
	touch $@

bench: $(READY) $(BENCH_STAMP)
	$(BIN)/python -m rolloutgate bench $(BENCH_ARGS)

bench-rl: $(READY) $(BENCH_STAMP)
	$(BIN)/python -m rolloutgate bench --only rl-shape $(BENCH_RL_ARGS)
