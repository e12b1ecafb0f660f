"""A client that sends a streaming request and never reads: the slow reader of the server and reliability tests."""

from __future__ import annotations

import socket

import orjson

__all__ = ("open_slow_reader",)


def open_slow_reader(url: str, max_tokens: int) -> socket.socket:
    """A streaming chat request from a client that never reads (a tiny receive buffer, so it fills fast)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    body = orjson.dumps(
        {
            "model": "sim-model",
            "messages": [{"role": "user", "content": "stream a lot"}],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
    )
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    sock.setblocking(False)
    return sock
