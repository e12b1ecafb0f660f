"""Ports for test servers: every server binds a port the OS gives it (port 0) and reports it; nothing assumes a
port is free (SGLang's default 30000 was taken once, and `make test-fleet` failed on it).

Where a port must be known before the servers that use it start (a fleet's replicas share one with
SO_REUSEPORT; an engine that comes up late where the gateway was told to look), `reserved_port` holds it:
bound to the OS's choice and not listening, so a connection to it is refused and no other process can take
it, and with SO_REUSEPORT, so servers of this user that set it too (aiohttp's `reuse_port=True`) bind it
beside the reservation.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ("port_of", "reserved_port")


@contextmanager
def reserved_port(host: str = "127.0.0.1") -> Iterator[socket.socket]:
    """A socket bound to a port the OS chose on `host` (`.getsockname()[1]`), held until the block ends or
    the caller closes it (to hand the port to a server that does not share it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, 0))
        yield sock


def port_of(sock: socket.socket) -> int:
    port: int = sock.getsockname()[1]
    return port
