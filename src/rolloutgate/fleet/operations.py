"""Engine control for the whole fleet: the gate, weight updates, aborts, cache flushes, the engines' metrics and
the state, sent to any replica and carried out on every one.

Theory of operation: the calls are the gateway's own operations (server/answer.py), run by each replica on its
own app (`run_here`), so one gateway and a fleet share one implementation. A replica that takes such a call
from a client judges the caller's rights itself (fleet/edge.py), then asks the controller, which runs it on
every live replica at once over their links (Ray actor calls: no second HTTP hop, so rights are never judged by
a forwarder's address) and answers with `compose`: which replicas took part, which engines (by URL) each held,
and the membership check. Every engine the controller's view has must have been held by its owner when the
owner ran the operation; an engine whose owner did not answer, or had not taken it into its pool yet, is
`missing`, and the operation fails (502) naming it, so "paused" never means "paused, except where it did not
arrive". The parts that did run are not undone: the answer says which did, and the call can be repeated (each
is idempotent: a second pause, resume, abort or flush changes nothing more).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import web
from prometheus_client.core import GaugeMetricFamily

from rolloutgate.errors import GatewayError
from rolloutgate.fleet.assignment import FleetView, engine_fleet_id
from rolloutgate.fleet.routing import FLEET_READS, FLEET_RL, FLEET_WIDE, RL_PREFIX
from rolloutgate.server.admin import gateway_state, pause_gate, resume_gate
from rolloutgate.server.answer import Answer
from rolloutgate.server.context import CONTEXT
from rolloutgate.server.engine_handle import EngineHandle
from rolloutgate.server.engine_metrics import CONTENT_TYPE, merge_labelled, merge_scrapes, scrape_engines
from rolloutgate.server.fan_out import abort_requests, flush_caches
from rolloutgate.server.rl_plane import ROUTE_PREFIX, Unreached, answer_part
from rolloutgate.server.rl_plane import compose as compose_rl
from rolloutgate.server.weight_update import begin_fleet_part, finish_fleet_part, update_all_weights

__all__ = (
    "OPERATIONS",
    "UPDATE_BEGIN",
    "UPDATE_FINISH",
    "FleetOperation",
    "ReplicaResult",
    "compose",
    "missing_engines",
    "operation_named",
    "run_here",
)

REPLICA_UP = "rolloutgate_replica_up"
Query = Mapping[str, str]
UPDATE_BEGIN, UPDATE_FINISH = "update_weights:begin", "update_weights:finish"
Access = Literal["admin", "worker", "open"]  # server/auth.py: check_admin, check_worker_admin, none


@dataclass(frozen=True, slots=True)
class ReplicaResult:
    """One replica's part: its answer, the engines (URLs) its pool held when it ran the operation, and the
    weight version each of them held once it had (the controller shares them: fleet/controller.py)."""

    answer: Answer
    held: tuple[str, ...]
    versions: Mapping[str, str | None] = field(default_factory=dict)


async def _state(app: web.Application, body: dict[str, Any], query: Query) -> Answer:
    del body, query
    ctx = app[CONTEXT]
    return Answer(200, gateway_state(app), engines=tuple(e.url for e in ctx.pool.engines.values()))


async def _metrics(app: web.Application, body: dict[str, Any], query: Query) -> Answer:
    del body, query
    scrapes = await scrape_engines(app)
    return Answer(200, [list(s) for s in scrapes], engines=tuple(url for _, url, _ in scrapes))


async def _gateway_metrics(app: web.Application, body: dict[str, Any], query: Query) -> Answer:
    del body, query
    return Answer(200, text=app[CONTEXT].metrics.render().decode(), content_type=CONTENT_TYPE)


@dataclass(frozen=True, slots=True)
class FleetOperation:
    name: str
    access: Access
    run: Callable[[web.Application, dict[str, Any], Query], Awaitable[Answer]]
    timeout_s: (
        float  # real seconds each replica has (an update drains first: its own drain_timeout bounds it)
    )
    checks_membership: bool = True  # a read (state, metrics) lists what answered instead of failing
    step: bool = False  # a step of another operation, which the controller runs (no route of its own)


def _body_only(
    operation: Callable[[web.Application, dict[str, Any]], Awaitable[Answer]],
) -> Callable[[web.Application, dict[str, Any], Query], Awaitable[Answer]]:
    async def run(app: web.Application, body: dict[str, Any], query: Query) -> Answer:
        del query
        return await operation(app, body)

    return run


def _fleet_id(handle: EngineHandle) -> str:
    return engine_fleet_id(handle.url)


async def _rl(app: web.Application, body: dict[str, Any], query: Query) -> Answer:
    """This replica's part of a trainer's `/v1/rl` call, its engines named by their fleet ids."""
    del query
    return await answer_part(app[CONTEXT], body["call"], _fleet_id)


async def _flush(app: web.Application, body: dict[str, Any], query: Query) -> Answer:
    del body
    return await flush_caches(app, query)


OPERATIONS: dict[str, FleetOperation] = {
    op.name: op
    for op in (
        FleetOperation("pause", "admin", _body_only(pause_gate), 60.0),
        FleetOperation("resume", "admin", _body_only(resume_gate), 60.0),
        FleetOperation("update_weights", "admin", _body_only(update_all_weights), 24 * 3600.0),
        # the all-at-once update in two steps, each replica's outcome judged between (fleet/controller.py)
        FleetOperation(UPDATE_BEGIN, "admin", _body_only(begin_fleet_part), 24 * 3600.0, step=True),
        FleetOperation(UPDATE_FINISH, "admin", _body_only(finish_fleet_part), 24 * 3600.0, step=True),
        FleetOperation("abort_request", "worker", _body_only(abort_requests), 30.0),
        FleetOperation("flush_cache", "worker", _flush, 3700.0),  # SGLang's ?timeout= is at most 3600 s
        FleetOperation("engine_metrics", "open", _metrics, 10.0, checks_membership=False),
        FleetOperation(FLEET_RL, "admin", _rl, 3700.0),  # an engine call has its own rl_control_timeout
        FleetOperation("state", "admin", _state, 10.0, checks_membership=False),
        FleetOperation("metrics", "open", _gateway_metrics, 10.0, checks_membership=False),
    )
}
assert {n for n, op in OPERATIONS.items() if not op.step} == {
    *FLEET_WIDE.values(),
    *FLEET_READS.values(),
    FLEET_RL,
}, "fleet/routing.py routes every operation"
assert RL_PREFIX == ROUTE_PREFIX, "fleet/routing.py sends every /v1/rl route to the controller"


def operation_named(name: str) -> FleetOperation:
    return OPERATIONS[name]


async def run_here(app: web.Application, name: str, body: dict[str, Any], query: Query) -> ReplicaResult:
    """Run operation `name` on this replica's gateway; an error it raises is its answer, as over HTTP."""
    ctx = app[CONTEXT]
    try:
        answer = await OPERATIONS[name].run(app, body, query)
    except GatewayError as exc:
        answer = Answer(exc.status, exc.payload())
    engines = ctx.pool.engines.values()
    return ReplicaResult(
        answer, tuple(e.url for e in engines), {e.url: e.info.weight_version for e in engines}
    )


