"""The floor under the gateway's front: aiohttp on uvloop answering a POST with a fixed JSON body.

    .venv/bin/python scripts/aiohttp_floor.py [connections] [seconds]

The server reads and parses the request body (orjson) and answers a 16-token `/generate`-shaped body: what any
aiohttp gateway pays per request before doing anything of its own. Pinned like `make bench` (server on CPU 0,
wrk on CPU 1); prints req/s and the server's CPU per request. Needs wrk (`make bench-tools`) and taskset.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time

SERVER = """
import sys, orjson, uvloop
from aiohttp import web
ANSWER = orjson.dumps({"text": " w" * 16, "output_ids": list(range(16)),
                       "meta_info": {"id": "x" * 32, "completion_tokens": 16, "prompt_tokens": 16}})
async def generate(request):
    orjson.loads(await request.read())
    return web.Response(body=ANSWER, content_type="application/json")
app = web.Application()
app.router.add_post("/generate", generate)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None,
            loop=uvloop.new_event_loop())
"""
BODY = (
    '{"input_ids":[11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26],"sampling_params":{"max_new_tokens":16}}'
)


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    connections = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    seconds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    port = 21000 + os.getpid() % 20000
    with tempfile.TemporaryDirectory() as work:
        lua = os.path.join(work, "post.lua")
        with open(lua, "w") as f:
            f.write(
                f'wrk.method="POST"\nwrk.headers["Content-Type"]="application/json"\nwrk.body=[==[{BODY}]==]\n'
            )
        server = subprocess.Popen(["taskset", "-c", "0", sys.executable, "-c", SERVER, str(port)])
        try:
            url = f"http://127.0.0.1:{port}/generate"
            time.sleep(1.5)
            subprocess.run(["taskset", "-c", "1", "wrk", "-t1", f"-c{connections}", "-d1s", "-s", lua, url],
                           check=True, capture_output=True)  # fmt: skip
            before = _cpu_seconds(server.pid)
            out = subprocess.run(
                ["taskset", "-c", "1", "wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "-s", lua, url],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            spent = _cpu_seconds(server.pid) - before
        finally:
            server.terminate()
            server.wait()
    done = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    rate = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    print(
        f"aiohttp floor, {connections} connections: {rate:,.0f} req/s, {spent / done * 1e6:.1f} us CPU per request"
    )


if __name__ == "__main__":
    main()
