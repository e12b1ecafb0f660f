"""verl's rollout router, served by a running rolloutgate gateway (docs/frameworks/verl.md).

verl (0.9.1, `verl/workers/rollout/router.py`, verl-project/verl#7115) builds its router from the YAML file that
`actor_rollout_ref.rollout.router_config_path` names: `router_class` is the class's fully qualified name, and the
whole YAML dict is its constructor's second argument (`ray.remote(cls).remote(servers, yaml_config)`, `servers`
mapping each engine's `host:port` to its server actor). verl's `LLMServerClient.generate`
(`verl/workers/rollout/llm_server.py`) asks the router `acquire_server(request_id)` for `(server_id, handle)`,
awaits `handle.generate.remote(request_id=, prompt_ids=, sampling_params=, ...)` for a `TokenOutput`, and calls
`release_server(server_id)` in its `finally` without waiting.

`RolloutgateRouter` (name it `rolloutgate.frameworks.verl.RolloutgateRouter` there) registers verl's engines
with the gateway (`POST /workers`) and answers every acquire with a `GatewayEndpoint`: a picklable stand-in for
the server actor whose `generate.remote(...)` posts the call to the gateway, SGLang's `/generate` or vLLM's
`/v1/completions` by family, with verl's `request_id` (a trajectory's sticky key) as `X-Session-Id`. The gateway
then queues, places, times and answers it; the endpoint turns the answer into the `TokenOutput` verl's server
would have returned (the same `max_tokens` default and clamping, the same stop reasons).

Nothing here imports verl, Ray or torch: verl's `TokenOutput` is imported when the first answer is built (in
verl's own processes, where verl is loaded), and a dataclass with its fields stands in where verl is absent.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.parse
import urllib.request
import weakref
from collections import OrderedDict
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal, cast

import aiohttp

__all__ = (
    "GatewayEndpoint",
    "GatewayError",
    "RolloutgateRouter",
    "RouterConfig",
    "TokenOutput",
    "close_sessions",
)

Family = Literal["sglang", "vllm"]
FAMILIES: tuple[Family, ...] = ("sglang", "vllm")
# verl's GlobalRequestLoadBalancer keeps this many request ids in its sticky LRU (router.py
# DEFAULT_ROUTING_CACHE_SIZE); the ids kept here are those released by `clear_sticky_cache`.
SESSION_MEMORY = 10_000
NO_SERVERS = (
    "No available servers in load balancer"  # verl's message: FullyAsyncLLMServerClient retries on it
)
ADMIN_TIMEOUT_S = 30.0


class GatewayError(RuntimeError):
    """The gateway answered a generate call with an error (its status and body are in the message)."""


@dataclass
class TokenOutput:
    """verl's `TokenOutput` (`verl/workers/rollout/replica.py`), field for field, for where verl is absent."""

    token_ids: list[int]
    log_probs: list[float] | None = None
    routed_experts: Any = None
    stop_reason: str | None = None
    num_preempted: int | None = None
    extra_fields: dict[str, Any] = field(default_factory=dict)


def _token_output_class() -> Any:
    """verl's own `TokenOutput` where verl imports, else the stand-in above."""
    try:
        from verl.workers.rollout.replica import TokenOutput as VerlTokenOutput  # type: ignore[import-not-found]
    except ImportError:
        return TokenOutput
    return VerlTokenOutput


