"""One mode of the replay: simulated engines, one gateway (engine time or wallclock), the agents, the events.

Theory of operation: `run_mode` starts the `incident` engines with a ledger on each (sim/ledger.py), the
production gateway (`GatewayServer`, as `rolloutgate serve` runs it) with a recorder (gateway.py), the agent
fleet (agents.py), and one task per scripted event of the timeline (scenario.py). At the end of the duration
it stops the agents, joins the client's attempts to the gateway's requests (attempts.py), takes every record
(agents, gateway, engines) and returns them as one JSON-able `ModeRecords`; measure.py turns them into figures.

Events:
- storm: `storm_sessions` new agents start at once, each with a ~100K-token history and one short turn;
- update: engine-time mode calls the gateway's `/admin/update_weights` (gate closed, engines paused in place,
  weights loaded, resumed); wallclock mode pauses every engine itself (`/pause_generation` in place), loads the
  weights, continues (the gateway knows nothing, like the incident's proxy);
- restart (with `version_faults`): the engine restarts (the simulator's `restart` fault) and comes back holding
  its launch weights; at the update, `fail_engine`'s update fails (`update_fails`, set for the update only);
- freeze: the engine stops for good. The freeze lands while the engine is decoding for someone and no
  ~100K-token prefill is in progress there (neither on the engine nor, as the gateway counts it, on its way
  there), so that "detected within stall_timeout" is what is measured (an idle engine
  is only found by health checks, and during a large prefill the gateway rightly allows the prefill's time on
  top, see core/liveness.py); the wait is recorded.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from rolloutgate.config import EngineSpec, GatewaySettings
from rolloutgate.server.app import GatewayServer
from rolloutgate.server.context import GatewayContext
from rolloutreplay.agents import AgentFleet, import_litellm
from rolloutreplay.attempts import join
from rolloutreplay.gateway import GatewayRecorder
from rolloutreplay.measure import LARGE_PREFILL_TOKENS
from rolloutreplay.scenario import (
    PREFILL_ADMISSION_OFF,
    ReplayConfig,
    ScenarioEvent,
    agent_plan,
    timeline,
)
from rolloutreplay.trace_workload import TraceWorkload
from rolloutsim import SimCluster
from rolloutsim.engine import SimEngine
from rolloutsim.faults import Fault
from rolloutsim.ledger import GenerationLedger
from rolloutsim.request import SimRequest

__all__ = ("ModeRecords", "run_mode")

Progress = Callable[[dict[str, Any]], None]
_PROGRESS_EVERY_REAL_S = 0.5
_LAG_PROBE_REAL_S = 0.05
_LAG_REPORTED_REAL_S = 0.1  # stalls of the event loop longer than this are recorded


async def _watch_loop(now: Callable[[], float], lags: list[tuple[float, float]]) -> None:
    """Record when this process's event loop fell behind: every timer, keep-alive and progress event of the
    mode waited that long (the fidelity of a time-scaled run depends on it)."""
    while True:
        before = time.perf_counter()
        await asyncio.sleep(_LAG_PROBE_REAL_S)
        late = time.perf_counter() - before - _LAG_PROBE_REAL_S
        if late > _LAG_REPORTED_REAL_S:
            lags.append((round(now(), 1), round(late, 3)))


@dataclass(frozen=True, slots=True, kw_only=True)
class ModeRecords:
    """Everything one mode's run recorded (JSON-able dicts), simulated seconds throughout."""

    mode: str
    config: dict[str, Any]
    engine_urls: list[str]
    events: list[dict[str, Any]]
    turns: list[dict[str, Any]]
    attempts: list[dict[str, Any]]
    ends: list[dict[str, Any]]
    marks: list[dict[str, Any]]
    generations: list[dict[str, Any]]
    holds: list[dict[str, Any]]
    ended_at: float
    real_s: float
    cpu_s: float
    loop_lags: list[tuple[float, float]]  # (simulated time, real seconds late) of event-loop stalls
    gateway_counters: dict[str, float] = field(default_factory=dict)  # its /metrics at the end: COUNTERS
    weights: list[dict[str, Any]] = field(default_factory=list)  # per engine: its versions, its updates

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModeRecords:
        return cls(**data)


