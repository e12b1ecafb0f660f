"""The one hop: a request that belongs to another replica, streamed there and its answer streamed back.

Theory of operation: a plain HTTP reverse proxy over one keep-alive client pool per replica. A request body
over 1 MiB (a 100K-token prompt is ~0.7 MB of ids as JSON, more with logprobs) or without a length is streamed
to the owner as it arrives, a smaller one passed whole (fewer writes); an answer with a length (ready whole)
is passed whole, any other streamed back chunk by chunk as the owner writes it, so the owner's keep-alive
bytes, SSE events and errors after keep-alive reach the client unchanged and on time. The forwarder adds `X-Rolloutgate-Forwarded-By` (the owner
serves it, never forwarding again) and `X-Forwarded-For`; the answer keeps the owner's
`X-Rolloutgate-Replica` and gains `X-Rolloutgate-Via`.

Failures: an owner that cannot be reached, that closes before it answers, or that breaks off having sent
only keep-alive spaces (a non-streamed answer still waiting for its engine: JSON allows leading whitespace)
is `HopFailed`: nothing of the answer reached the client. If the request's body was kept whole, the edge
(fleet/edge.py) sends it on to the next replica in the key's order at once (`resume`: the client's answer
already under way, to which that replica's answer is appended); else it answers 503 + Retry-After. Either way
it tells the controller to check that replica. An owner that breaks off after answer bytes: the client's
connection is cut, as the owner's own would have been. A client that leaves: its handler is cancelled here,
which closes the connection to the owner, which then sees the client leave (its retry grace, then the abort
on the engine).
"""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from rolloutgate.fleet.routing import FORWARDED_HEADER, VIA_HEADER

__all__ = ("HopFailed", "forward", "hop_session")

# RFC 9110 section 7.6.1's connection-specific fields, plus Host (the owner's own) and the framing aiohttp sets
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
    }
)
WHOLE_BYTES = 1 << 20  # bodies with a length up to this pass whole; others (and unsized ones) stream
CONNECT_TIMEOUT_S = 5.0  # to another replica, usually on the same network: longer means it is not there


class HopFailed(Exception):
    """The owner could not be reached, or broke off before any answer byte but keep-alive spaces reached the
    client. `replayable`: the body was kept, so another replica can take the request; `resume`: the client's
    answer, if already prepared (keep-alive spaces sent), to continue with another replica's answer."""

    def __init__(self, message: str, *, replayable: bool, resume: web.StreamResponse | None = None) -> None:
        super().__init__(message)
        self.replayable = replayable
        self.resume = resume


def hop_session() -> aiohttp.ClientSession:
    """The replica's client pool for hops: no total timeout (the owner's clocks bound the call and keep it
    alive), no decompression (bytes pass through as the owner wrote them)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60),
        timeout=aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT_S, sock_connect=CONNECT_TIMEOUT_S),
        auto_decompress=False,
    )


def _end_to_end(headers: CIMultiDictProxy[str]) -> CIMultiDict[str]:
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in _HOP_BY_HOP)


async def forward(
    request: web.Request,
    base_url: str,
    *,
    self_id: str,
    session: aiohttp.ClientSession,
    resume: web.StreamResponse | None = None,
) -> web.StreamResponse:
    """Serve `request` by the replica at `base_url` (module docstring); with `resume`, append its answer's
    bytes to that prepared answer. Raises HopFailed."""
    headers = _end_to_end(request.headers)
    headers[FORWARDED_HEADER] = self_id
    peer = request.remote or ""
    earlier = request.headers.get("X-Forwarded-For")
    headers["X-Forwarded-For"] = f"{earlier}, {peer}" if earlier else peer
    body: bytes | aiohttp.StreamReader | None = None
    if request.body_exists:
        length = request.content_length
        # a small body whole (one write to the owner), a large or unsized one streamed as it arrives
        body = await request.read() if length is not None and length <= WHOLE_BYTES else request.content
    replayable = not isinstance(body, aiohttp.StreamReader)
    try:
        upstream = await session.request(
            request.method,
            base_url + request.rel_url.raw_path_qs,
            headers=headers,
            data=body,
            allow_redirects=False,
        )
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        raise HopFailed(f"{type(exc).__name__}: {exc}", replayable=replayable, resume=resume) from exc
    answered = False
    try:
        headers = _end_to_end(upstream.headers)
        headers[VIA_HEADER] = self_id
        length = upstream.content_length
        if resume is None and length is not None and length <= WHOLE_BYTES:  # whole and ready: passed whole
            whole = web.Response(status=upstream.status, reason=upstream.reason, headers=headers)
            whole.body = await upstream.read()
            answered = True
            return whole
        response = resume
        if response is None:
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers=headers)
            await response.prepare(request)
        blank = True  # only keep-alive spaces so far: another replica may still answer in their place
        try:
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
                blank = blank and not chunk.strip(b" \t\r\n")
        except (aiohttp.ClientError, OSError, asyncio.IncompleteReadError) as exc:
            if blank:
                raise HopFailed(
                    f"broke off before answering ({type(exc).__name__})",
                    replayable=replayable,
                    resume=response,
                ) from exc
            # the owner broke off mid-answer: cut the client too, so it sees the failure as such
            if request.transport is not None:
                request.transport.abort()
            return response
        await response.write_eof()
        answered = True
        return response
    finally:
        # a whole answer read: the connection goes back to the pool; else (cut off, cancelled) it is closed,
        # which is how the owner learns that the client left
        if answered:
            upstream.release()
        else:
            upstream.close()
