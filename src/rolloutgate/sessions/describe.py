"""What `GET /sessions/{id}` shows beyond the records and the tree (samples.py `tree_metadata`), in miles' shape.

`token_mismatch` is miles' `tito_session_mismatch`, which its rollout metrics read (`tito_session_mismatch_rate`):
  the session's ids against the template's own rendering of its messages, split at special tokens and compared
  segment by segment. Assistant text differing is expected (the ids are the engine's, not a re-tokenization;
  earlier reasoning a template drops is kept as generated); anything else is a TITO bug worth a metric.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rolloutgate.sessions.render import ChatRenderer

__all__ = ("token_mismatch",)


def token_mismatch(
    renderer: ChatRenderer,
    messages: Sequence[dict[str, Any]],
    token_ids: Sequence[int],
    *,
    tools: list[Any] | None,
    template_kwargs: dict[str, Any] | None,
    add_generation_prompt: bool = False,
) -> list[dict[str, Any]]:
    """miles' `Mismatch.to_dict()` list (empty: the ids are what the template renders). With
    `add_generation_prompt`, `token_ids` are a next turn's prompt rather than a session's ids."""
    expected = renderer.encode(
        renderer.render(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            template_kwargs=template_kwargs,
        )
    )
    # a stop token the engine generated, or the close text after it, has no fixed place at the very end
    trailing = {*renderer.stop_token_ids, *renderer.close_ids}
    exp = _segments(_without_trailing(expected, trailing), renderer.special_ids)
    act = _segments(_without_trailing(list(token_ids), trailing), renderer.special_ids)
    if [special for special, _ in exp] != [special for special, _ in act]:
        detail = (
            f"segment count differs: expected {len(exp)}, got {len(act)}"
            if len(exp) != len(act)
            else "segment structure (special/content pattern) differs"
        )
        return [
            _mismatch("special_token_count", -1, _structure(renderer, exp), _structure(renderer, act), detail)
        ]
    opener = renderer.assistant_opener
    found = []
    for index, ((special, want), (_, got)) in enumerate(zip(exp, act, strict=True)):
        if want == got:
            continue
        want_text, got_text = renderer.decode(want), renderer.decode(got)
        if special:
            found.append(_mismatch("special_token_type", index, want_text, got_text))
        elif want_text != got_text:
            opened_by = renderer.decode(exp[index - 1][1]) if index and exp[index - 1][0] else ""
            in_answer = bool(opened_by) and (opened_by + want_text).startswith(opener)
            found.append(
                _mismatch("assistant_text" if in_answer else "non_assistant_text", index, want_text, got_text)
            )
    return found


def _segments(ids: Sequence[int], special_ids: frozenset[int]) -> list[tuple[bool, list[int]]]:
    """Each special token alone, runs of other ids together: (is_special, ids)."""
    out: list[tuple[bool, list[int]]] = []
    for token in ids:
        if token in special_ids:
            out.append((True, [token]))
        elif out and not out[-1][0]:
            out[-1][1].append(token)
        else:
            out.append((False, [token]))
    return out


def _without_trailing(ids: list[int], trailing: set[int]) -> list[int]:
    end = len(ids)
    while end and ids[end - 1] in trailing:
        end -= 1
    return ids[:end]


def _structure(renderer: ChatRenderer, segments: list[tuple[bool, list[int]]]) -> str:
    return " ".join(
        f"[{renderer.decode(ids)}]" if special else f"({len(ids)} tokens)" for special, ids in segments
    )


def _mismatch(kind: str, index: int, expected: str, actual: str, detail: str = "") -> dict[str, Any]:
    return {
        "type": kind,
        "segment_index": index,
        "expected_text": expected,
        "actual_text": actual,
        "detail": detail,
    }
