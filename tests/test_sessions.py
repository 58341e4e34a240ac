"""Sessions are owned by the client that opened them; stateful instances are never silently
replaced by fresh ones; plain Dask work is left alone (issue 13).

Each scenario failed on the code before: any client that had submitted into a session (a
worker's own client included) closed it when it went away, a driver's reconnect reset its
instances, plain tasks became "calls", a late call ran on a fresh instance.
"""

from __future__ import annotations

import threading
from concurrent.futures import CancelledError

import pytest
from distributed import Client, Scheduler, Worker
from distributed.utils_test import gen_cluster

import dask_agents as da
from dask_agents.scheduler_plugin.plugin import NAME
from tests.conftest import async_wait_for

HOLD = threading.Event()  # held calls wait on it (in-process workers)


@da.agent(stateful=True)
class Counter:
    def __init__(self) -> None:
        self.seen: list[int] = []

    def add(self, i: int) -> list[int]:
        self.seen.append(i)
        return list(self.seen)


@da.tool(kind="code_exec")
def held(i: int) -> int:
    HOLD.wait(60)
    return i


@da.tool(kind="code_exec")
def after(x: int) -> int:
    return x + 1


@da.agent
class Spawner:
    def run(self, n: int) -> None:
        futs = [da.stub(held)(i) for i in range(n)]
        from tests.conftest import wait_for

        wait_for(lambda: all(f.status == "pending" for f in futs))
        raise ValueError("the spawner gave up")


def plugin(s: Scheduler):
    return s.plugins[NAME]


def call_states(s: Scheduler, sid: str) -> dict[str, str]:
    sess = plugin(s).state.sessions.get(sid)
    return {k: r.state for k, r in sess.calls.items()} if sess else {}


def stateful_instances(*workers: Worker) -> int:
    return sum(w.plugins[NAME].instances.stateful_count() for w in workers)


def rejoin(client: Client, sid: str) -> da.Session:
    """A Session object of ``client`` carrying an existing session's id (a late or second caller)."""
    other = da.session(client)
    other.id = sid
    return other


FAST = {"agents.scheduler.housekeeping-interval": "50ms"}


# -- ownership ---------------------------------------------------------------------------------
@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)], timeout=60, config=FAST)
async def test_driver_reconnect_keeps_the_session_and_its_instance(c: Client, s: Scheduler, a: Worker) -> None:
    await da.install(c)
    counter = da.stub(Counter)
    async with da.session(c) as sess:
        for i in range(3):
            await counter.add(i)
        await c.scheduler_comm.comm.close()  # the driver's connection drops
        await async_wait_for(lambda: c.status == "running" and c.id in s.clients and c.scheduler_comm is not None
                             and not c.scheduler_comm.closed())
        assert await counter.add(9) == [0, 1, 2, 9]  # the same instance: nothing was reset
    assert plugin(s).state.sessions[sess.id].owner == c.id


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)], timeout=60, config=FAST)
async def test_a_second_client_closing_does_not_close_the_session(c: Client, s: Scheduler, a: Worker) -> None:
    await da.install(c)
    counter = da.stub(Counter)
    async with da.session(c) as sess:
        assert await counter.add(1) == [1]
        async with Client(s.address, asynchronous=True) as c2:
            async with rejoin(c2, sess.id):
                assert await counter.add(2) == [1, 2]
        await async_wait_for(lambda: len(s.clients) == 2)  # c2 is gone (c and fire-and-forget)
        assert plugin(s).state.sessions[sess.id].state == "active"
        assert await counter.add(3) == [1, 2, 3]


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)], timeout=60,
             config={**FAST, "agents.scheduler.session-grace": "200ms"})
async def test_owner_gone_past_the_grace_closes_the_session_and_fails_its_calls(
        c: Client, s: Scheduler, a: Worker) -> None:
    await da.install(c)
    HOLD.clear()
    owner = await Client(s.address, asynchronous=True)
    await da.install(owner)
    sess = da.session(owner)
    await sess.__aenter__()  # the owner's driver is inside its block (it never leaves it)
    assert await da.stub(Counter).add(1) == [1]
    sess._leave()
    async with rejoin(c, sess.id):  # another client's calls wait in the session
        running = da.stub(held)(1)
        waiting = da.stub(after)(running)
    await async_wait_for(lambda: call_states(s, sess.id).get(running.key) == "processing")
    await owner.close()
    rec = await async_wait_for(lambda: (r := plugin(s).state.sessions[sess.id]).state == "completed" and r)
    assert "disconnected" in rec.closed_reason and owner.id in rec.closed_reason
    for fut in (waiting, running):  # failed (not started) or cancelled (running): both say why
        with pytest.raises((da.SessionClosedError, CancelledError)) as ei:
            await fut
        assert sess.id in str(ei.value) and "did not reconnect" in str(ei.value)
    HOLD.set()


