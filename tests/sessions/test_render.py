"""Token-in-token-out rendering: the tokenizer folder, the template environment, and the incremental rule."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rolloutgate.sessions.errors import ChatTemplateError
from rolloutgate.sessions.render import ChatRenderer, Checkpoint, as_sglang_tools, close_overlap
from tests.sessions.fixtures import WEATHER_TOOL, build_tiny_tokenizer


def test_the_tiny_tokenizer_is_built_deterministically(tmp_path: Path, tokenizer_dir: Path) -> None:
    again = build_tiny_tokenizer(tmp_path / "again")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (again / name).read_bytes() == (tokenizer_dir / name).read_bytes()


def test_loads_the_folder(renderer: ChatRenderer) -> None:
    im_end = renderer.tokenizer.token_to_id("<|im_end|>")
    assert renderer.stop_token_ids == (im_end,)
    assert list(renderer.close_ids) == renderer.encode("<|im_end|>\n")
    assert renderer.special_tokens["eos_token"] == "<|im_end|>"
    assert (
        renderer.decode(renderer.encode("<tool_call>\n{}\n</tool_call>")) == "<tool_call>\n{}\n</tool_call>"
    )


def test_folder_errors(tmp_path: Path, tokenizer_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        ChatRenderer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((tokenizer_dir / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError, match="chat_template"):
        ChatRenderer.from_dir(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0].content }}|")
    assert (
        ChatRenderer.from_dir(tmp_path).render(
            [{"role": "user", "content": "hi"}], add_generation_prompt=False
        )
        == "hi|"
    )


def test_named_templates_pick_tool_use_when_tools_are_given(renderer: ChatRenderer) -> None:
    named = ChatRenderer(
        renderer.tokenizer, {"default": "plain", "tool_use": "with {{ tools | length }} tools"}
    )
    assert named.render([], add_generation_prompt=False) == "plain"
    assert (
        named.render([], tools=[{"name": "a"}, {"name": "b"}], add_generation_prompt=False) == "with 2 tools"
    )


def test_environment_matches_hugging_face(renderer: ChatRenderer) -> None:
    template = (
        "{% generation %}{{ messages[0].content | tojson }}{% endgeneration %}"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}!{% endfor %}{{ eos_token }}"
    )
    custom = ChatRenderer(renderer.tokenizer, template, special_tokens={"eos_token": "<|im_end|>"})
    # tojson neither HTML-escapes nor forces ASCII; loopcontrols and the generation tag work
    out = custom.render(
        [{"role": "user", "content": "<b> & é"}, {"role": "user", "content": "x"}],
        add_generation_prompt=False,
    )
    assert out == '"<b> & é"!<|im_end|>'
    failing = ChatRenderer(renderer.tokenizer, "{{ raise_exception('no system role here') }}")
    with pytest.raises(ChatTemplateError, match="no system role here") as info:
        failing.render([], add_generation_prompt=True)
    assert info.value.status == 400


def test_close_overlap() -> None:
    assert close_overlap([5, 2], [2, 9]) == 1
    assert close_overlap([5, 2, 9], [2, 9]) == 2
    assert close_overlap([5, 6], [2, 9]) == 0
    assert close_overlap([], [2, 9]) == 0
    assert close_overlap([5], []) == 0


TOOL_CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def conversation() -> list[tuple[list[dict[str, Any]], str, dict[str, Any]]]:
    """(new messages, what the model writes, the assistant message the agent echoes back) per turn."""
    return [
        (
            [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is the weather in Paris?"},
            ],
            TOOL_CALL_TEXT,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_0",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
        ),
        (
            [
                {
                    "role": "tool",
                    "tool_call_id": "call_0",
                    "content": '{"temperature": 21, "condition": "sunny"}',
                }
            ],
            "It is sunny and 21 degrees in Paris.",
            {"role": "assistant", "content": "It is sunny and 21 degrees in Paris."},
        ),
        (
            [{"role": "user", "content": "Thank you!"}],
            "You are welcome.",
            {"role": "assistant", "content": "You are welcome."},
        ),
    ]


def test_incremental_ids_equal_a_full_re_render(renderer: ChatRenderer) -> None:
    """With a prefix-stable template and output ids that equal the tokenized reply, reusing the session's ids
    gives exactly the ids of rendering the whole conversation from scratch, at every turn."""
    tools = [WEATHER_TOOL]
    im_end = renderer.stop_token_ids[0]
    messages: list[dict[str, Any]] = []
    checkpoint = Checkpoint(turns=0, messages=(), token_ids=[], last_output_ids=[])
    for turn, (new, model_text, echo) in enumerate(conversation()):
        messages = [*messages, *new]
        prompt = renderer.continue_prompt(checkpoint, messages, tools=tools, template_kwargs=None)
        assert prompt == renderer.encode(renderer.render(messages, tools=tools, add_generation_prompt=True))
        assert prompt[: len(checkpoint.token_ids)] == list(checkpoint.token_ids)
        output = [*renderer.encode(model_text), im_end]
        messages = [*messages, echo]
        checkpoint = Checkpoint(
            turns=turn + 1, messages=tuple(messages), token_ids=[*prompt, *output], last_output_ids=output
        )


def test_a_length_cut_reply_is_closed_by_the_bridge(renderer: ChatRenderer) -> None:
    first = [{"role": "user", "content": "Tell me a story."}]
    prompt = renderer.first_prompt(first, tools=None, template_kwargs=None)
    output = renderer.encode("Once upon a time")[:3]  # cut by max_tokens: no <|im_end|>
    echo = {"role": "assistant", "content": renderer.decode(output)}
    messages = [*first, echo, {"role": "user", "content": "Go on."}]
    base = Checkpoint(turns=1, messages=(*first, echo), token_ids=[*prompt, *output], last_output_ids=output)
    following = renderer.continue_prompt(base, messages, tools=None, template_kwargs=None)
    start = len(prompt) + len(output)
    assert following[:start] == [*prompt, *output]
    assert following[start : start + len(renderer.close_ids)] == list(renderer.close_ids)
    assert (
        renderer.decode(following[start:])
        == "<|im_end|>\n<|im_start|>user\nGo on.<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_template_that_rewrites_history_is_refused(renderer: ChatRenderer) -> None:
    counting = ChatRenderer(
        renderer.tokenizer,
        "[{{ messages | length }} messages]"
        "{%- for message in messages %}{{ '<|im_start|>' + message.role + '\\n' + message.content + "
        "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}",
        stop_token_ids=renderer.stop_token_ids,
    )
    first = [{"role": "user", "content": "hi"}]
    prompt = counting.first_prompt(first, tools=None, template_kwargs=None)
    output = [*counting.encode("hello"), renderer.stop_token_ids[0]]
    echo = {"role": "assistant", "content": "hello"}
    base = Checkpoint(turns=1, messages=(*first, echo), token_ids=[*prompt, *output], last_output_ids=output)
    with pytest.raises(ChatTemplateError, match="prefix-stable") as info:
        counting.continue_prompt(  # it rewrites the stand-in history too: refused even when appending
            base,
            [*first, echo, {"role": "user", "content": "again"}],
            tools=None,
            template_kwargs=None,
            rewritten_history="append",
        )
    assert info.value.code == "chat_template_error"


def test_config_reads_generation_eos_ids(tmp_path: Path, tokenizer_dir: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tokenizer_dir / name).read_bytes())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert ChatRenderer.from_dir(tmp_path).stop_token_ids == (2, 0)


# Qwen3's way: an assistant turn before the last user message is rendered without its reasoning.
DROPS_EARLIER_REASONING = (
    "{%- set last_user = namespace(i=-1) %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}{%- set last_user.i = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and loop.index0 < last_user.i %}"
    "{{ '<|im_start|>assistant\\n' + message.content.split('</think>')[-1].lstrip() + '<|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_a_template_that_drops_earlier_reasoning_is_appended_to_as_miles_does(renderer: ChatRenderer) -> None:
    qwen = ChatRenderer(renderer.tokenizer, DROPS_EARLIER_REASONING, stop_token_ids=renderer.stop_token_ids)
    first = [{"role": "user", "content": "hi"}]
    prompt = qwen.first_prompt(first, tools=None, template_kwargs=None)
    reply = "<think>the user greets</think>hello"
    output = [*qwen.encode(reply), renderer.stop_token_ids[0]]
    echo = {"role": "assistant", "content": reply}
    base = Checkpoint(turns=1, messages=(*first, echo), token_ids=[*prompt, *output], last_output_ids=output)
    following = [*first, echo, {"role": "user", "content": "again"}]
    with pytest.raises(ChatTemplateError, match="prefix-stable"):
        qwen.continue_prompt(base, following, tools=None, template_kwargs=None, rewritten_history="refuse")
    ids = qwen.continue_prompt(base, following, tools=None, template_kwargs=None, rewritten_history="append")
    assert ids[: len(prompt) + len(output)] == [*prompt, *output]  # the reasoning as generated, kept
    assert (
        qwen.decode(ids[len(prompt) + len(output) :])
        == "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_role_no_template_appends_after_an_answer_is_refused_as_miles_does(renderer: ChatRenderer) -> None:
    first = [{"role": "user", "content": "hi"}]
    prompt = renderer.first_prompt(first, tools=None, template_kwargs=None)
    output = [*renderer.encode("hello"), renderer.stop_token_ids[0]]
    echo = {"role": "assistant", "content": "hello"}
    base = Checkpoint(turns=1, messages=(*first, echo), token_ids=[*prompt, *output], last_output_ids=output)
    with pytest.raises(ChatTemplateError, match="role='developer'") as info:
        renderer.continue_prompt(
            base,
            [*first, echo, {"role": "developer", "content": "be brief"}],
            tools=None,
            template_kwargs=None,
        )
    assert info.value.status == 400 and info.value.param == "messages[2].role"
    for role in ("user", "tool"):  # roles miles lets a turn append (this template refuses a late system)
        renderer.continue_prompt(
            base, [*first, echo, {"role": role, "content": "x"}], tools=None, template_kwargs=None
        )


def test_a_chat_template_path_replaces_the_folders_template(tmp_path: Path, tokenizer_dir: Path) -> None:
    template = tmp_path / "fixed.jinja"
    template.write_text("{% for m in messages %}[{{ m.role }}]{% endfor %}")
    fixed = ChatRenderer.from_dir(tokenizer_dir, chat_template_path=template)
    assert fixed.render([{"role": "user", "content": "x"}], add_generation_prompt=False) == "[user]"


# Qwen3's own rule, reduced: reasoning is rendered only for assistant turns after the last user query, and for
# the last one always (as an empty block when it has none). An answer without reasoning is rendered with an
# empty block while it is last and without one once anything follows it, so no real history is prefix-stable.
EMPTY_THINK_WHILE_LAST = (
    "{%- set ns = namespace(last_query=messages|length - 1) %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_query = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and loop.index0 > ns.last_query and (loop.last or "
    "message.reasoning_content) %}"
    "{{ '<|im_start|>assistant\\n<think>' + (message.reasoning_content or '') + '</think>' + "
    "(message.content or '') + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}{{ '<|im_start|>user\\n<tool_response>' + message.content + "
    "'</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_miles_stand_in_serves_a_template_that_renders_the_last_answer_differently(
    renderer: ChatRenderer,
) -> None:
    """The plain user/assistant stand-in is not prefix-stable under this rule either (its assistant is after
    the last user query); miles' system + blank-reasoning assistant stand-in is, for tool results and users."""
    qwen = ChatRenderer(renderer.tokenizer, EMPTY_THINK_WHILE_LAST, stop_token_ids=renderer.stop_token_ids)
    first = [{"role": "user", "content": "weather?"}]
    prompt = qwen.first_prompt(first, tools=None, template_kwargs=None)
    output = [*qwen.encode("<think></think>checking"), renderer.stop_token_ids[0]]
    echo = {"role": "assistant", "content": "checking"}
    base = Checkpoint(turns=1, messages=(*first, echo), token_ids=[*prompt, *output], last_output_ids=output)
    for new, text in (
        ({"role": "tool", "content": "sunny"}, "<|im_start|>user\n<tool_response>sunny</tool_response>"),
        ({"role": "user", "content": "thanks"}, "<|im_start|>user\nthanks"),
    ):
        with pytest.raises(ChatTemplateError, match="prefix-stable"):
            qwen.continue_prompt(base, [*first, echo, new], tools=None, template_kwargs=None)
        ids = qwen.continue_prompt(
            base, [*first, echo, new], tools=None, template_kwargs=None, rewritten_history="append"
        )
        assert ids[: len(base.token_ids)] == list(base.token_ids)
        assert qwen.decode(ids[len(base.token_ids) :]) == f"\n{text}<|im_end|>\n<|im_start|>assistant\n"


