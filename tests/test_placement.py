"""Placement that follows the work (issue 14, first part): an agent call with the ``model=``
hint runs on the worker of the engine its session is bound to, so it and its LLM calls stay in
one process. Before, the hint was recorded and never read: about half of such calls ran on
another worker than their session's engine."""

from __future__ import annotations

from distributed import Client, Scheduler, Worker
from distributed.utils_test import gen_cluster

import dask_agents as da
from dask_agents.scheduler_plugin.plugin import NAME
from tests.conftest import async_wait_for

EMU = {"model": "emulated-llama", "engine": "emulated", "tokenizer": "byte", "emulation": {"time_scale": 0.001}}
CONFIG = {"agents.llm.models": {"emu": EMU}, "agents.control.enabled": False}


@da.agent(model="emu")
class Writer:
    def write(self, topic: str) -> str:
        from distributed import get_worker

        out = da.llm("emu").generate(f"write about {topic}", max_tokens=4).value(60)
        return f"{get_worker().address}|{out.worker}"


@gen_cluster(client=True, nthreads=[("127.0.0.1", 4), ("127.0.0.1", 4)], timeout=60, config=CONFIG)
async def test_an_agent_with_the_model_hint_runs_beside_its_sessions_engine(c: Client, s: Scheduler, a: Worker,
                                                                               b: Worker) -> None:
    await da.install(c, models=["emu"])
    plugin = s.plugins[NAME]
    await async_wait_for(lambda: len(plugin.model_workers.get("emu", ())) == 2)
    writer = da.stub(Writer)
    pairs = []
    for i in range(6):
        async with da.session(c) as sess:
            await da.llm("emu").generate("hello", max_tokens=2)  # binds the session to an engine
            engine = plugin.bindings[(sess.id, "llm:emu")]
            for j in range(3):
                here, llm_worker = (await writer.write(f"{i}-{j}")).split("|")
                pairs.append((engine, here, llm_worker))
    assert {e for e, _, _ in pairs} == {a.address, b.address}  # sessions on both engines
    assert all(here == engine == llm for engine, here, llm in pairs), pairs  # no hop between processes


@gen_cluster(client=True, nthreads=[("127.0.0.1", 4), ("127.0.0.1", 4)], timeout=60, config=CONFIG)
async def test_a_sessions_first_agent_call_runs_beside_the_engine_it_is_bound_to(c: Client, s: Scheduler, a: Worker,
                                                                                 b: Worker) -> None:
    """Placement from the start (issue 28): the agent call that opens a session, before any LLM
    call of it, binds the session to an engine and runs beside it. Before, it was placed first
    and its session bound later by its first LLM call: when its worker already had more live
    sessions than the other, that call went to the other engine (a hop for every LLM call)."""
    import contextlib

    await da.install(c, models=["emu"])
    plugin = s.plugins[NAME]
    await async_wait_for(lambda: len(plugin.model_workers.get("emu", ())) == 2)
    writer = da.stub(Writer)
    pairs = []
    async with contextlib.AsyncExitStack() as stack:  # the sessions stay open: each one an engine's load
        for i in range(6):
            sess = await stack.enter_async_context(da.session(c))
            here, llm_worker = (await writer.write(f"first {i}")).split("|")  # the session's first call
            pairs.append((plugin.bindings[(sess.id, "llm:emu")], here, llm_worker))
        assert plugin.admission.counts["bound_early"] == 6
    assert all(here == engine == llm for engine, here, llm in pairs), pairs
    assert sorted(e for e, _, _ in pairs).count(a.address) == 3  # the open sessions spread over both engines