@gen_cluster(client=True, nthreads=[("127.0.0.1", 4)], timeout=60,
             config={**FAST, "agents.scheduler.session-idle-timeout": "200ms",
                     "agents.scheduler.session-retention": "0s", "agents.scheduler.instance-linger": "0s"})
async def test_idle_sessions_are_closed_and_forgotten(c: Client, s: Scheduler, a: Worker) -> None:
    await da.install(c)
    counter = da.stub(Counter)
    sessions = [da.session(c) for _ in range(30)]
    for sess in sessions:  # drivers that never leave their block
        sess.__enter__()
        await counter.add(1)
        sess._leave()
    p = plugin(s)
    await async_wait_for(lambda: not p.state.sessions and not p.state.calls, timeout=30)
    await async_wait_for(lambda: stateful_instances(a) == 0)


# -- instances are never silently fresh ------------------------------------------------------
@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)], timeout=60,
             config={**FAST, "agents.scheduler.instance-linger": "30s"})
async def test_a_late_call_reopens_the_session_and_keeps_its_instance(c: Client, s: Scheduler, a: Worker) -> None:
    await da.install(c)
    async with da.session(c) as sess:
        assert await da.stub(Counter).add(1) == [1]
    await async_wait_for(lambda: plugin(s).state.sessions[sess.id].state == "completed")
    async with rejoin(c, sess.id):
        assert await da.stub(Counter).add(2) == [1, 2]


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)], timeout=60,
             config={**FAST, "agents.scheduler.instance-linger": "0s"})
async def test_a_call_after_the_instance_was_released_fails(c: Client, s: Scheduler, a: Worker) -> None:
    await da.install(c)
    async with da.session(c) as sess:
        assert await da.stub(Counter).add(1) == [1]
    await async_wait_for(lambda: stateful_instances(a) == 0)
    async with rejoin(c, sess.id):
        late = da.stub(Counter).add(2)
        with pytest.raises(da.InstanceLostError) as ei:
            await late
    assert sess.id in str(ei.value) and "Counter.add" in str(ei.value) and "released" in str(ei.value)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2), ("127.0.0.1", 2)], timeout=60,
             config={**FAST, "agents.scheduler.drain-timeout": "200ms"})
async def test_retired_worker_loses_its_instances_for_good(c: Client, s: Scheduler, a: Worker, b: Worker) -> None:
    """A retirement that outlasts its drain (tests/test_scale_down.py: one that does not)."""
    await da.install(c)
    counter = da.stub(Counter)
    async with da.session(c) as sess:
        assert await counter.add(1) == [1]
        host = plugin(s).bindings[(sess.id, "Counter")]
        await c.retire_workers([host])
        for i in (2, 3):  # every later call of the instance fails: none runs on a fresh one
            with pytest.raises(da.InstanceLostError) as ei:
                await counter.add(i)
            msg = str(ei.value)
            assert sess.id in msg and "Counter.add" in msg and host in msg
            assert ei.value.worker == host and ei.value.session == sess.id
        other = [w for w in (a, b) if w.address != host][0]
        assert stateful_instances(other) == 0


def test_worker_refuses_a_call_of_an_ended_session():
    from dask_agents.worker_plugin.instances import Instances

    inst = Instances()
    with inst.turn("C", "s", "k1", list) as first:
        first.append(1)
    inst.end_session("s")
    inst.ticket("C", "s", "k2")
    with pytest.raises(da.InstanceLostError, match="released"):
        with inst.turn("C", "s", "k2", list, method="add"):
            pass
    assert inst.stateful_count() == 0


