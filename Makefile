# The two commands a fresh machine needs: `make test` and `make demo`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The modules pyproject.toml's [tool.rolloutgate] compiled names are compiled by mypyc in the package build
# (setup.py): the editable install builds them beside their sources, `make native` again after an edit (mypyc
# rewrites only the C that changed, so an edit elsewhere costs a few seconds). READY: installed and compiled.
NATIVE  := $(VENV)/.native
SOURCES := $(shell find src/rolloutgate -name '*.py')
READY   := $(STAMP) $(NATIVE)

.PHONY: test test-install lint typecheck venv native clean-native clean sim-bench

$(STAMP): pyproject.toml setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"], sep="\n")' \
		| xargs -d '\n' $(BIN)/python -m pip install -q
	$(BIN)/python -m pip install -q --no-build-isolation -e '.[test,native]'
	touch $(STAMP)

venv: $(STAMP)

# The per-module stubs beside the sources are rewritten only when they change (the code is in one shared
# library), so they are touched: tests/conftest.py reads a stub older than its source as a stale build.
$(NATIVE): $(STAMP) $(SOURCES)
	$(BIN)/python setup.py -q build_ext --inplace
	find src -name '*.so' -exec touch {} +
	touch $@

native: $(NATIVE)

# The compiled modules removed from beside their sources: the interpreted ones run (until `make native`).
clean-native:
	find src -name '*.so' -delete
	rm -f $(NATIVE)

test: $(READY)
	LITELLM_LOCAL_MODEL_COST_MAP=True $(BIN)/python -m pytest -q

# `pip install .` into a fresh venv runs the modules `make` compiles (tests/install/, ~2 min: a real build).
test-install: $(STAMP)
	$(BIN)/python -m pytest -q -m install tests/install

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/mypy

typecheck: $(STAMP)
	$(BIN)/mypy

sim-bench: $(READY) wrk
	$(BIN)/python -m benchmarks.perf.sim_throughput

# Heavier suites and tools, one file each (e2e, bench, reliability).
-include mk/*.mk

clean:
	rm -rf $(VENV) build .pytest_cache .mypy_cache .ruff_cache
	find src -name '*.so' -delete
