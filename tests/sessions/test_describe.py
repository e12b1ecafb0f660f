"""`GET /sessions/{id}` beyond the records and the tree: miles' `tito_session_mismatch`."""

from __future__ import annotations

from rolloutgate.sessions.describe import token_mismatch
from rolloutgate.sessions.render import ChatRenderer


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