class _TimedLedger(GenerationLedger):
    """A ledger that also keeps each finished generation's token times (the engines record them only with
    `record_token_times`; ReplayConfig.record_token_times)."""

    def __init__(self, engine: int) -> None:
        super().__init__(engine=engine)
        self.token_times: dict[str, list[float]] = {}

    def finished(self, req: SimRequest) -> None:
        if req.token_times is not None and not req.internal:
            self.token_times[req.rid] = req.token_times
        super().finished(req)


def _token_times(ledger: GenerationLedger, live: list[SimRequest], rid: str) -> list[float]:
    """A generation's token times (ms precision: the records stay small enough to write and read)."""
    times = ledger.token_times.get(rid) if isinstance(ledger, _TimedLedger) else None
    if times is None:
        times = next((r.token_times or [] for r in live if r.rid == rid), [])
    return [round(t, 3) for t in times]


def gateway_settings(config: ReplayConfig, mode: str, urls: list[str]) -> GatewaySettings:
    """The one difference from `rolloutgate serve`: these settings (its defaults otherwise)."""
    settings: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": 0,
        "engines": [EngineSpec(url=url, family="sglang") for url in urls],
        "time_scale": config.time_scale,
        "clock": mode,
        "timeout": config.gateway_timeout_s,
        "stall_timeout": config.stall_timeout_s,
        "log_level": "warning",
        **({} if config.prefill_admission else PREFILL_ADMISSION_OFF),
    }
    if config.version_faults and mode == "engine":  # the wallclock proxy knows no versions
        settings["version_policy"] = "latest-only"
    if config.record_trace is not None:
        settings["record_trace"] = str(Path(config.record_trace) / f"trace-{mode}.jsonl")
    return GatewaySettings(**(settings | dict(config.gateway_settings)))


class _Events:
    """Runs the scripted events of one mode and remembers when each really happened."""

    def __init__(
        self,
        config: ReplayConfig,
        mode: str,
        cluster: SimCluster,
        gateway: GatewayServer,
        fleet: AgentFleet,
        http: aiohttp.ClientSession,
    ) -> None:
        self.config = config
        self.mode = mode
        self.cluster = cluster
        self.gateway = gateway
        self.fleet = fleet
        self.http = http
        self.done: list[dict[str, Any]] = []

    async def run(self, event: ScenarioEvent) -> None:
        delay = self.config.real_s(event.at_s - self.cluster.clock.now())
        if delay > 0:
            await asyncio.sleep(delay)
        record: dict[str, Any] = {"kind": event.kind, "planned_at": event.at_s, **event.detail}
        record["at"] = self.cluster.clock.now()
        if event.kind == "storm":
            wave = int(event.detail["wave"])
            group = f"storm{wave}" if self.config.groups else None
            for index in range(int(event.detail["sessions"])):
                plan = agent_plan(self.config, wave * 1000 + index, storm=True, group=group)
                self.fleet.start_agent(plan, f"storm{wave}-{index}", sessions=1)
        elif event.kind == "update":
            await self._update(record)
        elif event.kind == "freeze":
            await self._freeze(self.cluster.engines[int(event.detail["engine"])], record)
        elif event.kind == "restart":
            engine = self.cluster.engines[int(event.detail["engine"])]
            engine.set_fault(
                Fault(
                    kind="restart",
                    down_s=float(event.detail["down_s"]),
                    duration_s=float(event.detail["starting_s"]),
                )
            )
        record["ended_at"] = self.cluster.clock.now()
        self.done.append(record)

    async def _update(self, record: dict[str, Any]) -> None:
        failing = record.get("fail_engine")
        if failing is None:
            await self._update_all(record)
            return
        engine = self.cluster.engines[int(failing)]
        engine.set_fault(Fault(kind="update_fails"))
        try:
            await self._update_all(record)
        finally:
            engine.clear_faults("update_fails")

    async def _update_all(self, record: dict[str, Any]) -> None:
        body = {"model_path": "sim-model-v2", "weight_version": "v2"}
        if self.mode == "engine":
            payload: dict[str, Any] = {"path": "/update_weights_from_disk", "body": body, "mode": "in_place"}
            if self.config.update_on_failure is not None:
                payload["on_failure"] = self.config.update_on_failure
            if self.config.update_on_failure == "rollback":
                payload["rollback_body"] = {"model_path": "sim-model", "weight_version": "default"}
            async with self.http.post(f"{self.gateway.url}/admin/update_weights", json=payload) as response:
                record["status"] = response.status
                report = await response.json()
            record["failed"] = [r["engine"] for r in report.get("engines", []) if not r.get("ok")]
            record["excluded"] = report.get("excluded", [])
            return
        # wallclock: whoever updates the weights pauses the engines themselves; the proxy knows nothing
        urls = self.cluster.urls

        async def post(url: str, path: str, payload: dict[str, Any]) -> int:
            async with self.http.post(url + path, json=payload) as response:
                await response.read()
                return response.status

        await asyncio.gather(*(post(u, "/pause_generation", {"mode": "in_place"}) for u in urls))
        updated = await asyncio.gather(*(post(u, "/update_weights_from_disk", body) for u in urls))
        await asyncio.gather(*(post(u, "/continue_generation", {}) for u in urls))
        record["status"] = 200
        record["failed"] = [f"engine {i}" for i, status in enumerate(updated) if status != 200]

    async def _freeze(self, engine: SimEngine, record: dict[str, Any]) -> None:
        poll_s = max(0.01, self.config.real_s(0.5))
        while not self._is_freeze_moment(engine):  # noqa: ASYNC110 - polls the engine's and the gateway's state
            await asyncio.sleep(poll_s)
        record["waited_s"] = self.cluster.clock.now() - record["at"]
        record["at"] = self.cluster.clock.now()
        engine.set_fault(Fault(kind="freeze"))

    def _is_freeze_moment(self, engine: SimEngine) -> bool:
        return _is_decoding_only(engine) and not _gateway_sees_large_prefill(self.gateway.context, engine.url)


