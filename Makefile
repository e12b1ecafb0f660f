# The two commands a fresh machine needs: `make test` and (once the replay lands) `make demo`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The core and three pure edge modules compiled by mypyc (src/rolloutgate/core/_native.py names them); the
# build script rebuilds only when their sources changed. The gateway runs them when they match their sources,
# the interpreted ones otherwise. READY: installed and compiled.
NATIVE  := build/native/manifest.json
SOURCES := $(shell find src/rolloutgate -name '*.py')
READY   := $(STAMP) $(NATIVE)

.PHONY: test lint typecheck venv native clean sim-bench

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,native]'
	touch $(STAMP)

venv: $(STAMP)

$(NATIVE): $(STAMP) $(SOURCES) scripts/build_native.py
	$(BIN)/python scripts/build_native.py

native: $(NATIVE)

# The suite runs on the compiled modules; their own tests run once more on the interpreted ones.
test: $(READY)
	LITELLM_LOCAL_MODEL_COST_MAP=True $(BIN)/python -m pytest -q
	ROLLOUTGATE_NATIVE=0 $(BIN)/python -m pytest -q tests/core tests/engines/test_assemble.py \
		tests/engines/test_progress.py tests/server/test_validate.py

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
