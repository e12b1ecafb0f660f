"""The incident replay as a benchmark: recorded, replayed from its trace, compared (round_trip.py, docs/replay.md)."""
