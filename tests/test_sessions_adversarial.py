"""Adversarial tests of session ownership, grace, idle timeout, linger and cancel cascades
(commit 7b375c0). A test that fails names a bug; see each docstring for the root cause."""

from __future__ import annotations

import threading

import pytest
from distributed import Client, Scheduler, Worker, fire_and_forget
from distributed.utils_test import gen_cluster

import dask_agents as da
from dask_agents.scheduler_plugin.plugin import NAME
from tests.conftest import async_wait_for
from tests.test_sessions import Counter

GATE = threading.Event()  # held calls wait on it (in-process workers)
STARTED = threading.Event()  # set by adv_started_gated when it runs
FAST = {"agents.scheduler.housekeeping-interval": "50ms"}


@da.agent(stateful=True)
class AdvOther(Counter):
    """A second stateful component (the same state: the calls it has seen)."""


@da.tool(kind="code_exec")
def adv_gated(i: int) -> int:
    GATE.wait(60)
    return i


@da.tool(kind="code_exec")
def adv_started_gated(i: int) -> int:
    STARTED.set()
    GATE.wait(60)
    return i


@da.tool(kind="code_exec")
def adv_plus(x: int) -> int:
    return x + 1


@da.agent
class AdvLauncher:
    def run(self) -> None:
        """Fire-and-forget a nested call (it must run to its end), then fail."""
        fut = da.stub(adv_started_gated)(7)
        fire_and_forget(fut)
        STARTED.wait(30)  # the child runs: the scheduler knows it
        raise ValueError("the launcher failed after handing its work off")



@da.agent
class AdvNestedDriver:
    def run(self) -> list:
        """A component that opens its own session on the worker's client."""
        from distributed import get_client

        with da.session(get_client(), name="nested") as inner:
            c = da.stub(Counter)
            out = [c.add(1).result(), c.add(2).result()]
        return [inner.id, out]


def plugin(s: Scheduler):
    return s.plugins[NAME]


def rejoin(client: Client, sid: str) -> da.Session:
    other = da.session(client)
    other.id = sid
    return other


def rec_of(s: Scheduler, key: str):
    return plugin(s).state.calls.get(key)


# -- instances never silently fresh ------------------------------------------------------------
@gen_cluster(client=True, nthreads=[("127.0.0.1", 2), ("127.0.0.1", 2)], timeout=60,
             config={**FAST, "agents.scheduler.instance-linger": "0s", "agents.scheduler.session-retention": "0s"})
async def test_late_stateful_call_after_the_session_record_expired_never_runs_fresh(
        c: Client, s: Scheduler, a: Worker, b: Worker) -> None:
    """Bug: once ``state.expire`` dropped the session record (retention, or max-retained-sessions
    with many sessions), ``s.lost`` is gone with it; a late call recreates the record, finds no
    binding and no lost entry and ``_place`` binds it anew, to the least-assigned worker (not the
    one whose Instances._ended would refuse it): it runs on a fresh, empty instance."""
    await da.install(c)
    p = plugin(s)
    async with da.session(c) as sess:
        assert await da.stub(Counter).add(1) == [1]
        host = p.bindings[(sess.id, "Counter")]
    await async_wait_for(lambda: sess.id not in p.state.sessions)  # released, then expired
    async with rejoin(c, sess.id):
        late = da.stub(Counter).add(2)
        try:
            got = await late
        except da.InstanceLostError:
            return
    pytest.fail(f"a late call ran on a fresh instance ({got}, first instance on {host}, "
                f"late call on {rec_of(s, late.key).worker})")


