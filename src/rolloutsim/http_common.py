"""HTTP pieces shared by both API flavours: JSON and SSE, stream cadence, disconnect detection, and the
simulator's own admin routes (`/sim/state`, `/sim/faults`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from rolloutsim.faults import Fault, parse_fault
from rolloutsim.output_path import MIN_SLEEP_REAL_S
from rolloutsim.params import BadRequest
from rolloutsim.request import SimRequest

if TYPE_CHECKING:
    from rolloutsim.engine import SimEngine

__all__ = (
    "DONE",
    "DisconnectWatcher",
    "Frame",
    "StreamCursor",
    "StreamWriter",
    "add_admin_routes",
    "emit_body",
    "json_response",
    "read_json",
    "serve_frames",
    "sse",
    "sse_headers",
)

DONE = b"data: [DONE]\n\n"
# faults that close the engine's port: applied just after the answer that sets them has left
PORT_DROPPING = ("crash", "restart")
# a client that has gone away makes writes fail with one of these
WRITE_ERRORS = (ConnectionError, RuntimeError)


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        body=orjson.dumps(data), status=status, content_type="application/json", headers=headers
    )


def sse(data: Any) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


def sse_headers() -> dict[str, str]:
    return {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


@dataclass(slots=True)
class Frame:
    """One item of a generation answer on its way out: a stream chunk (SSE frame) or a whole body.

    `ready_at`: when the engine produced the output it carries (simulated s); `retime(delay)`: the item
    serialised again when the output path served it `delay` late, for items that report their own time
    (SGLang's `e2e_latency`, stamped by the tokenizer manager when it gets to the output); `answers`: the
    requests whose answer this item completes (their `answered_at` is set to when it is done); `rebuild()`:
    the same bytes again, for big items a stream may keep as a recipe while they wait (see StreamWriter).
    """

    ready_at: float
    data: bytes
    retime: Callable[[float], bytes] | None = None
    answers: Sequence[SimRequest] = ()
    rebuild: Callable[[], bytes] | None = None


async def serve_frames(engine: SimEngine, frames: list[Frame]) -> list[tuple[bytes, float]]:
    """Book `frames` on the engine's output path (sim/output_path.py) and count them; returns, in order,
    each one's bytes to write and the simulated time it is done (served and serialised)."""
    output = engine.output
    slots = await output.serialise([(f.ready_at, len(f.data)) for f in frames])
    out = []
    nbytes = 0
    for frame, (start, done) in zip(frames, slots, strict=True):
        data = frame.data
        if frame.retime is not None and start > frame.ready_at:
            data = frame.retime(start - frame.ready_at)
        out.append((data, done))
        nbytes += len(data)
        for req in frame.answers:
            req.answered_at = done
    output.path.count(nbytes, len(out))
    return out


# a stream keeps at most this many bytes of chunks waiting for the output path; past it, chunks that can be
# rebuilt (cumulative /generate chunks) wait as recipes and are serialised again when due, so a backed-up
# output path costs host CPU rather than memory (a saturated 8K-token cumulative stream can have ~1 GB due)
STREAM_QUEUE_BYTES = 1 << 20


class StreamWriter:
    """Writes a streamed answer's frames once the output path has served them.

    `send` books frames at once (so a stream's chunks queue on the output path when the engine produced
    them, not when an earlier chunk of the same stream has finally been written) and writes them when
    they are done: directly when nothing of this stream is waiting and they are due, else through a writer
    task that sleeps until each is due. A failed write is raised by the next `send` or by `close`.
    """

    __slots__ = ("_engine", "_error", "_held", "_queue", "_response", "_task")

    def __init__(self, engine: SimEngine, response: web.StreamResponse) -> None:
        self._engine = engine
        self._response = response
        self._queue: deque[tuple[float, bytes | Callable[[], bytes]]] = deque()
        self._held = 0  # bytes held in the queue
        self._task: asyncio.Task[None] | None = None
        self._error: BaseException | None = None

    async def send(self, frames: list[Frame], tail: bytes = b"") -> None:
        """Queue `frames` (then `tail`, e.g. the `[DONE]` sentinel, which costs nothing) for writing."""
        if self._error is not None:
            raise self._error
        served = await serve_frames(self._engine, frames) if frames else []
        clock = self._engine.output.clock
        last_done = served[-1][1] if served else clock.now()
        if (
            self._task is None
            and not self._queue
            and clock.real_seconds(last_done - clock.now()) < MIN_SLEEP_REAL_S
        ):
            await self._response.write(b"".join(data for data, _done in served) + tail)
            return
        for frame, (data, done) in zip(frames, served, strict=True):
            if frame.rebuild is not None and self._held + len(data) > STREAM_QUEUE_BYTES:
                self._queue.append((done, frame.rebuild))
            else:
                self._queue.append((done, data))
                self._held += len(data)
        if tail:
            self._queue.append((last_done, tail))
            self._held += len(tail)
        if self._task is None and self._queue:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        output, queue = self._engine.output, self._queue
        try:
            while queue:
                await output.wait(queue[0][0])
                due = output.clock.now() + output.clock.scale * MIN_SLEEP_REAL_S
                parts = []
                while queue and queue[0][0] < due:
                    item = queue.popleft()[1]
                    if isinstance(item, bytes):
                        self._held -= len(item)
                        parts.append(item)
                    else:
                        parts.append(item())
                await self._response.write(b"".join(parts))
        except WRITE_ERRORS as exc:
            self._error = exc
            queue.clear()
            self._held = 0
        finally:
            self._task = None

    async def close(self) -> None:
        """Wait until everything sent is written; raises the write error if one failed."""
        task = self._task
        if task is not None:
            await task
        if self._error is not None:
            raise self._error

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()


async def emit_body(
    engine: SimEngine,
    reqs: Sequence[SimRequest],
    payload: Any,
    *,
    retime: Callable[[float], None] | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    """A non-streamed generation answer: one body through the output path, ready when the last of `reqs`
    finished. `retime(delay)` updates `payload` in place when it was served `delay` late."""
    ready = max((r.finished_at for r in reqs if r.finished_at is not None), default=engine.now())

    def again(delay: float) -> bytes:
        assert retime is not None
        retime(delay)
        return orjson.dumps(payload)

    frame = Frame(ready, orjson.dumps(payload), None if retime is None else again, reqs)
    ((body, done),) = await serve_frames(engine, [frame])
    await engine.output.wait(done)
    return web.Response(body=body, content_type="application/json", headers=headers)


async def read_json(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object; an empty body is {}. Raises BadRequest otherwise."""
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"invalid JSON body: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest("the JSON body must be an object")
    return body


class StreamCursor:
    """Which cumulative token counts become stream events: the first token, then every `interval`-th
    token (counted from the start, like SGLang's `len(output_ids) % stream_interval == 0`), and the end."""

    __slots__ = ("done", "interval", "sent")

    def __init__(self, interval: int = 1) -> None:
        self.interval = max(1, interval)
        self.sent = 0
        self.done = False

    def marks(self, count: int, finished: bool) -> list[tuple[int, bool]]:
        """New (token count, is_final) events given the request's progress."""
        out: list[int] = []
        position = self.sent
        if count > position:
            if position == 0:
                out.append(1)
                position = 1
            following = (position // self.interval + 1) * self.interval
            while following <= count:
                out.append(following)
                following += self.interval
        events = [(mark, False) for mark in out]
        if finished and not self.done:
            self.done = True
            if out and out[-1] == count:
                events[-1] = (count, True)
            else:
                events.append((count, True))
        if events:
            self.sent = events[-1][0]
        return events

    def next_mark(self) -> int:
        """The token count of the next non-final event."""
        return 1 if self.sent == 0 else (self.sent // self.interval + 1) * self.interval


async def wait_change(event: asyncio.Event) -> None:
    await event.wait()
    event.clear()


def is_disconnected(request: web.BaseRequest) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


class DisconnectWatcher:
    """SGLang notices a gone client only when it next looks (every few seconds): every `disconnect_lag_s`
    simulated seconds this sweeps the open requests and aborts those whose client has disconnected."""

    def __init__(self, engine: SimEngine) -> None:
        self._engine = engine
        self._entries: dict[int, tuple[web.BaseRequest, SimRequest]] = {}
        self._task: asyncio.Task[None] | None = None

    def watch(self, request: web.BaseRequest, req: SimRequest) -> None:
        self._entries[id(req)] = (request, req)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._sweep())

    async def _sweep(self) -> None:
        period = max(0.02, self._engine.clock.real_seconds(self._engine.config.disconnect_lag_s))
        while self._entries:
            await asyncio.sleep(period)
            for key, (request, req) in list(self._entries.items()):
                if req.is_finished:
                    del self._entries[key]
                elif is_disconnected(request):
                    del self._entries[key]
                    self._engine.abort(req.rid)

    async def close(self, _app: web.Application | None = None) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


# --------------------------------------------------------------------------------- admin routes


def fault_list(engines: Sequence[SimEngine]) -> list[dict[str, Any]]:
    return [f.to_json() | {"engine": e.index} for e in engines for f in e.faults]


async def apply_fault_body(engines: Sequence[SimEngine], body: dict[str, Any]) -> list[dict[str, Any]]:
    """Apply a POST /sim/faults body to `engines`: {"fault": kind, ...params} sets one, {"faults": [...]}
    sets several, {"clear": "all" | kind | "stall:<rid>"} clears. Raises BadRequest."""
    clear = body.get("clear")
    try:
        faults: list[Fault] = []
        if "faults" in body:
            faults = [parse_fault(item) for item in body["faults"]]
        elif "fault" in body or "kind" in body:
            faults = [parse_fault(body)]
    except (ValueError, TypeError) as exc:
        raise BadRequest(str(exc)) from exc
    if clear is None and not faults:
        raise BadRequest('expected "fault", "faults" or "clear"')
    if clear is not None:
        for engine in engines:
            engine.clear_faults(None if clear in (True, "all") else str(clear))
    drops_port = [f for f in faults if f.kind in PORT_DROPPING]
    for engine in engines:
        for fault in faults:
            if fault.kind not in PORT_DROPPING:
                engine.set_fault(fault)
    if drops_port:
        # let this response leave before the port goes away (it may be the crashing engine's own port)
        loop = asyncio.get_running_loop()
        for engine in engines:
            loop.call_later(0.02, engine.set_fault, drops_port[0])
    listed = fault_list(engines)
    if drops_port:
        listed += [drops_port[0].to_json() | {"engine": e.index} for e in engines]
    return listed


def add_admin_routes(app: web.Application, engine: SimEngine) -> None:
    async def get_state(request: web.Request) -> web.Response:
        rid = request.query.get("rid")
        include = request.query.get("requests", "1") not in ("0", "false")
        return json_response(engine.state(rid=rid, include_requests=include))

    async def post_faults(request: web.Request) -> web.Response:
        try:
            listed = await apply_fault_body([engine], await read_json(request))
        except BadRequest as exc:
            return json_response({"error": {"message": exc.message}}, status=400)
        return json_response({"faults": listed})

    async def get_faults(_request: web.Request) -> web.Response:
        return json_response({"faults": fault_list([engine])})

    async def delete_faults(_request: web.Request) -> web.Response:
        engine.clear_faults()
        return json_response({"faults": []})

    app.router.add_get("/sim/state", get_state)
    app.router.add_post("/sim/faults", post_faults)
    app.router.add_get("/sim/faults", get_faults)
    app.router.add_delete("/sim/faults", delete_faults)
