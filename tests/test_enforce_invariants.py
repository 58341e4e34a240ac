"""The enforcement layer keeps its invariants whatever a policy suggests (scheduler_plugin/enforce.py).

A custom policy (``Suggest``) proposes exactly the actions a test puts in ``PLAN``; the layer
must refuse the moves that break an invariant (stateful calls, targets not hosting the model,
lacking the call's resources, not running) and count a move as applied only once Dask
confirmed it. Small in-process clusters; the tests poll for state, they never sleep.
"""

from __future__ import annotations

import threading
from typing import Any

from distributed import Client, Scheduler, Worker
from distributed.core import Status
from distributed.utils_test import gen_cluster

import dask_agents as da
from dask_agents.scheduler_plugin import enforce
from dask_agents.scheduler_plugin.actions import Action, Migrate
from dask_agents.scheduler_plugin.plugin import NAME
from tests.conftest import async_wait_for
from tests.test_control import submit_call

PLAN: list[Action] = []
GATE = threading.Event()


class Suggest:
    """A custom policy: returns what the test put in ``PLAN``, once."""

    def __call__(self, view: Any) -> list[Action]:
        out, PLAN[:] = list(PLAN), []
        return out


# only the custom policy: nothing else moves or re-prioritizes calls behind the test's back
CUSTOM = {"agents.control.enabled": False, "agents.control.client-actions": True,
          "agents.control.policies": {"suggest": {"class": "tests.test_enforce_invariants.Suggest"}}}


def hold(x: Any) -> Any:
    GATE.wait(30)
    return x


def done(x: Any) -> Any:
    return x


@da.agent(stateful=True)
class Tally:
    """Session state: how many calls this instance has seen."""

    def __init__(self) -> None:
        self.n = 0

    def add(self) -> int:
        self.n += 1
        return self.n


async def suggest(c: Client, *actions: Action) -> dict:
    """One pass of the control loop in which the custom policy suggests ``actions``."""
    PLAN[:] = actions
    return await da.control(c).run_once()


def queued_on(s: Scheduler, w: Worker, key: str) -> bool:
    """``key`` is assigned to ``w`` and waits there (not started)."""
    ts = s.tasks.get(key)
    return (ts is not None and ts.state == "processing" and ts.processing_on.address == w.address
            and key in w.state.tasks and w.state.tasks[key].state in ("ready", "constrained"))


def rejection(stats: dict, key: str) -> dict:
    return next(r for r in reversed(stats["rejections"]) if r.get("key") == key)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1), ("127.0.0.1", 1)], timeout=60, config=CUSTOM)
async def test_a_stateful_call_is_never_migrated(c: Client, s: Scheduler, a: Worker, b: Worker):
    GATE.clear()
    await da.install(c)
    plugin = s.plugins[NAME]
    tally = da.stub(Tally)
    async with da.session(c, name="tally") as sess:
        assert await tally.add() == 1
        home = plugin.bindings[(sess.id, "Tally")]
        src, other = (a, b) if home == a.address else (b, a)
        blocker = submit_call(c, hold, "x", session=sess, workers=[home])  # takes home's only thread
        second = tally.add()  # pinned to the instance's worker, queued behind the blocker
        await async_wait_for(lambda: queued_on(s, src, second.key))
        out = await suggest(c, Migrate(second.key, home, other.address, "custom policy"))
        assert out["pass"]["applied"] == {"suggest": 0}
        assert out["rejected"] == {"migrate": 1} and not out["requested"]
        assert rejection(out, second.key)["why"] == enforce.STATEFUL
        assert out["rejected_reasons"] == {f"migrate: {enforce.STATEFUL}": 1}
        GATE.set()
        assert await second == 2  # on its own instance: it did not run on a fresh one elsewhere
        assert await blocker == "x"
        assert plugin.bindings[(sess.id, "Tally")] == home  # the session's binding did not fork
    df = await da.telemetry(c, sess.id)
    row = df[df["key"] == second.key].iloc[0]
    assert row["worker"] == home and row["migrations"] == 0


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1), ("127.0.0.1", 1)], timeout=60, config=CUSTOM)
async def test_an_llm_call_moves_only_to_a_worker_hosting_its_model(c: Client, s: Scheduler, a: Worker, b: Worker):
    GATE.clear()
    await da.install(c)
    plugin = s.plugins[NAME]
    await async_wait_for(lambda: len(plugin.ready_workers) == 2)  # their hellos are in: nothing resets the hosts
    plugin.model_workers["m"] = {a.address}  # only a hosts model m
    async with da.session(c, name="llm") as sess:
        blocker = submit_call(c, hold, "x", session=sess, workers=[a.address])
        call = submit_call(c, done, "y", session=sess, component="llm.m", kind="llm", llm_model="m")
        await async_wait_for(lambda: queued_on(s, a, call.key))  # placed on the model's host
        out = await suggest(c, Migrate(call.key, a.address, b.address))
        assert out["rejected"] == {"migrate": 1} and not out["requested"]
        assert rejection(out, call.key)["why"] == "target does not host model m"
        GATE.set()
        assert await c.gather([blocker, call]) == ["x", "y"]
    df = await da.telemetry(c, sess.id)
    row = df[df["key"] == call.key].iloc[0]
    assert row["worker"] == a.address and row["migrations"] == 0