@gen_cluster(client=True, nthreads=[], timeout=60, config=FAST)
async def test_stateful_calls_submitted_before_any_worker_share_one_instance(c: Client, s: Scheduler) -> None:
    """Bug: with no worker at submit time ``_place`` returns without pinning (no candidates); the
    first to start binds the session (``_bind_where_it_runs``) but the calls already submitted
    stay unpinned and Dask may run them on another worker: a second, fresh instance."""
    await da.install(c)
    counter = da.stub(Counter)
    async with da.session(c):
        futs = [counter.add(i) for i in range(6)]
        await async_wait_for(lambda: all(f.key in s.tasks for f in futs))
        async with Worker(s.address, nthreads=1), Worker(s.address, nthreads=1):
            results = await c.gather(futs)
    assert max(len(r) for r in results) == 6, results  # one instance saw every call


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], timeout=60,
             config={**FAST, "agents.scheduler.instance-linger": "0s"})
async def test_a_never_used_component_of_a_released_session_is_not_lost(c: Client, s: Scheduler, a: Worker) -> None:
    """Inconsistency: the scheduler marks lost only the components whose instance existed
    (``s.lost``), but the worker guard refuses every stateful call of an ended session
    (``Instances._ended`` is per session): a component that never had an instance fails with
    InstanceLostError on the worker that hosted another component, and runs on any other."""
    await da.install(c)
    async with da.session(c) as sess:
        assert await da.stub(Counter).add(1) == [1]
    await async_wait_for(lambda: a.plugins[NAME].instances.stateful_count() == 0)
    async with rejoin(c, sess.id):
        assert await da.stub(AdvOther).add(5) == [5]


# -- ownership -----------------------------------------------------------------------------------
@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)], timeout=60, config=FAST)
async def test_a_joining_client_that_calls_first_does_not_own_the_session(c: Client, s: Scheduler, a: Worker) -> None:
    """Bug (README: "a second driver joining the session by id never owns it"): ownership goes to
    whichever client's call arrives first (``_session_call``); opening ``da.session`` tells the
    scheduler nothing. Here the joining client owns it: the opener's end is ignored and the
    joiner's end closes the session under the opener."""
    await da.install(c)
    p = plugin(s)
    async with da.session(c) as sess:
        async with Client(s.address, asynchronous=True) as c2:
            async with rejoin(c2, sess.id):
                assert await da.stub(Counter).add(1) == [1]
        assert await da.stub(Counter).add(2) == [1, 2]
        assert p.state.sessions[sess.id].state == "active"
    assert p.state.sessions[sess.id].owner == c.id


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)], timeout=60,
             config={**FAST, "agents.scheduler.session-retention": "0s", "agents.scheduler.instance-linger": "0s"})
async def test_client_sessions_forgets_clients_that_left(c: Client, s: Scheduler, a: Worker) -> None:
    """Memory: a client that disconnects after its sessions completed keeps its (later empty)
    ``client_sessions`` entry forever: ``remove_client`` pops only clients with no sessions left,
    and ``housekeeping`` empties the sets on expiry without deleting the key. One entry per
    short-lived driver, forever."""
    await da.install(c)
    p = plugin(s)
    ids = []
    for _ in range(3):
        async with Client(s.address, asynchronous=True) as c2:
            async with da.session(c2) as sess:
                assert await da.stub(adv_plus)(1) == 2
            await async_wait_for(lambda: p.state.sessions.get(sess.id) is None
                                 or p.state.sessions[sess.id].state == "completed")
            ids.append(c2.id)
    await async_wait_for(lambda: not p.state.sessions)
    await async_wait_for(lambda: not any(i in s.clients for i in ids))
    assert not [i for i in ids if i in p.client_sessions], p.client_sessions


# -- grace, closing ------------------------------------------------------------------------------
@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)], timeout=60,
             config={**FAST, "agents.scheduler.session-grace": "100ms"})
