"""The control loop on real (small, in-process) clusters."""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from typing import Any, Callable

import dask
from distributed import Client, Future, Scheduler, Worker
from distributed.utils_test import gen_cluster

import dask_agents as da
from dask_agents.scheduler_plugin.plugin import NAME
from tests.conftest import async_wait_for

RUNS: Counter = Counter()
GATE = threading.Event()
ORDER: list[str] = []


def work(i: int) -> int:
    RUNS[i] += 1
    GATE.wait(30)
    return i


# the tests drive the loop with run_once (a client may: client-actions)
MANUAL = {"agents.control.enabled": False, "agents.control.client-actions": True}


def submit_call(c: Client, fn: Callable, *args: Any, session: Any, component: str = "work", kind: str = "tool",
                llm_model: str | None = None, **kwargs: Any) -> Future:
    """Submit ``fn(*args)`` as a call of ``session`` (of ``component``, ``kind``; an LLM call names
    its ``llm_model``) with Dask's own placement options (``workers=``, ``resources=``...), which
    stubs do not take."""
    key = f"{component}-{uuid.uuid4().hex}"
    ann = {"call": key, "component": component, "kind": kind, "session": session.id, "llm_model": llm_model}
    with dask.annotate(agents=ann):
        return c.submit(fn, *args, key=key, **kwargs)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1), ("127.0.0.1", 1)], timeout=60, config=MANUAL)
async def test_queued_call_migrates_off_an_overloaded_worker_and_runs_once(c: Client, s: Scheduler, a: Worker, b: Worker):
    await da.install(c)
    RUNS.clear()
    GATE.clear()
    assert "stealing" in s.periodic_callbacks  # Dask balances plain tasks; our calls are kept out of it
    async with da.session(c) as sess:
        # a placement preference (loose restriction) piles the calls onto worker a
        futs = [submit_call(c, work, i, session=sess, workers=[a.address], allow_other_workers=True)
                for i in range(6)]
        await async_wait_for(lambda: sum(1 for f in futs if f.key in a.state.tasks) == 6)
        ctl = da.control(c)

        async def answered() -> dict | None:  # Dask confirmed or refused every move requested so far
            st = await ctl.stats()
            return st if st["moves_pending"] == 0 else None

        for _ in range(20):  # a few passes: the first may race with the worker starting one
            await ctl.run_once()
            out = await async_wait_for(answered)
            if out["applied"].get("migrate", 0) >= 2:
                break
        assert out["applied"]["migrate"] >= 2
        await async_wait_for(lambda: any(f.key in b.state.tasks for f in futs))
        GATE.set()
        assert sorted(await c.gather(futs)) == list(range(6))
    assert RUNS == {i: 1 for i in range(6)}  # each call ran exactly once
    df = await da.telemetry(c)
    on_b = df[(df["component"] == "work") & (df["migrations"] > 0)]
    assert len(on_b) >= 2 and set(on_b["worker"]) == {b.address}
    events = [e for _, e in await c.get_events("agents-control") if e.get("action") == "migrate"]
    assert {e["key"] for e in events} >= set(on_b["key"])


@da.tool
def step(tag: str) -> str:
    if tag == "blocker":
        GATE.wait(30)
    ORDER.append(tag)
    return tag


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], timeout=60,
             config={**MANUAL, "distributed.scheduler.worker-saturation": float("inf")})
async def test_retry_of_an_advanced_session_overtakes_new_work(c: Client, s: Scheduler, a: Worker):
    await da.install(c)
    ORDER.clear()
    GATE.set()
    advanced = da.session(c, name="advanced")
    async with advanced:
        for i in range(5):  # this session makes progress
            await da.stub(step)(f"done{i}")
        await async_wait_for(lambda: s.plugins[NAME].state.sessions[advanced.id].progress == 5)
        GATE.clear()
        ORDER.clear()
        async with da.session(c, name="blocker"):
            blocker = da.stub(step)("blocker")
        await async_wait_for(lambda: a.state.executing_count == 1)
        fresh = []
        for i in range(4):  # new requests arrive first...
            async with da.session(c, name=f"new{i}"):
                fresh.append(da.stub(step)(f"new{i}"))
        retry = da.stub(step)("retry")  # ...then the advanced session retries
        await async_wait_for(lambda: len(a.state.ready) == 5)
        GATE.set()
        await c.gather([blocker, retry, *fresh])
    assert ORDER[:2] == ["blocker", "retry"]
    assert ORDER[2:] == [f"new{i}" for i in range(4)]  # FIFO among equals


