"""Nothing waits on a dead engine loop: when the loop thread dies, every command still queued (a
request to add, or a ``call``) ends with EngineDead, and so does one queued after the loop's last
drain."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import pytest

from pagoda.node_agent.params import SamplingParams
from pagoda.node_agent.serving.worker.async_engine import AsyncEngine, EngineDead, _Command


class LoopKiller(BaseException):
    """Not an Exception: a ``call`` that raises it takes the loop thread down (a bug's stand-in)."""


def test_commands_queued_behind_the_loops_death_fail_instead_of_hanging(make_engine) -> None:
    engine = make_engine(kv_memory=8 << 20)

    async def main() -> None:
        ae = AsyncEngine(engine).start()
        entered, release = threading.Event(), threading.Event()

        def blocker(_engine):
            entered.set()
            assert release.wait(60)
            raise LoopKiller("the loop dies here")

        first = asyncio.ensure_future(ae.call(blocker))
        assert await asyncio.to_thread(entered.wait, 30)
        # queued while the loop is busy in ``blocker``: a call and a request
        second = asyncio.ensure_future(ae.call(lambda e: "never runs"))
        added = asyncio.ensure_future(ae.submit("hi", SamplingParams(max_tokens=2)))
        await asyncio.sleep(0.3)  # the request reaches the command queue (tokenized off the loop)
        release.set()
        for fut in (second, added):
            with pytest.raises(EngineDead):
                await asyncio.wait_for(fut, 10)
        first.cancel()
        assert ae.num_inflight == 0
        ae._thread.join(5)
        with pytest.raises(EngineDead):
            await ae.call(lambda e: 1)
        # a caller that saw the loop alive and queued after its last drain: failed on queueing
        done: concurrent.futures.Future = concurrent.futures.Future()
        ae._put(_Command("call", "", add=lambda e: 1, done=done))
        assert isinstance(done.exception(timeout=1), EngineDead)

    asyncio.run(main())