async def test_a_session_its_driver_ended_is_not_aborted_when_the_driver_goes(
        c: Client, s: Scheduler, a: Worker) -> None:
    """Bug: ``remove_client`` orphans every non-completed session of the owner, also those in
    ``closing`` (the driver left its block normally; what runs is wanted by someone else, e.g.
    fire_and_forget). Past the grace they are aborted: fire-and-forget work, which Dask itself
    keeps running after its client leaves, is cancelled."""
    await da.install(c)
    p = plugin(s)
    owner, sess, key = await _fire_and_forget_in_a_session(s)
    await async_wait_for(lambda: p.state.sessions[sess.id].state == "closing")
    await owner.close()
    await async_wait_for(lambda: owner.id not in s.clients)
    await async_wait_for(lambda: not p.orphans)  # the grace passed (or it was never orphaned)
    GATE.set()
    rec = await async_wait_for(lambda: (r := rec_of(s, key)) is not None and r.state in ("finished", "erred",
                                                                                          "cancelled") and r)
    assert rec.state == "finished", (rec.state, p.state.sessions[sess.id].closed_reason)


async def _fire_and_forget_in_a_session(s: Scheduler) -> tuple[Client, da.Session, str]:
    """A second client (the owner) leaves a session normally with a held fire-and-forget call
    running in it; returns (owner, session, the call's key). GATE releases the call."""
    GATE.clear()
    owner = await Client(s.address, asynchronous=True)
    await da.install(owner)
    async with da.session(owner) as sess:
        job = da.stub(adv_gated)(1)
        fire_and_forget(job)
    key = job.key
    await async_wait_for(lambda: (r := rec_of(s, key)) is not None and r.state == "processing")
    return owner, sess, key


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)], timeout=60,
             config={**FAST, "agents.scheduler.session-grace": "1s"})
async def test_a_session_that_completed_during_the_grace_is_not_closed_again(
        c: Client, s: Scheduler, a: Worker) -> None:
    """Bug: an orphaned session that completes on its own within the grace stays in ``orphans``
    (``_maybe_complete``/``_on_session_completed`` do not pop it); at the deadline housekeeping
    ``_close``s the completed session: its ``closed_reason`` is overwritten with "disconnected ...
    did not reconnect" and ``_on_session_completed`` runs a second time (latency counted twice)."""
    await da.install(c)
    p = plugin(s)
    GATE.clear()
    before = p.aggregates.session_latency.count
    owner, sess, key = await _fire_and_forget_in_a_session(s)
    await owner.close()
    await async_wait_for(lambda: owner.id not in s.clients)
    GATE.set()
    await async_wait_for(lambda: p.state.sessions[sess.id].state == "completed")
    assert rec_of(s, key).state == "finished"
    await async_wait_for(lambda: not p.orphans)
    assert p.state.sessions[sess.id].closed_reason is None
    assert p.aggregates.session_latency.count - before == 1


@gen_cluster(client=True, nthreads=[("127.0.0.1", 4)], timeout=60, config=FAST)
async def test_an_aborted_session_completes_once(c: Client, s: Scheduler, a: Worker) -> None:
    """Bug: ``_close(abort=True)`` fails/cancels the open calls synchronously; the last one's
    transition completes the session and calls ``_on_session_completed``; then ``_close`` calls
    it again (plugin.py ``if s.state == "completed": self._on_session_completed``): the session
    latency histogram (and the KV-hint end) counts it twice."""
    await da.install(c)
    p = plugin(s)
    GATE.clear()
    before = p.aggregates.session_latency.count
    with pytest.raises(RuntimeError):
        async with da.session(c) as sess:
            first = da.stub(adv_gated)(1)
            da.stub(adv_plus)(first)
            await async_wait_for(lambda: (r := rec_of(s, first.key)) is not None and r.state == "processing")
            raise RuntimeError("give up")
    await async_wait_for(lambda: p.state.sessions[sess.id].state == "completed")
    GATE.set()
    assert p.aggregates.session_latency.count - before == 1