def compose(
    operation: FleetOperation,
    view: FleetView,
    results: Mapping[str, ReplicaResult | str],
    body: Mapping[str, Any] | None = None,
) -> Answer:
    """The fleet's answer from each live replica's result, or why it gave none (module docstring). `body`: the
    operation's, as the replicas got it."""
    if operation.name == "engine_metrics":
        return _merged_engine_metrics(view, results)
    if operation.name == "metrics":
        return _merged_gateway_metrics(results)
    missing = missing_engines(view, results)
    if operation.name == FLEET_RL:
        assert body is not None, "a /v1/rl call is composed from its call"
        parts = [r.answer for r in results.values() if isinstance(r, ReplicaResult)]
        unreached = [Unreached(engine_fleet_id(m["engine"]), m["engine"], m["why"]) for m in missing]
        return compose_rl(body["call"], parts, unreached)
    replicas: dict[str, Any] = {}
    failed: list[int] = []
    for replica_id, result in results.items():
        if isinstance(result, str):
            replicas[replica_id] = {"ok": False, "error": result}
            failed.append(502)
            continue
        answer = result.answer
        replicas[replica_id] = {
            "ok": answer.status < 400,
            "status": answer.status,
            "answer": answer.text if answer.text is not None else answer.json,
            "engines": list(answer.engines),
        }
        if answer.status >= 400:
            failed.append(answer.status)
    engines = {url: owner for url, owner in view.owners.items() if url not in {m["engine"] for m in missing}}
    if not operation.checks_membership:
        missing = []
    ok = not failed and not missing
    body = {
        "ok": ok,
        "operation": operation.name,
        "replicas": replicas,
        "engines": engines,
        "missing": missing,
    }
    if ok or not operation.checks_membership:  # a read answers with what answered, and says what did not
        return Answer(200, body, engines=tuple(engines))
    # every replica refused the call the same way (a bad body): the caller's error, as one gateway's
    status = failed[0] if failed and len(failed) == len(results) and len(set(failed)) == 1 else 502
    return Answer(status if 400 <= status < 500 else 502, body, engines=tuple(engines))


