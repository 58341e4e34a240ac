"""Dynamic reallocation on a real (in-process) cluster with emulated engines: under the
Router's skew, an engine worker moves to the bottleneck model within K intervals, and back
when the skew reverses; no call is lost or stuck."""

from __future__ import annotations

import asyncio
import time

from distributed import Client, Scheduler, Worker
from distributed.utils_test import gen_cluster

import dask_agents as da
from dask_agents.scheduler_plugin.plugin import NAME
from tests.conftest import async_wait_for

EMU = {"engine": "emulated", "tokenizer": "byte",
       # ~0.2 s per 10-token call, 2 at a time: 10 calls/s per replica
       "emulation": {"max_batch": 2, "decode_s_per_step": 0.02, "prefill_s_per_token": 0.0, "time_scale": 1.0}}
CONFIG = {
    "agents.llm.models": {"chat": {"model": "emulated-chat", **EMU}, "coder": {"model": "emulated-coder", **EMU}},
    "agents.control.interval": "50ms",
    "agents.control.policies.reallocate.options.persistence": 4,
}


async def drive(c: Client, heavy: str, light: str, until, rate: float = 25.0, budget: float = 30.0) -> list:
    """Arrivals: ``rate`` calls/s to ``heavy`` and a tenth of that to ``light`` until ``until()``."""
    futs, t0, i = [], time.monotonic(), 0
    while not until() and time.monotonic() - t0 < budget:
        model = light if i % 10 == 9 else heavy
        async with da.session(c, name=f"req{i}"):
            futs.append(da.llm(model).generate(f"request {i} to {model}", max_tokens=10))
        i += 1
        await asyncio.sleep(1 / rate)  # inter-arrival time of the workload, not a wait for state
    return futs


@gen_cluster(client=True, nthreads=[("127.0.0.1", 4)] * 3, timeout=120, config=CONFIG)
async def test_capacity_follows_the_skew_and_back(c: Client, s: Scheduler, a: Worker, b: Worker, w: Worker):
    await da.install(c, models={"0": ["chat"], "1": ["chat"], "2": ["coder"]})
    plugin = s.plugins[NAME]
    await async_wait_for(lambda: len(plugin.model_workers["chat"]) == 2 and len(plugin.model_workers["coder"]) == 1)

    # phase 1: coding dominates -> a chat worker becomes a coder worker
    futs = await drive(c, "coder", "chat", until=lambda: len(plugin.model_workers["coder"]) == 2)
    assert len(plugin.model_workers["coder"]) == 2 and len(plugin.model_workers["chat"]) == 1
    results = await c.gather(futs)
    assert all(r.output_tokens == 10 for r in results)  # nothing lost, nothing stuck

    # phase 2: the skew reverses -> capacity moves back
    futs = await drive(c, "chat", "coder", until=lambda: len(plugin.model_workers["chat"]) == 2)
    assert len(plugin.model_workers["chat"]) == 2 and len(plugin.model_workers["coder"]) == 1
    results += await c.gather(futs)
    assert all(r.output_tokens == 10 for r in results)

    events = [e for _, e in await c.get_events("agents-control")]
    done = [e for e in events if e.get("action") == "reassign-done"]
    assert [(e["source"], e["target"]) for e in done] == [("chat", "coder"), ("coder", "chat")]
    assert not [e for e in events if e.get("action") == "reassign-failed"]
    stats = await da.control(c).stats()
    assert stats["drains"]["completed"] == 2 and stats["tick_seconds_p99"] < 0.5


def _models(model, dask_scheduler=None):  # run_on_scheduler passes the scheduler by keyword
    return sorted(dask_scheduler.plugins[NAME].model_workers.get(model, ()))


def _kill(address, dask_scheduler=None):
    from dask_agents.scheduler_plugin.actions import Kill

    return dask_scheduler.plugins[NAME].control.enforcer.apply([Kill(address)], "test")


def test_provision_and_kill_go_through_the_cluster_manager():
    import dask
    from distributed import Client, LocalCluster

    from tests.conftest import wait_for

    config = {**CONFIG, "agents.control.policies.reallocate.options.provision": True,
              "agents.control.policies.reallocate.options.provision-cooldown": "60s"}
    with dask.config.set(config), \
            LocalCluster(n_workers=2, threads_per_worker=4, processes=False, dashboard_address=":0") as cluster, \
            Client(cluster) as c:
        da.install(c, models={0: ["chat"], 1: ["coder"]})  # no donor: chat keeps its only replica
        link = da.attach_cluster(c, cluster, interval="100ms")
        wait_for(lambda: c.run_on_scheduler(_models, "coder") and c.run_on_scheduler(_models, "chat"))
        futs, t0, i = [], time.monotonic(), 0
        while len(c.run_on_scheduler(_models, "coder")) < 2 and time.monotonic() - t0 < 30:
            with da.session(c):
                futs.append(da.llm("coder").generate(f"request {i}", max_tokens=10))
            i += 1
            time.sleep(0.04)  # inter-arrival time of the workload
        coders = c.run_on_scheduler(_models, "coder")
        assert len(coders) == 2 and len(cluster.workers) == 3 and link.added == 1
        assert all(r.output_tokens == 10 for r in c.gather(futs))
        # kill the provisioned worker: through the cluster manager, which then forgets it
        new = [w for w in coders if c.scheduler_info()["workers"][w]["name"] == 2]
        assert new and c.run_on_scheduler(_kill, new[0]) == 1
        wait_for(lambda: len(c.scheduler_info()["workers"]) == 2 and len(cluster.worker_spec) == 2
                 and link.removed == [2])
        link.stop()



@da.tool
def busy_agent(i: int) -> int:
    import threading

    threading.Event().wait(0.5)  # keeps its worker's Dask queue busy while LLM calls are placed
    return i


@gen_cluster(client=True, nthreads=[("127.0.0.1", 8)] * 2, timeout=60,
             config={**CONFIG, "agents.control.enabled": False})
async def test_engine_choice_follows_engine_load_not_agent_load(c: Client, s: Scheduler, a: Worker, b: Worker):
    await da.install(c, models=["coder"])
    plugin = s.plugins[NAME]
    await async_wait_for(lambda: len(plugin.model_workers["coder"]) == 2)
    async with da.session(c):
        agents = [c.submit(busy_agent, i, workers=[a.address], pure=False) for i in range(6)]
    await async_wait_for(lambda: len(s.workers[a.address].processing) == 6)
    futs = []
    for i in range(4):  # new sessions while worker a is busy with agent work, not LLM work
        async with da.session(c, name=f"s{i}"):
            futs.append(da.llm("coder").generate(f"session {i}", max_tokens=10))
    results = await c.gather(futs)
    workers = [r.worker for r in results]
    assert workers.count(a.address) == 2 and workers.count(b.address) == 2
    await c.gather(agents)
