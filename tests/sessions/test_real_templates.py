"""The verdicts of docs/sessions.md's table, on the real templates (`make test-templates` lays them out)."""

from __future__ import annotations

import pytest

from tests.sessions import real_templates

# family -> case -> what the table says; a change either way must show up here and in docs/sessions.md
EXPECTED = {
    "qwen3": ["exact", "exact, reasoning kept", "exact", "exact, reasoning kept"],
    "qwen3-2507-instruct": ["exact", "exact", "exact", "exact"],
    "qwen3-2507-thinking": ["exact", "exact, reasoning kept", "exact", "exact, reasoning kept"],
    "minimax-m2": ["exact", "exact, reasoning kept", "exact", "FAIL"],
    "minimax-m2.5": ["exact", "exact, reasoning kept", "exact", "FAIL"],
    "minimax-m2.7": ["exact", "exact, reasoning kept", "exact", "FAIL"],
    "glm-4.5": ["exact", "FAIL", "FAIL", "exact"],
    "glm-4.7": ["exact", "FAIL", "FAIL", "exact"],
    "deepseek-v3.1": ["exact", "exact", "FAIL", "exact"],
    "llama-3.1": ["exact", "exact", "exact", "exact"],
    "qwen3.5": ["exact", "FAIL", "FAIL", "FAIL"],
}

pytestmark = pytest.mark.templates


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_each_familys_verdicts_are_the_tables(family: str) -> None:
    assert (real_templates.TOKENIZERS / family).is_dir(), (
        "run `make test-templates` (scripts/real_tokenizers.py)"
    )
    renderer = real_templates.load(real_templates.TOKENIZERS, family)
    got = [real_templates.verdict(renderer, case) for case in real_templates.CASES]
    assert [v if not v.startswith("FAIL") else "FAIL" for v in got] == EXPECTED[family], got
