"""A stand-in for miles' `tests.fast.rollout.session.test_samples._make_record`, used only where it is missing.

Three modules of miles' router suite (test_session_samples_op.py, test_session_samples_op_v2.py,
test_tree_assembly_invariants.py) import `_make_record` from miles' rollout/session tests, which the peers
snapshot in ../shared/peers/miles does not carry; without it those modules (97 of the 305 tests) fail to collect
on miles' own servers as on rolloutgate. The plugin installs this module under that name only when the real one
cannot be imported, in both runs, so the side-by-side stays fair.

What it builds is the record shape miles' assembler reads (reference/miles.md, the session contract): the
prompt ids in `request["input_ids"]`, SGLang's chat answer with `meta_info.output_token_logprobs` as
`(logprob, token_id)` pairs and the optional cache, weight-version and routing-replay fields beside them.
"""

from __future__ import annotations

import sys
import types
from typing import Any

STANDIN_MODULE = "tests.fast.rollout.session.test_samples"


def _make_record(
    prompt_token_ids: list[int],
    output_token_ids: list[int],
    output_log_probs: list[float] | None = None,
    finish_reason: str = "stop",
    cached_tokens: int | None = None,
    prompt_tokens: int | None = None,
    weight_version: str | None = None,
    routed_experts: str | None = None,
    routed_experts_start_len: int | None = None,
    sampling_masks: list[list[int]] | None = None,
    sampling_log_probs: list[float] | None = None,
) -> Any:
    """One chat turn's session record: `prompt_token_ids` in, `output_token_ids` out."""
    from miles.rollout.session.types import SessionRecord  # miles' own model: the record its assembler takes

    log_probs = output_log_probs
    if log_probs is None:
        # any distinct values do: the tests that read them pass their own
        log_probs = [-0.1 * (position + 1) for position in range(len(output_token_ids))]
    pairs = list(zip(output_token_ids, log_probs, strict=True))
    meta_info: dict[str, Any] = {
        "output_token_logprobs": [(log_prob, token_id) for token_id, log_prob in pairs],
        "completion_tokens": len(output_token_ids),
    }
    optional = {
        "cached_tokens": cached_tokens,
        "prompt_tokens": prompt_tokens,
        "weight_version": weight_version,
        "routed_experts": routed_experts,
    }
    meta_info.update({key: value for key, value in optional.items() if value is not None})
    request: dict[str, Any] = {
        "messages": [{"role": "user", "content": "hello"}],
        "input_ids": prompt_token_ids,
    }
    if routed_experts_start_len is not None:
        request["routed_experts_start_len"] = routed_experts_start_len
    if sampling_masks is not None:
        meta_info["output_token_sampling_mask"] = sampling_masks
        meta_info["output_token_sampling_logprobs"] = sampling_log_probs
        request["return_sampling_mask"] = True
    choice = {
        "message": {"role": "assistant", "content": "response"},
        "finish_reason": finish_reason,
        "logprobs": {
            "content": [{"logprob": log_prob, "token": f"t{token_id}"} for token_id, log_prob in pairs]
        },
        "meta_info": meta_info,
    }
    return SessionRecord(
        timestamp=0.0,
        method="POST",
        path="/v1/chat/completions",
        status_code=200,
        request=request,
        response={"choices": [choice]},
    )


def install_if_missing() -> bool:
    """Register this module under miles' name when miles' own is not importable; True when it was."""
    import importlib

    try:
        importlib.import_module(STANDIN_MODULE)
        return False
    except ModuleNotFoundError:
        pass
    parent_name = "tests.fast"
    importlib.import_module(parent_name)  # miles' real package: only the missing levels are stood in
    for name in ("tests.fast.rollout", "tests.fast.rollout.session"):
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = []
            sys.modules[name] = package
            setattr(sys.modules[parent_name], name.rsplit(".", 1)[1], package)
        parent_name = name
    module = types.ModuleType(STANDIN_MODULE, __doc__)
    module._make_record = _make_record  # type: ignore[attr-defined]
    sys.modules[STANDIN_MODULE] = module
    sys.modules["tests.fast.rollout.session"].test_samples = module  # type: ignore[attr-defined]
    return True
