"""The RL shape (`make bench-rl`): miles' TITO call, the same load direct, through rolloutgate and through two
releases of the SGLang Model Gateway, in one run.

Theory of operation. miles sends non-streaming SGLang `POST /generate` calls with `input_ids` of 20K-100K
tokens, prefix-shared within a session (each turn's `input_ids` are the previous turn's plus its output ids
plus a few new ids: the tool's answer), `return_logprob: true`, `no_stop_trim`, `skip_special_tokens`,
`spaces_between_special_tokens` as in reference/miles.md, and the header `X-SMG-Routing-Key: <session>`;
its client (httpx) has no timeout. This module builds that load and runs it once per path against the same
simulated engines (`rolloutgate sim --api sglang`, one process, decode at 70 tok/s whatever the batch,
time-scaled so that a 32K-token decode takes tens of seconds):

1. `direct`: the clients call the engines themselves, round-robin by session (session n on engine n mod N);
2. `rolloutgate`: `rolloutgate serve --engine ...` with its default settings, only `--time-scale` matching;
3. `sglang-router`: the SGLang Model Gateway as miles pins it (0.3.2), with a policy that follows the routing
   key (`manual`, sticky sessions; 0.3.2 has no consistent hashing);
4. `smg`: its newest release (the `smg` package, `python -m smg.launch_router`, the same flags);
5. `direct-again`: the direct phase once more (the noise floor of the paired latency).

The load is a plan fixed before the first phase (`plan_load`): `concurrency` workers, each with a budget of
generated tokens, runs sessions back to back; every turn's input length, new ids and `max_new_tokens` (drawn
from 2K-32K with density ~ 1/x^2: median ~3.8K, mean ~6K, so the long tail fits the time budget) are drawn
from the seed, and the engines' output ids are deterministic in the prompt, so every phase sends exactly the
same requests, as long as none fails. Each worker's budget is in tokens rather than turns so that all workers
finish at about the same time (no long drain at lower concurrency). Every phase is bounded in turns and in
time (`phase_cap_s`, then the outstanding calls are cancelled and the phase is marked cut).

What each phase measures, over the phase (first call to last answer):
- engine output work: each engine's Prometheus counters `sim:output_bytes_total` and `sim:output_chunks_total`
  (before and after; when the simulator does not expose them yet, `/proc/<sim>/io` wchar and syscw of the
  simulator process stand in, and the report says so), per request answered;
- gateway CPU seconds (`/proc/<pid>/stat`, the process and its children) per million generated tokens, the
  tokens counted from the answers' `meta_info.completion_tokens`;
- gateway RSS, sampled every 0.25 s with the client's in-flight count and in-flight request-body bytes; at the
  sample with the most body bytes in flight, (RSS - idle RSS) / those bytes;
- turn latency (client send to full answer), p50 and p99, and the simulator's and the client's CPU, which
  say whether the simulator was the bottleneck (`limits`).

Pinning (2 CPUs): the gateway under test alone on CPU 0; the simulator and this process (the clients) on CPU 1,
in every phase, so the direct phase has the same engine placement as the gateway phases. The engines' prefix
caches are flushed between phases. Verdicts: `goals()`, pure arithmetic over the phases' summaries.

The modules, in the order a run uses them: plan.py (the options and the load, fixed by the seed),
engines.py (the simulated engines' flags, counters, idling and cache flushes), clients.py (the closed-loop
clients of one phase), phase.py (one phase's results and the figures derived from them), measure.py (one
phase run and measured), verdict.py (the goals and what limited the run), render.py (the report) and run.py
(the whole run, its flags and its JSON).
"""
