"""What differs between the SGLang versions the suite meets, keyed by the version `/server_info` states.

Real engines are SGLang 0.5.9 (`make test-e2e-sglang`: the newest that runs on this CPU,
reference/real-sglang.md); the simulator's SGLang flavour states 0.5.23 (reference/engines.md, section A, read
from 0.5.23's source). A test asserts the facts of the version it meets, so each backend is held to what it
is; docs/simulator.md lists these differences.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ("SglangFacts", "facts_for")


@dataclass(frozen=True, slots=True, kw_only=True)
class SglangFacts:
    version: str
    retractions_key: str  # the meta_info field counting a request's retractions
    has_ready: bool  # GET /ready: 200, or 503 while paused
    loads_status: int  # GET /v1/loads

    def default_input_logprobs(self, prompt_ids: list[int]) -> list[list[Any]]:
        """`input_token_logprobs` of a `/generate` with `return_logprob` and no `logprob_start_len`."""
        if self.version == "0.5.9":
            # 0.5.9 resolves the default start (-1) to the last prompt token: one entry, not scored
            return [[None, prompt_ids[-1], None]]
        return []  # 0.5.23: -1 means output logprobs only


_FACTS = {
    # Measured on 0.5.9 (tokenizer_manager.py builds meta_info with "total_retractions"; no /ready route;
    # /v1/loads answers 500 with the fastapi its pins allow, reference/real-sglang.md).
    "0.5.9": SglangFacts(
        version="0.5.9", retractions_key="total_retractions", has_ready=False, loads_status=500
    ),
    # 0.5.23's source (reference/engines.md A.1, A.7, A.8): "num_retractions", /ready, /v1/loads.
    "0.5.23": SglangFacts(
        version="0.5.23", retractions_key="num_retractions", has_ready=True, loads_status=200
    ),
}


def facts_for(version: str) -> SglangFacts:
    try:
        return _FACTS[version]
    except KeyError:
        raise AssertionError(f"SGLang {version!r}: the suite knows 0.5.9 and 0.5.23 only") from None
