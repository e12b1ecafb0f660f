"""GRPO groups placed together against placed alone, on the simulator (`python -m benchmarks.grpo`)."""