class Broken:
    """A policy that always raises."""

    def __call__(self, view):
        raise RuntimeError("policy bug")


BROKEN = {**MANUAL, "agents.control.policies.broken": {"class": "tests.test_control.Broken"}}


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], timeout=60, config=BROKEN)
async def test_loop_keeps_serving_when_a_policy_raises(c: Client, s: Scheduler, a: Worker):
    await da.install(c)
    ctl = da.control(c)
    out = await ctl.run_once()
    assert out["policy_errors"] == 1 and "policy bug" in out["errors"]["broken"]
    assert set(out["pass"]["applied"]) == {"prioritize", "balance", "reallocate", "batching"}  # the others still ran
    await ctl.start()
    GATE.set()
    async with da.session(c):
        assert await da.stub(step)("after") == "after"  # the cluster keeps serving
    # it backs off (skipped for 1, then 2, 4... passes) and is retried
    await async_wait_for(lambda: s.plugins[NAME].control.policy_errors >= 3)
    stats = await ctl.stats()
    assert stats["running"] and stats["policy_errors"] >= 3 and stats["tick_seconds_max"] < 1.0
    # counted per policy, and so on /metrics
    from dask_agents.scheduler_plugin.metrics import _fault_families

    counts = s.plugins[NAME].control.policy_error_counts
    assert set(counts) == {"broken"} and sum(counts.values()) == s.plugins[NAME].control.policy_errors
    fam = next(f for f in _fault_families(s.plugins[NAME]) if f.name == "dask_agents_policy_errors")
    assert [(x.labels, x.value) for x in fam.samples if x.name.endswith("_total")] == [
        ({"policy": "broken"}, counts["broken"])]
    await ctl.stop()
    assert not (await ctl.stats())["running"]
    events = [e for _, e in await c.get_events("agents-control") if e.get("action") == "policy-error"]
    assert events and events[0]["policy"] == "broken"


def tag(t: str) -> str:
    if t == "blocker":
        GATE.wait(30)
    ORDER.append(t)
    return t


NO_BALANCE = {**MANUAL, "agents.control.policies.balance.enabled": False,
              "distributed.scheduler.worker-saturation": float("inf")}


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1), ("127.0.0.1", 1)], timeout=60, config=NO_BALANCE)
async def test_priorities_are_revised_while_calls_wait_on_a_worker(c: Client, s: Scheduler, a: Worker, b: Worker):
    await da.install(c)
    ORDER.clear()
    GATE.clear()
    on_a = {"workers": [a.address], "allow_other_workers": True}
    x, y = da.session(c, name="x"), da.session(c, name="y")
    async with da.session(c, name="blocker") as blocking:
        blocker = submit_call(c, tag, "blocker", session=blocking, **on_a)
    await async_wait_for(lambda: a.state.executing_count == 1)
    async with x:
        cx = submit_call(c, tag, "x", session=x, **on_a)
    async with y:
        cy = submit_call(c, tag, "y", session=y, **on_a)  # queued behind x: same progress, later arrival
        await async_wait_for(lambda: len(a.state.ready) == 2)
        for i in range(3):  # y makes progress elsewhere while both wait on a
            assert await submit_call(c, tag, f"y-step{i}", session=y, workers=[b.address]) == f"y-step{i}"
    await async_wait_for(lambda: s.plugins[NAME].state.sessions[y.id].progress == 3)
    out = await da.control(c).run_once()
    assert out["applied"].get("set_priority", 0) >= 1
    await async_wait_for(lambda: a.state.tasks[cy.key].priority < a.state.tasks[cx.key].priority)
    GATE.set()
    await c.gather([blocker, cx, cy])
    assert [t for t in ORDER if t in ("blocker", "x", "y")] == ["blocker", "y", "x"]
    df = await da.telemetry(c)
    assert int(df.loc[df["key"] == cy.key, "priority_changes"].iloc[0]) >= 1