def _gateway_sees_large_prefill(context: GatewayContext, url: str) -> bool:
    """The gateway counts a large prefill on this engine (one may still be on its way there)."""
    handle = context.pool.by_url(url)
    if handle is None:
        return False
    stats = context.driver.core.stats()
    return any(e.engine_id == handle.engine_id and e.large_prefills > 0 for e in stats.engines)


def _is_decoding_only(engine: SimEngine) -> bool:
    """The engine is decoding for someone and prefilling no large prompt (a freeze there is what a gateway
    must catch within its stall timeout)."""
    live = [r for r in engine.requests().values() if not r.is_finished]
    is_large_prefill = any(
        r.state.value in ("waiting", "prefilling")
        and r.prompt_tokens - r.cached_tokens >= LARGE_PREFILL_TOKENS
        for r in live
    )
    return not is_large_prefill and any(r.state.value == "running" for r in live)


async def warm_up(litellm: Any) -> None:
    """One call through LiteLLM before the clock starts: its first call loads much of the library (seconds
    of CPU), which would otherwise stall the first simulated minutes."""
    async with SimCluster(engines=1, api="sglang", profile="fast") as cluster:
        await litellm.acompletion(
            model="openai/sim-model",
            api_base=f"{cluster.urls[0]}/v1",
            api_key="replay",
            messages=[{"role": "user", "content": "warm up"}],
            max_tokens=4,
            timeout=30,
        )


