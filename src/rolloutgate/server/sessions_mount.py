"""The session API (sessions/) mounted on the gateway: its upstream calls take the gateway's request path.

`GatewayDispatcher` runs a session's call as a non-streaming exchange with the session id as routing key, so
session turns get affinity, admission, the engine-time clocks and hung-engine recovery like any request.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web

from rolloutgate.core.events import SessionEnded
from rolloutgate.engines.base import Route
from rolloutgate.errors import GatewayError, NotFound
from rolloutgate.server.context import CONTEXT, GatewayContext
from rolloutgate.server.exchange import Finished
from rolloutgate.server.front import ROUTES, apply_budget, new_request_id, submit
from rolloutgate.server.session_routes import add_session_routes
from rolloutgate.server.validate import estimate_prompt_tokens
from rolloutgate.sessions.registry import SessionLimits, SessionRegistry
from rolloutgate.sessions.render import ChatRenderer
from rolloutgate.sessions.service import SessionAnswer, SessionCall, SessionService, SessionSettings
from rolloutgate.sessions.store import SessionStore
from rolloutgate.sessions.tito import TurnDefaults

__all__ = ("GatewayDispatcher", "mount_sessions")

log = logging.getLogger("rolloutgate.sessions")


class GatewayDispatcher:
    def __init__(self, ctx: GatewayContext) -> None:
        self._ctx = ctx

    async def __call__(self, call: SessionCall) -> SessionAnswer:
        ctx = self._ctx
        route = ROUTES.get(call.path)
        if route is None or call.body is None:
            raise NotFound(f"sessions cannot run {call.method} {call.path} through the gateway queue")
        body = dict(call.body)  # a session's calls never stream to the client (its answer is one body)
        prompt_tokens = call.prompt_tokens
        if call.max_seq_len is not None:  # the agent speaks chat: no room is a 400 (token_budget.py)
            prompt_tokens = estimate_prompt_tokens(route, body) if prompt_tokens is None else prompt_tokens
            body, _ = apply_budget(
                ctx,
                route,
                body,
                prompt_tokens=prompt_tokens,
                max_seq_len=call.max_seq_len,
                client_route=Route.CHAT,
            )
        exchange, outbox = submit(
            ctx,
            route,
            body,
            call.headers,
            routing_key=call.routing_key,
            prompt_tokens=prompt_tokens,
            request_id=call.request_id,  # the turn's one id: the engine's rid and the session's record
        )
        try:
            item = await outbox.get()
        except asyncio.CancelledError:
            if exchange.unsubscribe(outbox):
                ctx.driver.client_disconnected(exchange)
            raise
        if isinstance(item, Finished):
            return SessionAnswer(
                status=200, body=item.body or b"{}", engine_id=exchange.engine_id, timing=item.timing
            )
        assert isinstance(item, GatewayError)
        if item.raw_body is not None:  # the engine's own error: the session relays it unchanged
            return SessionAnswer(status=item.status, body=item.raw_body, engine_id=exchange.engine_id)
        raise item


def mount_sessions(app: web.Application) -> None:
    ctx = app[CONTEXT]
    settings = ctx.settings
    store = SessionStore(settings.state_dir) if settings.state_dir else None
    registry = SessionRegistry(
        SessionLimits(
            max_sessions=settings.session_max,
            max_records_per_session=settings.session_max_records,
            idle_ttl_s=settings.session_idle_ttl,
            max_bytes=settings.session_max_bytes,
            keep_branches=settings.session_tree,
        ),
        journal=store,
    )
    if store is not None:
        _restore(registry, store, ctx.driver.clock.now())

        async def close_store(_app: web.Application) -> None:
            store.close()

        app.on_cleanup.append(close_store)
        ctx.extras["session_store"] = store
    renderer = (
        ChatRenderer.from_dir(settings.tokenizer, chat_template_path=settings.chat_template_path)
        if settings.tokenizer
        else None
    )
    engine_fields: dict[str, Any] = {}
    if settings.session_lora_path is not None:
        engine_fields["lora_path"] = settings.session_lora_path
    if settings.session_routing_replay:
        engine_fields["return_routed_experts"] = True
    if settings.session_indexer_replay:
        engine_fields["return_indexer_topk"] = True
    models = [e.info.max_model_len for e in ctx.pool.engines.values() if e.info.max_model_len]
    service = SessionService(
        registry,
        GatewayDispatcher(ctx),
        ctx.driver.clock,
        renderer=renderer,
        new_request_id=new_request_id,
        settings=SessionSettings(
            max_model_len=min(models) if models else None,
            tree=settings.session_tree,
            engine_route=settings.session_engine_route,
            rewritten_history=settings.session_rewritten_history,
            picker=settings.session_picker,
            samples_weight_versions=settings.samples_weight_versions,
            max_seq_len=settings.session_max_seq_len,
            replay_added_rows=settings.session_replay_added_rows,
            turn_defaults=TurnDefaults(
                template_kwargs=settings.chat_template_kwargs or {}, engine_fields=engine_fields
            ),
        ),
    )
    ctx.extras["sessions"] = service
    # a session's end releases its engine binding (cache-warm placement counts the sessions on each engine)
    service.on_end.append(lambda session_id: ctx.driver.handle(SessionEnded(routing_key=session_id)))
    ctx.metrics.watch_samples(lambda: registry.stats().metric_samples())

    add_session_routes(
        app,
        service,
        error_shape=settings.session_error_shape,
        sweep_interval_s=ctx.driver.clock.real_seconds(min(30.0, settings.session_idle_ttl / 2)),
    )


def _restore(registry: SessionRegistry, store: SessionStore, now: float) -> None:
    """Reload the sessions a previous gateway left in the state dir (each idle from now on)."""
    stored = store.load()
    for entry in stored:
        registry.restore(entry.session_id, entry.records, now)
    log.info(
        "restored %d sessions (%d turns) from %s",
        len(stored),
        sum(len(e.records) for e in stored),
        store.path,
    )
