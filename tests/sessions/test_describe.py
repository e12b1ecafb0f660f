"""`GET /sessions/{id}` beyond the records: miles' tree tables and its `tito_session_mismatch`."""

from __future__ import annotations

from typing import Any

from rolloutgate.sessions.describe import token_mismatch, tree_metadata
from rolloutgate.sessions.render import ChatRenderer
from rolloutgate.sessions.samples import TreePath
from tests.sessions.conftest import make_record


def test_tree_tables_have_a_node_per_turn_and_a_leaf_per_path_end() -> None:
    first, cut, retried = make_record(0), make_record(1), make_record(1, reply="again")
    cut = type(cut)(**{**_fields(cut), "finish_reason": "length"})
    paths = [TreePath([first, cut], [1, 2]), TreePath([first, retried], [1, 3])]
    tables = tree_metadata(paths)
    assert [(n["id"], n["parent"], n["truncated"]) for n in tables["nodes"]] == [
        (1, None, False),
        (2, 1, True),
        (3, 1, False),
    ]
    assert tables["leaves"] == [
        {"node_id": 2, "path_node_ids": [1, 2]},
        {"node_id": 3, "path_node_ids": [1, 3]},
    ]
    node = tables["nodes"][0]
    assert node["completion_span"] == [len(first.prompt_new_ids), node["num_tokens"]]


def _fields(record: Any) -> dict[str, Any]:
    return {name: getattr(record, name) for name in record.__dataclass_fields__ if name != "approx_bytes"}


def test_ids_that_are_the_templates_own_have_no_mismatch_and_edits_are_classified(
    renderer: ChatRenderer,
) -> None:
    messages = [
        {"role": "user", "content": "What is the weather?"},
        {"role": "assistant", "content": "Sunny."},
        {"role": "user", "content": "Thanks."},
        {"role": "assistant", "content": "You are welcome."},
    ]
    ids = renderer.encode(renderer.render(messages, add_generation_prompt=False))
    assert token_mismatch(renderer, messages, ids, tools=None, template_kwargs=None) == []
    assert renderer.assistant_opener == "<|im_start|>assistant"
    answer = renderer.encode("Sunny.")
    at = next(i for i in range(len(ids)) if ids[i : i + len(answer)] == answer)
    other_answer = [*ids[:at], *renderer.encode("Cloudy."), *ids[at + len(answer) :]]
    (found,) = token_mismatch(renderer, messages, other_answer, tools=None, template_kwargs=None)
    assert (found["type"], found["actual_text"].strip()) == ("assistant_text", "assistant\nCloudy.")
    question = renderer.encode("Thanks.")
    at = next(i for i in range(len(ids)) if ids[i : i + len(question)] == question)
    other_question = [*ids[:at], *renderer.encode("Bye."), *ids[at + len(question) :]]
    (found,) = token_mismatch(renderer, messages, other_question, tools=None, template_kwargs=None)
    assert found["type"] == "non_assistant_text"
    (found,) = token_mismatch(renderer, messages, ids[: at - 2], tools=None, template_kwargs=None)
    assert found["type"] == "special_token_count" and found["segment_index"] == -1
