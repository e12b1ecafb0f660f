"""Token in, token out: render chat messages to prompt ids exactly as training will see them.

Theory of operation. The gateway loads a local Hugging Face tokenizer folder (`tokenizer.json` and
`tokenizer_config.json` with a `chat_template`, or a `chat_template.jinja` file) with the `tokenizers`
library, and renders the template with jinja2 in the same sandboxed environment Hugging Face uses
(`trim_blocks`, `lstrip_blocks`, a `tojson` that does not HTML-escape, `raise_exception`, `strftime_now`,
`loopcontrols`, the `{% generation %}` tag). No model hub, no `transformers`.

The first turn's prompt is the template rendered with `add_generation_prompt=True`, tokenized. Every later
turn reuses the session's accumulated ids instead of re-tokenizing the history:

    prompt(k+1) = prompt(k) + output(k) + bridge(k) + encode(suffix(k+1))

- `output(k)` are the ids the engine generated in turn k, exactly as it returned them (never re-tokenized:
  re-tokenizing decoded text does not give back the same ids);
- `bridge(k)` closes the assistant turn where the engine did not: the template ends an assistant message
  with a closing text (ChatML: `<|im_end|>\\n`, tokenized once as `close_ids`); the engine stops at the stop
  token `<|im_end|>` and never generates the `\\n`. So the bridge is the part of `close_ids` that the output
  does not already end with (`\\n` after a normal stop; `<|im_end|>\\n` after a `length` cut);
- `suffix(k+1)` is the text the template renders after that closed assistant turn: render the request's
  messages with the generation prompt (`full`), render its first messages up to and including the echoed
  assistant reply without it (`head`), and take `full[len(head):]` (the new tool results or user message
  and the generation prompt).

The invariant: the ids sent to the engine as `input_ids` for turn k+1 start with every id of turn k's prompt
and output, so the trajectory (last prompt + last output) contains each turn's generated ids at the place
the engine generated them, and what the engine saw is exactly what training gets. It needs the template to
be prefix-stable at assistant boundaries (`full` starts with `head`; true of ChatML/Hermes templates, false
of templates that rewrite earlier turns, e.g. ones that drop earlier reasoning). Where it does not hold, the
suffix is rendered after a fixed stand-in history instead (`rewritten_history="append"`, the gateway's
default, as miles' TITO tokenizers do: the ids stay exact, and the engine sees the earlier turns as it
generated them, reasoning included, not as the template would render them now), or the request fails with
`chat_template_error` (`"refuse"`); a template that rewrites even that fails either way.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from rolloutgate.sessions.errors import ChatTemplateError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = ("ChatRenderer", "Checkpoint", "close_overlap")

_PROBE_USER = "\u2063rolloutgate-probe-user\u2063"
_PROBE_ASSISTANT = "\u2063rolloutgate-probe-assistant\u2063"
# Roles a turn may append after an answer (miles' `VALID_APPEND_ROLES`): anything else (e.g. `developer`) has
# no place after an assistant turn in the templates users train with, and miles refuses it with a 400.
APPEND_ROLES = frozenset({"tool", "user", "system", "assistant"})
# Closed assistant turns to render the new messages after, in order of preference. The first is miles' TITO
# stand-in (tito_tokenizer.py `_DUMMY_SYSTEM` + `_build_dummy_assistant`): no user message, so templates that
# render reasoning only after the last user query (Qwen3, MiniMax, DeepSeek) render the stand-in the same way
# with and without what follows; a blank `reasoning_content` keeps a "drop empty reasoning" branch from
# firing; the stored answer's tool calls make tool results render as answers to them. Then a plain exchange
# without, then with a system message (templates that require a user or a system message first).
_MILES_STAND_IN_SYSTEM: dict[str, Any] = {"role": "system", "content": "dummy system"}
_STAND_INS: tuple[list[dict[str, Any]], ...] = (
    [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_ASSISTANT}],
    [
        {"role": "system", "content": _PROBE_USER},
        {"role": "user", "content": _PROBE_USER},
        {"role": "assistant", "content": _PROBE_ASSISTANT},
    ],
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Checkpoint:
    """A session's state after `turns` turns: what the next turn must extend."""

    turns: int
    messages: tuple[dict[str, Any], ...]  # last request's messages + the reply ("" for no turns)
    token_ids: Sequence[int]  # last prompt + last output
    last_output_ids: Sequence[int]


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (HF's assistant-mask tag): renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: Any = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def close_overlap(output_ids: Sequence[int], close_ids: Sequence[int]) -> int:
    """The largest m such that `output_ids` ends with `close_ids[:m]` (how much of the closing the engine made)."""
    for m in range(min(len(close_ids), len(output_ids)), 0, -1):
        if list(output_ids[len(output_ids) - m :]) == list(close_ids[:m]):
            return m
    return 0


class ChatRenderer:
    """A tokenizer plus its chat template. Thread-safe for rendering and encoding (no mutable state)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        chat_template: str | dict[str, str],
        *,
        special_tokens: dict[str, str] | None = None,
        stop_token_ids: Sequence[int] = (),
        name: str = "tokenizer",
    ) -> None:
        self.tokenizer = tokenizer
        self.name = name
        env = _environment()
        templates = chat_template if isinstance(chat_template, dict) else {"default": chat_template}
        try:
            self._templates = {key: env.from_string(source) for key, source in templates.items()}
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"{name}: chat template does not parse: {exc}") from exc
        if "default" not in self._templates:
            raise ValueError(f"{name}: chat template list has no 'default' entry")
        self.special_tokens = dict(special_tokens or {})
        self.stop_token_ids = tuple(stop_token_ids)
        self.close_ids = self._probe_close_ids()
        # tokens that delimit messages and roles (miles' comparator segments at these)
        self.special_ids = frozenset(
            token_id for token_id, added in tokenizer.get_added_tokens_decoder().items() if added.special
        )
        self.assistant_opener = self._probe_assistant_opener()

    @classmethod
    def from_dir(cls, path: str | Path, *, chat_template_path: str | Path | None = None) -> ChatRenderer:
        """Load `tokenizer.json` + `tokenizer_config.json` (+ `chat_template.jinja`, `generation_config.json`);
        a `chat_template_path` file replaces the folder's template (miles' `--chat-template-path`).

        Raises ValueError when the folder lacks a tokenizer or a chat template; ImportError without `tokenizers`.
        """
        from tokenizers import Tokenizer

        folder = Path(path)
        if not (folder / "tokenizer.json").is_file():
            raise ValueError(f"{folder}: no tokenizer.json (a Hugging Face fast tokenizer folder is needed)")
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        config = _read_json(folder / "tokenizer_config.json")
        template: Any = config.get("chat_template")
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        if chat_template_path is not None:
            template = Path(chat_template_path).read_text(encoding="utf-8")
        if isinstance(template, list):
            template = {entry["name"]: entry["template"] for entry in template}
        if not template:
            raise ValueError(f"{folder}: no chat_template in tokenizer_config.json nor chat_template.jinja")
        special = {
            key: _token_text(config[key])
            for key in ("bos_token", "eos_token", "unk_token", "pad_token")
            if config.get(key) is not None
        }
        stops: list[int] = []
        eos = special.get("eos_token")
        eos_id = tokenizer.token_to_id(eos) if eos is not None else None
        if eos_id is not None:
            stops.append(eos_id)
        generation = _read_json(folder / "generation_config.json")
        extra = generation.get("eos_token_id")
        for token_id in extra if isinstance(extra, list) else [extra] if isinstance(extra, int) else []:
            if token_id not in stops:
                stops.append(token_id)
        return cls(tokenizer, template, special_tokens=special, stop_token_ids=stops, name=str(folder))

    # -- rendering and tokenizing -------------------------------------------------------------------------

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        tools: list[Any] | None = None,
        add_generation_prompt: bool,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The template's text for these messages. Raises ChatTemplateError if the template refuses them."""
        template = self._templates.get("tool_use") if tools else None
        template = template or self._templates["default"]
        context = {**self.special_tokens, **(template_kwargs or {})}
        normalized = _as_templates_expect(messages)
        # Most templates index tool-call arguments as objects; some (DeepSeek-V3.1) concatenate them as the JSON
        # text they came as: the messages as given are the second try.
        attempts = [(normalized, list(messages)) if normalized != messages else (normalized,)]
        tool_defs = as_sglang_tools(tools)
        tool_tries = (tool_defs, [t["function"] for t in tool_defs]) if tool_defs else (None,)
        for tool_try in tool_tries:  # SGLang's (and miles') fallback: the bare functions, for templates that
            for attempt in attempts[0]:  # want them
                try:
                    return template.render(
                        messages=attempt,
                        tools=tool_try,
                        add_generation_prompt=add_generation_prompt,
                        **context,
                    )
                # a template is a program: whatever it raises on these messages is theirs to fix, never a 500
                except Exception as exc:
                    failure = exc
        raise ChatTemplateError(f"the chat template failed on these messages: {failure}") from failure

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens written in it are recognized, none are added."""
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False).ids
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        text: str = self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return text

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id])

    # -- the incremental rule -----------------------------------------------------------------------------

    def first_prompt(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        tools: list[Any] | None,
        template_kwargs: dict[str, Any] | None,
    ) -> list[int]:
        return self.encode(
            self.render(messages, tools=tools, add_generation_prompt=True, template_kwargs=template_kwargs)
        )

    def continue_prompt(
        self,
        base: Checkpoint,
        messages: Sequence[dict[str, Any]],
        *,
        tools: list[Any] | None,
        template_kwargs: dict[str, Any] | None,
        rewritten_history: Literal["append", "refuse"] = "refuse",
    ) -> list[int]:
        """Prompt ids for `messages`, which extend `base.messages` (the caller checked): base ids + bridge +
        the new messages' ids. A template that rewrites the history already rendered (one that drops earlier
        reasoning) raises ChatTemplateError, or with `rewritten_history="append"` gets the new messages
        rendered after a fixed stand-in history instead, as miles' TITO tokenizers do: the engine then sees the
        earlier turns as they were generated, not as the template would render them now."""
        if base.turns == 0:
            return self.first_prompt(messages, tools=tools, template_kwargs=template_kwargs)
        for at, message in enumerate(messages[len(base.messages) :], start=len(base.messages)):
            if message.get("role") not in APPEND_ROLES:
                raise ChatTemplateError(  # miles' words, which its clients match
                    f"appended message at index {at} has role={message.get('role')!r}, allowed="
                    f"{sorted(APPEND_ROLES)}; the selected TITO fixed template does not support appending this role",
                    param=f"messages[{at}].role",
                )
        full = self.render(messages, tools=tools, add_generation_prompt=True, template_kwargs=template_kwargs)
        head = self.render(
            messages[: len(base.messages)],
            tools=tools,
            add_generation_prompt=False,
            template_kwargs=template_kwargs,
        )
        suffix: str | None = full[len(head) :] if full.startswith(head) else None
        if suffix is None and rewritten_history == "append":
            answer = base.messages[-1] if base.messages else {}
            suffix = self._suffix_after_stand_in(
                messages[len(base.messages) :], list(answer.get("tool_calls") or []), tools, template_kwargs
            )
        if suffix is None:
            at = next((i for i, (a, b) in enumerate(zip(full, head, strict=False)) if a != b), len(full))
            raise ChatTemplateError(
                "the chat template is not prefix-stable for this conversation: rendering the new messages "
                f"changes the already-rendered history at character {at}, so the session's token ids cannot be "
                "reused exactly (a template that rewrites earlier turns cannot serve token-in-token-out sessions)"
            )
        bridge = list(self.close_ids[close_overlap(base.last_output_ids, self.close_ids) :])
        following = self.encode(suffix)
        # GLM's way: the stop token the engine generated (`<|observation|>`, `<|user|>`) is the next message's
        # opening token itself, so the session's ids already hold it (miles trims it instead: max_trim_tokens)
        last = base.last_output_ids[-1] if base.last_output_ids else None
        if not bridge and following and last in self.stop_token_ids and following[0] == last:
            del following[0]
        return [*base.token_ids, *bridge, *following]

    def _suffix_after_stand_in(
        self,
        new_messages: Sequence[dict[str, Any]],
        answer_tool_calls: list[Any],
        tools: list[Any] | None,
        template_kwargs: dict[str, Any] | None,
    ) -> str | None:
        """What the template renders for `new_messages` after a closed assistant turn of a fixed stand-in
        history, or None if none is prefix-stable either (a template that rewrites everything)."""
        miles_stand_in = [
            _MILES_STAND_IN_SYSTEM,
            {"role": "assistant", "content": "", "reasoning_content": " ", "tool_calls": answer_tool_calls},
        ]
        for stand_in in (miles_stand_in, *_STAND_INS):
            try:
                head = self.render(
                    stand_in, tools=tools, add_generation_prompt=False, template_kwargs=template_kwargs
                )
                full = self.render(
                    [*stand_in, *new_messages],
                    tools=tools,
                    add_generation_prompt=True,
                    template_kwargs=template_kwargs,
                )
            except ChatTemplateError:
                continue
            if full.startswith(head):
                return full[len(head) :]
        return None

    def _probe_close_ids(self) -> tuple[int, ...]:
        """Ids of the text the template writes after an assistant message's content (ChatML: `<|im_end|>\\n`)."""
        for probe in _STAND_INS:
            try:
                text = self.render(probe, add_generation_prompt=False)
            except ChatTemplateError:
                continue
            at = text.rfind(_PROBE_ASSISTANT)
            if at >= 0:
                return tuple(self.encode(text[at + len(_PROBE_ASSISTANT) :]))
        return ()

    def _probe_assistant_opener(self) -> str:
        """The text that opens every assistant turn (ChatML: `<|im_start|>assistant`): what the generation
        prompt and an earlier answer's rendering share (the prompt may open reasoning, `<think>`; an earlier
        answer may have had its reasoning dropped)."""
        for probe in _STAND_INS:
            question = probe[:-1]
            try:
                head = self.render(question, add_generation_prompt=False)
                prompt = self.render(question, add_generation_prompt=True)
                answered = self.render([*probe, question[-1]], add_generation_prompt=False)
            except ChatTemplateError:
                continue
            if prompt.startswith(head) and answered.startswith(head):
                opens, earlier = prompt[len(head) :], answered[len(head) :]
                shared = next(
                    (i for i, (a, b) in enumerate(zip(opens, earlier, strict=False)) if a != b), len(opens)
                )
                return opens[:shared].rstrip()
        return ""

    def __repr__(self) -> str:
        return f"<ChatRenderer {self.name} close={list(self.close_ids)} stop={list(self.stop_token_ids)}>"


