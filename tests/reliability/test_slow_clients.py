"""Slow readers: a client that stops reading its stream costs the gateway a bounded buffer, its generation
is aborted on the engine, and its connection is cut; memory does not grow however many such clients come.

How it is bounded (server/exchange.py, server/app.py): aiohttp's writes wait for the socket to drain, so a
non-reading client first fills the kernel's socket buffers, then the transport's, then its exchange queue;
past `client_buffer_bytes` the queue is dropped and the client is cut off with an error, the driver starts
the retry grace and then aborts the generation; the app's watchdog closes a connection whose answer stays
unread for `client_write_timeout` real seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from pathlib import Path

import httpx
import pytest

from rolloutgate.server.app import GatewayServer
from tests.reliability.conftest import (
    Proc,
    add_figure,
    bump_figure,
    rss_sampler,
    spawn_gateway,
    wait_for,
)
from tests.server.conftest import MakeCluster, MakeGateway
from tests.server.slow_reader import open_slow_reader

pytestmark = pytest.mark.reliability

SCALE = 100.0
BUFFER_BYTES = 64 * 1024
WRITE_TIMEOUT_S = 2.0


def open_connections(gateway: GatewayServer) -> int:
    runner = gateway.runner
    return len(runner.server.connections) if runner is not None and runner.server is not None else 0


def drain_until_closed(sock: socket.socket, timeout_s: float = 10.0) -> int:
    """Read what is left; return the bytes read. Raises AssertionError unless the connection then ends.

    The receive buffer is raised first. With the 4 KB one a slow reader opens with, Linux can advertise a
    ~2 KB window, below the MSS of the gateway's end (half the largest window seen: 2 KB); that end then sends
    one probe's worth per persist timeout (~200 ms, doubling while nobody reads), and the megabytes its kernel
    queued for the reader would take minutes, every `recv` getting bytes within its timeout. A larger buffer
    lets the window grow after the next probe."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    sock.setblocking(True)
    sock.settimeout(timeout_s)
    total = 0
    try:
        while data := sock.recv(1 << 20):
            total += len(data)
    except ConnectionResetError:
        pass
    except TimeoutError:
        raise AssertionError("the connection stayed open") from None
    return total


def closed_by_gateway(gateway_url: str, sock: socket.socket) -> bool:
    """True once the gateway's end of `sock`'s connection is no longer ESTABLISHED (Linux: /proc/net/tcp).
    Draining the socket tells the same but, after a persist-timer stall (drain_until_closed), not in bounded
    time: the next probe can be two minutes away."""
    gateway_port = int(gateway_url.rsplit(":", 1)[1])
    client_port = sock.getsockname()[1]
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote, state = fields[1], fields[2], fields[3]
        if int(local.split(":")[1], 16) == gateway_port and int(remote.split(":")[1], 16) == client_port:
            return state != "01"  # 01: ESTABLISHED
    return True  # gone altogether


def max_buffered(gateway: GatewayServer) -> int:
    return max(
        (q.buffered_bytes for e in gateway.context.driver.exchanges.values() for q in e.subscribers),
        default=0,
    )


