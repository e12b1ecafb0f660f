"""Prefill-aware admission off and on, side by side (docs/prefill.md)."""
