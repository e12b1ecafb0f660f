"""Test fixtures (not in the package): a tiny tokenizer folder built offline, and a scripted SGLang `/generate` dispatcher.

`build_tiny_tokenizer(folder)` trains a byte-level BPE (the `tokenizers` library) on built-in text and writes
a Hugging Face tokenizer folder: `tokenizer.json`, and `tokenizer_config.json` with a ChatML chat template that
supports tools the Hermes/Qwen way (tool schemas in the system turn, `<tool_call>{json}</tool_call>` in
assistant turns, tool results as `<tool_response>` blocks in a user turn). Deterministic: the same files every
time, no network, well under a second. The real-engine suite can serve a model with it.

`ScriptedGenerate` stands in for the gateway + an SGLang engine: it answers `/generate` calls with scripted
replies, tokenized and ended with `<|im_end|>`, with deterministic logprobs, and keeps every call it saw (so
tests can compare the ids the engine saw with the trajectory).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from rolloutgate.core.timing import TimingBreakdown
from rolloutgate.sessions.render import ChatRenderer
from rolloutgate.sessions.service import SessionAnswer, SessionCall

__all__ = (
    "CHATML_TOOLS_TEMPLATE",
    "WEATHER_TOOL",
    "ScriptedGenerate",
    "build_tiny_tokenizer",
    "generate_answer",
)

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

CHATML_TOOLS_TEMPLATE = """
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call functions. Their signatures are in <tools></tools>:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nTo call a function, write <tool_call>{"name": <name>, "arguments": <object>}</tool_call>.<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- if not loop.first %}{{- raise_exception('a system message must come first') }}{%- endif %}
{%- elif message.role == 'user' %}
{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' + (message.content or '') }}
{%- for call in message.tool_calls or [] %}
{%- set fn = call.function if call.function is defined else call %}
{%- if (message.content or '') or not loop.first %}{{- '\\n' }}{%- endif %}
{{- '<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' }}
{%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- else %}
{{- raise_exception('unknown role: ' + message.role) }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
""".strip()

_CORPUS = (
    "You are a helpful assistant. The user asks a question and the assistant answers it.",
    "What is the weather in Paris today? It is sunny and 21 degrees in Paris.",
    "Let me look that up with a tool call. The tool returned a result; here is the answer.",
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    '{"name": "search", "arguments": {"query": "rollout gateway timeouts", "top_k": 3}}',
    '{"temperature": 21, "condition": "sunny", "results": ["a", "b", "c"]}',
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "The quick brown fox jumps over the lazy dog. 0123456789 + - * / = < > ( ) [ ] { } , . : ; ! ?",
    "Reinforcement learning rollouts need exact tokens and logprobs for every turn of every session.",
    "system user assistant tool function arguments name content result error done",
)


def build_tiny_tokenizer(folder: str | Path, *, vocab_size: int = 800) -> Path:
    """Write a tiny byte-level BPE tokenizer with a ChatML+tools chat template into `folder`; return it."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([line for line in _CORPUS for _ in range(4)], trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    tokenizer.save(str(out / "tokenizer.json"))
    decoder = {
        str(token_id): {
            "content": added.content,
            "special": added.special,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "single_word": False,
        }
        for token_id, added in sorted(tokenizer.get_added_tokens_decoder().items())
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 32768,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "added_tokens_decoder": decoder,
        "chat_template": CHATML_TOOLS_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True), encoding="utf-8")
    return out


@dataclass(eq=False)
class ScriptedGenerate:
    """A `Dispatcher` that plays an SGLang engine: each `/generate` call gets the next scripted reply text.

    `finish` per reply: "stop" ends with `<|im_end|>` (in the output ids, as SGLang returns a matched stop
    token); "length" cuts the reply to `cut_tokens` ids with no stop token.
    """

    renderer: ChatRenderer
    replies: list[str]
    finish: list[str] = field(default_factory=list)
    cut_tokens: int = 3
    engine_id: str = "engine-0"
    weight_version: str = "v1"
    calls: list[SessionCall] = field(default_factory=list)
    seen_input_ids: list[list[int]] = field(default_factory=list)
    produced_output_ids: list[list[int]] = field(default_factory=list)

    async def __call__(self, call: SessionCall) -> SessionAnswer:
        self.calls.append(call)
        if call.path != "/generate" or call.body is None:
            return SessionAnswer(status=404, body=b'{"error": {"message": "not scripted"}}')
        index = len(self.seen_input_ids)
        input_ids = list(call.body["input_ids"])
        self.seen_input_ids.append(input_ids)
        finish = self.finish[index] if index < len(self.finish) else "stop"
        ids = self.renderer.encode(self.replies[index])
        ids = ids[: self.cut_tokens] if finish == "length" else [*ids, *self.renderer.stop_token_ids[:1]]
        self.produced_output_ids.append(ids)
        return SessionAnswer(
            status=200,
            body=orjson.dumps(
                generate_answer(input_ids, ids, finish=finish, weight_version=self.weight_version)
            ),
            engine_id=self.engine_id,
            timing=TimingBreakdown(
                wall_s=0.5,
                queue_s=0.1,
                paused_s=0.0,
                contention_s=0.0,
                charged_s=0.4,
                stall_s=0.0,
                dispatched_s=0.4,
                attempts=1,
                engine_id=self.engine_id,
                tokens=len(ids),
            ),
        )


def scripted_logprob(position: int, token_id: int) -> float:
    """The deterministic logprob ScriptedGenerate reports for a token."""
    return -round(0.001 * (position + 1) + 0.0001 * (token_id % 97), 6)


def generate_answer(
    input_ids: Sequence[int], output_ids: Sequence[int], *, finish: str = "stop", weight_version: str = "v1"
) -> dict[str, Any]:
    """An SGLang `/generate` answer body (meta_info with `[logprob, id, null]` triples)."""
    if finish == "stop":
        finish_reason: dict[str, Any] = {"type": "stop", "matched": output_ids[-1] if output_ids else None}
    else:
        finish_reason = {"type": "length", "length": len(output_ids)}
    return {
        "text": "",
        "output_ids": list(output_ids),
        "meta_info": {
            "id": "rid",
            "finish_reason": finish_reason,
            "prompt_tokens": len(input_ids),
            "completion_tokens": len(output_ids),
            "cached_tokens": 0,
            "weight_version": weight_version,
            "output_token_logprobs": [[scripted_logprob(i, t), t, None] for i, t in enumerate(output_ids)],
        },
    }
