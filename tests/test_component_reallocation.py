"""Reallocation of bounded CPU components (Nalar Alg. 2 beyond engines): a component whose hints
bound its replicas (``max_replicas``) is routed to ``min_replicas`` workers, gains workers when it
is the bottleneck and gives them back when another one is, always within its bounds.

The policy alone on hand-made views (routes applied as the enforcer would), then the whole path
on a real in-process cluster: hints -> annotation -> scheduler -> policy -> enforcer -> where
the calls run."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from distributed import Client, Scheduler, Worker, get_worker
from distributed.utils_test import gen_cluster

import dask_agents as da
from dask_agents.annotation import sanitize_annotation
from dask_agents.errors import HintError
from dask_agents.scheduler_plugin.actions import Route
from dask_agents.scheduler_plugin.plugin import NAME
from dask_agents.scheduler_plugin.policies.reallocate import Reallocate
from dask_agents.scheduler_plugin.view import ClusterView, ComponentView, WorkerView
from tests.conftest import async_wait_for

WORKERS = ("A", "B", "C", "D")


class Sim:
    """Views one second apart: calls of each component arrive at ``rates[c]`` a second; each
    thread of its routed workers serves ``1 / duration[c]`` calls a second."""

    def __init__(self, bounds: dict[str, tuple[int, int]], duration: dict[str, float], engines=(), models=None):
        self.bounds, self.duration, self.models = bounds, duration, models or {}
        self.routes: dict[str, tuple[str, ...]] = {}
        self.counters = {c: [0.0, 0.0, 0.0] for c in bounds}  # created, completed, open
        self.t = 0.0
        self.engines = set(engines)

    def view(self, rates: dict[str, float]) -> ClusterView:
        comps = {}
        for c, (lo, hi) in self.bounds.items():
            created, done, open_ = self.counters[c]
            rate = rates.get(c, 0.0)
            capacity = len(self.routes.get(c, WORKERS)) / self.duration[c]
            served = min(open_ + rate, capacity)
            self.counters[c] = [created + rate, done + served, open_ + rate - served]
            comps[c] = ComponentView(c, self.duration[c] if done + served else None, int(created + rate), 1.0,
                                     int(round(open_ + rate - served)), int(done + served),
                                     self.routes.get(c, ()), lo, hi, self.models.get(c))
        workers = {w: WorkerView(w, 1, 0, 0, (), ("m",) if w in self.engines else ()) for w in WORKERS}
        self.t += 1
        return ClusterView.freeze(self.t, workers, {}, {}, comps)

    def run(self, pol: Reallocate, rates: dict[str, float], ticks: int) -> list[Route]:
        out = []
        for _ in range(ticks):
            for a in pol(self.view(rates)):
                assert isinstance(a, Route)
                lo, hi = self.bounds[a.component]
                assert min(max(lo, 1), len(WORKERS)) <= len(a.workers) <= hi and len(set(a.workers)) == len(a.workers)
                self.routes[a.component] = a.workers
                out.append(a)
        return out


def test_a_bounded_component_starts_on_its_minimum_then_grows_to_its_bottleneck_and_gives_back():
    sim = Sim({"slow": (1, 3), "fast": (1, 3)}, {"slow": 1.0, "fast": 1.0})
    pol = Reallocate(persistence=2, window="3s")
    sim.run(pol, {"slow": 0.1, "fast": 0.1}, 2)
    assert len(sim.routes["slow"]) == 1 and len(sim.routes["fast"]) == 1  # min_replicas each, apart
    assert set(sim.routes["slow"]).isdisjoint(sim.routes["fast"])

    sim.run(pol, {"slow": 5.0}, 8)  # slow is the bottleneck, overloaded: it takes the free workers
    assert len(sim.routes["slow"]) == 3 and len(sim.routes["fast"]) == 1
    assert set(sim.routes["slow"]).isdisjoint(sim.routes["fast"])

    sim.run(pol, {"fast": 5.0}, 30)  # once slow cleared its backlog, fast is: workers come back from slow, down to its minimum
    assert len(sim.routes["fast"]) == 3 and len(sim.routes["slow"]) == 1
    assert set(sim.routes["slow"]).isdisjoint(sim.routes["fast"])


def test_no_move_without_a_persistent_overloaded_bottleneck_or_past_the_bounds():
    sim = Sim({"slow": (1, 2), "fast": (2, 2)}, {"slow": 0.5, "fast": 0.5})
    pol = Reallocate(persistence=3, window="3s")
    sim.run(pol, {}, 1)
    setup = dict(sim.routes)
    assert len(setup["slow"]) == 1 and len(setup["fast"]) == 2
    assert sim.run(pol, {"slow": 1.0}, 10) == []  # within its capacity (2 calls/s): nothing to gain
    sim.run(pol, {"slow": 50.0}, 10)
    assert len(sim.routes["slow"]) == 2  # its max, from the one free worker
    assert sim.routes["fast"] == setup["fast"]  # at its min: never a donor
    sim.run(pol, {"slow": 50.0}, 10)
    assert len(sim.routes["slow"]) == 2


def test_one_at_its_max_does_not_keep_another_from_gaining():
    sim = Sim({"fixed": (1, 1), "grows": (1, 3)}, {"fixed": 1.0, "grows": 1.0})
    pol = Reallocate(persistence=2, window="3s")
    sim.run(pol, {"fixed": 20.0, "grows": 5.0}, 8)  # both overloaded; "fixed" the more, at its max
    assert len(sim.routes["fixed"]) == 1 and len(sim.routes["grows"]) == 3


def test_engine_workers_come_last_unless_the_component_calls_their_model():
    sim = Sim({"index": (2, 4)}, {"index": 1.0}, engines=("A", "B"))
    pol = Reallocate(persistence=1, window="3s")
    sim.run(pol, {"index": 0.1}, 2)
    assert sorted(sim.routes["index"]) == ["C", "D"]  # its min_replicas, on the workers without an engine
    sim.run(pol, {"index": 20.0}, 6)
    assert sorted(sim.routes["index"]) == ["A", "B", "C", "D"]  # overloaded: the engine workers too, last
    beside = Sim({"Coder": (1, 3)}, {"Coder": 1.0}, engines=("C",), models={"Coder": "m"})
    beside.run(Reallocate(persistence=1, window="3s"), {"Coder": 0.1}, 2)
    assert beside.routes["Coder"] == ("C",)  # an agent with model="m": beside its engine first


def test_unbounded_components_are_not_routed():
    free = ComponentView("Planner", 1.0, 10, 1.0, 5, 5)  # no max_replicas: runs anywhere, no route
    workers = {w: WorkerView(w, 1, 0, 0, ()) for w in WORKERS}
    assert list(Reallocate(persistence=1)(ClusterView.freeze(1.0, workers, {}, {}, {"Planner": free}))) == []


def test_replica_bounds_travel_in_the_annotation_and_are_checked():
    ann = sanitize_annotation({"component": "Runner", "min_replicas": 1, "max_replicas": 3})
    assert (ann["min_replicas"], ann["max_replicas"]) == (1, 3)
    for bad in ({"min_replicas": 4, "max_replicas": 3}, {"min_replicas": 1, "max_replicas": 0},
                {"min_replicas": True, "max_replicas": 3}, {"min_replicas": 1, "max_replicas": "3"},
                {"min_replicas": 1, "max_replicas": 2**40}):
        out = sanitize_annotation({"component": "Runner", **bad})
        assert (out["min_replicas"], out["max_replicas"]) == (None, None), bad
    assert "max_replicas" not in sanitize_annotation({"component": "Planner"})
    with pytest.raises(HintError, match="max_replicas"):
        da.tool(name="bad", max_replicas=1, min_replicas=2)(lambda: None)
    with pytest.raises(HintError, match="max_replicas"):  # past what the annotation carries: refused, not dropped
        da.tool(name="huge", max_replicas=2**16 + 1)(lambda: None)


def _hold(seconds: float) -> str:
    threading.Event().wait(seconds)  # the tool's own work: it holds one of the worker's threads
    return get_worker().address


@da.tool(min_replicas=1, max_replicas=3)
def slow_tool(i: int) -> str:
    return _hold(0.1)


@da.tool(min_replicas=1, max_replicas=3)
def fast_tool(i: int) -> str:
    return _hold(0.1)


@da.tool(min_replicas=2, max_replicas=2)
def pair_tool(i: int) -> str:
    return _hold(0.0)


async def drive(tool, until, rate: float = 30.0, budget: float = 60.0) -> list:
    """Calls of ``tool`` at ``rate`` a second until ``until()`` (or ``budget`` seconds)."""
    futs, t0, i = [], time.monotonic(), 0
    while not until() and time.monotonic() - t0 < budget:
        futs.append(da.stub(tool)(i))
        i += 1
        await asyncio.sleep(1 / rate)  # inter-arrival time of the workload, not a wait for state
    return futs


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 4, timeout=120,
             config={"agents.control.interval": "50ms",
                     "agents.control.policies.reallocate.options.persistence": 3,
                     "agents.control.policies.reallocate.options.window": "1s"})
async def test_a_cpu_component_gains_workers_as_the_bottleneck_and_gives_them_back(
        c: Client, s: Scheduler, *workers: Worker):
    await da.install(c)
    plugin = s.plugins[NAME]
    routes = plugin.control.enforcer.routes

    async with da.session(c, name="agent"):
        first = [da.stub(slow_tool)(0), da.stub(fast_tool)(0)]
        await async_wait_for(lambda: "slow_tool" in routes and "fast_tool" in routes)
        assert len(routes["slow_tool"]) == 1 and len(routes["fast_tool"]) == 1  # their min_replicas
        assert plugin.state.component_bounds == {"slow_tool": (1, 3), "fast_tool": (1, 3)}

        # a burst of slow_tool calls: it is the bottleneck and grows to its max_replicas
        futs = await drive(slow_tool, until=lambda: len(routes["slow_tool"]) == 3)
        assert len(routes["slow_tool"]) == 3 and len(routes["fast_tool"]) == 1
        route = set(routes["slow_tool"])
        after = set(await c.gather([da.stub(slow_tool)(i) for i in range(12)]))  # made once routed
        assert after <= route and len(after) >= 2  # only on its replicas, and on more than one
        await c.gather(futs)
        slow_before = len(routes["slow_tool"])

        # now fast_tool is: workers come back from slow_tool, which keeps its min_replicas
        futs = await drive(fast_tool, until=lambda: len(routes["fast_tool"]) >= 2)
        assert len(routes["fast_tool"]) >= 2 and 1 <= len(routes["slow_tool"]) < slow_before
        assert set(routes["fast_tool"]).isdisjoint(routes["slow_tool"])
        assert len(await c.gather(futs + first)) == len(futs) + 2  # nothing lost

    events = [e for _, e in await c.get_events("agents-control") if e.get("action") == "route"]
    assert {e["component"] for e in events} == {"slow_tool", "fast_tool"}
    assert all(1 <= len(e["workers"]) <= 3 for e in events)
    assert not [r for r in plugin.control.enforcer.rejections if r["action"] == "route"]


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, timeout=60,
             config={"agents.control.enabled": False})
async def test_the_enforcer_keeps_routes_within_the_bounds(c: Client, s: Scheduler, a: Worker, b: Worker):
    await da.install(c)
    plugin = s.plugins[NAME]
    async with da.session(c):
        await da.stub(slow_tool)(0)  # its bounds reach the scheduler with its first call
        await da.stub(pair_tool)(0)
    enforcer = plugin.control.enforcer
    w3 = "tcp://127.0.0.1:1"  # not a worker of this cluster
    refused = [Route("slow_tool", ()),  # "anywhere": past max_replicas=3 on any cluster
               Route("pair_tool", (a.address,)),  # below min_replicas=2 with two workers up
               Route("pair_tool", (a.address, a.address)),  # the same worker twice is one replica
               Route("slow_tool", (a.address, w3))]  # unknown worker
    assert enforcer.apply(refused, "test") == 0
    assert "slow_tool" not in enforcer.routes and "pair_tool" not in enforcer.routes
    assert enforcer.apply([Route("slow_tool", (b.address,)), Route("pair_tool", (a.address, b.address))], "test") == 2
    assert enforcer.routes["slow_tool"] == (b.address,)
    async with da.session(c):
        assert await da.stub(slow_tool)(1) == b.address


EMU = {"model": "emulated-llama", "engine": "emulated", "tokenizer": "byte", "emulation": {"time_scale": 0.001}}


@da.agent(model="emu", min_replicas=2, max_replicas=2)
class BoundedWriter:
    def write(self, topic: str) -> str:
        out = da.llm("emu").generate(f"write about {topic}", max_tokens=4).value(60)
        return f"{get_worker().address}|{out.worker}"


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)] * 3, timeout=90,
             config={"agents.llm.models": {"emu": EMU}, "agents.control.interval": "50ms"})
async def test_a_bounded_agent_with_the_model_hint_is_routed_beside_its_engines(c: Client, s: Scheduler,
                                                                               *workers: Worker):
    await da.install(c, models={"0": ["emu"], "1": ["emu"]})  # the third worker hosts no engine
    plugin = s.plugins[NAME]
    await async_wait_for(lambda: len(plugin.model_workers.get("emu", ())) == 2)
    engines = set(plugin.model_workers["emu"])
    routes = plugin.control.enforcer.routes
    writer = da.stub(BoundedWriter)
    async with da.session(c):
        await writer.write("first")  # its bounds reach the scheduler
    await async_wait_for(lambda: "BoundedWriter" in routes)
    assert set(routes["BoundedWriter"]) == engines  # its two replicas: its model's engine workers
    pairs = []
    for i in range(8):
        async with da.session(c) as sess:
            for j in range(2):
                here, llm = (await writer.write(f"{i}-{j}")).split("|")
                pairs.append((plugin.bindings[(sess.id, "llm:emu")], here, llm))
    assert {engine for engine, _, _ in pairs} == engines  # sessions on both engines
    assert all(here == engine == llm for engine, here, llm in pairs), pairs  # each call beside its engine
