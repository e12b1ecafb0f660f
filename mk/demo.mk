# The project's main demo: the incident replayed side by side, engine time vs wallclock (docs/replay.md).
#   make demo    sets up .venv if needed, then `rolloutgate replay incident --out out/demo` (about 2 minutes):
#                a table in the terminal, out/demo/replay.json and out/demo/replay.png
DEMO_OUT ?= out/demo

.PHONY: demo

demo: $(READY)
	LITELLM_LOCAL_MODEL_COST_MAP=True $(BIN)/rolloutgate replay incident --out $(DEMO_OUT)
