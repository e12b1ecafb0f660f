"""From one mode's records to its figures: every definition the replay reports lives here.

Theory of operation: a run leaves three views on one simulated time line (world.py): the agents' turns and
their client's HTTP attempts (agents.py, attempts.py), the gateway's verdicts (gateway.py), and the engines'
generations and holds (sim/ledger.py). They join on two keys: a turn's tag (every HTTP attempt of the turn has
it) and the gateway's request id (each attempt's, attempts.py `join`; each engine rid is
`<request id>-<attempt>`).

Definitions (simulated seconds; "the end" is the end of the run):

- attempt: one HTTP request of a client to the gateway (LiteLLM's retries are attempts of the same turn);
- killed attempt: it ended without an answer, because its client gave up (a read timeout: it closes the
  connection) or because the gateway answered an error (timeout, hung engine, ...);
- progressing: the generation serving the attempt had been admitted by its engine (its prefill or decode had
  begun), had not ended, and its engine was not frozen (an operator's pause counts as progressing: the work
  resumes where it stopped);
- spurious timeout: a killed attempt whose generation was progressing when it was killed;
- client-visible failure: a turn whose LiteLLM call raised (after LiteLLM's own retries), except a turn
  refused because its prompt filled its session's token budget (the session ends there: `turns_at_full_budget`);
- tokens not generated past the budget: over the answered turns, the tokens asked for (`max_tokens`) less
  those generated (with `ignore_eos` an uncapped turn generates exactly what it asked for); beside it the
  gateway's own count, `rolloutgate_budget_tokens_saved_total`, and the other RL counters from its /metrics
  (world.py COUNTERS; 0 where the gateway does not export one);
- generation: one dispatch to an engine (one rid); delivered: it finished and its answer reached a client (a
  partial sample, the stale request's last attempt answered with what it had when its engine aborted it, too);
- engine-seconds of a generation: from its admission to its end (or the end of the run), less the time its
  engine was paused or frozen: the time it held a slot of a working batch;
- wasted engine-seconds: engine-seconds of generations whose answer no client received, except
  (a) generations still serving a waiting client at the end (in progress: still generating, or finished with
  its answer on its way to that client when the run ended), and (b) generations the frozen engine
  held when it froze or received after it (until the gateway stopped sending): the work it had done on them is
  lost to the fault in any mode ("lost to the fault"); so is the work of the generations an engine's crash or
  restart ended (its ledger's abort message `engine crashed`);
- weights (from the engines' ledgers alone, sim/ledger.py; not the gateway's view): the fleet's newest version
  at a moment is the newest any engine holds then, versions ordered by when an engine first held them (its
  launch checkpoint first);
  - tokens under a version the policy forbids: tokens generated under a version older than the fleet's newest
    at the moment they were generated (`latest-only` allows none), of every generation ("generated") and of
    the delivered ones ("served");
  - dispatch to a half-updated engine: a generation that reached its engine (its call's arrival, before a
    pause or an update let it in) while that engine was mid-update, or while the fleet's update to a version
    was under way (from the first engine's update to that version to the last one's end) and the engine did
    not hold it yet, or while the engine held a version older than the fleet's newest (its update failed, it
    restarted onto its launch checkpoint): `mid_update`, `update_pending`, `behind`, in that order;
- detection time: from the freeze to the first verdict of the gateway on that engine (quarantined by the
  engine-time liveness check, or unhealthy by the health check); new sessions the gateway sent to the engine
  after it froze (it cannot know yet) grow its stall window by their prefill allowance (core/liveness.py),
  reported as `prefill_allowance_s`.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import Counter
from dataclasses import dataclass
from typing import Any

from rolloutgate.core.config import GatewayCoreConfig
from rolloutgate.core.liveness import prefill_allowance_s

__all__ = (
    "LARGE_PREFILL_TOKENS",
    "FleetWeights",
    "GenerationView",
    "Intervals",
    "measure",
    "version_figures",
    "view_generations",
)

LARGE_PREFILL_TOKENS = GatewayCoreConfig().contention_min_prefill_tokens  # what the gateway counts as large

_CRASHED = (
    "engine crashed"  # the simulator's abort message for what a crash or restart ended (engine_model.py)
)
_TIMEOUT_CODES = frozenset({"timeout", "stall", "engine_hung", "attempts_exhausted", "max_wall"})


class Intervals:
    """Per engine, sorted intervals of one kind (pauses, freezes, large prefills)."""

    def __init__(self, spans: list[tuple[float, float]]) -> None:
        self.spans = sorted(spans)

    def covers(self, at: float) -> bool:
        return any(start <= at < end for start, end in self.spans)

    def overlap(self, start: float, end: float) -> float:
        total = 0.0
        for s, e in self.spans:
            lo, hi = max(s, start), min(e, end)
            if hi > lo:
                total += hi - lo
        return total


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerationView:
    """A generation joined with what the gateway and the clients did with it."""

    record: dict[str, Any]
    request_id: str
    attempt: int
    end_at: float  # its end, or the end of the run
    engine_seconds: float
    outcome: str  # delivered | wasted | fault | in_progress
    killed_at: float | None  # when the attempt it served was killed (timeouts), if it was


def _request_id(rid: str) -> tuple[str, int]:
    head, _, tail = rid.rpartition("-")
    return (head, int(tail)) if head and tail.isdigit() else (rid, 0)


def _holds(records: dict[str, Any], reason: str) -> dict[int, Intervals]:
    end = records["ended_at"]
    spans: dict[int, list[tuple[float, float]]] = {}
    for hold in records["holds"]:
        if hold["reason"] == reason:
            stop = hold["end_at"] if hold["end_at"] is not None else end
            spans.setdefault(hold["engine"], []).append((hold["start_at"], stop))
    return {engine: Intervals(s) for engine, s in spans.items()}


def _attempt_outcome(attempt: dict[str, Any], ends: dict[str, dict[str, Any]], run_end: float) -> str:
    ended = attempt["ended_at"]
    if ended is None or ended >= run_end:
        # still running at the end, or cut by the end of the run (in its last tick: the clock has ms steps)
        return "unfinished"
    if attempt["client_gone"]:
        return "client_timeout"
    end = ends.get(attempt["request_id"] or "")
    if attempt["status"] == 200 and end is not None and end["ok"]:
        return "answered"
    return "gateway_error"


def _kill_time(attempt: dict[str, Any], ends: dict[str, dict[str, Any]]) -> float:
    if attempt["client_gone"]:
        return float(attempt["ended_at"])
    end = ends.get(attempt["request_id"] or "")
    return float(end["at"]) if end is not None else float(attempt["ended_at"])


def view_generations(records: dict[str, Any]) -> tuple[list[GenerationView], dict[str, Any]]:
    """Every generation with its engine-seconds and outcome, plus the joined attempt tables."""
    run_end = float(records["ended_at"])
    ends = {e["request_id"]: e for e in records["ends"]}
    attempts = records["attempts"]
    pauses, freezes = _holds(records, "pause"), _holds(records, "freeze")
    freeze_event = next((e for e in records["events"] if e["kind"] == "freeze"), None)
    freeze_at = float(freeze_event["at"]) if freeze_event else math.inf
    answered: set[str] = set()
    killed_at: dict[str, float] = {}
    waiting: set[str] = set()
    for attempt in attempts:
        outcome = _attempt_outcome(attempt, ends, run_end)
        rid = attempt["request_id"]
        if rid is None:
            continue
        if outcome == "answered":
            answered.add(rid)
        elif outcome == "unfinished":
            waiting.add(rid)
        else:
            at = _kill_time(attempt, ends)
            killed_at[rid] = min(at, killed_at.get(rid, math.inf))
    last_attempt: dict[str, int] = {}
    for g in records["generations"]:
        request_id, number = _request_id(g["rid"])
        last_attempt[request_id] = max(number, last_attempt.get(request_id, number))
    views = []
    for g in records["generations"]:
        request_id, number = _request_id(g["rid"])
        engine = g["engine"]
        is_live_at_end = g["finished_at"] is None or g["finished_at"] > run_end
        end_at = run_end if is_live_at_end else g["finished_at"]
        start = g["started_at"]
        seconds = 0.0
        if start is not None and end_at > start:
            seconds = end_at - start
            seconds -= pauses[engine].overlap(start, end_at) if engine in pauses else 0.0
            seconds -= freezes[engine].overlap(start, end_at) if engine in freezes else 0.0
        # a partial sample (`--on-stale partial`) is its last attempt's output, ended by the engine's abort
        finished = g["finish"] in ("stop", "length") or (
            g["finish"] == "abort" and number == last_attempt[request_id]
        )
        delivered = finished and request_id in answered
        killed = killed_at.get(request_id)
        caught_by_freeze = (
            engine in freezes and freeze_at < end_at
        )  # running there when it froze, or sent after
        lost_in_crash = g["finish"] == "abort" and g.get("message") == _CRASHED
        if delivered:
            outcome = "delivered"
        elif (caught_by_freeze and (killed is None or killed >= freeze_at)) or lost_in_crash:
            outcome = "fault"
        elif request_id in waiting and (is_live_at_end or g["finish"] in ("stop", "length")):
            outcome = "in_progress"  # its client still waits at the end: generating, or its answer on its way
        else:
            outcome = "wasted"
        views.append(
            GenerationView(
                record=g,
                request_id=request_id,
                attempt=number,
                end_at=end_at,
                engine_seconds=max(0.0, seconds),
                outcome=outcome,
                killed_at=killed,
            )
        )
    joined = {
        "ends": ends,
        "answered": answered,
        "killed_at": killed_at,
        "freezes": freezes,
        "pauses": pauses,
    }
    return views, joined


def _is_progressing(g: dict[str, Any], at: float, freezes: dict[int, Intervals]) -> bool:
    start, finished = g["started_at"], g["finished_at"]
    if start is None or start > at or (finished is not None and finished < at - 1e-6):
        return False
    frozen = freezes.get(g["engine"])
    return not (frozen is not None and frozen.covers(at))


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))
    return ordered[index]


def _kills(
    records: dict[str, Any], views: list[GenerationView], joined: dict[str, Any]
) -> list[dict[str, Any]]:
    """Every killed attempt: when, why, and whether its generation was progressing."""
    run_end = float(records["ended_at"])
    ends = joined["ends"]
    by_request: dict[str, list[dict[str, Any]]] = {}
    for v in views:
        by_request.setdefault(v.request_id, []).append(v.record)
    out = []
    for attempt in records["attempts"]:
        outcome = _attempt_outcome(attempt, ends, run_end)
        if outcome not in ("client_timeout", "gateway_error"):
            continue
        at = _kill_time(attempt, ends)
        end = ends.get(attempt["request_id"] or "")
        code = "client_timeout" if outcome == "client_timeout" else (end["code"] if end else "error")
        generations = by_request.get(attempt["request_id"] or "", [])
        serving = [g for g in generations if g["submitted_at"] <= at + 1e-6]
        progressing = any(_is_progressing(g, at, joined["freezes"]) for g in serving)
        out.append(
            {
                "tag": attempt["tag"],
                "at": at,
                "arrived_at": attempt["arrived_at"],
                "code": code,
                "is_timeout": code == "client_timeout" or code in _TIMEOUT_CODES,
                "progressing": progressing,
                "engine": serving[-1]["engine"] if serving else None,
            }
        )
    return out


def _allowance_after_freeze(records: dict[str, Any], engine: int, since: float, until: float) -> float:
    """The prefill allowance the gateway's liveness check grants for new sessions' prompts it sent to the
    frozen engine after it froze (core/liveness.py: a large prefill shows no progress for a while, so the stall
    window grows by its tokens at a floor rate, capped): the detection may legitimately take that much longer."""
    core = GatewayCoreConfig()
    kinds = {t["tag"]: t["kind"] for t in records["turns"]}
    tags = {a["request_id"]: a["tag"] for a in records["attempts"] if a["request_id"]}
    tokens = 0
    for g in records["generations"]:
        if g["engine"] != engine or not since <= g["submitted_at"] < until:
            continue
        is_new_session = kinds.get(tags.get(_request_id(g["rid"])[0], ""), "") in ("opening", "storm")
        if is_new_session and g["prompt_tokens"] >= core.contention_min_prefill_tokens:
            tokens += int(g["prompt_tokens"])
    return prefill_allowance_s(
        tokens,
        floor_tokens_per_s=core.prefill_floor_tokens_per_s,
        max_allowance_s=core.max_prefill_allowance_s,
    )


def _detection(records: dict[str, Any]) -> dict[str, Any]:
    freeze = next((e for e in records["events"] if e["kind"] == "freeze"), None)
    if freeze is None:
        return {"frozen_engine": None}
    engine = int(freeze["engine"])
    url = records["engine_urls"][engine]
    end = float(records["ended_at"])
    marks = [m for m in records["marks"] if m["engine_url"] == url and freeze["at"] <= m["at"] <= end]
    marks = [m for m in marks if m["state"] in ("quarantined", "unhealthy", "removed")]
    first = min(marks, key=lambda m: m["at"]) if marks else None
    allowance = 0.0 if first is None else _allowance_after_freeze(records, engine, freeze["at"], first["at"])
    until = end if first is None else float(first["at"])
    # the run's own event loop, late while the verdict was due, delays it that much (simulated seconds)
    lags = [late for at, late in records.get("loop_lags", []) if freeze["at"] <= at <= until]
    return {
        "frozen_engine": engine,
        "frozen_at": freeze["at"],
        "waited_for_prefill_s": freeze.get("waited_s", 0.0),
        "detected_after_s": None if first is None else first["at"] - freeze["at"],
        "detected_as": None if first is None else first["state"],
        "prefill_allowance_s": allowance,
        "loop_lag_s": round(max(lags, default=0.0) * float(records["config"]["time_scale"]), 1),
    }


def _frozen_requests(
    views: list[GenerationView], records: dict[str, Any], joined: dict[str, Any]
) -> dict[str, Any]:
    freeze = next((e for e in records["events"] if e["kind"] == "freeze"), None)
    if freeze is None:
        return {}
    engine, at = int(freeze["engine"]), float(freeze["at"])
    urls = records["engine_urls"]
    ends = joined["ends"]
    killed_at = joined["killed_at"]
    caught = {  # requests the frozen engine held at the freeze or got after it, whose client was still waiting
        v.request_id
        for v in views
        if v.record["engine"] == engine and at < v.end_at and killed_at.get(v.request_id, math.inf) >= at
    }
    answered = [r for r in caught if r in joined["answered"]]
    elsewhere = [r for r in answered if (ends[r]["engine_url"] or "") != urls[engine]]
    # A request moved off the frozen engine may still be decoding elsewhere when the run stops: moved, not lost
    # (its end may even be recorded, a moment after the run's end, when the last answers were collected).
    moving = {
        v.request_id
        for v in views
        if v.request_id in caught
        and v.request_id not in joined["answered"]
        and v.outcome == "in_progress"
        and v.record["engine"] != engine
    }
    return {
        "caught": len(caught),
        "answered": len(answered),
        "answered_by_other_engines": len(elsewhere),
        "still_running_elsewhere_at_end": len(moving),
        "failed": sum(1 for r in caught if r in ends and not ends[r]["ok"]),
    }


def _windows(
    records: dict[str, Any], kills: list[dict[str, Any]], client_timeout_s: float
) -> list[dict[str, Any]]:
    """For each storm and the update: the client attempts in flight then and how many of them were killed,
    counting apart the turns that fit in the client timeout when nothing disturbs them (opening and medium
    turns; a long turn needs more than the client timeout in any case)."""
    kinds = {t["tag"]: t["kind"] for t in records["turns"]}
    killed = {(k["tag"], k["arrived_at"]) for k in kills}
    out = []
    for event in records["events"]:
        if event["kind"] not in ("storm", "update"):
            continue
        at = float(event["at"])
        in_flight = [
            a
            for a in records["attempts"]
            if a["arrived_at"] <= at
            and (a["ended_at"] is None or a["ended_at"] > at)
            and kinds.get(a["tag"]) not in (None, "storm")
        ]
        fitting = [a for a in in_flight if kinds[a["tag"]] in ("opening", "medium")]
        after = [k for k in kills if at <= k["at"] < at + client_timeout_s and k["is_timeout"]]
        out.append(
            {
                "kind": event["kind"],
                "at": at,
                "in_flight": len(in_flight),
                "in_flight_killed": sum(1 for a in in_flight if (a["tag"], a["arrived_at"]) in killed),
                "fitting_in_flight": len(fitting),
                "fitting_killed": sum(1 for a in fitting if (a["tag"], a["arrived_at"]) in killed),
                "timeouts_in_next_client_timeout": len(after),
            }
        )
    return out


class FleetWeights:
    """The engines' weights over time, from their ledgers (`records["weights"]`, sim/ledger.py `weights()`)."""

    def __init__(self, weights: list[dict[str, Any]]) -> None:
        changes = sorted(
            ((float(v["at"]), int(w["engine"]), str(v["version"])) for w in weights for v in w["versions"]),
        )
        self.rank: dict[str, int] = {}  # versions by when an engine first held them
        for _, _, version in changes:
            self.rank.setdefault(version, len(self.rank))
        self.timeline: dict[int, list[tuple[float, str]]] = {}
        for at, engine, version in changes:
            self.timeline.setdefault(engine, []).append((at, version))
        self.updates = [
            (
                int(w["engine"]),
                float(u["begun_at"]),
                math.inf if u["ended_at"] is None else float(u["ended_at"]),
                u["target"],
                bool(u["ok"]),
            )
            for w in weights
            for u in w["updates"]
        ]

    def held(self, engine: int, at: float) -> str | None:
        """The version `engine` held at `at` (a change at `at` counts), None before its first."""
        held = None
        for when, version in self.timeline.get(engine, []):
            if when > at:
                break
            held = version
        return held

    def newest(self, at: float) -> int:
        """The rank of the newest version any engine held at `at` (-1: none known)."""
        ranks = [self.rank[v] for e in self.timeline if (v := self.held(e, at)) is not None]
        return max(ranks, default=-1)

    def is_forbidden(self, version: str, at: float) -> bool:
        """Tokens under `version` at `at` are older than the fleet's newest then (latest-only forbids them)."""
        rank = self.rank.get(version)
        return rank is not None and rank < self.newest(at)

    def half_updated(self, engine: int, at: float) -> str | None:
        """Why `engine` was half-updated at `at` (module docstring), or None."""
        if any(e == engine and begun <= at < ended for e, begun, ended, _, _ in self.updates):
            return "mid_update"
        held = self.held(engine, at)
        for target in {t for _, _, _, t, _ in self.updates if t is not None}:
            spans = [(begun, ended) for _, begun, ended, t, _ in self.updates if t == target]
            if min(b for b, _ in spans) <= at < max(e for _, e in spans) and held != target:
                return "update_pending"
        if held is not None and self.is_forbidden(held, at):
            return "behind"
        return None


