"""Graceful scale-down drains sessions instead of failing them (issue 27).

Before: ``retire_workers`` of a worker holding stateful instances failed their sessions
(``InstanceLostError``: the retirement took 0.42 s, nothing drained), and adaptive scaling
picked such workers. Now Dask's choice skips them (``valid_workers_downscaling``) and a
retirement waits for their live sessions (``agents.scheduler.drain-timeout``) while they take no
new ones.
"""

from __future__ import annotations

import asyncio

import pytest
from distributed import Client, Scheduler, Worker
from distributed.utils_test import gen_cluster

import dask_agents as da
from dask_agents.scheduler_plugin.plugin import NAME
from tests.conftest import async_wait_for
from tests.test_plugin_faults import CONFIG, Ledger


def plugin(s: Scheduler):
    return s.plugins[NAME]


def home(s: Scheduler, sid: str) -> str:
    return plugin(s).bindings[(sid, "Ledger")]


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1), ("127.0.0.1", 1)], timeout=60, config=CONFIG)
async def test_retiring_a_worker_waits_for_its_live_session_which_completes_correctly(c: Client, s: Scheduler,
                                                                                        a: Worker, b: Worker):
    await da.install(c)
    ledger = da.stub(Ledger)
    async with da.session(c, name="long") as sess:
        assert await ledger.write(1) == [1]
        victim = home(s, sess.id)
        retire = asyncio.ensure_future(c.retire_workers(workers=[victim]))
        await async_wait_for(lambda: victim in plugin(s).roster.retiring)
        async with da.session(c, name="new") as new:  # a new session goes to the other worker
            assert await ledger.write(10) == [10]
        assert home(s, new.id) != victim
        assert not retire.done() and victim in s.workers
        for i in (2, 3):  # the old session goes on on its own instance
            assert await ledger.write(i) == list(range(1, i + 1))
    await retire  # its session ended: the retirement goes ahead
    await async_wait_for(lambda: victim not in s.workers)
    rec = plugin(s).state.sessions[sess.id]
    assert rec.closed_reason is None and not any("retired" in why for why in rec.lost.values())


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1), ("127.0.0.1", 1)], timeout=60, config=CONFIG)
async def test_dasks_choice_of_workers_to_close_skips_live_sessions(c: Client, s: Scheduler, a: Worker, b: Worker):
    await da.install(c)
    ledger = da.stub(Ledger)
    async with da.session(c, name="busy") as sess:
        assert await ledger.write(1) == [1]
        busy = home(s, sess.id)
        free = (b if busy == a.address else a).address
        assert s.workers_to_close(n=1) == [free]
        assert s.workers_to_close(n=2) == [free]  # never the busy one while its session lives
        await c.retire_workers(n=1)  # Dask chooses: the free one, at once
        await async_wait_for(lambda: free not in s.workers)
        assert await ledger.write(2) == [1, 2]
    await async_wait_for(lambda: plugin(s).state.sessions[sess.id].state == "completed")
    assert s.workers_to_close(n=1) == [busy]


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1), ("127.0.0.1", 1)], timeout=60,
             config={**CONFIG, "agents.scheduler.drain-timeout": "300ms"})
async def test_past_the_drain_timeout_the_session_fails_naming_the_retirement(c: Client, s: Scheduler,
                                                                               a: Worker, b: Worker):
    await da.install(c)
    ledger = da.stub(Ledger)
    async with da.session(c, name="outlived") as sess:
        assert await ledger.write(1) == [1]
        victim = home(s, sess.id)
        await c.retire_workers(workers=[victim])
        await async_wait_for(lambda: victim not in s.workers)
        with pytest.raises(da.InstanceLostError) as ei:
            await ledger.write(2)
        assert "drain-timeout" in str(ei.value) and sess.id in str(ei.value)