async def run_mode(
    config: ReplayConfig,
    mode: str,
    progress: Progress | None = None,
    ready: Callable[[], Awaitable[None]] | None = None,
) -> ModeRecords:
    """Run one mode ("engine" or "wallclock") for `config.duration_s` simulated seconds. `ready`, if given, is
    awaited once LiteLLM is loaded and warm, just before the engines start (to start both modes together)."""
    if mode not in ("engine", "wallclock"):
        raise ValueError(f"mode must be 'engine' or 'wallclock', got {mode!r}")
    litellm = import_litellm()
    await warm_up(litellm)
    if ready is not None:
        await ready()
    real0, cpu0 = time.perf_counter(), time.process_time()
    async with SimCluster(
        engines=config.engines,
        api="sglang",
        profile="incident",
        time_scale=config.time_scale,
        seed=config.seed,
        record_token_times=config.record_token_times,
    ) as cluster:
        ledger_type = _TimedLedger if config.record_token_times else GenerationLedger
        ledgers = ledger_type.attach_fleet(cluster.engines)
        clock = cluster.clock
        lags: list[tuple[float, float]] = []
        watcher = asyncio.create_task(_watch_loop(clock.now, lags))
        gateway = GatewayServer(gateway_settings(config, mode, cluster.urls))
        await gateway.start()
        recorder = GatewayRecorder(gateway.context, clock.now)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as http:
            fleet = AgentFleet(config, gateway.url, clock.now, litellm, http)
            if config.trace is None:
                for index in range(config.agents):
                    fleet.start_agent(agent_plan(config, index), f"a{index:02d}")
                scripted = timeline(config)
            else:  # a recorded trace's sessions and events instead (trace_workload.py)
                workload = TraceWorkload.read(config.trace, config)
                for name, agent in workload.agents():
                    fleet.start_agent(agent, name, sessions=len(agent.sessions))
                scripted = workload.events()
            events = _Events(config, mode, cluster, gateway, fleet, http)
            event_tasks = [asyncio.create_task(events.run(e)) for e in scripted]
            try:
                while clock.now() < config.duration_s:
                    if progress is not None:
                        progress(_progress(mode, clock.now(), fleet, config))
                    remaining = config.real_s(config.duration_s - clock.now())
                    await asyncio.sleep(min(_PROGRESS_EVERY_REAL_S, max(0.0, remaining)))
            finally:
                ended_at = clock.now()
                for task in event_tasks:
                    task.cancel()
                await asyncio.gather(*event_tasks, return_exceptions=True)
                await fleet.stop()
                watcher.cancel()
            counters = await _gateway_counters(http, gateway.url)
        generations: list[dict[str, Any]] = []
        holds: list[dict[str, Any]] = []
        for engine, ledger in zip(cluster.engines, ledgers, strict=True):
            engine.sync()
            live = [r for r in engine.model.requests() if not r.is_finished]
            records, engine_holds = ledger.snapshot(live)
            if config.record_token_times:
                generations += [
                    r.to_json() | {"token_times": _token_times(ledger, live, r.rid)} for r in records
                ]
            else:
                generations += [r.to_json() for r in records]
            holds += [h.to_json() for h in engine_holds]
        join(fleet.attempts, recorder.arrivals)
        result = ModeRecords(
            mode=mode,
            config=config.to_json(),
            engine_urls=list(cluster.urls),
            events=events.done,
            turns=[asdict(t) for t in fleet.turns],
            attempts=[asdict(a) for a in fleet.attempts],
            ends=[asdict(e) for e in recorder.ends.values()],
            marks=[asdict(m) for m in recorder.marks],
            generations=generations,
            holds=holds,
            ended_at=ended_at,
            real_s=time.perf_counter() - real0,
            cpu_s=time.process_time() - cpu0,
            loop_lags=lags,
            gateway_counters=counters,
            weights=[ledger.weights() for ledger in ledgers],
        )
        if progress is not None:
            progress(_progress(mode, ended_at, fleet, config) | {"done": True})
        await gateway.stop(grace_s=0.0)
    return result


# the RL scheduling counters the replay reports (docs/rl.md): name -> (metric, labels it must carry). Each is
# added by its own part of the gateway; one this gateway does not export reads 0.
COUNTERS: dict[str, tuple[str, dict[str, str]]] = {
    "budget_tokens_saved": ("rolloutgate_budget_tokens_saved_total", {}),
    "group_prefill_tokens_saved": ("rolloutgate_group_prefill_tokens_saved_total", {}),
    "stale_requeued": ("rolloutgate_stale_requests_total", {"action": "requeued"}),
    "stale_partial": ("rolloutgate_stale_requests_total", {"action": "partial"}),
}


async def _gateway_counters(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """The COUNTERS, read from the gateway's /metrics as any scraper reads them (0 where one is absent)."""
    async with http.get(f"{url}/metrics") as response:
        text = await response.text()
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    return {
        key: sum(s.value for s in samples if s.name == name and labels.items() <= s.labels.items())
        for key, (name, labels) in COUNTERS.items()
    }


def _progress(mode: str, now: float, fleet: AgentFleet, config: ReplayConfig) -> dict[str, Any]:
    turns = fleet.turns
    return {
        "mode": mode,
        "now": round(min(now, config.duration_s), 1),
        "duration": config.duration_s,
        "turns_ok": sum(1 for t in turns if t.ok),
        "turns_failed": sum(1 for t in turns if t.ok is False),
    }
