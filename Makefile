# The two commands a fresh machine needs: `make test` and (once the replay lands) `make demo`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The core compiled by mypyc (src/rolloutgate/core/_native.py), rebuilt when a core source changes; the gateway
# runs it when it matches its sources, the interpreted core otherwise. READY: installed, core compiled.
NATIVE       := build/native/rolloutgate/core/manifest.json
CORE_SOURCES := $(shell find src/rolloutgate/core -name '*.py')
READY        := $(STAMP) $(NATIVE)

.PHONY: test lint typecheck venv native clean sim-bench

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,native]'
	touch $(STAMP)

venv: $(STAMP)

$(NATIVE): $(STAMP) $(CORE_SOURCES) scripts/build_native.py
	$(BIN)/python scripts/build_native.py

native: $(NATIVE)

# The suite runs on the compiled core; the core's own tests run once more on the interpreted one.
test: $(READY)
	LITELLM_LOCAL_MODEL_COST_MAP=True $(BIN)/python -m pytest -q
	ROLLOUTGATE_NATIVE=0 $(BIN)/python -m pytest -q tests/core

lint: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/mypy

typecheck: $(STAMP)
	$(BIN)/mypy

sim-bench: $(READY)
	$(BIN)/python -m rolloutgate.bench.sim_throughput

# Heavier suites and tools, one file each (e2e, bench, reliability).
-include mk/*.mk

clean:
	rm -rf $(VENV) build .pytest_cache .mypy_cache .ruff_cache
