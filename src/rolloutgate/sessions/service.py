"""The session API's logic, between its routes (server/session_routes.py) and the gateway (an injected
dispatcher).

Theory of operation: the service owns a `SessionRegistry` (sans-IO) and an optional `ChatRenderer`, reads
time from an injected clock, and sends every upstream call through a `Dispatcher`: the gateway's own request
path (queueing, admission, placement with the session id as routing key, engine-time clocks, keep-alive-free
waiting), which returns the engine's answer with its timing breakdown. One chat turn is:

    begin_chat: read + validate -> plan (registry) -> prompt ids (renderer) -> begin
    run_chat:   dispatch -> parse -> commit

with no `await` in `begin_chat`, so concurrent requests of one session see a consistent state. A turn
that fails upstream is not recorded (`end_turn` in a `finally`); the engine's error goes back to the agent
unchanged.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

import orjson
from multidict import CIMultiDict

from rolloutgate import token_budget
from rolloutgate.core.clock import Clock
from rolloutgate.core.timing import TimingBreakdown
from rolloutgate.errors import BadRequest
from rolloutgate.sessions import tito
from rolloutgate.sessions.describe import token_mismatch
from rolloutgate.sessions.errors import (
    ChatTemplateError,
    EngineAnswerInvalid,
    SessionConflict,
    SessionEvicted,
    SessionNotFound,
)
from rolloutgate.sessions.messages import message_key, tools_key
from rolloutgate.sessions.record import (
    TurnRecord,
    build_trajectory,
    engine_meta_of,
    expand_records,
    ids_array,
    logprob_array,
)
from rolloutgate.sessions.registry import SessionRegistry
from rolloutgate.sessions.render import ChatRenderer
from rolloutgate.sessions.samples import Picker, TreePath, assemble_linear, assemble_tree, tree_metadata
from rolloutgate.sessions.samples_wire import WeightVersionsWire, encode_samples
from rolloutgate.sessions.session import Session, TurnTicket

__all__ = (
    "ChatOutcome",
    "ChatTurn",
    "Dispatcher",
    "SessionAnswer",
    "SessionCall",
    "SessionService",
    "SessionSettings",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionCall:
    """One upstream call on behalf of a session: sent through the gateway with `routing_key` for affinity."""

    request_id: str
    routing_key: str  # the session id
    method: str
    path: str  # upstream path: "/generate", "/v1/chat/completions", or a proxied path
    body: dict[str, Any] | None = None  # a JSON body (the gateway's inference routes)
    raw_body: bytes | None = None  # a proxied body, forwarded as is
    query: str = ""
    headers: Mapping[str, str] = field(default_factory=dict)  # client headers to pass on
    # the session's token budget: the gateway caps the body's output limit to what it leaves after the prompt
    # (`prompt_tokens`, exact when the gateway tokenized it; else the gateway's estimate); token_budget.py
    max_seq_len: int | None = None
    prompt_tokens: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionAnswer:
    """The engine's final answer (a whole body even if the gateway streamed it upstream)."""

    status: int
    body: bytes
    headers: Mapping[str, str] = field(default_factory=dict)
    engine_id: str | None = None
    timing: TimingBreakdown | None = None

    def json(self) -> Any:
        return orjson.loads(self.body)


