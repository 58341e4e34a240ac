"""The control loop on real (small, in-process) clusters."""

from __future__ import annotations

import threading
from collections import Counter

from distributed import Client, Scheduler, Worker
from distributed.utils_test import gen_cluster

import dask_agents as da
from scheduler_plugin.plugin import NAME
from tests.conftest import async_wait_for

RUNS: Counter = Counter()
GATE = threading.Event()
ORDER: list[str] = []


def work(i: int) -> int:
    RUNS[i] += 1
    GATE.wait(30)
    return i


MANUAL = {"agents.control.enabled": False}  # the tests drive the loop with run_once


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1), ("127.0.0.1", 1)], timeout=60, config=MANUAL)
async def test_queued_call_migrates_off_an_overloaded_worker_and_runs_once(c: Client, s: Scheduler, a: Worker, b: Worker):
    await da.install(c)
    RUNS.clear()
    GATE.clear()
    assert "stealing" not in s.periodic_callbacks  # Dask's own balancing is replaced by ours
    async with da.session(c):
        # a placement preference (loose restriction) piles the calls onto worker a
        futs = [c.submit(work, i, workers=[a.address], allow_other_workers=True, pure=False) for i in range(6)]
        await async_wait_for(lambda: sum(1 for f in futs if f.key in a.state.tasks) == 6)
        ctl = da.control(c)
        moved = 0
        for _ in range(20):  # a few passes: the first may race with the worker starting one
            out = await ctl.run_once()
            moved = out["applied"].get("migrate", 0)
            if moved:
                break
        assert moved >= 2
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
    await async_wait_for(lambda: s.plugins[NAME].control.ticks >= 3)
    stats = await ctl.stats()
    assert stats["running"] and stats["policy_errors"] >= 3 and stats["tick_seconds_max"] < 1.0
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
    on_a = {"workers": [a.address], "allow_other_workers": True, "pure": False}
    x, y = da.session(c, name="x"), da.session(c, name="y")
    async with da.session(c, name="blocker"):
        blocker = c.submit(tag, "blocker", **on_a)
    await async_wait_for(lambda: a.state.executing_count == 1)
    async with x:
        cx = c.submit(tag, "x", **on_a)
    async with y:
        cy = c.submit(tag, "y", **on_a)  # queued behind x: same progress, later arrival
        await async_wait_for(lambda: len(a.state.ready) == 2)
        for i in range(3):  # y makes progress elsewhere while both wait on a
            assert await c.submit(tag, f"y-step{i}", workers=[b.address], pure=False) == f"y-step{i}"
    await async_wait_for(lambda: s.plugins[NAME].state.sessions[y.id].progress == 3)
    out = await da.control(c).run_once()
    assert out["applied"].get("set_priority", 0) >= 1
    await async_wait_for(lambda: a.state.tasks[cy.key].priority < a.state.tasks[cx.key].priority)
    GATE.set()
    await c.gather([blocker, cx, cy])
    assert [t for t in ORDER if t in ("blocker", "x", "y")] == ["blocker", "y", "x"]
    df = await da.telemetry(c)
    assert int(df.loc[df["key"] == cy.key, "priority_changes"].iloc[0]) >= 1
