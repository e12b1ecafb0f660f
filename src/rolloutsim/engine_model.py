"""The scheduling physics of one simulated engine, in simulated time (sans-IO).

Theory of operation: the engine runs one *step* at a time, back to back while it has work. A step is
planned from the queues at its start time and completes at `end_at`; its effects (prefill progress, one
token per decoding request) land at `end_at`. Time comes in as an argument: `advance(now)` completes every
step that ends at or before `now` and returns the requests that changed; `next_event_at()` says when the
step in flight ends (inf when idle, paused or frozen). Every other method takes `now`, first completes the
steps due by then, then applies its change.

Rules:
1. Continuous batching: at most `max_running_requests` requests are admitted (prefilling or decoding);
   the rest wait in FCFS order. A request is admitted while its context fits the KV capacity (always when the
   engine is empty).
1a. Preemption (`kv_preemption`, off by default): when a step's new decode tokens would not fit the KV capacity,
   the newest admitted request goes back to the head of the queue with its KV freed (vLLM's recompute
   preemption, SGLang's decode retraction), as many as it takes, keeping one; it is prefilled again (prompt and
   output so far, from the prefix cache where its blocks survive) when it fits. A waiting request is admitted
   only if its context fits beside one decode step of the running batch, and none in a step that preempted
   (vLLM's scheduler). The prefix cache is evicted to the room the requests leave after every step.
2. Prefill costs only the uncached prompt tokens: the prefix cache is matched at admission. A prefill batch
   holds at most `chunked_prefill_size` tokens; one request at a time may be partially prefilled (chunked).
   The step that completes a request's prefill also produces its first token.
3. "held" (SGLang): a prefill batch runs *instead of* a decode step whenever one can be formed, so running
   requests get no tokens while another prompt is prefilled, except for `prefill_decode_interval` decode
   steps run between two prefill batches. "mixed" (vLLM): every step decodes all running requests and fills
   the rest of the token budget with prefill; its duration is the sum of both parts.
4. A decode step gives every running request one token and lasts `decode_step_s(batch, context)`.
   Consecutive decode steps with no change in between are computed in one go (bursts).
5. Abort: a waiting request finishes at once ("Abort in waiting queue"); a running one at the end of the
   step in flight (SGLang, "Aborted") or at once (vLLM, or when no step runs). A frozen engine processes
   no aborts until it thaws.
6. Holds (pause in place, retract, freeze, wedge) stop the step clock; the step resumes where it stopped.
7. A compile (fault) lengthens the first step that runs a client's request, once; while that step or a
   freeze or wedge lasts, the scheduler is stuck in a forward pass (`is_scheduler_stuck`): it answers no
   control request.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Protocol

from rolloutsim.faults import Fault
from rolloutsim.output_path import OutputPath
from rolloutsim.prefix_cache import PrefixCache, block_hashes
from rolloutsim.profiles import SimEngineConfig, decode_step_s, prefill_chunk_s
from rolloutsim.request import FinishReason, RequestState, SimRequest
from rolloutsim.stats import EngineStats
from rolloutsim.tokens import EOS_TOKEN_ID

__all__ = ("PAUSE_MODES", "EngineModel", "LedgerHooks")

PAUSE_MODES = ("abort", "retract", "in_place", "keep", "drain", "wait")
_RECENT_LIMIT = 4096  # finished requests kept for /sim/state
_QUEUE_FULL = FinishReason(kind="abort", message="The request queue is full.", status_code=503)


@dataclass(slots=True)
class _Step:
    kind: str  # "prefill" | "decode" | "mixed"
    end_at: float
    decoders: list[SimRequest] = field(default_factory=list)
    prefill: list[tuple[SimRequest, int]] = field(default_factory=list)
    remaining_s: float = 0.0  # while held
    is_compiling: bool = False  # lengthened by a compile fault: the scheduler is stuck in it


class LedgerHooks(Protocol):
    """What the model, and its HTTP face (`written`), tell an attached ledger (sim/ledger.py's GenerationLedger,
    which knows the engine it is attached to: so declared here, the model does not depend on it)."""

    def finished(self, req: SimRequest) -> None: ...
    def written(self, rid: str) -> None: ...
    def held(self, reason: str, at: float) -> None: ...
    def released(self, reason: str, at: float) -> None: ...
    # told by the engine (sim/engine.py): its weights
    def version_changed(self, at: float, version: str, cause: str) -> None: ...
    def update_begun(self, at: float, target: str | None) -> None: ...
    def update_ended(self, at: float, ok: bool) -> None: ...


class EngineModel:
    """One engine's queues, batches and caches. See the module docstring for the rules."""

    def __init__(self, config: SimEngineConfig, *, api: str = "sglang") -> None:
        self.config = config
        self.mode = config.resolved_prefill_mode(api)
        self._vllm = api == "vllm"
        self._no_mix_with_logprobs = config.mixed_skips_logprobs and not self._vllm
        self._free_decode = decode_step_s(config, 1, 1) == 0.0  # every coefficient is zero
        self._preempts = config.kv_preemption
        self.cache = PrefixCache(config.prefix_block_tokens)
        self._waiting: deque[SimRequest] = deque()
        self._limbo: list[SimRequest] = []  # accepted under the blackhole fault, never started
        self._prefilling: dict[str, SimRequest] = {}
        self._running: dict[str, SimRequest] = {}
        self._chunked: SimRequest | None = None
        self._live: dict[str, SimRequest] = {}
        self._recent: OrderedDict[str, SimRequest] = OrderedDict()
        self._pending_aborts: dict[str, SimRequest] = {}
        self._touched: dict[int, SimRequest] = {}
        self._step: _Step | None = None
        self._cursor = 0.0  # when the next step may start
        self._holds: set[str] = set()
        self._decodes_owed = 0
        self._kv_used = 0
        self._running_context = 0
        self.faults: dict[str, Fault] = {}
        self.pause_mode: str | None = None
        self.stats = EngineStats()
        self.output = OutputPath(config)  # the tokenizer manager's queue and counters (sim/output_path.py)
        self.ledger: LedgerHooks | None = None  # benchmarks: every generation and hold (sim/ledger.py)

    # ----------------------------------------------------------------------------- queries

    @property
    def paused(self) -> bool:
        return self.pause_mode is not None

    @property
    def is_frozen(self) -> bool:
        return "freeze" in self._holds or "wedge" in self._holds

    @property
    def is_scheduler_stuck(self) -> bool:
        """Whether the scheduler is inside a forward pass that does not return (frozen, wedged) or has not
        yet (a compile), as of the last `advance`: it answers no control request then."""
        return self.is_frozen or (self._step is not None and self._step.is_compiling)

    @property
    def running_count(self) -> int:
        return sum(1 for r in (*self._running.values(), *self._prefilling.values()) if not r.internal)

    @property
    def waiting_count(self) -> int:
        return sum(1 for r in (*self._waiting, *self._limbo) if not r.internal)

    @property
    def live_count(self) -> int:
        return sum(1 for r in self._live.values() if not r.internal)

    @property
    def kv_used_tokens(self) -> int:
        return self._kv_used

    @property
    def kv_filled_tokens(self) -> int:
        """KV holding computed tokens: a prompt in prefill counts as far as its chunks went, as SGLang allocates
        a prompt's KV chunk by chunk (its `/get_load` tokens grow between chunks; `kv_used_tokens` reserves the
        whole context at admission)."""
        unfilled = sum(max(0, r.context_tokens - r.prefilled) for r in self._prefilling.values())
        return self._kv_used - unfilled

    def request(self, rid: str) -> SimRequest | None:
        """A live or recently finished request."""
        return self._live.get(rid) or self._recent.get(rid)

    def requests(self) -> list[SimRequest]:
        """Live requests, then recently finished ones (health checks excluded)."""
        return [r for r in (*self._live.values(), *self._recent.values()) if not r.internal]

    def is_live(self, rid: str) -> bool:
        return rid in self._live

    def next_event_at(self) -> float:
        if self._holds or self._step is None:
            return math.inf
        return self._step.end_at

    # ----------------------------------------------------------------------------- commands

    def advance(self, now: float) -> list[SimRequest]:
        """Complete the steps due by `now`; return every request that changed since the last call."""
        self._run_until(now)
        self._settle_aborts(now)
        self.stats.sample(now)
        changed = list(self._touched.values())
        self._touched.clear()
        return changed

    def submit(self, req: SimRequest, now: float) -> None:
        """Queue a request. Raises ValueError if a live request has the same rid."""
        self._run_until(now)
        if req.rid in self._live:
            raise ValueError(f"Duplicate request ID detected: {req.rid}")
        req.submitted_at = now
        if self.config.record_token_times:
            req.token_times = []
        self._live[req.rid] = req
        if not req.internal:
            self.stats.requests_total += 1
            self.stats.prompt_tokens_total += req.prompt_tokens
        limit = self.config.max_queued_requests
        if limit is not None and len(self._waiting) + len(self._limbo) >= limit:
            self._finish(req, _QUEUE_FULL, now)
        elif "blackhole" in self.faults:
            self._limbo.append(req)
        else:
            self._waiting.append(req)
        self._wake(now)

    def abort(self, rid: str, now: float, *, prefix: bool = False, message: str | None = None) -> int:
        """Abort the live request `rid` (every live rid starting with it if `prefix`); returns how many."""
        self._run_until(now)
        if prefix:
            targets = [r for r in self._live.values() if r.rid.startswith(rid) and not r.internal]
        else:
            target = self._live.get(rid)
            targets = [] if target is None else [target]
        for req in targets:
            self._abort_one(req, now, message)
        self._settle_aborts(now)
        self._wake(now)
        return len(targets)

    def abort_all(self, now: float, *, message: str | None = None) -> int:
        self._run_until(now)
        targets = [r for r in self._live.values() if not r.internal]
        for req in targets:
            self._abort_one(req, now, message)
        self._settle_aborts(now)
        self._wake(now)
        return len(targets)

    def pause(self, mode: str, now: float) -> None:
        """Close the engine: abort (everything), retract (back to the queue, KV freed), in_place/keep
        (stop where it is), drain/wait (run in-flight work to the end; new work waits for resume, or the HTTP layer
        refuses it where configured)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"unknown pause mode {mode!r}; choose from {', '.join(PAUSE_MODES)}")
        self._run_until(now)
        self.pause_mode = mode
        if mode == "abort":
            for req in [r for r in self._live.values() if not r.internal]:
                self._abort_one(req, now, None, at_once=True)
        elif mode == "retract":
            self._retract_all(now)
        if mode not in ("drain", "wait"):
            self._hold("pause", now)
        self._settle_aborts(now)

    def resume(self, now: float) -> None:
        self._run_until(now)
        self.pause_mode = None
        self._release("pause", now)
        self._wake(now)

    def flush_cache(self, now: float) -> bool:
        """Empty the prefix cache; refused (False) while any request is queued or running."""
        self._run_until(now)
        if self.live_count:
            return False
        self.cache.clear()
        return True

    def set_fault(self, fault: Fault, now: float) -> None:
        self._run_until(now)
        previous_slow = self._slow()
        self.faults[fault.key] = fault
        if fault.kind in ("freeze", "wedge"):
            self._hold(fault.kind, now)
        elif fault.kind == "slow":
            self._rescale_step(now, fault.factor, previous_slow)
        self._wake(now)

    def clear_fault(self, key: str, now: float) -> None:
        """Remove the fault with this key (`freeze`, `slow`, `stall:<rid>`, ...); no-op if absent."""
        self._run_until(now)
        fault = self.faults.pop(key, None)
        if fault is None:
            return
        if fault.kind in ("freeze", "wedge"):
            self._release(fault.kind, now)
        elif fault.kind == "slow":
            self._rescale_step(now, 1.0, fault.factor)
        elif fault.kind == "blackhole":
            for req in self._limbo:
                if req.state is RequestState.WAITING and not req.is_finished:
                    self._waiting.append(req)
            self._limbo.clear()
        self._settle_aborts(now)
        self._wake(now)

    def crash(self, now: float) -> None:
        """Lose everything: requests end (nobody is left to read them), caches empty, pause lifts."""
        self._run_until(now)
        for req in list(self._live.values()):
            self._finish(req, FinishReason(kind="abort", message="engine crashed", status_code=500), now)
        self._waiting.clear()
        self._limbo.clear()
        self._pending_aborts.clear()
        self._step = None
        self._chunked = None
        self._holds.discard("pause")
        self.pause_mode = None
        self.cache.clear()
        self.output.reset(now)
        self._kv_used = self._running_context = 0

    # ----------------------------------------------------------------------------- stepping

    def _wake(self, now: float) -> None:
        """After a change: an idle engine starts its next step now, not in the past."""
        if self._step is None and now > self._cursor:
            self._cursor = now
        self._run_until(now)

    def _run_until(self, now: float) -> None:
        while not self._holds:
            if self._step is None:
                self._step = self._plan()
                if self._step is None:
                    return
            step = self._step
            if step.end_at > now:
                return
            if step.kind == "decode" and not self._pending_aborts and not self._has_prefill_work():
                self._complete_decode_burst(step, now)
            else:
                self._complete(step)

    def _slow(self) -> float:
        fault = self.faults.get("slow")
        return 1.0 if fault is None else fault.factor

    def _is_stalled(self, req: SimRequest) -> bool:
        return bool(self.faults) and f"stall:{req.rid}" in self.faults

    def _decoders(self) -> list[SimRequest]:
        return [
            r
            for r in self._running.values()
            if r.abort_pending is None and not self._is_stalled(r) and r.completion_tokens < r.limit
        ]

    def _decode_cost(self) -> float:
        return decode_step_s(self.config, len(self._running), self._running_context)

    def _plan(self) -> _Step | None:
        step = self._plan_step()
        compile_fault = self.faults.get("compile")
        if step is not None and compile_fault is not None and self._runs_client_work(step):
            del self.faults["compile"]  # compiled once: every later step runs at its own speed
            step.end_at += compile_fault.duration_s
            step.is_compiling = True
        return step

    @staticmethod
    def _runs_client_work(step: _Step) -> bool:
        """A health probe's shape was compiled at start-up; a client's request brings the new shapes."""
        return any(not r.internal for r in step.decoders) or any(not r.internal for r, _n in step.prefill)

    def _plan_step(self) -> _Step | None:
        start = self._cursor
        decoders = self._decoders()
        mixing = self.mode == "mixed"
        if mixing and self._no_mix_with_logprobs:
            head = self._chunked or (self._waiting[0] if self._waiting else None)
            if any(r.wants_logprobs for r in decoders) or (head is not None and head.wants_logprobs):
                mixing = False
        if mixing:
            preempted = False
            if self._preempts and decoders:
                decoders, preempted = self._make_room(decoders)
            budget = self.config.chunked_prefill_size - len(decoders)
            items = self._take_prefill(budget, start, admit=not preempted) if budget > 0 else []
            if not decoders and not items:
                return None
            cost = (self._decode_cost() if decoders else 0.0) + self._prefill_cost(items)
            kind = "mixed" if items else "decode"
            return _Step(kind=kind, end_at=start + cost * self._slow(), decoders=decoders, prefill=items)
        if decoders and (self._decodes_owed > 0 or not self._has_prefill_work()):
            self._decodes_owed = max(0, self._decodes_owed - 1)
            if self._preempts:
                decoders, _ = self._make_room(decoders)
            return _Step(kind="decode", end_at=start + self._decode_cost() * self._slow(), decoders=decoders)
        items = self._take_prefill(self.config.chunked_prefill_size, start)
        if not items:
            return None
        self._decodes_owed = self.config.prefill_decode_interval
        return _Step(kind="prefill", end_at=start + self._prefill_cost(items) * self._slow(), prefill=items)

    def _prefill_cost(self, items: list[tuple[SimRequest, int]]) -> float:
        return sum(prefill_chunk_s(self.config, req.prefilled, n) for req, n in items)

    def _has_prefill_work(self) -> bool:
        if self._chunked is not None:
            return True
        return bool(self._waiting) and self._can_admit(self._waiting[0])

    def _can_admit(self, req: SimRequest) -> bool:
        if self.pause_mode in ("drain", "wait") and not req.internal:
            return False  # draining: in-flight work runs to its end, new work waits for resume (vLLM 0.32)
        admitted = len(self._running) + len(self._prefilling)
        if admitted == 0:
            return True
        if admitted >= self.config.max_running_requests:
            return False
        # with preemption, room is left for the running batch's next decode step (vLLM allocates the running
        # requests' slots before it admits; otherwise the newcomer would be preempted at once)
        reserve = len(self._running) if self._preempts else 0
        return self._kv_used + reserve + req.prefill_target <= self.config.kv_capacity_tokens

    def _make_room(self, decoders: list[SimRequest]) -> tuple[list[SimRequest], bool]:
        """Preempt the newest admitted requests until one decode step of `decoders` fits the KV capacity; returns
        the decoders left and whether any request was preempted."""
        capacity = self.config.kv_capacity_tokens
        preempted = False
        while self._kv_used + len(decoders) > capacity:
            victim = self._newest_admitted()
            if victim is None:
                break
            self._preempt(victim)
            preempted = True
            decoders = [r for r in decoders if r is not victim]
        return decoders, preempted

    def _newest_admitted(self) -> SimRequest | None:
        """The request preemption takes first: the last admitted (vLLM pops the tail of its running list; the
        one being prefilled was admitted after every decoding one), never the only one, nor one being aborted."""
        if len(self._running) + len(self._prefilling) <= 1:
            return None
        for pool in (self._prefilling, self._running):
            for req in reversed(pool.values()):
                if req.abort_pending is None:
                    return req
        return None

    def _preempt(self, req: SimRequest) -> None:
        """Back to the head of the queue, KV freed; prefilled again (prompt + output so far) when readmitted."""
        self._unadmit(req)
        if not req.internal:
            self.stats.preempted_total += 1
        self._waiting.appendleft(req)

    def _unadmit(self, req: SimRequest) -> None:
        """A running (or prefilling) request made waiting again, its KV freed: it prefills its prompt and its
        output so far again when admitted (a retraction, a preemption)."""
        self._release_memory(req)
        req.state = RequestState.WAITING
        req.prefill_target = req.context_tokens
        req.prefilled = 0
        req.num_retractions += 1
        if not req.internal:
            self.stats.retracted_total += 1

    def _take_prefill(self, budget: int, at: float, *, admit: bool = True) -> list[tuple[SimRequest, int]]:
        items: list[tuple[SimRequest, int]] = []
        partial = False  # a request in this batch stays unfinished: nobody else may start
        chunked = self._chunked
        if chunked is not None:
            n = min(chunked.prefill_target - chunked.prefilled, budget)
            items.append((chunked, n))
            budget -= n
            partial = chunked.prefilled + n < chunked.prefill_target
        while admit and budget > 0 and not partial and self._waiting and self._can_admit(self._waiting[0]):
            req = self._waiting.popleft()
            self._admit(req, at)
            n = min(req.prefill_target - req.prefilled, budget)
            items.append((req, n))
            budget -= n
            partial = req.prefilled + n < req.prefill_target
        return items

    def _admit(self, req: SimRequest, at: float) -> None:
        req.state = RequestState.PREFILLING
        if req.started_at is None:
            req.started_at = at
            if not req.internal:
                self.stats.queue_time.observe(at - req.submitted_at)
        cached = 0
        if self.config.enable_prefix_cache:
            sequence = req.prompt_ids + req.output_ids() if req.completion_tokens else req.prompt_ids
            hashes = block_hashes(sequence, self.cache.block_tokens)
            cached = min(self.cache.match(hashes, len(sequence)), req.prefill_target - 1)
        req.prefilled = cached
        if req.num_retractions == 0:
            req.cached_tokens = cached
            if not req.internal:
                self.stats.cached_tokens_total += cached
        self._prefilling[req.rid] = req
        self._kv_used += req.context_tokens
        self.cache.evict_to(self.config.kv_capacity_tokens - self._kv_used)

    def _complete(self, step: _Step) -> None:
        at = step.end_at
        self._cursor = at
        self._step = None
        for req, n in step.prefill:
            if req.is_finished or req.rid not in self._prefilling or req.abort_pending is not None:
                continue
            req.prefilled += n
            if req.prefilled < req.prefill_target:
                self._chunked = req
                continue
            self._start_decoding(req, at)
        for req in step.decoders:
            if req.state is RequestState.RUNNING and req.abort_pending is None and not self._is_stalled(req):
                self._emit(req, 1, at)
        for req in list(self._pending_aborts.values()):
            self._finish(req, req.abort_pending or FinishReason(kind="abort", message="Aborted"), at)
        self._pending_aborts.clear()
        self.stats.progress_events += 1
        if self._preempts:
            self.cache.evict_to(self.config.kv_capacity_tokens - self._kv_used)

    def _start_decoding(self, req: SimRequest, at: float) -> None:
        del self._prefilling[req.rid]
        if self._chunked is req:
            self._chunked = None
        if self.config.enable_prefix_cache:
            self.cache.insert(block_hashes(req.prompt_ids, self.cache.block_tokens))
            self.cache.evict_to(self.config.kv_capacity_tokens - self._kv_used)
        req.state = RequestState.RUNNING
        self._running[req.rid] = req
        self._running_context += req.context_tokens
        if req.completion_tokens >= req.limit:
            self._finish_by_limit(req, at)
        elif not self._is_stalled(req):
            self._emit(req, 1, at)  # the prefill forward pass samples the next token

    def _complete_decode_burst(self, step: _Step, now: float) -> None:
        """Complete `step` and every identical decode step after it that ends by `now`."""
        decoders = [r for r in step.decoders if r.state is RequestState.RUNNING and not self._is_stalled(r)]
        if not decoders:
            self._complete(step)
            return
        max_steps = min(r.limit - r.completion_tokens for r in decoders)
        if self._preempts:  # no further than the KV room goes (the step itself was planned to fit)
            room = self.config.kv_capacity_tokens - self._kv_used
            max_steps = min(max_steps, max(1, room // len(decoders)))
        at = step.end_at
        if self._free_decode:
            ends = [at] * max_steps  # no time passes: run to the first finish at once
        else:
            slow = self._slow()
            batch = len(self._running)
            context = self._running_context
            ends = [at]
            while len(ends) < max_steps:
                context += len(decoders)
                duration = decode_step_s(self.config, batch, context) * slow
                if at + duration > now:
                    break
                at += duration
                ends.append(at)
        self._cursor = at
        self._step = None
        for req in decoders:
            self._emit(req, len(ends), at, ends)
        self.stats.progress_events += len(ends)
        if self._preempts:
            self.cache.evict_to(self.config.kv_capacity_tokens - self._kv_used)

    def _emit(self, req: SimRequest, count: int, at: float, times: list[float] | None = None) -> None:
        if req.completion_tokens == 0:
            req.first_token_at = at if times is None else times[0]
            if not req.internal:
                self.stats.ttft.observe(req.first_token_at - req.submitted_at)
        wanted = req.completion_tokens + count >= req.notify_from
        if wanted and req.emit_log is not None:
            req.emit_log.append((req.completion_tokens, count, at, times))
        req.completion_tokens += count
        self._kv_used += count
        self._running_context += count
        if not req.internal:
            self.stats.generated_tokens_total += count
        if req.token_times is not None:
            req.token_times.extend(times if times is not None else [at] * count)
        if wanted:
            self._touched[id(req)] = req
        if req.completion_tokens >= req.limit:
            self._finish_by_limit(req, at)

    def _finish_by_limit(self, req: SimRequest, at: float) -> None:
        if req.stop_at is not None and req.completion_tokens >= req.stop_at:
            self._finish(req, FinishReason(kind="stop", matched=EOS_TOKEN_ID), at)
        else:
            self._finish(req, FinishReason(kind="length", length=req.completion_tokens), at)

    # ----------------------------------------------------------------------------- endings

    def _abort_one(self, req: SimRequest, now: float, message: str | None, *, at_once: bool = False) -> None:
        if req.is_finished:
            return
        if req.state is RequestState.WAITING:
            if req in self._limbo:
                self._limbo.remove(req)
            else:
                self._waiting.remove(req)
            reason = FinishReason(kind="abort", message=message or "Abort in waiting queue", in_queue=True)
            self._finish(req, reason, now)
            return
        reason = FinishReason(kind="abort", message=message or "Aborted")
        in_flight = self._step is not None and not self._holds
        if self.is_frozen or (in_flight and not self._vllm and not at_once):
            req.abort_pending = reason
            self._pending_aborts[req.rid] = req
        else:
            self._finish(req, reason, now)

    def _settle_aborts(self, now: float) -> None:
        """Pending aborts complete with the step in flight; with none in flight (and no freeze), now."""
        if self._pending_aborts and not self.is_frozen and (self._step is None or self._holds):
            for req in list(self._pending_aborts.values()):
                self._finish(req, req.abort_pending or FinishReason(kind="abort", message="Aborted"), now)
            self._pending_aborts.clear()

    def _release_memory(self, req: SimRequest) -> None:
        """Take an admitted request out of the batch; its tokens stay in the prefix cache."""
        was_running = self._running.pop(req.rid, None) is not None
        if was_running:
            self._running_context -= req.context_tokens
        elif self._prefilling.pop(req.rid, None) is None:
            return
        self._kv_used -= req.context_tokens
        if self._chunked is req:
            self._chunked = None
        if self.config.enable_prefix_cache:
            if was_running:
                kept = req.prompt_ids + req.output_ids()
            else:
                kept = req.prompt_ids[: max(0, req.prefilled - req.completion_tokens)]
            self.cache.insert(block_hashes(kept, self.cache.block_tokens))
            self.cache.evict_to(self.config.kv_capacity_tokens - self._kv_used)

    def _finish(self, req: SimRequest, reason: FinishReason, at: float) -> None:
        self._release_memory(req)
        self._pending_aborts.pop(req.rid, None)
        req.state = RequestState.FINISHED
        req.prompt_ids = []  # finished requests are kept for /sim/state; their prompts need not be
        req.finish = reason
        req.finished_at = at
        req.abort_pending = None
        self._live.pop(req.rid, None)
        self._touched[id(req)] = req
        if self.ledger is not None:
            self.ledger.finished(req)
        if req.internal:
            return
        self._recent[req.rid] = req
        if len(self._recent) > _RECENT_LIMIT:
            self._recent.popitem(last=False)
        self.stats.record_finish(reason.kind, req.e2e_latency(), req.completion_tokens)

    def _retract_all(self, now: float) -> None:
        """Every admitted request goes back to the head of the queue, its KV freed (SGLang `retract`)."""
        self._step = None
        self._decodes_owed = 0
        for req in list(self._pending_aborts.values()):  # being aborted anyway: end them now
            self._finish(req, req.abort_pending or FinishReason(kind="abort", message="Aborted"), now)
        retracted = [r for r in (*self._running.values(), *self._prefilling.values()) if not r.is_finished]
        retracted.sort(key=lambda r: r.submitted_at)
        for req in retracted:
            self._unadmit(req)
        self._waiting.extendleft(reversed(retracted))

    def _hold(self, reason: str, now: float) -> None:
        if not self._holds and self._step is not None:
            self._step.remaining_s = max(0.0, self._step.end_at - now)
        self._holds.add(reason)
        if self.ledger is not None:
            self.ledger.held(reason, now)

    def _release(self, reason: str, now: float) -> None:
        if reason not in self._holds:
            return
        self._holds.discard(reason)
        if self.ledger is not None:
            self.ledger.released(reason, now)
        if not self._holds:
            if self._step is not None:
                self._step.end_at = now + self._step.remaining_s
            self._cursor = max(self._cursor, now)

    def _rescale_step(self, now: float, factor: float, previous: float) -> None:
        step = self._step
        if step is None or previous == factor:
            return
        ratio = factor / previous
        if self._holds:
            step.remaining_s *= ratio
        else:
            step.end_at = now + max(0.0, step.end_at - now) * ratio

    def __repr__(self) -> str:
        return (
            f"<EngineModel {self.mode} [{len(self._running)} running, {len(self._prefilling)} prefilling, "
            f"{len(self._waiting)} waiting] holds={sorted(self._holds)}>"
        )