def _tokens_under_forbidden(g: dict[str, Any], weights: FleetWeights, run_end: float) -> int:
    """Of a generation's tokens, those generated under a version older than the fleet's newest then. Its token
    count is known at its submission (0), at every weight change of the fleet (`token_marks`) and at its end;
    between two of those the fleet's versions are fixed, so each stretch is judged at its start."""
    end = run_end if g["finished_at"] is None else min(float(g["finished_at"]), run_end)
    points = [(float(g["submitted_at"]), 0)]
    points += [(float(at), int(n)) for at, n in g.get("token_marks", [])]
    points.append((end, int(g["completion_tokens"])))
    spans = [(str(v), int(start)) for v, start in g.get("weight_spans", [])]
    if not spans:
        return 0
    bounds = [start for _, start in spans[1:]] + [math.inf]
    forbidden = 0
    for (at, first), (_, last) in itertools.pairwise(points):
        for (version, start), stop in zip(spans, bounds, strict=True):
            lo, hi = max(first, start), min(last, stop)
            if hi > lo and weights.is_forbidden(version, at):
                forbidden += int(hi - lo)
    return forbidden


def version_figures(records: dict[str, Any], views: list[GenerationView]) -> dict[str, Any]:
    """Tokens under a version the policy forbids, and dispatches to a half-updated engine (module
    docstring), from the engines' ledgers; zeros for records without them."""
    weights = FleetWeights(records.get("weights", []))
    run_end = float(records["ended_at"])
    generated = served = 0
    forbidden_generations: list[dict[str, Any]] = []
    dispatches: list[dict[str, Any]] = []
    for v in views:
        g = v.record
        tokens = _tokens_under_forbidden(g, weights, run_end)
        if tokens:
            generated += tokens
            served += tokens if v.outcome == "delivered" else 0
            forbidden_generations.append(
                {"rid": g["rid"], "engine": g["engine"], "tokens": tokens, "outcome": v.outcome}
            )
        arrived = g.get("arrived_at")
        at = float(g["submitted_at"] if arrived is None else arrived)
        reason = weights.half_updated(int(g["engine"]), at) if weights.timeline else None
        if reason is not None:
            dispatches.append({"rid": g["rid"], "engine": g["engine"], "at": at, "reason": reason})
    return {
        "versions": sorted(weights.rank, key=weights.rank.__getitem__),
        "forbidden_tokens_generated": generated,
        "forbidden_tokens_served": served,
        "forbidden_generations": forbidden_generations,
        "half_updated_dispatches": len(dispatches),
        "half_updated_by_reason": dict(Counter(d["reason"] for d in dispatches)),
        "half_updated_list": dispatches,
    }


