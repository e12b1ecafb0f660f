# The two commands a fresh machine needs: `make test` and (once the replay lands) `make demo`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: test lint typecheck venv clean sim-bench

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	LITELLM_LOCAL_MODEL_COST_MAP=True $(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/mypy

typecheck: $(STAMP)
	$(BIN)/mypy

sim-bench: $(STAMP)
	$(BIN)/python -m rolloutgate.bench.sim_throughput

# Heavier suites and tools, one file each (e2e, bench, reliability).
-include mk/*.mk

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