# -- a failed request stops its work --------------------------------------------------------
@gen_cluster(client=True, nthreads=[("127.0.0.1", 8)], timeout=60, config=FAST)
async def test_leaving_the_block_with_an_error_gives_up_the_sessions_calls(c: Client, s: Scheduler, a: Worker) -> None:
    await da.install(c)
    HOLD.clear()
    with pytest.raises(ValueError):
        async with da.session(c) as sess:
            running = [da.stub(held)(i) for i in range(3)]
            waiting = da.stub(after)(running[0])
            await async_wait_for(lambda: sum(v == "processing" for v in call_states(s, sess.id).values()) == 3)
            raise ValueError("the driver saw an error")
    # the session ends while the held calls' threads still block: nothing waits on them
    rec = await async_wait_for(lambda: (r := plugin(s).state.sessions[sess.id]).state == "completed" and r)
    assert not HOLD.is_set() and "exception" in rec.closed_reason
    states = call_states(s, sess.id)
    assert states[waiting.key] in ("erred", "cancelled") and all(states[f.key] == "cancelled" for f in running)
    HOLD.set()


@gen_cluster(client=True, nthreads=[("127.0.0.1", 8)], timeout=60, config=FAST)
async def test_nested_calls_of_a_failed_call_are_cancelled(c: Client, s: Scheduler, a: Worker) -> None:
    await da.install(c)
    HOLD.clear()
    async with da.session(c) as sess:
        with pytest.raises(da.CallFailedError, match="gave up"):
            await da.stub(Spawner).run(3)
        nested = lambda: [r for r in plugin(s).state.sessions[sess.id].calls.values() if r.component == "held"]  # noqa: E731
        await async_wait_for(lambda: len(nested()) == 3 and all(r.state == "cancelled" for r in nested()))
    assert not HOLD.is_set()  # cancelled while still running: they did not run to their end
    HOLD.set()


# -- plain Dask work is left alone ------------------------------------------------------------
@da.tool(kind="code_exec")
def array_sum(n: int) -> float:
    """A tool that computes a Dask collection itself (nested plain work)."""
    import dask.array as darr

    return float(darr.ones(n, chunks=10).sum().compute())


def _order(s: Scheduler, keys) -> list:
    return sorted(keys, key=lambda k: s.tasks[k].priority[2:])


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)], timeout=60, config=FAST)
async def test_plain_collections_keep_dask_priorities_and_are_not_calls(c: Client, s: Scheduler, a: Worker) -> None:
    import dask.array as darr

    await da.install(c)
    x = (darr.arange(1500, chunks=10) * 2).sum()  # ~ 300 tasks
    ref = c.persist(x)
    await ref
    ref_keys = [k for k in s.tasks if k in dict(x.__dask_graph__())]
    expected = _order(s, ref_keys)
    del ref
    await async_wait_for(lambda: not any(k in s.tasks for k in ref_keys))
    async with da.session(c):
        got = c.persist(x)
        await got
        keys = [k for k in s.tasks if k in dict(x.__dask_graph__())]
        assert _order(s, keys) == expected  # Dask's own (memory-aware) order, untouched
        assert await da.stub(array_sum)(100) == 100.0  # a tool computing a collection still works
    p = plugin(s)
    assert not any(k in p.state.calls for k in keys)
    assert [r.component for r in p.state.calls.values()] == ["array_sum"]
    del got


def _slow(i: int) -> int:
    import time

    time.sleep(0.05)  # work that takes time (not a wait in the test)
    return i


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1), ("127.0.0.1", 1)], timeout=60,
             config={**FAST, "agents.control.enabled": False})
async def test_dask_stealing_balances_plain_tasks_but_never_moves_calls(
        c: Client, s: Scheduler, a: Worker, b: Worker) -> None:
    import dask

    await da.install(c)
    futs = c.map(_slow, range(40), workers=[a.address], allow_other_workers=True, pure=False)
    await c.gather(futs)
    where = await c.who_has(futs)
    assert any(b.address in ws for ws in where.values())  # Dask's stealing still balances plain work
    async with da.session(c):
        with dask.annotate(workers=[a.address], allow_other_workers=True):
            calls = [da.stub(slow_tool)(i) for i in range(40)]
        await c.gather(calls)
    where = await c.who_has(calls)
    assert all(ws == (a.address,) for ws in where.values())  # agent calls: only the control plane moves them


@da.tool(kind="code_exec")
def slow_tool(i: int) -> int:
    return _slow(i)
