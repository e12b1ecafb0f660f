# End-to-end suite against real SGLang 0.5.9 engines on the CPU (docs/e2e.md).
#   make e2e-sglang-env       .venv-sglang: SGLang 0.5.9, pinned CPU deps, two stand-ins (scripts/sglang_env.sh)
#   make e2e-sglang-model     the tiny model, built with that venv's transformers 4.57 (scripts/make_tiny_model.py)
#   make test-e2e-sglang      both, two engines on OS-given loopback ports, `pytest -m e2e tests/e2e`
#   make test-e2e-sim-sglang  the same tests against `rolloutgate sim --api sglang`: no engine install
# The engines run from .venv-sglang; the test process (gateway, clients, pytest) runs from the main .venv.
SGLANG_VENV        ?= .venv-sglang
SGLANG_VERSION     := 0.5.9
SGLANG_STAMP       := $(SGLANG_VENV)/.installed-sglang-$(SGLANG_VERSION)
E2E_SGLANG_DIR     ?= .e2e-sglang
E2E_SGLANG_MODEL   := $(E2E_SGLANG_DIR)/model
E2E_SGLANG_MSTAMP  := $(E2E_SGLANG_MODEL)/.built

.PHONY: e2e-sglang-env e2e-sglang-model test-e2e-sglang test-e2e-sim-sglang

$(SGLANG_STAMP): scripts/sglang_env.sh scripts/sglang_cpu/requirements.txt
	SGLANG_VENV=$(SGLANG_VENV) PYTHON=$(PYTHON) bash scripts/sglang_env.sh

e2e-sglang-env: $(SGLANG_STAMP)

# Its own model folder: a tokenizer config written by transformers 5 (vLLM's venv) names a class 4.57 lacks.
$(E2E_SGLANG_MSTAMP): scripts/make_tiny_model.py $(SGLANG_STAMP)
	$(SGLANG_VENV)/bin/python scripts/make_tiny_model.py --out $(E2E_SGLANG_MODEL) --manifest
	touch $@

e2e-sglang-model: $(E2E_SGLANG_MSTAMP)

# Extra pytest arguments: make test-e2e-sglang E2E_PYTEST_ARGS='-k pause -x'
test-e2e-sglang: $(READY) $(SGLANG_STAMP) $(E2E_SGLANG_MSTAMP)
	SGLANG_VENV=$(SGLANG_VENV) VENV=$(VENV) E2E_DIR=$(E2E_SGLANG_DIR) bash scripts/e2e_sglang_run.sh $(E2E_PYTEST_ARGS)

test-e2e-sim-sglang: $(READY)
	E2E_BACKEND=sim-sglang LITELLM_LOCAL_MODEL_COST_MAP=True $(BIN)/python -m pytest -m e2e tests/e2e $(E2E_PYTEST_ARGS)
