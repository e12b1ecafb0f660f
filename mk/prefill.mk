# Prefill-aware admission off and on, side by side in the incident replay (docs/prefill.md); not part of
# `make test`.
#   make prefill-compare                                  7 seeds, each run off and on (~13 minutes on 2 cores)
#   make prefill-compare PREFILL_ARGS='--seeds 0,1'       fewer seeds
# Writes $(PREFILL_OUT)/prefill_replay.md (the table), prefill_replay.json and each run's raw records.
PREFILL_OUT  ?= out/prefill-replay
PREFILL_ARGS ?=

.PHONY: prefill-compare

prefill-compare: $(STAMP)
	LITELLM_LOCAL_MODEL_COST_MAP=True $(BIN)/python -m rolloutgate.bench.prefill_replay --out $(PREFILL_OUT) $(PREFILL_ARGS)
