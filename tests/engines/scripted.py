"""A scripted loopback HTTP server for the lean upstream client's tests: each request is answered with the
raw bytes a script returns, so every framing case is exact.

Where a test needs the pieces of an answer to arrive in separate reads (or after something the client does),
it says so with `pace` rather than with a pause between writes: the server writes the next piece only once
`pace(written)` holds, `written` being the count of this answer's pieces written so far. A pause would only
make a separate read likely; `pace` makes the order the test needs the only one possible.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from tests.sim.helpers import wait_until

Script = Callable[[bytes], list[bytes] | None]  # request head+body -> writes (None: close without answer)
Pace = Callable[[int], bool]  # pieces of this answer written so far -> write the next one now


class ScriptedServer:
    def __init__(self) -> None:
        self.script: Script = lambda _request: [b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"]
        self.requests: list[bytes] = []
        self.connections = 0
        self.closed = 0  # connections that ended (the client closed, or the server did)
        self.close_after_answer = False
        # None: the pieces are written at once. Once the client closed the connection, no piece waits
        # (the rest is written as an engine would before it notices: the writes fail).
        self.pace: Pace | None = None
        self.server: asyncio.AbstractServer | None = None
        self.url = ""

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                request = head + await reader.readexactly(length)
                self.requests.append(request)
                writes = self.script(request)
                if writes is None:
                    break
                for written, piece in enumerate(writes, 1):
                    writer.write(piece)
                    await writer.drain()
                    if self.pace is not None and written < len(writes):
                        await wait_until(
                            self._paced(written, reader, writer), f"the client after piece {written}"
                        )
                if self.close_after_answer:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.closed += 1
            writer.close()

    def _paced(
        self, written: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> Callable[[], bool]:
        def next_piece() -> bool:
            gone = reader.at_eof() or writer.is_closing()  # the client closed (or reset) the connection
            return gone or self.pace is None or self.pace(written)

        return next_piece

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


def bytewise(data: bytes) -> list[bytes]:
    return [data[i : i + 1] for i in range(len(data))]
