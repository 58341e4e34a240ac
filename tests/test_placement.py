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


@da.agent()
class Classifier:
    """An agent without a ``model=`` hint that calls the ``coder`` model."""

    def route(self, text: str) -> str:
        from distributed import get_worker

        out = da.llm("coder").generate(f"route {text}", max_tokens=2).value(60)
        return f"{get_worker().address}|{out.worker}"


@da.agent()
class Chatter:
    """An agent without a ``model=`` hint that calls the ``chat`` model."""

    def answer(self, text: str) -> str:
        from distributed import get_worker

        out = da.llm("chat").generate(f"answer {text}", max_tokens=2).value(60)
        return f"{get_worker().address}|{out.worker}"


TWO_MODELS = {"agents.llm.models": {"coder": EMU, "chat": EMU}, "agents.control.enabled": False}


@gen_cluster(client=True, nthreads=[("127.0.0.1", 4), ("127.0.0.1", 4)], timeout=60, config=TWO_MODELS)
async def test_an_agent_without_the_hint_runs_beside_the_engine_of_the_model_it_calls(
        c: Client, s: Scheduler, a: Worker, b: Worker) -> None:
    """A router's agents on two models, one engine each (issue 26): an agent without a
    ``model=`` hint goes beside the engine of the model its component's LLM calls use, learnt
    from the call graph. Before, it went beside the one model its session was bound to: a
    session bound to ``coder`` by its classifier sent its chat agent to the coder's worker, and
    every chat LLM call crossed to the other process through the scheduler (measured on the
    yardstick's router: half of all LLM calls, 5 ms each way instead of 0.6)."""
    await da.install(c, models={a.name: ["chat"], b.name: ["coder"]})
    plugin = s.plugins[NAME]
    await async_wait_for(lambda: plugin.model_workers.get("chat") and plugin.model_workers.get("coder"))
    rows = []
    for i in range(6):
        async with da.session(c):
            rows.append(("classifier", *(await da.stub(Classifier).route(str(i))).split("|")))
            rows.append(("chatter", *(await da.stub(Chatter).answer(str(i))).split("|")))
    assert plugin.state.called_model("Classifier") == "coder"
    assert plugin.state.called_model("Chatter") == "chat"
    later = rows[2:]  # the first session's calls teach the plugin what each agent calls
    assert all(here == engine for _, here, engine in later), rows
    assert {engine for _, _, engine in later} == {a.address, b.address}


def test_the_model_a_component_calls_is_its_calls_majority() -> None:
    """``called_model``: the model more than half of a component's own LLM calls used; a
    component split evenly between two models has none (no engine to sit beside)."""
    from dask_agents.scheduler_plugin.state import WorkflowState

    st = WorkflowState()
    st.add_call("a-1", {"call": "a-1", "component": "A", "kind": "agent", "session": "s"}, (), 0.0)
    st.add_call("b-1", {"call": "b-1", "component": "B", "kind": "agent", "session": "s"}, (), 0.0)
    assert st.called_model("A") is None
    for i, (creator, model) in enumerate([("a-1", "m"), ("a-1", "m"), ("a-1", "n"), ("b-1", "m"), ("b-1", "n")]):
        st.add_call(f"l-{i}", {"call": f"l-{i}", "component": "llm", "kind": "llm", "session": "s",
                               "creator": creator, "llm_model": model}, (), 0.0)
    assert st.called_model("A") == "m"
    assert st.called_model("B") is None
