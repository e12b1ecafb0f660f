"""What keeping session records on a second replica costs, and why not one store the fleet shares:
`python -m benchmarks.fleet.replication_cost` (docs/fleet.md).

Theory of operation: both designs make one Ray actor call per committed turn, carrying that turn's record, and
the agent's answer waits for it; they differ in where the calls land. Replication spreads them over the
replicas (each takes its backups' share: 1/N of the fleet's turns); a shared store takes every turn of the fleet
in one process (or needs sharding and its own replication, which is this design again). So what decides is
one receiver's cost per turn. On a local Ray cluster, a receiver actor applies turns exactly as a backup
replica does (fleet/replication.py `receive`, sessions/registry.py `take_turn`) to records of the users' shape:
a turn of `--decode` tokens with logprobs, its text in the reply and in the response, `--tool` new prompt
tokens. It prints:

- the latency a turn waits for its copy: one sender, one call at a time (p50 / p90);
- the receiver's CPU per turn, from its own process clock, under `--senders` senders sending at once: the most
  turns one receiver process can take per second is 1 / that;
- the record's size on the wire (Ray's serialisation of the change).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import orjson

from benchmarks.kit.stats import percentile
from rolloutgate.sessions.record import TurnRecord, ids_array, logprob_array

__all__ = ("main", "record_of_shape")


def record_of_shape(index: int, *, decode: int, tool: int, request_id: str) -> TurnRecord:
    """A turn as a session API records it: `decode` output ids with logprobs, ~4 characters of text per token
    in the reply and again in the response, `tool` new prompt ids."""
    text = "word " * (decode * 4 // 5)
    reply = {"role": "assistant", "content": text}
    response = {"id": request_id, "object": "chat.completion", "choices": [{"index": 0, "message": reply}]}
    return TurnRecord(
        index=index,
        request_id=request_id,
        request_at_unix=0.0,
        finished_at_unix=0.0,
        request={"model": "m", "max_tokens": decode},
        messages_from=2 * index,
        new_messages=({"role": "user", "content": "tool " * (tool * 4 // 5)},),
        reply_message=reply,
        response=response,
        prompt_prefix_len=index * (decode + tool),
        prompt_new_ids=ids_array(range(tool)),
        output_ids=ids_array(range(decode)),
        output_logprobs=logprob_array(-0.5 for _ in range(decode)),
        finish_reason="length",
        engine_id="engine-0",
        weight_version="1",
        timing=None,
        request_key=b"k" * 16,
        tools_key=b"t" * 16,
        message_keys=(b"m" * 16, b"r" * 16),
        tokenized_by_gateway=False,
    )


def _no_peers(handle: object) -> Any:
    raise AssertionError("a receiver sends nothing")


class _Receiver:
    """A backup replica's receiving side, alone in its actor."""

    def __init__(self) -> None:
        from rolloutgate.fleet.assignment import FleetView
        from rolloutgate.fleet.replication import Replication
        from rolloutgate.sessions.registry import SessionLimits, SessionRegistry

        empty = FleetView(epoch="", version=0, replicas={}, engines={}, owners={})
        limits = SessionLimits(max_bytes=64 * 1024**3, max_records_per_session=100_000)
        self._replication = Replication(
            "receiver", SessionRegistry(limits), time.monotonic, lambda: empty, _no_peers
        )

    async def replicate(self, changes: list[Any]) -> list[str]:
        return self._replication.receive(changes)

    async def cpu_s(self) -> float:
        return time.process_time()


class _Sender:
    """One replica's sending side: `turns` turns of its own session, one call at a time."""

    def __init__(self, receiver: Any, decode: int, tool: int) -> None:
        self._receiver, self._decode, self._tool = receiver, decode, tool

    async def send(self, session_id: str, turns: int) -> list[float]:
        from rolloutgate.fleet.links import TurnChange
        from rolloutgate.sessions.registry import SessionCopy

        await self._receiver.replicate.remote([SessionCopy(session_id=session_id, records=())])
        latencies, after = [], None
        for index in range(turns):
            request_id = f"{session_id}-{index}"
            record = record_of_shape(index, decode=self._decode, tool=self._tool, request_id=request_id)
            started = time.perf_counter()
            wanted = await self._receiver.replicate.remote([TurnChange(session_id, record, after)])
            latencies.append((time.perf_counter() - started) * 1000)
            assert not wanted, "the receiver could not take a turn"
            after = request_id
        return latencies


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--decode", type=int, default=16_000, help="output tokens per turn (default 16,000)")
    parser.add_argument("--tool", type=int, default=1_000, help="new prompt tokens per turn (default 1,000)")
    parser.add_argument("--turns", type=int, default=100, help="turns per sender (default 100)")
    parser.add_argument("--senders", type=int, default=4, help="senders at once for the CPU figure")
    args = parser.parse_args(argv)

    import ray
    from ray import cloudpickle  # type: ignore[attr-defined, unused-ignore]

    from rolloutgate.fleet.links import TurnChange

    sample = record_of_shape(1, decode=args.decode, tool=args.tool, request_id="sample")
    wire_kb = (
        len(
            cloudpickle.dumps(  # type: ignore[no-untyped-call, unused-ignore]
                [TurnChange("s", sample, "before")]
            )
        )
        / 1024
    )
    json_kb = len(orjson.dumps(sample.response)) / 1024
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        receiver_actor: Any = ray.remote(_Receiver)  # actor handles are untyped
        sender_actor: Any = ray.remote(_Sender)
        receiver = receiver_actor.options(num_cpus=0).remote()
        senders = [
            sender_actor.options(num_cpus=0).remote(receiver, args.decode, args.tool)
            for _ in range(args.senders)
        ]
        ray.get(senders[0].send.remote("warm", 5))
        alone = ray.get(senders[0].send.remote("alone", args.turns))
        cpu_before = ray.get(receiver.cpu_s.remote())
        started = time.monotonic()
        together = ray.get([s.send.remote(f"s{i}", args.turns) for i, s in enumerate(senders)])
        wall_s = time.monotonic() - started
        cpu_s = ray.get(receiver.cpu_s.remote()) - cpu_before
    finally:
        ray.shutdown()
    turns = args.senders * args.turns
    cpu_ms = cpu_s / turns * 1000
    print(
        f"a turn of {args.decode:,} tokens with logprobs (+{args.tool:,} prompt tokens): {wire_kb:.0f} KiB to its "
        f"backup as Ray sends it (its response JSON alone {json_kb:.0f} KiB)"
    )
    print(
        f"one sender, one turn at a time: p50 {_q(alone, 50):.2f} ms, p90 {_q(alone, 90):.2f} ms per turn "
        f"({args.turns} turns)"
    )
    flat = [x for run in together for x in run]
    print(
        f"{args.senders} senders at once: the receiver's CPU {cpu_ms:.2f} ms per turn "
        f"(at most {1000 / cpu_ms:,.0f} turns/s per receiving process); {turns / wall_s:,.0f} turns/s here "
        f"on a shared 2-core machine; p50 {_q(flat, 50):.2f} ms per turn"
    )
    return 0


def _q(values: list[float], q: int) -> float:
    return percentile(values, q, method="linear")


if __name__ == "__main__":
    raise SystemExit(main())