class Dispatcher(Protocol):
    async def __call__(self, call: SessionCall) -> SessionAnswer:
        """Run the call through the gateway and return the engine's answer (any status the engine gave).

        Raises rolloutgate.errors.GatewayError for a gateway verdict (timeout, no engine, queue full), which
        the session API relays to the agent as is. Cancelling the awaiting task abandons the call.
        """
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionSettings:
    default_max_tokens: int = 16_384  # max_new_tokens when the agent sets none (SGLang's own default is 128)
    max_model_len: int | None = None  # caps max_new_tokens at the context length left
    tree: bool = False  # miles' v2: samples per leaf (the registry keeps the branches: SessionLimits)
    # with a renderer: the gateway's prompt ids go to SGLang `/generate` (the gateway parses the reply) or to
    # its chat endpoint as `input_ids` (the engine's tool-call and reasoning parsers read it, as miles does)
    engine_route: Literal["generate", "chat"] = "generate"
    rewritten_history: Literal["append", "refuse"] = "append"  # a template that rewrites earlier turns
    picker: Picker = "drop_retries"
    samples_weight_versions: WeightVersionsWire = "spans"
    max_seq_len: int | None = None  # the token budget of a session created without one (none: no budget)
    turn_defaults: tito.TurnDefaults = field(default_factory=tito.TurnDefaults)  # the launch flags' share
    # routing replay of only the rows a turn adds past its checkpoint (miles' in_place pause: the KV stays)
    replay_added_rows: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatOutcome:
    """What the agent gets for one chat turn: a completion, or the engine's error relayed."""

    status: int
    completion: dict[str, Any] | None = None
    error_body: bytes | None = None
    error_headers: Mapping[str, str] = field(default_factory=dict)
    timing: TimingBreakdown | None = None
    engine_id: str | None = None
    recorded: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatTurn:
    """A chat turn begun (`SessionService.begin_chat`): planned, its prompt rendered, in flight in the
    registry. `request_id` is the turn's one id: the gateway's call, the engine's rid and the record."""

    request_id: str
    session: Session  # as it was when the turn began (it may be deleted while the turn runs)
    request: tito.ChatRequest
    keys: list[bytes]  # the messages' keys
    tools_key: bytes
    ticket: TurnTicket
    base_ids: Sequence[int]  # the ids of the checkpoint it extends
    prompt_ids: list[int] | None  # the gateway's rendering (None: the engine renders, recorded mode)
    headers: Mapping[str, str]
    max_seq_len: int | None
    request_at: float  # wall-clock seconds


