"""The incident replayed side by side, engine time vs wallclock: `rolloutgate replay` (cli.py, docs/replay.md)."""
