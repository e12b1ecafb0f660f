"""Prometheus text for a simulated engine, with SGLang's (`sglang:`) or vLLM's (`vllm:`) metric names.

Written by hand (a few dozen lines) rather than through prometheus_client, because one process holds many
engines and each must expose only its own numbers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rolloutsim.engine_model import EngineModel

__all__ = ("render_sglang", "render_vllm")


def _gauge(name: str, labels: str, value: float, kind: str = "gauge") -> list[str]:
    return [f"# TYPE {name} {kind}", f"{name}{{{labels}}} {value}"]


def _output_path(model: EngineModel, now: float, labels: str) -> list[str]:
    """The simulator's own counters, the same in both flavours: KV preemptions (`kv_preemption`; also counted in
    the engines' own retraction/preemption counters), and the output path's (sim/output_path.py)."""
    output = model.output
    lines: list[str] = []
    lines += _gauge("sim:num_preemptions_total", labels, model.stats.preempted_total, "counter")
    for name, value in (
        ("output_bytes_total", output.bytes_total),
        ("output_chunks_total", output.chunks_total),
        ("output_busy_seconds_total", output.busy_s(now)),
    ):
        lines += _gauge(f"sim:{name}", labels, value, "counter")
    lines += _gauge("sim:output_backlog_seconds", labels, output.backlog_s(now))
    return lines


def render_sglang(model: EngineModel, now: float) -> str:
    config = model.config
    labels = f'model_name="{config.served_model_name}",engine_type="unified",tp_rank="0",pp_rank="0"'
    capacity = config.kv_capacity_tokens
    hit_rate = model.cache.hits_tokens / model.cache.queries_tokens if model.cache.queries_tokens else 0.0
    lines: list[str] = []
    for name, value in (
        ("num_running_reqs", model.running_count),
        ("num_queue_reqs", model.waiting_count),
        ("num_grammar_queue_reqs", 0),
        ("num_paused_reqs", model.running_count if model.pause_mode in ("in_place", "retract") else 0),
        ("gen_throughput", model.stats.gen_throughput(now)),
        ("cache_hit_rate", hit_rate),
        ("token_usage", model.kv_used_tokens / capacity),
        ("num_used_tokens", model.kv_used_tokens),
        ("kv_available_tokens", max(0, capacity - model.kv_used_tokens)),
        ("max_total_num_tokens", capacity),
        ("context_len", config.context_len),
    ):
        lines += _gauge(f"sglang:{name}", labels, value)
    # SGLang (0.5.9 measured, 0.5.23's source alike) counts a request's generated tokens in
    # generation_tokens_total when it finishes (TokenizerMetricsCollector.observe_one_finished_request); the
    # live count is realtime_tokens_total{mode="decode"}, bumped every decode step by the scheduler.
    lines.append("# TYPE sglang:realtime_tokens_total counter")
    lines.append(
        f'sglang:realtime_tokens_total{{{labels},mode="decode"}} {model.stats.generated_tokens_total}'
    )
    for name, value in (
        ("prompt_tokens_total", model.stats.prompt_tokens_total),
        ("generation_tokens_total", model.stats.finished_generated_tokens_total),
        ("cached_tokens_total", model.stats.cached_tokens_total),
        ("num_requests_total", model.stats.requests_total),
        ("num_aborted_requests_total", model.stats.aborted_total),
        ("num_retracted_requests_total", model.stats.retracted_total),
    ):
        lines += _gauge(f"sglang:{name}", labels, value, "counter")
    lines += model.stats.ttft.lines("sglang:time_to_first_token_seconds", labels)
    lines += model.stats.e2e.lines("sglang:e2e_request_latency_seconds", labels)
    # submission to the start of prefill, as SGLang's own (0.5.9 measured, tests/e2e/test_sglang_contract.py)
    lines += model.stats.queue_time.lines("sglang:queue_time_seconds", labels)
    lines += _output_path(model, now, labels)
    return "\n".join(lines) + "\n"


def render_vllm(model: EngineModel, now: float) -> str:
    config = model.config
    labels = f'model_name="{config.served_model_name}",engine="0"'
    lines: list[str] = []
    for name, value in (
        ("num_requests_running", model.running_count),
        ("num_requests_waiting", model.waiting_count),
        ("kv_cache_usage_perc", model.kv_used_tokens / config.kv_capacity_tokens),
        ("engine_sleep_state", 0),
    ):
        lines += _gauge(f"vllm:{name}", labels, value)
    for name, value in (
        ("prompt_tokens_total", model.stats.prompt_tokens_total),
        ("generation_tokens_total", model.stats.generated_tokens_total),
        ("prefix_cache_queries_total", model.cache.queries_tokens),
        ("prefix_cache_hits_total", model.cache.hits_tokens),
        ("num_preemptions_total", model.stats.retracted_total),
    ):
        lines += _gauge(f"vllm:{name}", labels, value, "counter")
    lines.append("# TYPE vllm:request_success_total counter")
    for reason in ("stop", "length", "abort"):
        count = model.stats.finished_by_reason.get(reason, 0)
        lines.append(f'vllm:request_success_total{{{labels},finished_reason="{reason}"}} {count}')
    lines += model.stats.ttft.lines("vllm:time_to_first_token_seconds", labels)
    lines += model.stats.e2e.lines("vllm:e2e_request_latency_seconds", labels)
    lines += model.stats.queue_time.lines("vllm:request_queue_time_seconds", labels)
    lines += _output_path(model, now, labels)
    return "\n".join(lines) + "\n"