def missing_engines(view: FleetView, results: Mapping[str, ReplicaResult | str]) -> list[dict[str, Any]]:
    """Every engine of the view whose owner did not run the operation holding it, and why."""
    missing: list[dict[str, Any]] = []
    for url, owner in view.owners.items():
        held_by = results.get(owner) if owner is not None else None
        if owner is not None and isinstance(held_by, ReplicaResult) and url in held_by.held:
            continue
        if owner is None:
            why = "no live replica owns it"
        elif isinstance(held_by, ReplicaResult):
            why = f"its owner {owner} had not taken it into its pool yet"
        else:
            why = f"its owner {owner} did not answer"
        missing.append({"engine": url, "owner": owner, "why": why})
    return missing


def _merged_gateway_metrics(results: Mapping[str, ReplicaResult | str]) -> Answer:
    """Every replica's own metrics in one exposition, each sample labelled with its `replica`; a replica that
    did not answer is `rolloutgate_replica_up` 0."""
    up = GaugeMetricFamily(REPLICA_UP, "1 if the replica answered this fleet-wide scrape", labels=["replica"])
    parts = []
    for replica_id, result in results.items():
        answered = isinstance(result, ReplicaResult) and result.answer.text is not None
        up.add_metric([replica_id], 1.0 if answered else 0.0)
        if isinstance(result, ReplicaResult) and result.answer.text is not None:
            parts.append(({"replica": replica_id}, result.answer.text))
    return Answer(200, text=merge_labelled(parts, [up]).decode(), content_type=CONTENT_TYPE)


def _merged_engine_metrics(view: FleetView, results: Mapping[str, ReplicaResult | str]) -> Answer:
    """Every replica's engines in one exposition; an engine id is qualified by its replica (ids are a replica's
    own), and an engine whose owner did not answer is `up` 0."""
    scrapes: list[tuple[str, str, str | None]] = []
    for replica_id, result in results.items():
        if isinstance(result, ReplicaResult):
            scrapes.extend((f"{replica_id}/{e}", url, text) for e, url, text in result.answer.json)
    answered = {url for _, url, _ in scrapes}
    scrapes.extend((f"{owner}/?", url, None) for url, owner in view.owners.items() if url not in answered)
    return Answer(200, text=merge_scrapes(scrapes).decode(), content_type=CONTENT_TYPE)
