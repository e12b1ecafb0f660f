"""Engine configurations for the simulator, and the named profiles.

Every number that shapes simulated timing lives in `SimEngineConfig`; a profile is just a named config.
docs/simulator.md derives the `incident` profile's figures (70 tok/s alone, 4-8 tok/s during a 100K-token
prefill, a 34-37 s prefill) from the fields below; `decode_step_s` and `prefill_chunk_s` are the two cost
formulas the engine model uses, kept here so the docs, the tests and the model share one definition.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

from rolloutsim.tokens import DEFAULT_VOCAB_SIZE, MIN_VOCAB_SIZE

__all__ = (
    "PROFILES",
    "PrefillMode",
    "SimEngineConfig",
    "decode_step_s",
    "make_config",
    "prefill_chunk_s",
)

PrefillMode = Literal["held", "mixed"]
Api = Literal["sglang", "vllm"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SimEngineConfig:
    """One simulated engine. Durations are simulated seconds; rates are per simulated second."""

    profile: str = "custom"
    served_model_name: str = "sim-model"
    # the model's folder, as a real engine names it (SGLang `model_path`, vLLM's card `root`), when the
    # simulator plays a real model's tokenizer (sim/cli.py --tokenizer); its vocabulary is `vocab_size`
    model_path: str | None = None
    vocab_size: int = (
        DEFAULT_VOCAB_SIZE  # prompt ids at or past it are refused (400), generated ids stay below
    )
    # scheduling
    max_running_requests: int = 8
    chunked_prefill_size: int = 256  # tokens per prefill batch (vLLM: max_num_batched_tokens)
    max_queued_requests: int | None = None  # beyond it new requests are refused (503 "queue full")
    # "held": a prefill batch runs instead of a decode step (SGLang); "mixed": every step decodes all running
    # requests and fills the rest of the token budget with prefill (vLLM). None: the API flavour's default.
    prefill_mode: PrefillMode | None = None
    prefill_decode_interval: int = 0  # held mode: decode steps run between two prefill batches
    mixed_skips_logprobs: bool = True  # SGLang: a batch that asks for logprobs is never mixed
    # prefill cost: per token 1/rate, growing linearly with the context already in the KV cache (attention):
    # a token at context position c costs (1 + c / knee) / rate. inf rate = free; inf knee = no growth.
    prefill_tokens_per_s: float = 10_000.0
    prefill_attention_knee_tokens: float = math.inf
    # decode step: base + per running request + per 1,000 context tokens held by the batch
    decode_base_s: float = 0.010
    decode_per_request_s: float = 0.001
    decode_per_ktoken_s: float = 0.0001
    # memory
    kv_capacity_tokens: int = 65_536
    # preemption under KV pressure (vLLM's recompute preemption, SGLang's decode retraction; off: admission is
    # the only memory check and running requests may grow past the capacity): when a step's new tokens would not
    # fit, the newest admitted request goes back to the head of the queue, its KV freed, and is prefilled again
    # (prompt + output so far) when it fits; a waiting request is admitted only if its context fits beside one
    # decode step of the running batch; no admission in a step that preempted (docs/simulator.md "Physics")
    kv_preemption: bool = False
    enable_prefix_cache: bool = True
    prefix_block_tokens: int = 16  # cache granularity (vLLM block / SGLang page)
    context_len: int = 32_768
    # generation
    default_max_new_tokens: int = 128  # SGLang's SamplingParams default; also used by the OpenAI routes
    stop_fraction: float = 0.0  # share of requests (not ignore_eos) that stop early with EOS
    # control plane
    weight_update_s: float = 2.0  # how long /update_weights_from_disk takes once it runs
    health_poll_s: float = 1.0  # SGLang /health polls for scheduler output at this period...
    health_timeout_s: float = 20.0  # ...and answers 503 after this long without any
    # SGLang 0.5.9 has no /ready (404, paused or not): a pause shows only as /health hanging while the control
    # plane (/get_load, /server_info, /metrics) answers at once (reference/real-sglang.md)
    sglang_ready_route: bool = True
    vllm_reject_while_paused: bool = False  # vLLM 0.33 docs: 503 in abort/wait pause; 0.32 measured: held
    disconnect_lag_s: float = 2.0  # SGLang notices a client disconnect this long after it happens (vLLM: 0)
    enable_cache_report: bool = True  # usage.prompt_tokens_details.cached_tokens on the OpenAI routes
    record_token_times: bool = False  # keep each token's simulated time per request (tests only)
    # SGLang --incremental-streaming-output: a streamed /generate chunk carries only its new text, ids and
    # output logprobs (reference/engines.md), not the output so far
    incremental_streaming_output: bool = False
    # output path (SGLang's tokenizer manager, vLLM's API server process): one serial queue per engine; every
    # stream chunk or whole body the engine emits for a generation costs output_chunk_s + bytes / rate there
    # (docs/simulator.md "Output path" for the figures). inf rate and 0 per chunk = free.
    output_bytes_per_s: float = 200e6
    output_chunk_s: float = 30e-6

    @property
    def output_cost_enabled(self) -> bool:
        return self.output_chunk_s > 0 or not math.isinf(self.output_bytes_per_s)

    def __post_init__(self) -> None:
        for name in ("max_running_requests", "chunked_prefill_size", "kv_capacity_tokens", "context_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.vocab_size < MIN_VOCAB_SIZE:
            raise ValueError(f"vocab_size must be >= {MIN_VOCAB_SIZE}, got {self.vocab_size!r}")
        for name in (
            "decode_base_s",
            "decode_per_request_s",
            "decode_per_ktoken_s",
            "weight_update_s",
            "health_poll_s",
            "health_timeout_s",
            "disconnect_lag_s",
            "output_chunk_s",
        ):
            value = getattr(self, name)
            if math.isnan(value) or value < 0 or math.isinf(value):
                raise ValueError(f"{name} must be a finite duration >= 0, got {value!r}")
        if not self.prefill_tokens_per_s > 0 or not self.prefill_attention_knee_tokens > 0:
            raise ValueError("prefill rates must be > 0 (inf allowed)")
        if not self.output_bytes_per_s > 0:
            raise ValueError(f"output_bytes_per_s must be > 0 (inf: free), got {self.output_bytes_per_s!r}")
        if self.prefill_decode_interval < 0 or self.prefix_block_tokens < 1:
            raise ValueError("prefill_decode_interval must be >= 0 and prefix_block_tokens >= 1")
        if not 0.0 <= self.stop_fraction <= 1.0:
            raise ValueError(f"stop_fraction must be in [0, 1], got {self.stop_fraction!r}")
        if self.prefill_mode not in (None, "held", "mixed"):
            raise ValueError(f"prefill_mode must be 'held' or 'mixed', got {self.prefill_mode!r}")

    def resolved_prefill_mode(self, api: str) -> PrefillMode:
        if self.prefill_mode is not None:
            return self.prefill_mode
        return "mixed" if api == "vllm" else "held"


def decode_step_s(config: SimEngineConfig, batch_size: int, context_tokens: int) -> float:
    """Duration of one decode step for `batch_size` running requests holding `context_tokens` in KV."""
    return (
        config.decode_base_s
        + config.decode_per_request_s * batch_size
        + config.decode_per_ktoken_s * context_tokens / 1000.0
    )


def prefill_chunk_s(config: SimEngineConfig, start_position: int, tokens: int) -> float:
    """Duration of prefilling `tokens` prompt tokens that sit after `start_position` tokens already in KV.

    Integral of (1 + c / knee) / rate over c in [start, start + tokens).
    """
    if tokens <= 0 or math.isinf(config.prefill_tokens_per_s):
        return 0.0
    mid = start_position + tokens / 2.0
    return tokens / config.prefill_tokens_per_s * (1.0 + mid / config.prefill_attention_knee_tokens)


# The incident of DESIGN.md (see docs/simulator.md for the derivation of each figure).
_INCIDENT = SimEngineConfig(
    profile="incident",
    max_running_requests=256,
    chunked_prefill_size=512,
    prefill_decode_interval=1,
    prefill_tokens_per_s=4_600.0,
    prefill_attention_knee_tokens=90_000.0,
    decode_base_s=0.0140,
    decode_per_request_s=0.0002,
    decode_per_ktoken_s=0.00001,
    kv_capacity_tokens=1_200_000,
    context_len=262_144,
    weight_update_s=25.0,
)

# Small and quick, for tests: a lone request decodes at ~90 tok/s, a 1,000-token prompt prefills in 0.1 s.
_DEFAULT = SimEngineConfig(profile="default")

# As fast as possible: no simulated time passes at all (gateway overhead benchmarks).
_FAST = SimEngineConfig(
    profile="fast",
    max_running_requests=4096,
    chunked_prefill_size=1 << 20,
    prefill_tokens_per_s=math.inf,
    decode_base_s=0.0,
    decode_per_request_s=0.0,
    decode_per_ktoken_s=0.0,
    kv_capacity_tokens=1 << 30,
    enable_prefix_cache=False,
    context_len=1 << 20,
    default_max_new_tokens=16,
    weight_update_s=0.0,
    health_poll_s=0.0,
    disconnect_lag_s=0.0,
    output_bytes_per_s=math.inf,
    output_chunk_s=0.0,
)

PROFILES: dict[str, SimEngineConfig] = {"incident": _INCIDENT, "default": _DEFAULT, "fast": _FAST}


def make_config(profile: str | SimEngineConfig = "default", **overrides: Any) -> SimEngineConfig:
    """A profile (by name or value) with `overrides` applied; None-valued overrides are ignored."""
    if isinstance(profile, SimEngineConfig):
        base = profile
    else:
        if profile not in PROFILES:
            raise ValueError(f"unknown profile {profile!r}; choose from {sorted(PROFILES)}")
        base = PROFILES[profile]
    fields = {f.name for f in dataclasses.fields(SimEngineConfig)}
    unknown = set(overrides) - fields
    if unknown:
        raise TypeError(f"unknown engine settings: {sorted(unknown)}")
    changes = {k: v for k, v in overrides.items() if v is not None}
    return dataclasses.replace(base, **changes)
