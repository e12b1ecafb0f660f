"""`rolloutgate sim` as a process: engines on their ports, start-up faults, clean exit on SIGTERM."""

from __future__ import annotations

import asyncio
import re
import signal
import sys

import aiohttp

from rolloutgate.cli import build_parser


def test_sim_flags_parse() -> None:
    args = build_parser(only="sim").parse_args(
        [
            "sim",
            "--engines",
            "2",
            "--base-port",
            "31000",
            "--api",
            "sglang",
            "--profile",
            "incident",
            "--time-scale",
            "100",
            "--max-running-requests",
            "16",
            "--decode-base-ms",
            "20",
            "--fault",
            "0:freeze",
        ]
    )
    assert (args.engines, args.base_port, args.api, args.profile, args.time_scale) == (
        2,
        31000,
        "sglang",
        "incident",
        100.0,
    )
    from rolloutsim.cli import _overrides

    assert _overrides(args) == {"max_running_requests": 16, "decode_base_s": 0.02}


async def test_sim_command_serves_engines_and_exits_on_sigterm() -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "rolloutgate",
        "sim",
        "--engines",
        "2",
        "--base-port",
        "0",
        "--api",
        "sglang",
        "--profile",
        "incident",
        "--time-scale",
        "100",
        "--fault",
        "1:refuse",
        "--admin-port",
        "0",
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        urls: list[str] = []
        admin = None
        async with asyncio.timeout(60):
            while True:
                line = (await process.stdout.readline()).decode()
                assert line, "the simulator exited early"
                if match := re.match(r"engine \d sglang (http://\S+)", line):
                    urls.append(match.group(1))
                elif match := re.match(r"admin (http://\S+)", line):
                    admin = match.group(1)
                elif line.startswith("profile incident"):
                    break
        assert len(urls) == 2 and admin is not None
        async with aiohttp.ClientSession() as session:
            body = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
            async with session.post(urls[0] + "/generate", json=body) as response:
                assert response.status == 200
            async with session.post(urls[1] + "/generate", json=body) as response:
                assert response.status == 503
            async with session.get(admin + "/sim/state", params={"requests": "0"}) as response:
                engines = (await response.json())["engines"]
            assert [e["faults"] for e in engines] == [[], [{"kind": "refuse", "status": 503}]]
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 20) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