def as_sglang_tools(tools: Sequence[Any] | None) -> list[dict[str, Any]] | None:
    """The tool definitions as SGLang's chat route hands them to the template, and miles' TITO renderer with it
    (`[Tool(**t).model_dump() for t in tools]`, SGLang 0.5.23 protocol.py; miles' `extract_tool_dicts`): a bare
    function is wrapped; each tool is `type`, `function` and `defer_loading` (null unless sent); the function
    keeps the keys it came with, in their order, the ones the model knows and the client left out (description,
    parameters) after them as null, `strict` and `defer_loading` only when set, other keys dropped. Rendering
    them any other way gives the engine another prompt than the one miles and SGLang render for the same call.
    Raises ChatTemplateError for a tool without a string name."""
    if not tools:
        return None
    out: list[dict[str, Any]] = []
    for at, tool in enumerate(tools):
        wrapped = (
            tool if isinstance(tool, dict) and "function" in tool else {"type": "function", "function": tool}
        )
        function = wrapped["function"]
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ChatTemplateError(f"tools[{at}] is not a function definition with a string name")
        defer_loading = wrapped.get("defer_loading")
        known = {"description": None, "parameters": None, "strict": None, "defer_loading": None, **function}
        if known["defer_loading"] is None:  # the tool's own flag, placed as a key the client did not send
            known["defer_loading"] = defer_loading
        dumped = {
            key: known[key]
            for key in (*function, "description", "name", "parameters", "strict", "defer_loading")
            if key in _FUNCTION_FIELDS and not (key in ("strict", "defer_loading") and known[key] is None)
        }
        out.append(
            {"type": wrapped.get("type", "function"), "function": dumped, "defer_loading": defer_loading}
        )
    return out


_FUNCTION_FIELDS = frozenset({"description", "name", "parameters", "strict", "defer_loading"})


def _as_templates_expect(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant messages as Hugging Face templates index them (SGLang's and miles' normalisation): tool call
    arguments as objects (GLM and MiniMax iterate `arguments | items`), content "" for none. Messages that need
    nothing are passed as they are (histories are long)."""
    out = list(messages)
    for at, message in enumerate(out):
        if message.get("role") != "assistant":
            continue
        calls = message.get("tool_calls")
        parsed = [_with_object_arguments(call) for call in calls] if isinstance(calls, list) else calls
        if message.get("content") is None or parsed != calls:
            out[at] = {**message, "content": message.get("content") or "", "tool_calls": parsed}
            if parsed is None:
                del out[at]["tool_calls"]
    return out


def _with_object_arguments(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(arguments := function.get("arguments"), str):
        return call
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return call  # left as the model wrote it: a template that needs an object fails, with a 400
    return {**call, "function": {**function, "arguments": value}} if isinstance(value, dict) else call


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    value = json.loads(path.read_text(encoding="utf-8"))
    return value if isinstance(value, dict) else {}


def _token_text(value: Any) -> str:
    return str(value["content"]) if isinstance(value, dict) else str(value)
