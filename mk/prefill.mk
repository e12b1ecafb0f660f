# Prefill-aware admission off and on, side by side (docs/prefill.md); not part of `make test`.
#   make prefill-compare                                  the incident replay over HTTP, 7 seeds, each run off and
#                                                         on (~13 minutes on 2 cores)
#   make prefill-compare PREFILL_ARGS='--seeds 0,1'       fewer seeds
#   make prefill-exact                                    the same workload in the exact world (sans-IO core +
#                                                         engine model, virtual time), 40 seeds, with bootstrap
#                                                         intervals (a few minutes on 2 cores)
#   make prefill-exact PREFILL_EXACT_ARGS='--seeds 0-9'   fewer seeds
# prefill-compare writes $(PREFILL_OUT)/prefill_replay.md (the table), prefill_replay.json and each run's raw
# records; prefill-exact writes $(PREFILL_EXACT_OUT)/prefill_exact.md and prefill_exact.json.
PREFILL_OUT  ?= out/prefill-replay
PREFILL_ARGS ?=
PREFILL_EXACT_OUT  ?= out/prefill-exact
PREFILL_EXACT_ARGS ?=

.PHONY: prefill-compare prefill-exact

prefill-compare: $(READY)
	LITELLM_LOCAL_MODEL_COST_MAP=True $(BIN)/python -m benchmarks.prefill.replay --out $(PREFILL_OUT) $(PREFILL_ARGS)

prefill-exact: $(READY)
	$(BIN)/python -m benchmarks.prefill.exact --out $(PREFILL_EXACT_OUT) $(PREFILL_EXACT_ARGS)