# -- cancel cascades ---------------------------------------------------------------------------
@gen_cluster(client=True, nthreads=[("127.0.0.1", 4)], timeout=60, config=FAST)
async def test_a_fire_and_forget_child_survives_its_failed_creator(c: Client, s: Scheduler, a: Worker) -> None:
    """Bug: ``_cancel_children`` assumes only the creator held a child's future, and
    ``dask_compat.cancel_tasks`` cancels with force=True for every client that wants it: a child
    handed off (fire_and_forget, a Queue/Variable, passed to the driver) is cancelled too."""
    await da.install(c)
    GATE.clear()
    STARTED.clear()
    async with da.session(c) as sess:
        with pytest.raises(da.CallFailedError, match="handing its work off"):
            await da.stub(AdvLauncher).run()
        child = lambda: [r for r in plugin(s).state.sessions[sess.id].calls.values()  # noqa: E731
                         if r.component == "adv_started_gated"]
        await async_wait_for(lambda: len(child()) == 1)
        GATE.set()
        await async_wait_for(lambda: child()[0].state in ("finished", "erred", "cancelled"))
        assert child()[0].state == "finished"


@gen_cluster(client=True, nthreads=[("127.0.0.1", 4)], timeout=60, config=FAST)
async def test_giving_up_a_session_keeps_calls_another_session_depends_on(c: Client, s: Scheduler, a: Worker) -> None:
    """Bug: ``_abort`` fails/cancels (force, every client) each open call of the given-up session,
    also those a call of another, live session depends on: that session's call fails."""
    await da.install(c)
    GATE.clear()
    with pytest.raises(RuntimeError):
        async with da.session(c) as shared:
            x = da.stub(adv_gated)(1)
            async with da.session(c):
                y = da.stub(adv_plus)(x)
            raise RuntimeError("the first request failed; the second still needs x")
    # given up (the end travels on the client's stream), but x is still needed: it runs on
    await async_wait_for(lambda: (r := plugin(s).state.sessions.get(shared.id)) is not None and r.state == "closing")
    assert call_state(s, x.key) == "processing"
    GATE.set()
    assert await y == 2
    await async_wait_for(lambda: plugin(s).state.sessions[shared.id].state == "completed")


def call_state(s: Scheduler, key: str) -> str | None:
    rec = plugin(s).state.calls.get(key)
    return rec.state if rec is not None else None


# -- regression guards (pass today) --------------------------------------------------------------
@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)], timeout=60,
             config={**FAST, "agents.scheduler.session-grace": "100ms"})
async def test_reconnect_within_the_grace_clears_the_orphan(c: Client, s: Scheduler, a: Worker) -> None:
    await da.install(c)
    p = plugin(s)
    async with da.session(c) as sess:
        assert await da.stub(Counter).add(1) == [1]
        await c.scheduler_comm.comm.close()
        await async_wait_for(lambda: c.status == "running" and c.id in s.clients and c.scheduler_comm is not None
                             and not c.scheduler_comm.closed())
        assert sess.id not in p.orphans
        assert await da.stub(Counter).add(2) == [1, 2]
    assert p.state.sessions[sess.id].closed_reason is None


@gen_cluster(client=True, nthreads=[("127.0.0.1", 4)], timeout=60, config=FAST)
async def test_a_session_opened_inside_a_component_completes(c: Client, s: Scheduler, a: Worker) -> None:
    await da.install(c)
    p = plugin(s)
    async with da.session(c):
        inner_id, out = await da.stub(AdvNestedDriver).run()
    assert out == [[1], [1, 2]]
    await async_wait_for(lambda: p.state.sessions[inner_id].state == "completed")


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)], timeout=60, config=FAST)
async def test_a_non_owner_leaving_with_an_error_gives_up_nothing(c: Client, s: Scheduler, a: Worker) -> None:
    await da.install(c)
    async with da.session(c) as sess:
        assert await da.stub(Counter).add(1) == [1]
        async with Client(s.address, asynchronous=True) as c2:
            with pytest.raises(RuntimeError):
                async with rejoin(c2, sess.id):
                    await da.stub(Counter).add(2)
                    raise RuntimeError("the second driver fails")
        assert plugin(s).state.sessions[sess.id].state == "active"
        assert await da.stub(Counter).add(3) == [1, 2, 3]
