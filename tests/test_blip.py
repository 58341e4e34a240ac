"""A driver's connection blip loses no call and runs none twice (issue 27).

Before: closing the driver's comm for 1 s cancelled every in-flight call on the client while
the running stateful call still finished on its instance; re-submitting the cancelled calls,
as the README advised, ran steps twice (``[0, 1, 1, 2]``) and telemetry said ``cancelled``.
Now the scheduler plugin holds a disconnected driver's calls (``Sessions.before_client_left``)
and its futures ask for them again once it is back (``AgentFuture._reattach``).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import distributed.client as dc
import pytest
from distributed import Client, Scheduler, Worker
from distributed.utils_test import gen_cluster

import dask_agents as da
from dask_agents.scheduler_plugin.sessions import KEEPER
from tests.conftest import async_wait_for
from tests.test_sessions import FAST, call_states, plugin

GATE = threading.Event()


@da.agent(stateful=True)
class Steps:
    """Session state: the steps taken, in order."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def step(self, i: int, gated: bool = False) -> list[int]:
        if gated:
            GATE.wait(30)
        self.steps.append(i)
        return list(self.steps)


@contextlib.contextmanager
def network_down() -> Iterator[threading.Event]:
    """The driver cannot reconnect until the yielded event is set (as benchmarks/faults.py)."""
    up = threading.Event()
    real = dc.connect

    async def connect(*args: Any, **kwargs: Any) -> Any:
        if not up.is_set():
            raise OSError("test: the driver's network is down")
        return await real(*args, **kwargs)

    dc.connect = connect
    try:
        yield up
    finally:
        up.set()
        dc.connect = real


def reconnected(c: Client) -> bool:
    return c.status == "running" and c.scheduler_comm is not None and not c.scheduler_comm.closed()


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)], timeout=60, config=FAST)
async def test_a_call_running_through_a_blip_finishes_once_and_its_future_gets_it(c: Client, s: Scheduler,
                                                                                 a: Worker):
    await da.install(c)
    GATE.clear()
    steps = da.stub(Steps)
    async with da.session(c, name="blip") as sess:
        assert await steps.step(0) == [0]
        running = steps.step(1, gated=True)
        await async_wait_for(lambda: call_states(s, sess.id).get(running.key) == "processing"
                             and a.state.executing_count == 1)
        with network_down() as up:
            await c.scheduler_comm.comm.close()  # the driver's connection drops
            await async_wait_for(lambda: c.id not in s.clients)
            assert running.key in plugin(s).sessions.kept[c.id][1]  # held for the driver meanwhile
            GATE.set()  # the call ends while its driver is away
            await async_wait_for(lambda: call_states(s, sess.id).get(running.key) == "finished")
            up.set()
            await async_wait_for(lambda: reconnected(c))
        assert await running == [0, 1]  # its own result, not a cancellation
        assert await steps.step(2) == [0, 1, 2]  # nothing ran twice
    assert call_states(s, sess.id)[running.key] == "finished"
    assert KEEPER not in s.clients or not s.clients[KEEPER].wants_what  # nothing held for nobody
    assert plugin(s).sessions.kept == {}


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)], timeout=60, config=FAST)
async def test_a_call_still_running_after_the_reconnect_is_reported_when_it_ends(c: Client, s: Scheduler,
                                                                                  a: Worker):
    """The plain close of the README's scenario (Dask reconnects at once): the call is still
    running when the driver asks again; its future resolves when it ends."""
    await da.install(c)
    GATE.clear()
    steps = da.stub(Steps)
    async with da.session(c, name="blip2") as sess:
        running = steps.step(1, gated=True)
        await async_wait_for(lambda: call_states(s, sess.id).get(running.key) == "processing")
        await c.scheduler_comm.comm.close()
        await async_wait_for(lambda: reconnected(c) and c.id in s.clients)
        GATE.set()
        assert await running == [1]
        assert await steps.step(2) == [1, 2]


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)], timeout=60,
             config={**FAST, "agents.scheduler.session-grace": "300ms"})
async def test_a_driver_back_after_its_grace_gets_a_clear_error_not_a_rerun(c: Client, s: Scheduler, a: Worker):
    await da.install(c)
    GATE.clear()
    steps = da.stub(Steps)
    sess = da.session(c, name="late")
    await sess.__aenter__()
    assert await steps.step(0) == [0]
    running = steps.step(1, gated=True)
    await async_wait_for(lambda: call_states(s, sess.id).get(running.key) == "processing")
    with network_down() as up:
        await c.scheduler_comm.comm.close()
        rec = await async_wait_for(lambda: (r := plugin(s).state.sessions[sess.id]).state == "completed" and r)
        await async_wait_for(lambda: c.id not in plugin(s).sessions.kept)
        up.set()
        await async_wait_for(lambda: reconnected(c))
    GATE.set()
    with pytest.raises(da.CallLostError) as ei:
        await running
    text = str(ei.value)
    assert sess.id in text and "Steps.step" in text and running.key in text and "did not reconnect" in text
    assert "disconnected" in rec.closed_reason
    sess._leave()
