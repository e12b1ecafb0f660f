"""How many token ids a model has, read from its local folder: the bound every prompt id must stay under.

An engine indexes its embedding table with each prompt id; SGLang 0.5.9 does so unchecked, and an id past the
table (or a negative one) takes the whole server down (reference/real-sglang.md). The table's size is the
model's `config.json` `vocab_size` (its `text_config`'s for a multimodal model, as SGLang's `hf_text_config`),
which is at least the tokenizer's length: Qwen pads its 151,669 tokens to 151,936 rows, and an id between the
two, which the model may sample, harms nothing. A folder without `config.json` (a tokenizer alone) gives the
tokenizer's length with its added tokens, read from `tokenizer.json` (what `len(tokenizer)` says).

Neither SGLang (0.5.9, or main) nor vLLM states its vocabulary over HTTP; both name their model's folder
(SGLang `/server_info` `model_path`, the `/v1/models` card's `root`), which the gateway reads when it can
(the adapters' `probe`, engines/). The simulator states it as well (`vocab_size`, sim/).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import orjson

__all__ = ("folder_vocab_size", "tokenizer_length")

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=64)  # an engine is probed again after each pause; its vocabulary stays
def folder_vocab_size(folder: str | Path) -> int | None:
    """The vocabulary of the model or tokenizer in `folder` (see the module docstring); None when `folder` is
    not a readable local folder with a `config.json` that states it or a `tokenizer.json`."""
    path = Path(folder)
    try:
        if not path.is_dir():
            return None
        config = path / "config.json"
        if config.is_file():
            size = _config_vocab_size(orjson.loads(config.read_bytes()))
            if size is not None:
                return size
        tokenizer = path / "tokenizer.json"
        if tokenizer.is_file():
            return tokenizer_length(orjson.loads(tokenizer.read_bytes()))
    except (OSError, orjson.JSONDecodeError) as error:
        log.info("no vocabulary read from %s: %s", folder, error)
    return None


def _config_vocab_size(config: Any) -> int | None:
    if not isinstance(config, dict):
        return None
    text = config.get("text_config")
    for section in (text, config):
        size = section.get("vocab_size") if isinstance(section, dict) else None
        if type(size) is int and size > 0:
            return size
    return None


def tokenizer_length(tokenizer: Any) -> int | None:
    """`len(tokenizer)` of a parsed `tokenizer.json`: one past its largest id, added tokens included (a BPE or
    WordPiece `vocab` maps tokens to ids, a Unigram one lists them); None when it holds no ids."""
    if not isinstance(tokenizer, dict):
        return None
    model = tokenizer.get("model")
    vocab = model.get("vocab") if isinstance(model, dict) else None
    size = 0
    if isinstance(vocab, dict):
        size = max((i + 1 for i in vocab.values() if type(i) is int), default=0)
    elif isinstance(vocab, list):
        size = len(vocab)
    added = tokenizer.get("added_tokens")
    if isinstance(added, list):
        ids = [token.get("id") for token in added if isinstance(token, dict)]
        size = max([size, *(i + 1 for i in ids if type(i) is int)])
    return size or None