# SGLang 0.5.23's `[Tool(**t).model_dump() for t in tools]` (protocol.py), printed by that SGLang for each case
# (`.venv-miles`, make test-miles): the tool text the engine's own chat route and miles' TITO renderer render.
SGLANG_TOOL_DUMPS = [
    (
        [{"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}}],
        [
            {
                "type": "function",
                "function": {"name": "a", "parameters": {"type": "object"}, "description": None},
                "defer_loading": None,
            }
        ],
    ),
    (
        [{"name": "b", "description": "d", "parameters": {}}],  # a bare function
        [
            {
                "type": "function",
                "function": {"name": "b", "description": "d", "parameters": {}},
                "defer_loading": None,
            }
        ],
    ),
    (
        [
            {
                "type": "function",
                "function": {"parameters": {"x": 1}, "name": "c", "strict": True, "extra": 5},
                "defer_loading": True,
            }
        ],
        [
            {
                "type": "function",
                "function": {
                    "parameters": {"x": 1},
                    "name": "c",
                    "strict": True,
                    "description": None,
                    "defer_loading": True,
                },
                "defer_loading": True,
            }
        ],
    ),
    (
        [{"type": "function", "function": {"name": "e", "description": "z"}, "extra_top": 1}],
        [
            {
                "type": "function",
                "function": {"name": "e", "description": "z", "parameters": None},
                "defer_loading": None,
            }
        ],
    ),
    (
        [{"type": "function", "function": {"name": "f", "defer_loading": False}, "defer_loading": True}],
        [
            {
                "type": "function",
                "function": {"name": "f", "defer_loading": False, "description": None, "parameters": None},
                "defer_loading": True,
            }
        ],
    ),
]


@pytest.mark.parametrize(("tools", "dumped"), SGLANG_TOOL_DUMPS)
def test_tools_are_rendered_as_sglang_dumps_them(tools: list[Any], dumped: list[Any]) -> None:
    # key order matters: the template writes each tool with tojson, in the dict's order
    assert json.dumps(as_sglang_tools(tools)) == json.dumps(dumped)


def test_a_tool_without_a_name_is_a_template_error() -> None:
    with pytest.raises(ChatTemplateError, match=r"tools\[1\]"):
        as_sglang_tools([{"name": "ok"}, {"type": "function", "function": {"description": "no name"}}])