@dataclass(frozen=True)
class RouterConfig:
    """The router YAML's keys (beside verl's own `router_class`).

    `gateway_url` and `family` are required; `prompt_length` and `response_length` are the rollout config's
    (`actor_rollout_ref.rollout.*`), which verl's servers use to size a call that names no `max_tokens`, and
    `max_model_len` defaults to their sum as verl's does."""

    gateway_url: str
    family: Family
    prompt_length: int
    response_length: int
    max_model_len: int | None = None
    model: str | None = None  # the `model` field of vLLM calls (omitted when None)
    api_key: str | None = None  # sent as `Authorization: Bearer` on generate calls and session releases
    admin_token: str | None = None  # sent on worker registration and removal
    register_servers: bool = True  # POST verl's engines to the gateway's /workers (False: `serve --engine`)
    repetition_penalty: float = 1.0  # verl's vLLM server's defaults (rollout config)
    ignore_eos: bool = False

    @classmethod
    def from_yaml(cls, config: Mapping[str, Any]) -> RouterConfig:
        """From verl's YAML dict; an unknown key is refused (a typo would otherwise be a silent default)."""
        known = {f.name for f in fields(cls)}
        given = {str(k): v for k, v in config.items() if k != "router_class"}
        unknown = sorted(set(given) - known)
        if unknown:
            raise ValueError(f"unknown rolloutgate router keys {unknown}; known: {sorted(known)}")
        missing = sorted(
            name
            for name in ("gateway_url", "family", "prompt_length", "response_length")
            if name not in given
        )
        if missing:
            raise ValueError(f"the rolloutgate router YAML needs {missing}")
        if given["family"] not in FAMILIES:
            raise ValueError(
                f"family must be one of {FAMILIES} (verl's rollout.name), not {given['family']!r}"
            )
        given["gateway_url"] = str(given["gateway_url"]).rstrip("/")
        return cls(**given)

    @property
    def context_length(self) -> int:
        return self.max_model_len or self.prompt_length + self.response_length


@dataclass(frozen=True)
class GatewayEndpoint:
    """What `acquire_server` hands verl in place of a server actor: `generate.remote(**kwargs)` is awaited.
    `session_id` is the acquire's sticky key (verl's `request_id`, a trajectory's), which verl does not pass on
    to the server's `generate` (it sends a fresh per-turn id there)."""

    config: RouterConfig
    session_id: str | None = None

    @property
    def generate(self) -> _Remote:
        return _Remote(self)

    async def call(
        self,
        *,
        request_id: str,
        prompt_ids: list[int],
        sampling_params: Mapping[str, Any],
        image_data: Any = None,
        video_data: Any = None,
        audio_data: Any = None,
        mm_processor_kwargs: Mapping[str, Any] | None = None,
        priority: int = 0,
    ) -> Any:
        """One generate call through the gateway; verl's `TokenOutput` (or the stand-in) of its answer."""
        del (
            request_id,
            priority,
        )  # verl's per-turn engine id and vLLM priority: the gateway assigns and orders
        if image_data is not None or video_data is not None or audio_data is not None or mm_processor_kwargs:
            raise NotImplementedError(
                "the rolloutgate router carries text (token ids) only, no multimodal data"
            )
        cfg = self.config
        ids = [int(t) for t in prompt_ids]
        params = dict(sampling_params)
        logprobs = bool(params.pop("logprobs", False))
        headers = {"Content-Type": "application/json"}
        if self.session_id:
            headers["X-Session-Id"] = self.session_id
        if cfg.api_key:
            headers["Authorization"] = f"Bearer {cfg.api_key}"
        if cfg.family == "vllm":
            params.setdefault("repetition_penalty", cfg.repetition_penalty)
            params.setdefault("ignore_eos", cfg.ignore_eos)
            body: dict[str, Any] = {
                **params,
                "prompt": ids,
                "max_tokens": _max_tokens(cfg, params, len(ids), floor=1, reserve=0),
                "return_token_ids": True,
            }
            if logprobs:
                body["logprobs"] = 0
            if cfg.model:
                body["model"] = cfg.model
            answer, engine = await _post(f"{cfg.gateway_url}/v1/completions", body, headers)
            return _from_completion(answer, engine, logprobs)
        params["max_new_tokens"] = _max_tokens(cfg, params, len(ids), floor=0, reserve=1)
        body = {"input_ids": ids, "sampling_params": params, "return_logprob": logprobs}
        answer, engine = await _post(f"{cfg.gateway_url}/generate", body, headers)
        return _from_generate(answer, engine, logprobs)


class _Remote:
    """`handle.generate` as verl calls it: `.remote(...)` gives the awaitable (a Ray actor call gives a ref)."""

    def __init__(self, endpoint: GatewayEndpoint) -> None:
        self.endpoint = endpoint

    def remote(self, *, request_id: str, **kwargs: Any) -> Coroutine[Any, Any, Any]:
        return self.endpoint.call(request_id=request_id, **kwargs)


