"""Fixtures for the session tests: the tiny offline tokenizer, a renderer, and record builders."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rolloutgate.sessions.messages import message_key, tools_key
from rolloutgate.sessions.record import TurnRecord, ids_array, logprob_array
from rolloutgate.sessions.render import ChatRenderer
from tests.sessions.fixtures import build_tiny_tokenizer


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))


@pytest.fixture(scope="session")
def renderer(tokenizer_dir: Path) -> ChatRenderer:
    return ChatRenderer.from_dir(tokenizer_dir)


def make_record(
    index: int,
    *,
    prompt_prefix_len: int = 0,
    prompt_new_ids: list[int] | None = None,
    output_ids: list[int] | None = None,
    logprobs: list[float] | None = None,
    messages_from: int = 0,
    new_messages: list[dict[str, Any]] | None = None,
    reply: str = "ok",
    tools: Any = None,
    payload: str = "",
) -> TurnRecord:
    """A record with consistent keys; `payload` pads the request to control approx_bytes."""
    new = new_messages if new_messages is not None else [{"role": "user", "content": f"turn {index}"}]
    reply_message = {"role": "assistant", "content": reply}
    outputs = output_ids if output_ids is not None else [100 + index, 2]
    return TurnRecord(
        index=index,
        request_id=f"r{index}",
        request_at_unix=1.0,
        finished_at_unix=2.0,
        request={"model": "m", "payload": payload},
        messages_from=messages_from,
        new_messages=tuple(new),
        reply_message=reply_message,
        response={"id": f"chatcmpl-r{index}"},
        prompt_prefix_len=prompt_prefix_len,
        prompt_new_ids=ids_array(prompt_new_ids if prompt_new_ids is not None else [1, 10 + index]),
        output_ids=ids_array(outputs),
        output_logprobs=logprob_array(logprobs if logprobs is not None else [-0.5] * len(outputs)),
        finish_reason="stop",
        engine_id="e0",
        weight_version="v1",
        timing=None,
        request_key=b"key-%d" % index,
        tools_key=tools_key(tools, None),
        message_keys=(*(message_key(m) for m in new), message_key(reply_message)),
        tokenized_by_gateway=True,
    )


@pytest.fixture
def record() -> Any:
    """`record(index, **fields)` builds a TurnRecord (see make_record)."""
    return make_record
