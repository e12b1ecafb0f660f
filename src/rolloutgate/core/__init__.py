"""rolloutgate's sans-IO core: queueing, admission, placement, clocks and verdicts as plain objects.

Theory of operation: the edges (server/, engines/) translate what they see into events (events.py) and feed
them, with the time, to `Gateway.handle(event, now)` (gateway.py); the core answers with commands
(commands.py) and says when it next needs to be woken (`next_deadline()` / `on_time(now)`). Nothing here reads a
clock, sleeps, logs or touches a socket (tests/test_layering.py enforces the imports), so every rule is tested
exactly and fast on a `ManualClock`.

Module map:
    events, commands, timing, clock   the contract with the edges
    config, stats                     settings in, observations out (frozen values)
    gateway                           the state machine's API: events to their handlers, timers to verdicts
    ledger                            the state, and the bookkeeping every handler and verdict shares
    on_requests, on_engines, on_gate  the event handlers: requests, engines, the gate and weight updates
    verdicts                          the timers: when each deadline is, and what happens when it passes
    view                              `Gateway.inspect()`: the state, read-only, for tests and debugging
    charge_meter, request_clock       the one home of budget arithmetic: what each engine's (and the queue's)
                                      time was, and each request's charged, queue, paused, contention
    wait_queue, dispatcher            who waits where, what starts next (O(log n) per decision)
    admission, session_table          per-engine slots, prefill budget and rest; where each session's prefix lives
    placement/                        one module per policy behind `PlacementPolicy`
    liveness                          per-engine hung detection with a prefill allowance
    gate                              the weight-update gate
    request_state, engine_state       enums + transition tables
    records                           the per-request and per-engine records (they point at each other)
    timer_heap                        keyed lazy-deletion deadlines
    attach                            retry attachment index (attach keys -> request ids, TTL + LRU)
"""