class SessionService:
    def __init__(
        self,
        registry: SessionRegistry,
        dispatcher: Dispatcher,
        clock: Clock,
        *,
        renderer: ChatRenderer | None = None,
        settings: SessionSettings | None = None,
        wall_clock: Callable[[], float] = time.time,
        new_request_id: Callable[[], str] | None = None,
    ) -> None:
        self.registry = registry
        self.dispatcher = dispatcher
        self.clock = clock
        self.renderer = renderer
        self.settings = settings or SessionSettings()
        self._wall = wall_clock
        self._new_request_id = new_request_id or (lambda: uuid.uuid4().hex)
        # called with a session's id when it ends (deleted, samples taken, expired): the gateway releases its
        # engine binding (core/session_table.py `release`)
        self.on_end: list[Callable[[str], None]] = []
        # awaited after a session is created, has a turn recorded or is deleted, before the caller hears of
        # it: a fleet replica waits there until its backup holds the change (fleet/replication.py)
        self.settle: Callable[[str], Awaitable[None]] | None = None

    # -- session lifecycle -----------------------------------------------------------------------------------

    def create(self, max_seq_len: int | None = None) -> str:
        """A new session with `max_seq_len` as its token budget (None: the settings' default, if any)."""
        budget = self.settings.max_seq_len if max_seq_len is None else max_seq_len
        return self.registry.create(self.clock.now(), max_seq_len=budget).session_id

    def describe(self, session_id: str, *, full_prompt_ids: bool = True) -> dict[str, Any]:
        """`GET /sessions/{id}`: miles' shape (`session_id`, `records`, `metadata`) plus token metadata."""
        session = self.registry.get(session_id, self.clock.now())
        ids = session.token_ids
        metadata: dict[str, Any] = {
            "accumulated_token_ids": ids.tolist(),
            "num_turns": session.turns,
            "num_tokens": len(ids),
            "tokenized_by_gateway": self.renderer is not None,
            "turns_in_flight": len(session.in_flight),
            "approx_bytes": session.approx_bytes,
            "max_trim_tokens": 0,  # miles field: the gateway never trims ids
            "max_seq_len": session.max_seq_len,
        }
        if self.renderer is not None and session.records:
            last = session.records[-1].request
            messages, _ = session.state_after(session.turns)
            # as miles: a comparison that cannot be made is left out, not an error
            with contextlib.suppress(ChatTemplateError):
                metadata["tito_session_mismatch"] = token_mismatch(
                    self.renderer,
                    messages,
                    ids,
                    tools=last.get("tools"),
                    template_kwargs=last.get("chat_template_kwargs"),
                )
        if self.settings.tree:
            metadata["tree"] = tree_metadata(self._tree_paths(session))
        return {
            "session_id": session_id,
            "records": expand_records(session.records, full_prompt_ids=full_prompt_ids),
            "metadata": metadata,
        }

    @staticmethod
    def _tree_paths(session: Session) -> list[TreePath]:
        """Every leaf's path of a tree session: the branches it moved away from, then the current one."""
        return [
            *(TreePath(b.records, b.seqs) for b in session.branches),
            TreePath(session.records, session.seqs),
        ]

    def delete(self, session_id: str) -> None:
        self.registry.delete(session_id, self.clock.now())
        self._ended(session_id)

    async def settled(self, session_id: str) -> None:
        """Wait until the change just made to the session is where `settle` wants it (nothing without)."""
        if self.settle is not None:
            await self.settle(session_id)

    def _ended(self, session_id: str) -> None:
        for callback in self.on_end:
            callback(session_id)

    def trajectory(self, session_id: str) -> dict[str, Any]:
        session = self.registry.get(session_id, self.clock.now())
        return build_trajectory(session.records).as_dict(session_id)

    def expire(self) -> list[str]:
        expired = self.registry.expire(self.clock.now())
        for session_id in expired:
            self._ended(session_id)
        return expired

    def samples(self, session_id: str, body: Any) -> bytes:
        """`POST /sessions/{id}/samples {"max_seq_len", "metadata"?}`: miles' safetensors payload (samples.py,
        samples_wire.py). Raises SessionNotFound/SessionEvicted, BadRequest, SamplesUnassemblable (422)."""
        max_seq_len, agent_metadata = _samples_request(body)
        session = self.registry.get(session_id, self.clock.now())
        decode = self.renderer.decode if self.renderer is not None else None
        if self.settings.tree:
            result = assemble_tree(
                self._tree_paths(session),
                max_seq_len=max_seq_len,
                decode=decode,
                picker=self.settings.picker,
                agent_metadata=agent_metadata,
            )
        else:
            result = assemble_linear(session.records, max_seq_len=max_seq_len, decode=decode)
        samples = encode_samples(
            result, tree=self.settings.tree, weight_versions=self.settings.samples_weight_versions
        )
        self._ended(session_id)  # its samples taken, the session's rollout is over
        return samples

    # -- one chat turn ---------------------------------------------------------------------------------------

    async def chat(self, session_id: str, body: Any, headers: Mapping[str, str] | None = None) -> ChatOutcome:
        """Run one chat turn of a session: `begin_chat` then `run_chat`. Raises GatewayError subclasses
        (session and gateway errors; a turn whose prompt fills its token budget: 400 context_length_exceeded,
        from the dispatcher)."""
        return await self.run_chat(self.begin_chat(session_id, body, headers))

    def begin_chat(self, session_id: str, body: Any, headers: Mapping[str, str] | None = None) -> ChatTurn:
        """Read, plan and render one chat turn and mark it in flight, without a wait: one consistent view of
        the session. Raises GatewayError subclasses for what the session refuses. The turn must then be run
        (`run_chat`) or `abandon`ed."""
        request = self.settings.turn_defaults.apply(tito.read_chat_request(body))
        headers = CIMultiDict(headers or {})  # names without case, as HTTP's, whoever hands them over
        header_budget = token_budget.header_budget(headers)
        keys = [message_key(m) for m in request.messages]
        tkey = tools_key(request.tools, request.template_kwargs)
        registry, renderer = self.registry, self.renderer
        session = registry.get(session_id, self.clock.now())
        max_seq_len = token_budget.tightest(header_budget, session.max_seq_len)
        base = registry.plan_turn(session, request.messages, keys, tkey, strict=renderer is not None)
        checkpoint = session.checkpoint(base.keep_turns)
        prompt_ids: list[int] | None = None
        if renderer is not None:
            prompt_ids = renderer.continue_prompt(
                checkpoint,
                request.messages,
                tools=request.tools,
                template_kwargs=request.template_kwargs,
                rewritten_history=self.settings.rewritten_history,
            )
        if self.settings.replay_added_rows and request.body.get("return_routed_experts"):
            # the checkpoint's rows but its last are a causal prefix of this prompt (the ids extend it): the
            # engine sends only the rest, and the record keeps the offset it used
            start = max(0, len(checkpoint.token_ids) - 1)
            request = replace(request, body={**request.body, "routed_experts_start_len": start})
        ticket = registry.begin_turn(session, base, _request_key(tkey, keys), self.clock.now())
        return ChatTurn(
            request_id=self._new_request_id(),
            session=session,
            request=request,
            keys=keys,
            tools_key=tkey,
            ticket=ticket,
            base_ids=checkpoint.token_ids,
            prompt_ids=prompt_ids,
            headers=headers,
            max_seq_len=max_seq_len,
            request_at=self._wall(),
        )

    async def run_chat(self, turn: ChatTurn) -> ChatOutcome:
        """Dispatch a begun turn, read the engine's answer and commit it; its in-flight mark goes whatever
        happens. Raises GatewayError subclasses (a gateway verdict; an engine answer that is not a turn)."""
        request, base = turn.request, turn.ticket.base
        try:
            answer = await self.dispatcher(
                self._upstream_call(
                    turn.session.session_id,
                    turn.request_id,
                    request,
                    turn.prompt_ids,
                    turn.headers,
                    turn.max_seq_len,
                )
            )
            if answer.status >= 400:
                return ChatOutcome(
                    status=answer.status,
                    error_body=answer.body,
                    error_headers=answer.headers,
                    timing=answer.timing,
                    engine_id=answer.engine_id,
                )
            engine_turn, completion, prefix_len, new_ids = self._read_answer(
                answer, request, turn.prompt_ids, turn.base_ids, turn.request_id, int(turn.request_at)
            )
            reply = tito.reply_message_of(completion)
            record = TurnRecord(
                index=base.keep_turns,
                request_id=turn.request_id,
                request_at_unix=turn.request_at,
                finished_at_unix=self._wall(),
                request=_without_messages(request.body, turn.session),
                messages_from=base.messages_from,
                new_messages=tuple(request.messages[base.messages_from :]),
                reply_message=reply,
                response=completion,
                prompt_prefix_len=prefix_len,
                prompt_new_ids=ids_array(new_ids),
                output_ids=ids_array(engine_turn.output_ids),
                output_logprobs=logprob_array(engine_turn.output_logprobs),
                finish_reason=engine_turn.finish_reason,
                engine_id=answer.engine_id,
                weight_version=engine_turn.weight_version,
                timing=answer.timing.as_dict() if answer.timing is not None else None,
                request_key=turn.ticket.request_key,
                tools_key=turn.tools_key,
                message_keys=(*turn.keys[base.messages_from :], message_key(reply)),
                tokenized_by_gateway=self.renderer is not None,
                engine_meta=engine_meta_of(engine_turn.meta_info),
            )
            recorded = self._commit(turn.ticket, record)
            if recorded:
                await self.settled(turn.session.session_id)
            return ChatOutcome(
                status=200,
                completion=completion,
                timing=answer.timing,
                engine_id=answer.engine_id,
                recorded=recorded,
            )
        finally:
            self.abandon(turn)

    def abandon(self, turn: ChatTurn) -> None:
        """Forget a begun turn that will not be recorded (its client left); nothing after it committed."""
        self.registry.end_turn(turn.ticket, self.clock.now())

    def _upstream_call(
        self,
        session_id: str,
        request_id: str,
        request: tito.ChatRequest,
        prompt_ids: list[int] | None,
        headers: Mapping[str, str],
        max_seq_len: int | None,
    ) -> SessionCall:
        if self.renderer is not None and prompt_ids is not None and self.settings.engine_route == "chat":
            path = "/v1/chat/completions"
            body = tito.tito_chat_body(request, prompt_ids, stop_token_ids=self.renderer.stop_token_ids)
        elif self.renderer is not None and prompt_ids is not None:
            path = "/generate"
            body = tito.generate_body(
                request,
                prompt_ids,
                stop_token_ids=self.renderer.stop_token_ids,
                default_max_tokens=self.settings.default_max_tokens,
                max_model_len=self.settings.max_model_len,
            )
        else:
            path, body = "/v1/chat/completions", tito.recorded_chat_body(request)
        return SessionCall(
            request_id=request_id,
            routing_key=session_id,
            method="POST",
            path=path,
            body=body,
            headers=headers,
            max_seq_len=max_seq_len,
            prompt_tokens=None if prompt_ids is None else len(prompt_ids),
        )

    def _read_answer(
        self,
        answer: SessionAnswer,
        request: tito.ChatRequest,
        prompt_ids: list[int] | None,
        base_ids: Sequence[int],
        request_id: str,
        created: int,
    ) -> tuple[tito.EngineTurn, dict[str, Any], int, Sequence[int]]:
        """(the engine's turn, the agent's completion, ids shared with the session, the prompt's new ids)."""
        try:
            parsed = answer.json()
        except orjson.JSONDecodeError as exc:
            raise EngineAnswerInvalid(f"the engine's answer is not JSON: {exc}") from exc
        if self.renderer is not None and prompt_ids is not None and self.settings.engine_route == "chat":
            turn = tito.parse_chat_answer(parsed)
            seen = (turn.meta_info or {}).get("prompt_tokens")  # absent (miles' mock): the ids sent stand
            if seen is not None and seen != len(prompt_ids):
                raise EngineAnswerInvalid(
                    f"the engine saw {seen} prompt tokens, the gateway sent {len(prompt_ids)} as input_ids (an "
                    "engine whose chat endpoint takes no input_ids renders the messages itself)"
                )
            if not isinstance((turn.meta_info or {}).get("output_token_logprobs"), list):
                raise EngineAnswerInvalid("the engine's chat answer has no meta_info.output_token_logprobs")
            completion = tito.strip_chat_answer(parsed, request, keep_meta_info=True)
            return turn, completion, len(base_ids), prompt_ids[len(base_ids) :]
        if self.renderer is not None and prompt_ids is not None:
            turn = tito.parse_generate_answer(parsed, prompt_len=len(prompt_ids))
            completion = tito.completion_from_turn(
                request, turn, self.renderer, prompt_ids=prompt_ids, request_id=request_id, created=created
            )
            return turn, completion, len(base_ids), prompt_ids[len(base_ids) :]
        turn = tito.parse_chat_answer(parsed)
        engine_prompt = turn.prompt_ids or []
        shared = _common_prefix_len(base_ids, engine_prompt)
        return turn, tito.strip_chat_answer(parsed, request), shared, engine_prompt[shared:]

    def _commit(self, ticket: TurnTicket, record: TurnRecord) -> bool:
        """Commit; a session deleted, evicted or changed meanwhile still lets the agent have its answer."""
        try:
            self.registry.commit_turn(ticket, record, self.clock.now())
        except (SessionNotFound, SessionEvicted, SessionConflict):
            return False
        return True


