"""Gateway settings: flags > environment (`ROLLOUTGATE_*`) > config file (TOML or JSON) > defaults.

Durations are seconds (simulated seconds when `time_scale` != 1, so a gateway in front of a time-scaled
simulator keeps the same numbers as in production). `None` for an optional limit means "no limit".
"""

from __future__ import annotations

import ipaddress
import json
import math
import re
from pathlib import Path
from typing import Any, Literal

import yarl
from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    JsonConfigSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from rolloutgate.core.config import GatewayCoreConfig, Placement
from rolloutgate.core.weights import OnStale

__all__ = ("EngineSpec", "GatewaySettings", "load_settings")

_CORE = GatewayCoreConfig()  # the defaults of what the core decides live in the core (core/config.py)

EngineFamilyName = Literal["auto", "sglang", "vllm", "openai"]


class EngineSpec(BaseModel):
    """One engine of the pool: `http://host:port`, optionally `family+http://...`."""

    url: str
    family: EngineFamilyName = "auto"
    capacity: int | None = Field(default=None, ge=1)

    @classmethod
    def parse(cls, text: str) -> EngineSpec:
        family, sep, url = text.partition("+")
        if sep and family in ("sglang", "vllm", "openai", "auto"):
            return cls(url=url, family=family)  # type: ignore[arg-type]
        return cls(url=text)

    @field_validator("url")
    @classmethod
    def _http_only(cls, url: str) -> str:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"engine URL must be http(s)://, got {url!r}")
        # what could never be reached is refused here, not kept pending (server/pool.py `register`)
        try:
            parsed = yarl.URL(url)
        except ValueError as exc:
            raise ValueError(f"engine URL {url!r}: {exc}") from None
        host = parsed.host or ""
        if not host or any(c.isspace() for c in host) or parsed.port == 0:
            raise ValueError(f"engine URL {url!r} needs a host and a port other than 0")
        if parsed.query_string or parsed.fragment:
            raise ValueError(f"engine URL {url!r} has a query or a fragment")
        return url.rstrip("/")


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ROLLOUTGATE_", extra="forbid")

    host: str = Field(default="127.0.0.1", description="address to bind")
    port: int = Field(default=8000, ge=0, le=65535, description="port to bind (0 picks a free one)")
    processes: int = Field(
        default=1,
        ge=1,
        description="serve from N processes on the one port, each owning a share of the engines (docs/fleet.md)",
    )
    engines: list[EngineSpec] = Field(
        default_factory=list,
        description="engine URL, repeatable; prefix the family to skip detection: vllm+http://host:port",
    )
    sim: int = Field(default=0, ge=0, description="serve in front of N simulated engines in this process")
    sim_api: Literal["sglang", "vllm"] = Field(default="sglang", description="API of the simulated engines")
    sim_profile: str = Field(default="default", description="speed profile of the simulated engines")
    time_scale: float = Field(default=1.0, gt=0, description="gateway seconds per real second")

    clock: Literal["engine", "wallclock"] = Field(default="engine", description="what timeouts measure")
    timeout: float = Field(default=600.0, gt=0, description="charged engine time per request")
    stall_timeout: float = Field(
        default=60.0, gt=0, description="seconds without progress before a stall verdict"
    )
    queue_timeout: float | None = Field(
        default=None, gt=0, description="seconds a request may wait in the gateway queue"
    )
    max_wall: float | None = Field(default=None, gt=0, description="absolute cap on a request's wall time")
    max_timeout_override: float = Field(default=3600.0, gt=0, description="cap on per-request overrides")

    capacity: int | None = Field(
        default=None, ge=1, description="in-flight limit per engine (overrides probe)"
    )
    default_capacity: int = Field(default=64, ge=1, description="when an engine does not report one")
    max_queue: int = Field(
        default=_CORE.max_queue, ge=1, description="requests waiting in the gateway at once"
    )
    max_attempts: int = Field(
        default=_CORE.max_attempts, ge=1, description="engines a request may be tried on"
    )
    no_engine_grace: float = Field(
        default=_CORE.no_engine_grace_s,
        ge=0,
        description="seconds a request waits for an engine when none is usable",
    )
    contention_min_prefill_tokens: int = Field(
        default=_CORE.contention_min_prefill_tokens,
        ge=0,
        description="only prefills of at least this many uncached tokens count as contention",
    )
    affinity_max_excess: int = Field(
        default=_CORE.affinity_max_excess,
        ge=0,
        description="in flight above the least loaded engine before a session moves",
    )
    session_binding_idle: float | None = Field(
        default=_CORE.session_idle_s,
        gt=0,
        description="seconds a session's engine binding outlives its last call (none = until evicted, DELETE or "
        "/finish_session releases it)",
    )
    session_max_in_flight: int | None = Field(
        default=None,
        ge=1,
        description="a session's calls in the gateway at once, queued or running; more wait in order, blocking "
        "nobody (SMG caps 2 per key; none = no cap)",
    )
    placement: Placement = Field(
        default=_CORE.placement, description="how requests are placed on engines (docs/prefill.md)"
    )
    # cache-warm placement (core/placement/cache_warm.py, docs/rl.md): a new session goes to the engine with the
    # fewest sessions whose cache has room for its history; this is that room, per engine
    engine_cache_tokens: int | None = Field(
        default=None,
        ge=1,
        description="prefix-cache tokens per engine for its sessions' histories, for --placement cache_warm "
        "(none = not known: every engine has room)",
    )
    prefill_budget_tokens: int | None = Field(
        default=None,
        ge=0,
        description="uncached prompt tokens in prefill at once per engine: none = from the engine's chunk size "
        "and capacity, 0 or 'off' = no budget (docs/prefill.md)",
    )
    prefill_rest_ratio: float = Field(
        default=_CORE.prefill_rest_ratio,
        ge=0,
        le=100,
        description="after long prefills an engine takes no other for this times their duration (0 = never)",
    )
    engine_poll_interval: float | None = Field(
        default=None,
        gt=0,
        description="seconds between load readings of an engine with calls whose answer comes whole "
        "(engine-level progress); default a twentieth of stall_timeout, at most 3",
    )
    checkpoint_tokens: int = Field(
        default=0,
        ge=0,
        description="a non-streaming single-prompt /generate call's output comes from the engine every this "
        "many tokens, so when its engine dies, hangs or is drained it continues on another from its last chunk "
        "instead of starting over; each chunk repeats the output so far (SGLang's cumulative stream), so the "
        "engine's output work grows with the length squared over this, unless the engine runs with "
        "--incremental-streaming-output (then with the length: docs/gateway.md). 0 = first token and "
        "end only: what a direct call costs, and such a call starts over",
    )
    engine_pause_aborts: Literal["pass", "rerun"] = Field(
        default="pass",
        description="a call that an engine's own pause in abort mode ended (a trainer's SGLang "
        "/pause_generation {mode: abort} or vLLM /pause?mode=abort, sent to the engine directly): pass = answered "
        "as the engine answered it (finish reason abort, its partial output); rerun = run again once an engine "
        "takes work, as the gateway's own abort-mode gate does (a streaming client's from its last token). "
        "Either way an abort the engine was not paused for (an /abort_request) is passed on",
    )

    keepalive_interval: float = Field(
        default=15.0, ge=0, description="seconds of client silence before a keep-alive byte (0 = off)"
    )
    keepalive_non_streaming: bool = Field(
        default=True, description="keep-alive spaces before a non-streamed JSON answer too"
    )
    retry_grace: float = Field(
        default=_CORE.retry_grace_s,
        ge=0,
        description="seconds a disconnected client's generation waits for its retry",
    )
    result_ttl: float = Field(
        default=300.0,
        ge=0,
        description="seconds a finished answer with an Idempotency-Key is kept for a retry",
    )
    result_cache_entries: int = Field(default=10_000, ge=0, description="finished answers kept for retries")

    health_interval: float = Field(default=5.0, gt=0, description="seconds between engine health checks")
    # under SGLang's own 20 s (SGLANG_HEALTH_CHECK_TIMEOUT): a check that waits behind a pause gives up first,
    # and the readiness read right after it still sees the pause before SGLang marks itself unhealthy
    health_timeout: float = Field(default=15.0, gt=0, description="seconds one health check may take")
    hang_check_timeout: float = Field(
        default=_CORE.hang_check_s,
        ge=0,
        description="seconds before the end of an engine's stall window at which it is asked whether it is "
        "paused (it has this long to say so before it is judged hung; 0 = not asked)",
    )
    health_failures: int = Field(
        default=3, ge=1, description="failed health checks in a row before an engine is unhealthy"
    )
    warmup_timeout: float = Field(
        default=_CORE.warmup_timeout_s,
        ge=0,
        description="seconds an engine's first work since it joined or was unhealthy may show no progress "
        "(a compile on its first request) before it is judged hung, when longer than stall_timeout "
        "(0 = no warm-up)",
    )

    admin_token: str | None = Field(default=None, description="token required by admin and worker endpoints")
    allow_remote_admin: bool = Field(
        default=False, description="admin and worker endpoints from any client (without an admin token)"
    )
    trusted_networks: list[str] = Field(
        default_factory=list,
        description="CIDR, repeatable: machines there may register and remove workers and send /abort_request "
        "and /flush_cache without a token (never the other admin endpoints)",
    )
    rl_control_timeout: float = Field(
        default=600.0,
        gt=0,
        description="seconds one engine call through the RL control plane (/v1/rl) may take",
    )
    rl_fanout_concurrency: int = Field(
        default=32, ge=1, description="engine calls in flight at once in one /v1/rl/engine fan-out"
    )
    api_keys: list[str] = Field(default_factory=list, description="accepted inference API key, repeatable")
    max_body_bytes: int = Field(default=32 * 1024 * 1024, ge=1024, description="largest request body")
    max_header_bytes: int = Field(default=8190, ge=256, description="longest request line or header field")
    max_headers: int = Field(default=128, ge=8, description="most header fields in one request")
    max_messages: int = Field(default=4096, ge=1, description="most messages in one chat request")
    max_tokens_limit: int = Field(default=262_144, ge=1, description="largest max_tokens a request may ask")

    tokenizer: str | None = Field(
        default=None, description="local Hugging Face tokenizer folder for token-in-token-out sessions"
    )
    chat_template_path: str | None = Field(
        default=None,
        description="with --tokenizer: a Jinja chat template file used instead of the tokenizer folder's own "
        "(miles' --chat-template-path, e.g. its fixed Qwen3 template)",
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None,
        description="JSON object of chat template kwargs for every session turn, under the request's own "
        "(miles' --apply-chat-template-kwargs, e.g. '{\"enable_thinking\": false}')",
    )
    session_lora_path: str | None = Field(
        default=None,
        description="LoRA adapter name put on every session turn sent to the engine as `lora_path`, unless the "
        "agent names one (miles with --lora-rank: the adapter being trained, not the base weights)",
    )
    session_routing_replay: bool = Field(
        default=False,
        description="ask the engine for each session turn's routed experts (`return_routed_experts`), kept in "
        "the turn records and samples (miles' --use-rollout-routing-replay)",
    )
    session_replay_added_rows: bool = Field(
        default=False,
        description="with routing replay, ask the engine only for the rows past the session's checkpoint "
        "(`routed_experts_start_len`): for trainers that pause in place, keeping the session's KV (miles' "
        "--pause-generation-mode in_place)",
    )
    session_indexer_replay: bool = Field(
        default=False,
        description="ask the engine for each session turn's DSA indexer top-k (`return_indexer_topk`; miles' "
        "--use-rollout-indexer-replay)",
    )
    session_error_shape: Literal["openai", "miles"] = Field(
        default="openai",
        description="the session API's own errors as OpenAI error objects, or as miles' session server writes "
        'them ({"error": "<message>"}, which miles\' clients and tests read)',
    )
    session_max: int = Field(default=10_000, ge=1, description="sessions held at once")
    session_max_records: int = Field(default=1_000, ge=1, description="turn records per session")
    session_idle_ttl: float = Field(
        default=3600.0, gt=0, description="idle seconds before a session is evicted"
    )
    session_max_bytes: int = Field(
        default=4 * 1024**3, ge=1, description="approximate memory bound, all sessions"
    )
    session_engine_route: Literal["generate", "chat"] = Field(
        default="generate",
        description="with --tokenizer: the gateway's prompt ids go to the engine's /generate (the gateway parses "
        "tool calls) or to its chat endpoint as input_ids (the engine's own tool-call and reasoning parsers "
        "read the reply, as miles does; SGLang)",
    )
    session_rewritten_history: Literal["append", "refuse"] = Field(
        default="append",
        description="with --tokenizer, a chat template that rewrites earlier turns (drops earlier reasoning): "
        "append the new messages to the session's ids as miles does, or refuse the turn (400)",
    )
    session_tree: bool = Field(
        default=False,
        description="tree sessions (miles' --use-session-server v2): a retry or rollback is a branch, and "
        "/samples gives one sample per leaf the picker keeps",
    )
    session_picker: Literal["drop_retries", "drop_same_prompt", "keep_all"] = Field(
        default="drop_retries",
        description="tree sessions: which leaves become samples (drop_retries, miles' default: a leaf with a "
        "later sibling is dropped; drop_same_prompt: only one whose later sibling re-sent the same prompt)",
    )
    # session token budgets (rolloutgate/token_budget.py, docs/rl.md): miles sends its --max-seq-len only to
    # /samples, at the end; this gives every session that budget from its first turn
    session_max_seq_len: int | None = Field(
        default=None,
        ge=1,
        description="token budget of a session created without one (prompt + generated; none = no budget): "
        "each turn's max_tokens is capped to what it leaves",
    )
    samples_weight_versions: Literal["spans", "strings"] = Field(
        default="spans",
        description="weight_versions on the samples wire: per-call spans (miles' newest codec) or version "
        "strings (miles 2026-08, 31f1ca9)",
    )
    # weight versions and the staleness bound (core/weights.py, docs/rl.md)
    max_staleness: int | None = Field(
        default=_CORE.max_staleness,
        ge=0,
        description="at a weight update, requests running since more than this many updates ago are stale "
        "(none = no bound; 0 = every request the update finds running)",
    )
    version_policy: str = Field(
        default="any",
        description="the weights a request may start on when it names no policy (x-smg-version-policy): any, "
        "latest-only (only engines holding the newest weight version in the pool) or max-staleness:K",
    )
    on_stale: OnStale = Field(
        default=_CORE.on_stale,
        description="what becomes of a stale request: requeue (aborted, re-run from scratch on the new "
        "weights), partial (aborted, answered with its tokens so far and finish reason abort) or pace (none is "
        "aborted: new work waits while the trainer is behind, with --pace-batch; docs/rl.md)",
    )
    pace_batch: int | None = Field(
        default=None,
        ge=1,
        description="with --on-stale pace: the units of new work (sessions; calls without a session key) the "
        "trainer consumes per weight version; at most this x (version + max_staleness + 1) are admitted",
    )
    state_dir: str | None = Field(
        default=None, description="folder for durable session records (SQLite); sessions survive a restart"
    )
    shutdown_grace: float = Field(
        default=30.0, ge=0, description="on SIGTERM, seconds in-flight requests get to finish before a 503"
    )
    client_write_timeout: float = Field(
        default=60.0,
        gt=0,
        description="REAL seconds (not time-scaled: clients read in real time) a client may leave its "
        "answer unread before it is cut off",
    )
    client_buffer_bytes: int = Field(
        default=4 * 1024 * 1024,
        ge=64 * 1024,
        description="stream bytes a slow client may fall behind before it is cut off with an error",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(default="info", description="log level")
    # trace capture (server/trace.py): what `rolloutgate replay trace FILE` replays against simulated engines
    record_trace: str | None = Field(
        default=None,
        description="file to write a trace to: one JSON line per finished request (arrival, session, "
        "lengths, outcome, timings; no text, no token ids; docs/replay.md)",
    )

    @field_validator("prefill_budget_tokens", mode="before")
    @classmethod
    def _budget_off(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip().lower() in ("off", "none", "derived", "auto"):
            return 0 if value.strip().lower() == "off" else None
        return value

    @field_validator("chat_template_kwargs", mode="before")
    @classmethod
    def _json_object(cls, value: Any) -> Any:
        if isinstance(value, str):  # a flag's text; the environment and a config file parse it already
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"not JSON: {exc}") from None
        if value is not None and not isinstance(value, dict):
            raise ValueError("must be a JSON object")
        return value

    @field_validator("version_policy")
    @classmethod
    def _known_version_policy(cls, policy: str) -> str:
        # a request may also name min-version:V (server/fleet_versions.py); a default cannot name one version
        if policy in ("any", "latest-only") or re.fullmatch(r"max-staleness:\d+", policy):
            return policy
        raise ValueError(f"version_policy must be any, latest-only or max-staleness:K, not {policy!r}")

    @field_validator("trusted_networks")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        for network in value:
            try:
                ipaddress.ip_network(network, strict=False)
            except ValueError as exc:
                raise ValueError(f"trusted network must be an address or CIDR: {exc}") from None
        return value

    @field_validator("engines", mode="before")
    @classmethod
    def _engine_strings(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        if isinstance(value, list):
            return [EngineSpec.parse(v) if isinstance(v, str) else v for v in value]
        return value

    @model_validator(mode="after")
    def _pace_complete(self) -> GatewaySettings:
        if self.on_stale == "pace" and (self.pace_batch is None or self.max_staleness is None):
            raise ValueError("--on-stale pace needs --max-staleness K and --pace-batch N (docs/rl.md)")
        if self.pace_batch is not None and self.on_stale != "pace":
            raise ValueError("--pace-batch applies to --on-stale pace only")
        return self

    @property
    def queue_timeout_s(self) -> float:
        return math.inf if self.queue_timeout is None else self.queue_timeout

    @property
    def max_wall_s(self) -> float:
        return math.inf if self.max_wall is None else self.max_wall

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # flags > environment > config file (set per load by `load_settings`) > defaults
        return (
            init_settings,
            env_settings,
            TomlConfigSettingsSource(settings_cls),
            JsonConfigSettingsSource(settings_cls),
        )


def load_settings(flags: dict[str, Any], config_file: str | None = None) -> GatewaySettings:
    """Settings from the flags given (a None value clears an optional limit), the environment and an
    optional file."""
    settings_cls: type[GatewaySettings] = GatewaySettings
    if config_file:
        config = GatewaySettings.model_config.copy()
        if Path(config_file).suffix == ".toml":
            config["toml_file"] = config_file
        else:
            config["json_file"] = config_file
        settings_cls = type("GatewaySettingsFromFile", (GatewaySettings,), {"model_config": config})
    return settings_cls(**flags)
