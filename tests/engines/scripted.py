"""A scripted loopback HTTP server for the lean upstream client's tests: each request is answered with the
raw bytes a script returns, so every framing case is exact."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

Script = Callable[[bytes], list[bytes] | None]  # request head+body -> writes (None: close without answer)


class ScriptedServer:
    def __init__(self) -> None:
        self.script: Script = lambda _request: [b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"]
        self.requests: list[bytes] = []
        self.connections = 0
        self.close_after_answer = False
        self.gap_s = 0.0
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
                for piece in writes:
                    writer.write(piece)
                    await writer.drain()
                    if self.gap_s:
                        await asyncio.sleep(self.gap_s)
                if self.close_after_answer:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


def bytewise(data: bytes) -> list[bytes]:
    return [data[i : i + 1] for i in range(len(data))]
