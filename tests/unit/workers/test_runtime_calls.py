"""A worker's admin actions run for another worker over the mesh (broker.workers.runtime):
an action that returns at once is answered at once; one that takes a while (a coroutine: a
leave's steps, broker.workers.leaving) is answered when it is done, without holding up the
answers to the other requests meanwhile; one that fails is answered ``None``. Real sockets
between two runtimes on one event loop."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import uvloop

from broker.commitlog import Streams
from broker.workers.runtime import WorkerRuntime


async def _runtimes(tmp: Path) -> list[WorkerRuntime]:
    runtimes = [WorkerRuntime(i, 2, Streams(tmp, [])) for i in range(2)]
    for rt in runtimes:
        await rt.mesh.start()
    for rt in runtimes:
        await rt.mesh.wait_connected(5)
    return runtimes


def test_awaited_actions_answer_when_done_and_a_failure_answers_none(tmp_path: Path) -> None:
    async def main() -> None:
        zero, one = await _runtimes(tmp_path)
        release = asyncio.Event()

        async def slow(argument: Any) -> Any:
            await release.wait()
            return {"done": argument}

        async def broken(argument: Any) -> Any:
            raise RuntimeError("this step failed")

        one.actions["slow"] = slow
        one.actions["quick"] = lambda argument: argument + 1
        one.actions["broken"] = broken
        zero.actions["slow"] = slow
        waiting = asyncio.ensure_future(zero.call(1, "slow", "x"))
        here = asyncio.ensure_future(zero.call(0, "slow", "y"))  # this worker's own
        # A quick action asked meanwhile is answered while the slow one waits.
        assert await zero.call(1, "quick", 41) == 42
        await asyncio.sleep(0.05)
        assert not waiting.done() and not here.done()
        release.set()
        assert await waiting == {"done": "x"}
        assert await here == {"done": "y"}
        assert await zero.call(1, "broken", None) is None
        for rt in (zero, one):
            await rt.close()

    uvloop.run(asyncio.wait_for(main(), 10))