R = {"resources": {"R": 1}}


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1, R), ("127.0.0.1", 1), ("127.0.0.1", 1, R)], timeout=60,
             config=CUSTOM)
async def test_a_call_moves_only_to_a_worker_with_its_resources(c: Client, s: Scheduler, a: Worker, b: Worker,
                                                               w: Worker):
    GATE.clear()
    await da.install(c)
    async with da.session(c, name="res") as sess:
        blocker = submit_call(c, hold, "x", session=sess, workers=[a.address])
        call = submit_call(c, done, "y", session=sess, resources={"R": 1}, workers=[a.address],
                           allow_other_workers=True)
        await async_wait_for(lambda: queued_on(s, a, call.key))
        out = await suggest(c, Migrate(call.key, a.address, b.address))  # b has no R
        assert out["rejected"] == {"migrate": 1} and not out["requested"]
        assert rejection(out, call.key)["why"] == enforce.LACKS_RESOURCES
        out = await suggest(c, Migrate(call.key, a.address, w.address))  # w has R: it may go there
        assert out["requested"] == {"migrate": 1}
        await async_wait_for(lambda: s.plugins[NAME].control.enforcer.applied["migrate"] == 1)
        assert await call == "y"
        GATE.set()
        assert await blocker == "x"
    df = await da.telemetry(c, sess.id)
    row = df[df["key"] == call.key].iloc[0]
    assert row["worker"] == w.address and row["migrations"] == 1
    # the scheduler's books moved with the call: nothing left held on a, nothing negative on w
    assert s.workers[a.address].used_resources["R"] == 0 and s.workers[w.address].used_resources["R"] == 0


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1), ("127.0.0.1", 1)], timeout=60, config=CUSTOM)
async def test_a_worker_that_is_not_running_is_never_a_target(c: Client, s: Scheduler, a: Worker, b: Worker):
    GATE.clear()
    await da.install(c)
    async with da.session(c, name="status") as sess:
        blocker = submit_call(c, hold, "x", session=sess, workers=[a.address])
        call = submit_call(c, done, "y", session=sess, workers=[a.address], allow_other_workers=True)
        await async_wait_for(lambda: queued_on(s, a, call.key))
        for status in (Status.paused, Status.closing_gracefully):  # paused (memory), retiring
            b.status = status  # the worker tells the scheduler, as when it pauses or retires
            await async_wait_for(lambda: s.workers[b.address].status == status)
            out = await suggest(c, Migrate(call.key, a.address, b.address))
            assert not out["requested"] and rejection(out, call.key)["why"] == f"target is {status.name}"
        out = await suggest(c, Migrate(call.key, a.address, "tcp://127.0.0.1:1"))  # closed, or never was
        assert rejection(out, call.key)["why"] == "unknown target"
        assert out["rejected"] == {"migrate": 3} and not out["requested"]
        b.status = Status.running
        GATE.set()
        assert await c.gather([blocker, call]) == ["x", "y"]
    df = await da.telemetry(c, sess.id)
    assert df[df["key"] == call.key].iloc[0]["migrations"] == 0


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1), ("127.0.0.1", 1)], timeout=60, config=CUSTOM)
async def test_a_move_counts_as_applied_only_once_dask_confirms_it(c: Client, s: Scheduler, a: Worker, b: Worker):
    GATE.clear()
    await da.install(c)
    enforcer = s.plugins[NAME].control.enforcer
    async with da.session(c, name="confirm") as sess:
        blocker = submit_call(c, hold, "x", session=sess, workers=[a.address])
        call = submit_call(c, done, "y", session=sess, workers=[a.address], allow_other_workers=True)
        await async_wait_for(lambda: queued_on(s, a, call.key))
        # inline, so nothing else runs before the checks: the victim has not answered yet
        assert enforcer.apply([Migrate(call.key, a.address, b.address)], "custom") == 1
        assert enforcer.requested["migrate"] == 1 and enforcer.stats()["moves_pending"] == 1
        assert not enforcer.applied and s.plugins[NAME].state.calls[call.key].migrations == 0
        assert not [e for _, e in await c.get_events("agents-control") if e.get("action") == "migrate"]
        await async_wait_for(lambda: enforcer.applied["migrate"] == 1)  # the victim gave it up
        assert enforcer.stats()["moves_pending"] == 0 and not enforcer.refused
        assert await call == "y"
        GATE.set()
        assert await blocker == "x"
    df = await da.telemetry(c, sess.id)
    row = df[df["key"] == call.key].iloc[0]
    assert row["worker"] == b.address and row["migrations"] == 1
    events = [e for _, e in await c.get_events("agents-control") if e.get("action") == "migrate"]
    assert [e["key"] for e in events] == [call.key]


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1), ("127.0.0.1", 1)], timeout=60, config=CUSTOM)
async def test_a_move_the_victim_refuses_is_counted_as_refused_not_applied(c: Client, s: Scheduler, a: Worker,
                                                                           b: Worker):
    GATE.clear()
    await da.install(c)
    enforcer = s.plugins[NAME].control.enforcer
    # the scheduler learns what a worker executes from its heartbeats: without them it does not
    # know the call started, so only the victim can refuse the move (as within a heartbeat's lag)
    a.periodic_callbacks["heartbeat"].stop()
    try:
        async with da.session(c, name="refuse") as sess:
            running = submit_call(c, hold, "x", session=sess, workers=[a.address], allow_other_workers=True)
            await async_wait_for(lambda: a.state.tasks.get(running.key) is not None
                                 and a.state.tasks[running.key].state == "executing")
            assert not s.workers[a.address].executing
            out = await suggest(c, Migrate(running.key, a.address, b.address))
            assert out["requested"] == {"migrate": 1} and not out["applied"]
            await async_wait_for(lambda: enforcer.refused["migrate"] == 1)  # the victim had started it
            stats = await da.control(c).stats()
            assert not stats["applied"] and stats["moves_pending"] == 0
            assert rejection(stats, running.key)["outcome"] == "refused"
            assert s.tasks[running.key].worker_restrictions == {a.address}  # still pinned where it runs
            # once the scheduler knows it started, the move is not even requested
            await a.heartbeat()
            assert s.workers[a.address].executing
            out = await suggest(c, Migrate(running.key, a.address, b.address))
            assert out["requested"] == {"migrate": 1} and rejection(out, running.key)["why"] == enforce.STARTED
            GATE.set()
            assert await running == "x"
    finally:
        a.periodic_callbacks["heartbeat"].start()
    df = await da.telemetry(c, sess.id)
    row = df[df["key"] == running.key].iloc[0]
    assert row["worker"] == a.address and row["migrations"] == 0
    assert not [e for _, e in await c.get_events("agents-control") if e.get("action") == "migrate"]
