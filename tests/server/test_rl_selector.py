"""SMG's label selectors (server/rl_selector.py): the examples of SMG's docs, and the errors with offsets."""

from __future__ import annotations

import pytest

from rolloutgate.server.rl_selector import SelectorError, parse_selector

SGLANG = {"engine": "sglang", "health": "ready", "base_url": "http://rollout-0:30000", "tp_size": "1"}
VLLM = {"engine": "vllm", "health": "not_ready", "role": "reward", "base_url": "http://rollout-1:30000"}


@pytest.mark.parametrize(
    ("text", "matched"),
    [
        ("engine=sglang", [True, False]),
        ("engine in (sglang,vllm)", [True, True]),
        ("engine notin (vllm)", [True, False]),
        ("role!=reward", [True, False]),
        ("engine=sglang, health=ready", [True, False]),
        ("  engine = sglang ,health = ready ", [True, False]),
        ("base_url=http://rollout-0:30000", [True, False]),
        ('base_url="http://rollout-1:30000"', [False, True]),
        ("tp_size=1, engine in (sglang)", [True, False]),
        ("role=reward", [False, True]),
        ("Engine=sglang", [False, False]),  # keys are case-sensitive
        ('role="re\\"ward"', [False, False]),
    ],
)
def test_smgs_examples_match_as_its_docs_say(text: str, matched: list[bool]) -> None:
    selector = parse_selector(text)
    assert [selector.matches(SGLANG), selector.matches(VLLM)] == matched


def test_quoted_values_keep_commas_spaces_and_escapes() -> None:
    selector = parse_selector('note in ("a, b", "c\\\\d", "say \\"hi\\"")')
    assert selector.matches({"note": "a, b"})
    assert selector.matches({"note": "c\\d"})
    assert selector.matches({"note": 'say "hi"'})
    assert not selector.matches({"note": "a"})


@pytest.mark.parametrize(
    ("text", "offset"),
    [
        ("engine==sglang", 7),
        ("engine", 6),
        ("=sglang", 0),
        ("engine in sglang", 10),
        ("engine in (sglang", 17),
        ("engine=sglang,", 14),
        ("engine=sglang health=ready", 14),
        ('engine="sglang', 7),
        ("engine~sglang", 6),
        ("é=1", 0),
    ],
)
def test_a_selector_that_does_not_parse_names_the_byte_where_it_broke(text: str, offset: int) -> None:
    with pytest.raises(SelectorError) as caught:
        parse_selector(text)
    assert caught.value.offset == offset