def _stalls(records: dict[str, Any]) -> dict[str, Any]:
    """How far the mode's event loop fell behind (real seconds): the run's own fidelity check."""
    lags = [late for _, late in records.get("loop_lags", [])]
    scale = float(records["config"]["time_scale"])
    return {
        "count": len(lags),
        "max_real_s": max(lags, default=0.0),
        "max_simulated_s": round(max(lags, default=0.0) * scale, 1),
        "total_real_s": round(sum(lags), 2),
    }


def measure(records: dict[str, Any]) -> dict[str, Any]:
    """The figures of one mode (see the module docstring for every definition)."""
    config = records["config"]
    views, joined = view_generations(records)
    kills = _kills(records, views, joined)
    turns = records["turns"]
    done = [t for t in turns if t["ok"] is not None]
    ok_turns = [t for t in done if t["ok"]]
    at_budget = [t for t in done if not t["ok"] and t.get("budget_full")]
    failed = [t for t in done if not t["ok"] and not t.get("budget_full")]
    counters = records.get("gateway_counters", {})
    latencies = [t["ended_at"] - t["started_at"] for t in ok_turns]
    attempts_per_turn = Counter(a["tag"] for a in records["attempts"])
    failed_chains = [t["ended_at"] - t["started_at"] for t in failed]
    last_kill = {k["tag"]: k for k in sorted(kills, key=lambda k: k["at"])}
    failed_progressing = sum(1 for t in failed if last_kill.get(t["tag"], {}).get("progressing"))
    seconds: dict[str, float] = dict.fromkeys(("delivered", "wasted", "fault", "in_progress"), 0.0)
    tokens: dict[str, int] = dict.fromkeys(seconds, 0)
    for v in views:
        seconds[v.outcome] += v.engine_seconds
        tokens[v.outcome] += int(v.record["completion_tokens"])
    return {
        "mode": records["mode"],
        "duration_s": records["ended_at"],
        "real_s": records["real_s"],
        "cpu_s": records["cpu_s"],
        "loop_stalls": _stalls(records),
        "turns": {
            "completed": len(ok_turns),
            "failed": len(failed),
            "unfinished": len(turns) - len(done),
            "by_kind": {
                kind: {
                    "completed": sum(1 for t in ok_turns if t["kind"] == kind),
                    "failed": sum(1 for t in failed if t["kind"] == kind),
                }
                for kind in sorted({t["kind"] for t in turns})
            },
            "latency_p50_s": _percentile(latencies, 0.50),
            "latency_p99_s": _percentile(latencies, 0.99),
        },
        "client_visible_failures": len(failed),
        "client_visible_failures_progressing": failed_progressing,
        "failure_errors": dict(Counter(t["error"] for t in failed)),
        "failed_turn_attempts": {
            str(k): n for k, n in Counter(attempts_per_turn[t["tag"]] for t in failed).items()
        },
        "failed_turn_chain_s_median": statistics.median(failed_chains) if failed_chains else None,
        "attempts": len(records["attempts"]),
        "killed_attempts": len(kills),
        "spurious_timeouts": sum(1 for k in kills if k["is_timeout"] and k["progressing"]),
        "kills_by_code": dict(Counter(k["code"] for k in kills)),
        "generations": len(views),
        "answers_delivered": len(ok_turns),
        "engine_seconds": {k: round(v, 1) for k, v in seconds.items()},
        "wasted_engine_seconds": round(seconds["wasted"], 1),
        "lost_to_fault_engine_seconds": round(seconds["fault"], 1),
        "wasted_tokens": tokens["wasted"],
        "detection": _detection(records),
        "frozen_engine_requests": _frozen_requests(views, records, joined),
        "budgets": {
            "max_seq_len": config.get("max_seq_len"),
            "tokens_saved": int(counters.get("budget_tokens_saved", 0)),
            "tokens_not_generated": sum(t["max_tokens"] - t["completion_tokens"] for t in ok_turns),
            "turns_capped": sum(1 for t in ok_turns if t["completion_tokens"] < t["max_tokens"]),
            "turns_at_full_budget": len(at_budget),
        },
        "group_prefill_tokens_saved": int(counters.get("group_prefill_tokens_saved", 0)),
        "stale_requests": {
            "requeued": int(counters.get("stale_requeued", 0)),
            "partial": int(counters.get("stale_partial", 0)),
        },
        "weights": version_figures(records, views),
        "events": _windows(records, kills, float(config["client_timeout_s"])),
        "kills": kills,
    }
