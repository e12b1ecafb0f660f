# The fleet on Ray (docs/fleet.md); not part of `make test` (tests/fleet's sans-IO rules and its in-process
# fleet are: they need no Ray).
#   make test-fleet                               3 replica actors on a local Ray cluster, 7 simulated engines
#                                                 (~1 min on 2 cores, most of it Ray starting)
#   make test-fleet FLEET_ARGS='-k sigkill'       a part of it
#   make fleet-hop-cost                           what the one hop costs, p50 over 200 calls (~35 s)
#   make fleet-replication-cost                   what a session record's copy costs its backup (~30 s)
#   make fleet-scale                              CPU per M tokens and added latency, 1/2/4 replicas (~5 min)
FLEET_STAMP := $(VENV)/.installed-fleet
FLEET_ARGS  ?=

.PHONY: test-fleet fleet-hop-cost fleet-replication-cost fleet-scale

# The `fleet` extra's requirements (Ray), read from pyproject.toml: the same as `pip install -e '.[fleet]'`
# without building the package again (the compiled modules are `make native`'s).
$(FLEET_STAMP): $(STAMP) pyproject.toml
	$(BIN)/python -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["fleet"], sep="\n")' \
		| xargs -d '\n' $(BIN)/python -m pip install -q
	touch $@

test-fleet: $(READY) $(FLEET_STAMP)
	$(BIN)/python -m pytest -m fleet tests/fleet -q $(FLEET_ARGS)

fleet-hop-cost: $(READY) $(FLEET_STAMP)
	$(BIN)/python -m benchmarks.fleet.hop_cost

fleet-replication-cost: $(READY) $(FLEET_STAMP)
	$(BIN)/python -m benchmarks.fleet.replication_cost

fleet-scale: $(READY) $(FLEET_STAMP)
	$(BIN)/python -m benchmarks.fleet.scale --calls 288
