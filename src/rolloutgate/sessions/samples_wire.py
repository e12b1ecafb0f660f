"""miles' samples wire (`samples/codec.py`): `Sample`s as one safetensors payload.

Per sample i: tensors `tokens.i` (int64), `loss_mask.i` (uint8), `rollout_log_probs.i` (float64); the other
fields in `_samples_meta`, a uint8 tensor of compact UTF-8 JSON `{"samples": [{response, response_length,
status, weight_versions, spec_info, prefix_cache_info, metadata, [reward], nulls}], "session_metadata",
"empty_reason"}`. `nulls` names the tensor fields a sample has none of (MoE routing replay, here). Tree
sessions (miles' v2) add `reward`.

`weight_versions` changed shape in miles: its newest codec reads one list of `{"version", "abs_start",
"abs_end"}` spans per merged call (`WeightVersionsPerCall`), the 2026-08 snapshot (31f1ca9) a list of
version strings. `WeightVersionsWire` picks one (`--samples-weight-versions`); decoding either with the other
codec fails in miles.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import orjson
from safetensors.numpy import save

from rolloutgate.sessions.samples import Sample, SamplesResult

__all__ = ("CONTENT_TYPE", "META_KEY", "WeightVersionsWire", "encode_samples")

CONTENT_TYPE = "application/octet-stream"
META_KEY = "_samples_meta"
WeightVersionsWire = Literal["spans", "strings"]
_NULL_TENSORS = ("rollout_routed_experts", "rollout_indexer_topk")


def encode_samples(
    result: SamplesResult, *, tree: bool, weight_versions: WeightVersionsWire = "spans"
) -> bytes:
    tensors: dict[str, np.ndarray[Any, Any]] = {}
    metas = []
    for i, sample in enumerate(result.samples):
        tensors[f"tokens.{i}"] = np.asarray(sample.tokens, dtype=np.int64)
        tensors[f"loss_mask.{i}"] = np.asarray(sample.loss_mask, dtype=np.uint8)
        tensors[f"rollout_log_probs.{i}"] = np.asarray(sample.rollout_log_probs, dtype=np.float64)
        meta: dict[str, Any] = {
            "response": sample.response,
            "response_length": sample.response_length,
            "status": sample.status.value,
            "weight_versions": _weight_versions(sample, weight_versions),
            "spec_info": sample.spec_info,
            "prefix_cache_info": sample.prefix_cache_info,
            "metadata": sample.metadata,
        }
        if tree:
            meta["reward"] = sample.reward
        meta["nulls"] = list(_NULL_TENSORS)
        metas.append(meta)
    document = {
        "samples": metas,
        "session_metadata": result.session_metadata,
        "empty_reason": result.empty_reason,
    }
    tensors[META_KEY] = np.frombuffer(orjson.dumps(document), dtype=np.uint8)
    return save(tensors)


def _weight_versions(sample: Sample, wire: WeightVersionsWire) -> list[Any]:
    if wire == "strings":  # one version per merged call that reported one
        return [call[0].version for call in sample.weight_versions if call]
    return [
        [{"version": s.version, "abs_start": s.abs_start, "abs_end": s.abs_end} for s in call]
        for call in sample.weight_versions
    ]
