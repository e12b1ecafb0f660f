"""Token-in-token-out on the real chat templates of the families users train (scripts/real_tokenizers.py).

For each family folder and each way a conversation goes on after an answer (a tool result, a user follow-up, a
system message, and a user follow-up with thinking off), one answered turn then the next turn's prompt, built
as the gateway builds it (`ChatRenderer.continue_prompt`, miles' append rule where the template rewrites
history). The engine's answer is simulated as the template's own text for the reply, up to the end of the
assistant message, plus the family's stop token.

Verdicts, per cell:
- `exact`: the ids equal the template's own tokenization of the whole conversation;
- `exact, reasoning kept`: they differ only inside earlier answers (miles' `assistant_text`: the template drops
  earlier reasoning, the session keeps the ids the engine generated), never in what anyone else wrote;
- `FAIL: ...`: any other difference, or an error.

    python -m tests.sessions.real_templates [--dir .tokenizers]   # prints the table in docs/sessions.md
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rolloutgate.sessions.describe import token_mismatch
from rolloutgate.sessions.errors import ChatTemplateError
from rolloutgate.sessions.render import ChatRenderer, Checkpoint

TOKENIZERS = Path(__file__).resolve().parents[2] / ".tokenizers"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
FIRST = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Paris?"},
]
CALL = {
    "id": "call00000",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
# The reply the agent echoes back: reasoning (as SGLang's reasoning parser splits it), content and a tool call
REPLY = {
    "role": "assistant",
    "content": "Let me look that up.",
    "reasoning_content": "The user wants the weather; I should call the tool.",
    "tool_calls": [CALL],
}
CASES: dict[str, tuple[list[dict[str, Any]], dict[str, Any] | None]] = {
    "tool result": ([{"role": "tool", "tool_call_id": "call00000", "content": '{"celsius": 21}'}], None),
    "user follow-up": ([{"role": "user", "content": "And in Rome?"}], None),
    "system append": ([{"role": "system", "content": "Answer in one sentence."}], None),
    "thinking off": (
        [{"role": "user", "content": "And in Rome?"}],
        {"enable_thinking": False, "thinking": False},
    ),
}


# What the folders lack: GLM's generation_config.json stops at the next message's role token as well as at
# <|endoftext|> (eos_token_id [151329, 151336, 151338]: <|endoftext|>, <|user|>, <|observation|>).
STOP_IDS = {
    "glm-4.5": (151329, 151336, 151338),
    "glm-4.6": (151329, 151336, 151338),
    "glm-4.7": (151329, 151336, 151338),
    "glm-4.7-flash": (154820, 154827, 154829),
}


def load(root: Path, family: str) -> ChatRenderer:
    renderer = ChatRenderer.from_dir(root / family)
    if family in STOP_IDS:
        renderer.stop_token_ids = STOP_IDS[family]
    return renderer


def families(root: Path = TOKENIZERS) -> list[str]:
    return sorted(p.name for p in root.iterdir() if (p / "tokenizer.json").is_file()) if root.is_dir() else []


def verdict(renderer: ChatRenderer, case: str) -> str:
    appended, kwargs = CASES[case]
    # with thinking off there is no reasoning to answer with
    reply = {k: v for k, v in REPLY.items() if k != "reasoning_content"} if kwargs else REPLY
    try:
        first_ids = renderer.first_prompt(FIRST, tools=[WEATHER], template_kwargs=kwargs)
        output = _engine_output(renderer, reply, appended, kwargs)
        base = Checkpoint(
            turns=1, messages=(*FIRST, reply), token_ids=[*first_ids, *output], last_output_ids=output
        )
        messages = [*FIRST, reply, *appended]
        ids = renderer.continue_prompt(
            base, messages, tools=[WEATHER], template_kwargs=kwargs, rewritten_history="append"
        )
        if ids[: len(base.token_ids)] != list(base.token_ids):
            return "FAIL: the prompt does not extend the session's ids"
        full = renderer.render(messages, tools=[WEATHER], add_generation_prompt=True, template_kwargs=kwargs)
        if ids == renderer.encode(full):
            return "exact"
        found = token_mismatch(
            renderer, messages, ids, tools=[WEATHER], template_kwargs=kwargs, add_generation_prompt=True
        )
        other = [m["type"] for m in found if m["type"] != "assistant_text"]
        return "exact, reasoning kept" if not other else f"FAIL: {', '.join(sorted(set(other)))}"
    except (ChatTemplateError, ValueError) as exc:
        return f"FAIL: {str(exc)[:80]}"


def _engine_output(
    renderer: ChatRenderer,
    reply: dict[str, Any],
    appended: list[dict[str, Any]],
    kwargs: dict[str, Any] | None,
) -> list[int]:
    """What the engine generates for reply: the template's text for it after the generation prompt, up to the
    assistant message's closing text, then the stop token (the close text's first id where it is a stop)."""
    prompt = renderer.render(FIRST, tools=[WEATHER], add_generation_prompt=True, template_kwargs=kwargs)
    whole = renderer.render(
        [*FIRST, reply], tools=[WEATHER], add_generation_prompt=False, template_kwargs=kwargs
    )
    if not whole.startswith(prompt):
        raise ValueError("the reply's rendering does not extend the generation prompt")
    text = whole[len(prompt) :]
    close = renderer.decode(list(renderer.close_ids))
    if close and text.endswith(close):
        text = text[: -len(close)]
    ids = renderer.encode(text)
    # the model stops where its template goes on: at the next message's opening token where that is a stop
    after = renderer.encode(
        renderer.render(
            [*FIRST, reply, *appended], tools=[WEATHER], add_generation_prompt=True, template_kwargs=kwargs
        )
    )
    following = after[len(renderer.encode(whole)) - len(renderer.close_ids) :] if not close else []
    stop = (
        following[0] if following and following[0] in renderer.stop_token_ids else renderer.stop_token_ids[0]
    )
    return [*ids, stop]


def table(root: Path = TOKENIZERS) -> str:
    rows = ["| family | " + " | ".join(CASES) + " |", "| --- |" + " --- |" * len(CASES)]
    for family in families(root):
        try:
            renderer = load(root, family)
        except ValueError as exc:  # DeepSeek-V3.2 ships no template: miles renders it with Python code
            rows.append(
                f"| {family} | "
                + " | ".join(["no chat template: " + str(exc).split(": ")[-1]] * len(CASES))
                + " |"
            )
            continue
        rows.append(f"| {family} | " + " | ".join(verdict(renderer, case) for case in CASES) + " |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=TOKENIZERS)
    print(table(parser.parse_args().dir))


if __name__ == "__main__":
    main()
