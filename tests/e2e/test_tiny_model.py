"""scripts/make_tiny_model.py builds byte-identical files for a fixed seed, offline.

It needs torch, transformers and tokenizers, which only the engine's venv has (E2E_ENGINE_PYTHON, set by
`make test-e2e`); the simulator backend has no model to build."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from tests.e2e.harness import REPO_ROOT

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not os.environ.get("E2E_ENGINE_PYTHON"),
        reason="needs the engine venv (E2E_ENGINE_PYTHON, make test-e2e)",
    ),
]


def build(out: Path, seed: int) -> dict[str, str]:
    result = subprocess.run(
        [
            os.environ["E2E_ENGINE_PYTHON"],
            "scripts/make_tiny_model.py",
            "--out",
            str(out),
            "--seed",
            str(seed),
            "--manifest",
        ],
        cwd=REPO_ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return {name: digest for digest, name in (line.split("  ", 1) for line in result.stdout.splitlines())}


def test_two_builds_are_byte_identical_and_the_seed_matters(tmp_path: Path) -> None:
    first, second = build(tmp_path / "a", 0), build(tmp_path / "b", 0)
    assert first == second
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(first)
    other = build(tmp_path / "c", 1)
    assert other["model.safetensors"] != first["model.safetensors"]
    assert (tmp_path / "a" / "model.safetensors").stat().st_size < 5_000_000