async def test_a_client_that_stops_reading_is_bounded_aborted_and_cut(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    cluster = await make_cluster(engines=1, time_scale=SCALE)
    gateway = await make_gateway(
        cluster,
        client_buffer_bytes=BUFFER_BYTES,
        client_write_timeout=WRITE_TIMEOUT_S,
        retry_grace=1.0,
        keepalive_interval=0,
    )
    max_tokens = 30_000  # the simulated context is 32K
    sock = open_slow_reader(gateway.url, max_tokens)
    try:
        largest = 0
        started = time.monotonic()
        # (A client cannot see the cut without reading: the gateway's FIN waits behind the unread bytes.)
        await wait_for(lambda: open_connections(gateway) == 1, what="the client connected")
        while open_connections(gateway):
            largest = max(largest, max_buffered(gateway))
            assert time.monotonic() - started < 60, "the slow client was never cut off"
            await asyncio.sleep(0.01)
        cut_after_s = time.monotonic() - started
        received = drain_until_closed(sock)
        assert received > BUFFER_BYTES  # it was sent what the sockets could hold, then the connection ended
    finally:
        sock.close()
    # The queue of the client never held much more than the bound (one event past it, at most).
    assert largest <= BUFFER_BYTES + 4096, largest
    # Its generation was aborted on the engine long before its end, and nothing is left in the gateway.
    await wait_for(lambda: cluster.engines[0].running_count == 0, what="generation aborted")
    generated = cluster.engines[0].generated_tokens_total
    assert generated < max_tokens, generated
    await wait_for(lambda: gateway.context.active_requests == 0 and not gateway.context.driver.exchanges)
    # and the gateway serves on
    ok = await http.post(
        f"{gateway.url}/v1/chat/completions",
        json={"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    )
    assert ok.status_code == 200
    add_figure(
        "slow_reader.single",
        {"tokens_generated_of": [generated, max_tokens], "cut_after_s": round(cut_after_s, 2)},
    )


async def test_a_client_that_reads_slowly_but_keeps_up_gets_its_whole_stream(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    """The bound is for clients that fall far behind, not for ones that read slowly: a reader that pauses
    now and then still gets every event."""
    cluster = await make_cluster(engines=1, time_scale=10.0)
    gateway = await make_gateway(
        cluster, client_buffer_bytes=BUFFER_BYTES, client_write_timeout=WRITE_TIMEOUT_S, keepalive_interval=0
    )
    body = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 300,
        "ignore_eos": True,
        "stream": True,
    }
    events = 0
    async with http.stream("POST", f"{gateway.url}/v1/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                assert '"error"' not in line, line
                events += 1
                if events % 50 == 0:
                    await asyncio.sleep(0.3)  # a pause, well under the write timeout
    assert events >= 300


@pytest.mark.timeout(360)  # three waves, each waiting for the watchdog: slow on a busy 2-core machine
async def test_waves_of_slow_readers_do_not_grow_memory(
    procs: list[Proc], tmp_path: Path, http: httpx.AsyncClient
) -> None:
    """A gateway subprocess meets three waves of clients that never read (with normal clients among them):
    its RSS after the third wave is where it was after the first."""
    gateway = spawn_gateway(
        [
            "--sim",
            "2",
            "--time-scale",
            "50",
            "--retry-grace",
            "1",
            "--stall-timeout",
            "600",
            "--keepalive-interval",
            "0",
            "--log-level",
            "warning",
        ],
        tmp_path / "gateway.log",
        env={
            "ROLLOUTGATE_CLIENT_BUFFER_BYTES": str(BUFFER_BYTES),
            "ROLLOUTGATE_CLIENT_WRITE_TIMEOUT": str(WRITE_TIMEOUT_S),
        },
    )
    procs.append(gateway)
    normal = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 50,
        "stream": True,
    }

    async def normal_client() -> int:
        async with http.stream("POST", f"{gateway.url}/v1/chat/completions", json=normal) as response:
            text = (await response.aread()).decode()
        assert response.status_code == 200 and text.rstrip().endswith("data: [DONE]"), text[-300:]
        return 1

    async def idle() -> None:
        for _ in range(600):
            state = (await http.get(f"{gateway.url}/admin/state")).json()
            if not state["queue_depth"] and not any(state["in_flight"].values()):
                return
            await asyncio.sleep(0.1)
        raise AssertionError(f"the gateway did not go idle: {state}")

    await asyncio.gather(*(normal_client() for _ in range(20)))  # warm-up
    await idle()
    after_wave: list[int] = []
    slow_total = normal_total = 0
    async with rss_sampler(gateway.pid) as samples:
        baseline = gateway.rss()
        for _wave in range(3):
            # Streams longer than the kernel's socket buffers hold (~11K tokens on loopback), so each client
            # really falls behind the gateway.
            sockets = [open_slow_reader(gateway.url, 25_000) for _ in range(12)]
            normals = asyncio.gather(*(normal_client() for _ in range(10)))
            try:
                normal_total += sum(await normals)
                await idle()
                # every slow reader's connection was cut by the gateway's watchdog
                cut_so_far = slow_total + len(sockets)
                await wait_for(
                    lambda cut_so_far=cut_so_far: gateway.log().count("cutting off a client") >= cut_so_far,
                    timeout_s=60,
                    what="slow readers cut",
                )
                await wait_for(
                    lambda sockets=sockets: all(closed_by_gateway(gateway.url, s) for s in sockets),
                    what="the slow readers' connections closed by the gateway",
                )
            finally:
                for sock in sockets:
                    with contextlib.suppress(OSError):
                        sock.close()
            slow_total += len(sockets)
            after_wave.append(gateway.rss())
    peak = max(rss for _, rss in samples)
    mib = 1024 * 1024
    add_figure(
        "slow_reader.waves",
        {
            "slow_clients": slow_total,
            "normal_clients_ok": normal_total,
            "rss_baseline_mib": round(baseline / mib, 1),
            "rss_after_each_wave_mib": [round(r / mib, 1) for r in after_wave],
            "rss_peak_mib": round(peak / mib, 1),
        },
    )
    bump_figure("faults_survived.slow_readers", slow_total)
    assert after_wave[2] - after_wave[0] < 16 * mib, after_wave
    assert peak - baseline < 200 * mib, (baseline, peak)
    assert gateway.is_alive()
