# Reliability suite (docs/reliability.md): security, engine faults, slow clients, graceful shutdown, durable
# sessions, 10,000 queued + 1,000 in flight under load, property-based fuzzing of every endpoint, and busy
# engines that must not be taken for dead (-k busy_not_dead prints that table).
# A few minutes; CI runs it after `make test`.
#   make test-reliability                                  the suite, as CI runs it
#   make test-reliability RELIABILITY_ARGS='-k fuzz'       a part of it
#   RG_RELIABILITY_REPORT=figures.json make test-reliability   also writes the measured figures as JSON
#   RG_LOAD_SECONDS=180 make test-reliability              hold the load for longer
.PHONY: test-reliability

test-reliability: $(READY)
	LITELLM_LOCAL_MODEL_COST_MAP=True $(BIN)/python -m pytest -m reliability tests/reliability -q $(RELIABILITY_ARGS)
