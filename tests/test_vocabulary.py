"""A model's vocabulary read from its folder (rolloutgate/vocabulary.py): the bound prompt ids are checked
against (server/validate.py), learned from an engine's model folder, the gateway's tokenizer, the simulator's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from rolloutgate.vocabulary import folder_vocab_size, tokenizer_length


def _folder(tmp_path: Path, **files: Any) -> Path:
    for name, content in files.items():
        (tmp_path / f"{name}.json").write_bytes(orjson.dumps(content))
    return tmp_path


def _tokenizer(vocab: Any, added: list[int]) -> dict[str, Any]:
    return {
        "model": {"type": "BPE", "vocab": vocab},
        "added_tokens": [{"id": i, "content": f"<{i}>"} for i in added],
    }


def test_the_model_config_states_the_embedding_table(tmp_path: Path) -> None:
    # Qwen: 151,669 tokens padded to 151,936 rows; the rows are what an id indexes
    folder = _folder(tmp_path, config={"vocab_size": 151_936}, tokenizer=_tokenizer({"a": 0}, [151_668]))
    assert folder_vocab_size(folder) == 151_936


def test_a_multimodal_model_states_it_in_its_text_config(tmp_path: Path) -> None:
    folder = _folder(tmp_path, config={"text_config": {"vocab_size": 248_320}, "vocab_size": 5})
    assert folder_vocab_size(str(folder)) == 248_320


def test_a_tokenizer_alone_gives_its_length_with_its_added_tokens(tmp_path: Path) -> None:
    folder = _folder(
        tmp_path, config={"model_type": "x"}, tokenizer=_tokenizer({"a": 0, "b": 1, "c": 2}, [3, 4])
    )
    assert folder_vocab_size(folder) == 5


@pytest.mark.parametrize(
    ("tokenizer", "length"),
    [
        (_tokenizer({"a": 0, "b": 7}, []), 8),
        (_tokenizer({"a": 0}, [9]), 10),
        ({"model": {"type": "Unigram", "vocab": [["a", -1.0], ["b", -2.0]]}, "added_tokens": []}, 2),
        ({"model": {"type": "BPE", "vocab": {}}, "added_tokens": []}, None),
        ([], None),
    ],
)
def test_tokenizer_length(tokenizer: Any, length: int | None) -> None:
    assert tokenizer_length(tokenizer) == length


def test_what_is_not_a_readable_model_folder_gives_none(tmp_path: Path) -> None:
    assert folder_vocab_size(tmp_path / "absent") is None
    assert folder_vocab_size("Qwen/Qwen3-8B") is None  # a hub name, not a folder here
    assert folder_vocab_size(tmp_path) is None  # empty
    (tmp_path / "config.json").write_bytes(b"{not json")
    assert folder_vocab_size(tmp_path) is None