def _samples_request(body: Any) -> tuple[int | None, dict[str, Any] | None]:
    if body is None:
        body = {}
    if not isinstance(body, dict):
        raise BadRequest("the samples request must be a JSON object")
    max_seq_len = body.get("max_seq_len")
    if max_seq_len is not None and (
        not isinstance(max_seq_len, int) or isinstance(max_seq_len, bool) or max_seq_len < 1
    ):
        raise BadRequest("'max_seq_len' must be a positive integer or null", param="max_seq_len")
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise BadRequest("'metadata' must be an object or null", param="metadata")
    return max_seq_len, metadata


def _request_key(tkey: bytes, keys: Sequence[bytes]) -> bytes:
    """A short digest of what the template renders (messages and tools): equal for a retried request."""
    digest = hashlib.blake2b(tkey, digest_size=16)
    for key in keys:
        digest.update(len(key).to_bytes(8, "little"))
        digest.update(key)
    return digest.digest()


def _without_messages(body: dict[str, Any], session: Session) -> dict[str, Any]:
    """The turn's request as its record keeps it: without the messages (kept once, as the session's) and the
    client's transport flags (`stream`, `stream_options`: a streamed and a whole answer are the same turn)."""
    request = {k: v for k, v in body.items() if k not in _NOT_RECORDED}
    previous = session.records[-1].request if session.records else None
    if previous is not None and "tools" in request and previous.get("tools") == request["tools"]:
        request["tools"] = previous["tools"]  # share one copy across turns
    return request


_NOT_RECORDED = frozenset({"messages", "stream", "stream_options"})


def _common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):
        return n
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
