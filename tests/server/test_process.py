"""What a serving process sets up (server/process.py): the first stop signal starts the shutdown, each one
after cuts its grace short."""

from __future__ import annotations

import asyncio
import os
import signal

from rolloutgate.server.process import until_stop_signal


async def test_the_first_signal_stops_and_each_one_after_hurries() -> None:
    hurried: list[int] = []
    waiting = asyncio.create_task(until_stop_signal(lambda: hurried.append(1), signals=(signal.SIGUSR1,)))
    await asyncio.sleep(0)  # its handler is installed
    assert not waiting.done()
    os.kill(os.getpid(), signal.SIGUSR1)
    await asyncio.wait_for(waiting, timeout=10)
    assert hurried == []
    os.kill(os.getpid(), signal.SIGUSR1)
    os.kill(os.getpid(), signal.SIGUSR1)
    for _ in range(100):  # bounded: the handler runs on the loop's next turns
        if len(hurried) == 2:
            break
        await asyncio.sleep(0)
    assert hurried == [1, 1]
    asyncio.get_running_loop().remove_signal_handler(signal.SIGUSR1)