def _max_tokens(
    cfg: RouterConfig, params: dict[str, Any], prompt_len: int, *, floor: int, reserve: int
) -> int:
    """verl's servers' budget: the call's `max_tokens`/`max_new_tokens`, else the rollout's response length
    capped by what the prompt leaves of prompt_length + response_length; clamped to [floor, room]."""
    room = cfg.context_length - prompt_len - reserve
    if room < floor:
        raise ValueError(f"prompt of {prompt_len} tokens leaves no room within {cfg.context_length}")
    given = params.pop("max_tokens", None)
    other = params.pop("max_new_tokens", None)
    if given is None:
        given = other
    if given is None:
        given = min(cfg.response_length, cfg.prompt_length + cfg.response_length - prompt_len)
    return max(floor, min(int(given), room))


def _from_completion(answer: Mapping[str, Any], engine: str | None, logprobs: bool) -> Any:
    """vLLM's `/v1/completions` answer as verl's vLLM server builds its `TokenOutput`."""
    choice = answer["choices"][0]
    token_ids = [int(t) for t in choice.get("token_ids") or []]
    log_probs: list[float] | None = None
    if logprobs:
        log_probs = [float(x) for x in (choice.get("logprobs") or {}).get("token_logprobs") or []]
    finish = choice.get("finish_reason")
    stop_reason = "aborted" if finish == "abort" else "completed" if finish in ("stop", "length") else finish
    details = (answer.get("usage") or {}).get("prompt_tokens_details") or {}
    extra = {"num_cached_tokens": details.get("cached_tokens"), "rolloutgate_engine": engine}
    return _token_output_class()(
        token_ids=token_ids, log_probs=log_probs, stop_reason=stop_reason, extra_fields=extra
    )


def _from_generate(answer: Mapping[str, Any], engine: str | None, logprobs: bool) -> Any:
    """SGLang's `/generate` answer as verl's SGLang server builds its `TokenOutput`."""
    meta = answer.get("meta_info") or {}
    finish = meta.get("finish_reason")
    token_ids = [int(t) for t in answer.get("output_ids") or []]
    log_probs: list[float] | None = None
    if logprobs:
        entries = meta.get("output_token_logprobs") or []
        if len(entries) == len(token_ids):
            log_probs = [float(entry[0]) for entry in entries]
        else:  # verl's server drops the output when they disagree
            token_ids, log_probs = [], []
    extra = {"num_cached_tokens": meta.get("cached_tokens"), "rolloutgate_engine": engine}
    return _token_output_class()(
        token_ids=token_ids,
        log_probs=log_probs,
        stop_reason=finish.get("type") if isinstance(finish, Mapping) else None,
        extra_fields=extra,
    )


_SESSIONS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, aiohttp.ClientSession] = (
    weakref.WeakKeyDictionary()
)


def _session() -> aiohttp.ClientSession:
    """One client session per event loop (verl's agent loop workers each run one), no total timeout: the
    gateway's clocks bound the call, and its keep-alive bytes hold the connection while the call waits."""
    loop = asyncio.get_running_loop()
    session = _SESSIONS.get(loop)
    if session is None or session.closed:
        connector = aiohttp.TCPConnector(limit=0)
        session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))
        _SESSIONS[loop] = session
    return session


async def close_sessions() -> None:
    """Close this event loop's client session (a test's or a worker's end)."""
    session = _SESSIONS.pop(asyncio.get_running_loop(), None)
    if session is not None:
        await session.close()


