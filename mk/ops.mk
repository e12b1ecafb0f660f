# Dashboards and alerts (deploy/, docs/operations.md); `make check-rules` is part of CI (.ci/run).
#   make check-rules     promtool check rules on deploy/prometheus/alerts.yml, then its unit tests
#                        (deploy/prometheus/alerts_test.yml: each alert fires on synthetic series and stays
#                        quiet); installs Debian's prometheus package (promtool) when it is missing (a second)
#   make dashboard-png   docs/img/dashboard.png: a short incident replay scraped by a local Prometheus, each
#                        panel of deploy/grafana/rolloutgate.json evaluated over it and drawn (~3 minutes)
PROMTOOL        ?= promtool
SUDO            := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
DASHBOARD_OUT   ?= out/dashboard
DASHBOARD_ARGS  ?=

.PHONY: check-rules dashboard-png promtool

promtool:
	@command -v $(PROMTOOL) >/dev/null || { $(SUDO) apt-get update -qq && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus; }

check-rules: promtool
	$(PROMTOOL) check rules deploy/prometheus/alerts.yml
	$(PROMTOOL) test rules deploy/prometheus/alerts_test.yml

dashboard-png: $(READY) promtool
	LITELLM_LOCAL_MODEL_COST_MAP=True $(BIN)/python scripts/render_dashboard.py --out $(DASHBOARD_OUT) \
		--png docs/img/dashboard.png $(DASHBOARD_ARGS)

# `rolloutgate top` in a real terminal (tmux): an engine freezes, is shown hung, then quarantined (~10-20 s).
.PHONY: test-top
test-top: $(READY)
	$(BIN)/python -m pytest tests/top -m tmux -q
