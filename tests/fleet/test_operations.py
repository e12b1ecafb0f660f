"""The fleet's answer to an engine-control call (fleet/operations.py `compose`): which replicas and engines
took part, and the membership check, on hand-made results (no fleet, no HTTP)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from rolloutgate.fleet.assignment import EngineEntry, FleetView
from rolloutgate.fleet.operations import OPERATIONS, ReplicaResult, compose
from rolloutgate.fleet.routing import FLEET_READS, FLEET_RL, FLEET_WIDE
from rolloutgate.server.answer import Answer

A, B, C = "http://a:1", "http://b:1", "http://c:1"


def view() -> FleetView:
    return FleetView(
        epoch="e",
        version=3,
        replicas={"r0": "http://r0", "r1": "http://r1"},
        engines={u: EngineEntry(u) for u in (A, B, C)},
        owners={A: "r0", B: "r0", C: "r1"},
    )


def paused(*urls: str) -> ReplicaResult:
    return ReplicaResult(Answer(200, {"status": "paused"}, engines=urls), held=urls)


def test_every_owner_answering_with_its_engines_is_a_success_listing_each_engine_by_owner() -> None:
    answer = compose(OPERATIONS["pause"], view(), {"r0": paused(A, B), "r1": paused(C)})
    assert answer.status == 200
    assert answer.json["ok"] and answer.json["missing"] == []
    assert answer.json["engines"] == {A: "r0", B: "r0", C: "r1"}
    assert answer.json["replicas"]["r1"] == {
        "ok": True,
        "status": 200,
        "answer": {"status": "paused"},
        "engines": [C],
    }


def test_an_owner_that_did_not_answer_fails_the_call_and_its_engines_are_named() -> None:
    answer = compose(OPERATIONS["pause"], view(), {"r0": paused(A, B), "r1": "pause: no answer in 60 s"})
    assert answer.status == 502 and not answer.json["ok"]
    assert answer.json["missing"] == [{"engine": C, "owner": "r1", "why": "its owner r1 did not answer"}]
    assert answer.json["engines"] == {A: "r0", B: "r0"}  # what did take part is still said
    assert answer.json["replicas"]["r1"] == {"ok": False, "error": "pause: no answer in 60 s"}


def test_an_engine_its_owner_had_not_taken_into_its_pool_yet_is_missing() -> None:
    answer = compose(OPERATIONS["resume"], view(), {"r0": paused(A), "r1": paused(C)})
    assert answer.status == 502
    assert [m["engine"] for m in answer.json["missing"]] == [B]
    assert "had not taken it" in answer.json["missing"][0]["why"]


def test_an_engine_with_no_live_owner_is_missing() -> None:
    orphaned = FleetView(epoch="e", version=1, replicas={}, engines={A: EngineEntry(A)}, owners={A: None})
    answer = compose(OPERATIONS["abort_request"], orphaned, {})
    assert answer.status == 502 and answer.json["missing"][0]["why"] == "no live replica owns it"


def test_the_same_refusal_from_every_replica_is_the_callers_error() -> None:
    refusal = Answer(400, {"error": {"message": "'mode' must be ...", "param": "mode"}})
    results = {r: ReplicaResult(refusal, held=held) for r, held in (("r0", (A, B)), ("r1", (C,)))}
    answer = compose(OPERATIONS["pause"], view(), results)
    assert answer.status == 400 and not answer.json["ok"] and answer.json["missing"] == []
    mixed = {"r0": results["r0"], "r1": ReplicaResult(Answer(409, {}), held=(C,))}
    assert compose(OPERATIONS["pause"], view(), mixed).status == 502


def test_a_read_answers_with_what_answered_and_says_what_did_not() -> None:
    state = ReplicaResult(Answer(200, {"queue_depth": 0}, engines=(A, B)), held=(A, B))
    answer = compose(OPERATIONS["state"], view(), {"r0": state, "r1": "ActorDiedError"})
    assert answer.status == 200 and answer.json["ok"] is False  # r1's silence is said, not hidden
    assert answer.json["replicas"]["r1"] == {"ok": False, "error": "ActorDiedError"}
    assert answer.json["missing"] == [] and answer.json["replicas"]["r0"]["answer"] == {"queue_depth": 0}


def test_engine_metrics_of_every_replica_merge_with_replica_qualified_ids_and_a_silent_owner_is_down() -> (
    None
):
    scrape = "# TYPE sglang_num_running_reqs gauge\nsglang_num_running_reqs 3\n"
    r0 = ReplicaResult(Answer(200, [["e0", A, scrape], ["e1", B, None]], engines=(A, B)), held=(A, B))
    answer = compose(OPERATIONS["engine_metrics"], view(), {"r0": r0, "r1": "ActorDiedError"})
    assert answer.status == 200 and answer.text is not None
    families = {f.name: f for f in text_string_to_metric_families(answer.text)}
    up = {s.labels["engine"]: s.value for s in families["rolloutgate_engine_metrics_up"].samples}
    assert up == {"r0/e0": 1.0, "r0/e1": 0.0, "r1/?": 0.0}
    running = families["sglang_num_running_reqs"].samples
    assert [(s.labels["engine"], s.labels["engine_url"], s.value) for s in running] == [("r0/e0", A, 3.0)]


def test_every_route_the_edge_sends_the_controller_has_an_operation() -> None:
    routed = {name for name, operation in OPERATIONS.items() if not operation.step}
    assert routed == {*FLEET_WIDE.values(), *FLEET_READS.values(), FLEET_RL}


def test_every_replicas_own_metrics_merge_with_a_replica_label() -> None:
    registry = CollectorRegistry()
    Counter("rolloutgate_requests", "Requests received", ["route"], registry=registry).labels("generate").inc(
        5
    )
    own = generate_latest(registry).decode()  # a replica's own /metrics, as it writes it
    results: dict[str, ReplicaResult | str] = {
        "r0": ReplicaResult(Answer(200, text=own), held=(A, B)),
        "r1": "ActorDiedError",
    }
    answer = compose(OPERATIONS["metrics"], view(), results)
    assert answer.status == 200 and answer.text is not None
    families = {f.name: f for f in text_string_to_metric_families(answer.text)}
    [sample] = families["rolloutgate_requests"].samples
    assert sample.labels == {"route": "generate", "replica": "r0"} and sample.value == 5.0
    up = {s.labels["replica"]: s.value for s in families["rolloutgate_replica_up"].samples}
    assert up == {"r0": 1.0, "r1": 0.0}