async def _post(url: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[dict[str, Any], str | None]:
    async with _session().post(url, data=json.dumps(body), headers=headers) as resp:
        raw = await resp.read()
        if resp.status >= 400:
            raise GatewayError(
                f"rolloutgate answered {resp.status} to {url}: {raw[:2000].decode(errors='replace')}"
            )
        return cast(dict[str, Any], json.loads(raw)), resp.headers.get("X-Rolloutgate-Engine")


def _admin_call(
    cfg: RouterConfig, method: str, path: str, body: Mapping[str, Any] | None = None, *, token: str | None
) -> Any:
    """A blocking call to the gateway from the router actor (verl calls its router's methods synchronously)."""
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{cfg.gateway_url}{path}", data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=ADMIN_TIMEOUT_S) as resp:
            return json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        detail = exc.read()[:2000].decode(errors="replace")
        raise GatewayError(f"rolloutgate answered {exc.code} to {method} {path}: {detail}") from None


def engine_url(address: str) -> str:
    """verl's server address (`host:port`, `[v6]:port`) as the gateway's engine URL."""
    return address if "://" in address else f"http://{address}"


class RolloutgateRouter:
    """verl's `RequestLoadBalancer` protocol (verl/workers/rollout/router.py), answered by a rolloutgate gateway.

    Every acquire gets the same server id (the gateway's) and an endpoint bound to verl's `request_id`; the
    gateway chooses the engine. The counts here are verl's own bookkeeping (`get_total_inflight`, polled by
    fully-async drain loops); the gateway's per-engine view is `get_status()["servers"]`."""

    def __init__(self, servers: Mapping[str, Any], config: Mapping[str, Any]) -> None:
        self.config = RouterConfig.from_yaml(config)
        self.server_id = f"rolloutgate:{self.config.gateway_url}"
        self._servers: dict[str, None] = {}
        self._inflight = 0
        self._sessions: OrderedDict[str, None] = OrderedDict()  # request ids since the last clear, LRU
        self.add_servers(servers)

    def require_acquire_fields(self) -> list[str]:
        """Routing keys on `request_id` alone: the gateway reads the prompt itself."""
        return []

    def require_release_fields(self) -> list[str]:
        return []

    def acquire_server(self, request_id: str, **extra: Any) -> tuple[str, GatewayEndpoint]:
        del extra  # none declared
        if not self._servers:
            raise RuntimeError(NO_SERVERS)
        self._sessions[request_id] = None
        self._sessions.move_to_end(request_id)
        while len(self._sessions) > SESSION_MEMORY:
            self._sessions.popitem(last=False)
        self._inflight += 1
        return self.server_id, GatewayEndpoint(self.config, request_id)

    def release_server(self, server_id: str, request_id: str | None = None) -> None:
        """A call ended (verl's `finally`, every turn): counted only; the session lives on for its next turn."""
        del request_id
        if server_id == self.server_id and self._inflight > 0:
            self._inflight -= 1

    def add_servers(self, servers: Mapping[str, Any]) -> None:
        """verl's engines (`host:port` to actor handle; the handles are not used): registered with the gateway
        unless `register_servers` is false (a gateway started with `--engine`)."""
        for address in servers:
            if self.config.register_servers:
                _admin_call(
                    self.config,
                    "POST",
                    "/workers",
                    {"url": engine_url(address), "family": self.config.family},
                    token=self.config.admin_token,
                )
            self._servers[str(address)] = None

    def remove_servers(self, server_ids: list[str]) -> None:
        """Taken out of the gateway's pool (verl's elastic scaling and fully-async weight sync)."""
        for address in server_ids:
            if address not in self._servers:
                continue
            if self.config.register_servers:
                query = urllib.parse.urlencode({"url": engine_url(address)})
                _admin_call(self.config, "POST", f"/remove_worker?{query}", token=self.config.admin_token)
            del self._servers[address]

    def get_all_servers(self) -> list[str]:
        return list(self._servers)

    def get_total_inflight(self) -> int:
        return self._inflight

    def _engine_loads(self) -> dict[str, int]:
        workers = _admin_call(self.config, "GET", "/workers", token=self.config.admin_token)["workers"]
        return {str(w.get("url")): int(w.get("in_flight", 0)) for w in workers}

    def get_status(self) -> dict[str, Any]:
        loads = self._engine_loads()
        return {
            "servers": loads,
            "total_inflight": self._inflight,
            "active_servers": len(self._servers),
            "gateway": self.config.gateway_url,
        }

    def clear_sticky_cache(self) -> dict[str, Any]:
        """verl's phase switch: every session acquired since the last clear is released at the gateway
        (`POST /finish_session`), so the next calls are placed by load again."""
        cleared = list(self._sessions)
        for session_id in cleared:
            query = urllib.parse.urlencode({"session_id": session_id})
            _admin_call(self.config, "POST", f"/finish_session?{query}", token=self.config.api_key)
        self._sessions.clear()
        return {"cleared_entries": len(cleared), "server_loads": self._engine_loads()}
