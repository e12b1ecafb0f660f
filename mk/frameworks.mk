# verl's own classes against rolloutgate (docs/frameworks/verl.md, "verl's own code against rolloutgate"); not
# part of `make test`, CI runs it after test-miles.
#   make verl-env    .venv-verl: verl from the package index (--no-deps) with the few packages its router and
#                    rollout-client modules import, a CPU torch from the machine's local wheels, Ray, and
#                    rolloutgate's own requirements; rolloutgate itself is read from src/ (a .pth file), so the
#                    Ray actor verl starts for the router imports the plugin being tested; a stamp
#   make test-verl   verl's `get_router_handle` (YAML, FQN, Ray actor) and `LLMServerClient` /
#                    `FullyAsyncLLMServerClient` driving the rolloutgate router against simulated engines
#                    (tests/compat/frameworks/test_verl_own_router.py, on a local Ray cluster)
VERL_VENV    ?= .venv-verl
VERL_BIN     := $(VERL_VENV)/bin
VERL_VERSION := 0.9.1
VERL_STAMP   := $(VERL_VENV)/.installed-verl-$(VERL_VERSION)
# verl imports torch from `verl/__init__.py` (verl.protocol) and ray from router.py and llm_server.py; the CPU
# build of torch lies in the machine's local wheels (the index's torch is the CUDA build, with its GPU libraries).
VERL_TORCH   := torch==2.13.0+cpu
# What `import verl.workers.rollout.llm_server, verl.workers.rollout.router` needs beyond torch and ray, within
# verl 0.9.1's own pins (its METADATA); verl's other requirements (wandb, datasets, peft, ...) are not imported there.
VERL_DEPS    := 'transformers>=5.5.3,<5.11,!=5.6.0' 'tensordict>=0.8.0,<=0.10.0,!=0.9.0' omegaconf cachetools \
                codetiming orjson fastapi uvicorn

.PHONY: verl-env test-verl

$(VERL_STAMP): pyproject.toml mk/frameworks.mk
	test -x $(VERL_BIN)/python || $(PYTHON) -m venv $(VERL_VENV)
	$(VERL_BIN)/python -m pip install -q '$(VERL_TORCH)' ray $(VERL_DEPS)
	$(VERL_BIN)/python -m pip install -q --no-deps verl==$(VERL_VERSION)
	$(VERL_BIN)/python -c 'import tomllib; t = tomllib.load(open("pyproject.toml", "rb")); print(*t["project"]["dependencies"], sep="\n")' \
		| xargs -d '\n' $(VERL_BIN)/python -m pip install -q pytest pytest-asyncio pytest-timeout httpx
	$(VERL_BIN)/python -c 'import site, os; open(os.path.join(site.getsitepackages()[0], "rolloutgate-src.pth"), "w").write(os.path.abspath("src") + "\n")'
	$(VERL_BIN)/python -c 'import verl.workers.rollout.llm_server, verl.workers.rollout.router, rolloutgate.frameworks.verl'
	touch $@

verl-env: $(VERL_STAMP)

test-verl: $(READY) $(VERL_STAMP)
	$(VERL_BIN)/python -m pytest -q -m verl tests/compat/frameworks/test_verl_own_router.py $(VERL_PYTEST_ARGS)
