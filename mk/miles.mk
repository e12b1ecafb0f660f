# miles' own router/session suite against rolloutgate (docs/miles.md, "miles' own suite against rolloutgate");
# not part of `make test`, CI runs it after.
#   make miles-env    .venv-miles: miles' CPU test requirements (--no-deps), the encoding_dsv4 stand-in and
#                     Qwen3's real tokenizer as a hub-cache entry (scripts/miles_env.sh, ~2 min once); a stamp
#   make test-miles   miles' suite unmodified on miles' own servers (the baseline, rerun only when miles, the
#                     venv or tests/compat/miles change), then its 72 HTTP tests with `rolloutgate serve` (from
#                     .venv) where miles' servers were, and the two side by side (out/miles/rolloutgate.md).
#                     Fails on a failure not in tests/compat/miles/expected_failures.toml, or a listed test
#                     that passes. ~3.5 min on 2 cores with the baseline, ~2.5 with it cached.
#   make miles-diagnose the same HTTP tests with miles' mock also answering what SGLang does and the mock lacks
#                     (/server_info, /v1/models, meta_info.prompt_tokens), no expected-failure list: what each
#                     test meets once the engine is admitted (out/miles/diagnose.md). Diagnosis only, never CI.
# miles is read from ../shared/peers/miles (read-only; nothing is written there).
MILES_DIR   ?= ../shared/peers/miles
MILES_VENV  ?= .venv-miles
MILES_STAMP := $(MILES_VENV)/.installed-miles
MILES_OUT   ?= out/miles
MILES_RUN   := $(MILES_VENV)/bin/python scripts/miles_suite.py --miles-dir $(MILES_DIR) --venv $(MILES_VENV)
MILES_BASELINE := $(MILES_OUT)/baseline.json

.PHONY: miles-env test-miles miles-diagnose

$(MILES_STAMP): scripts/miles_env.sh $(MILES_DIR)/requirements-tests-cpu.txt
	MILES_DIR=$(MILES_DIR) MILES_VENV=$(MILES_VENV) PYTHON=$(PYTHON) bash scripts/miles_env.sh
	touch $@

miles-env: $(MILES_STAMP)

# Without miles' checkout the suite cannot run: say where it is looked for, not "No rule to make target".
$(MILES_DIR)/requirements-tests-cpu.txt:
	@echo "make test-miles reads miles from $(MILES_DIR) (shared/peers/miles beside this checkout), which is" \
		"not there: clone the project beside shared/ or give MILES_DIR=/path/to/peers/miles" >&2
	@exit 1

# The baseline file is written only when miles' suite passes on miles' own servers: a failure there is this
# machine's setup, not rolloutgate, and stops the target before rolloutgate is tried.
$(MILES_BASELINE): $(MILES_STAMP) $(wildcard tests/compat/miles/*.py) $(shell find $(MILES_DIR)/tests $(MILES_DIR)/miles -name '*.py' 2>/dev/null)
	$(MILES_RUN) baseline --out $(MILES_BASELINE).tmp
	mv $(MILES_BASELINE).tmp $(MILES_BASELINE)

test-miles: $(READY) $(MILES_STAMP) $(MILES_BASELINE)
	$(MILES_RUN) run --baseline $(MILES_BASELINE) --out $(MILES_OUT)/rolloutgate.json
	$(MILES_RUN) fixed-template --out $(MILES_OUT)/fixed-template.json

miles-diagnose: $(READY) $(MILES_STAMP) $(MILES_BASELINE)
	-RG_MILES_MOCK_LIKE_SGLANG=1 $(MILES_RUN) run --baseline $(MILES_BASELINE) --out $(MILES_OUT)/diagnose.json \
		--expected /dev/null
