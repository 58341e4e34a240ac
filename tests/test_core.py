"""The programming model end to end on small in-process clusters (gen_cluster)."""

from __future__ import annotations

import logging
import threading

import pytest
from distributed import Client, Scheduler, Worker
from distributed.utils_test import gen_cluster

import dask_agents as da
from dask_agents.scheduler_plugin.plugin import NAME, AgentsSchedulerPlugin
from dask_agents.worker_plugin.plugin import AgentsWorkerPlugin
from tests.conftest import async_wait_for

# What the components really did, recorded where they ran (in-process workers).
LOG: list[dict] = []
LOG_LOCK = threading.Lock()


def record(**kw) -> None:
    with LOG_LOCK:
        LOG.append({"key": da.current_call(), "session": da.current_session(), **kw})


@da.tool(kind="file_io")
def doc_search(query: str) -> str:
    record(component="doc_search")
    return f"docs({query})"


@da.tool(kind="code_exec")
def code_exec(code: str) -> str:
    record(component="code_exec")
    return f"ran({code})"


@da.agent
class Planner:
    """Splits an issue into subtasks."""

    def plan(self, issue: str) -> list[str]:
        record(component="Planner")
        return [f"{issue}/{i}" for i in range(3)]


@da.agent
class Developer:
    """Implements a subtask with two nested tool calls."""

    def implement(self, subtasks: list[str], i: int, feedback: str | None = None) -> str:
        record(component="Developer")
        docs = da.stub(doc_search)(subtasks[i])
        out = da.stub(code_exec)(f"{subtasks[i]}+{docs.value(30)}")
        return f"patch[{out.value(30)}|{feedback}]"


@da.agent
class Checker:
    """Fails the first attempt of patch 0, passes everything else."""

    def test(self, patch: str) -> bool:
        record(component="Checker")
        return not (patch.startswith("patch[ran(bug/0") and "None" in patch)


async def install(c: Client) -> None:
    await da.install(c)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 4), ("127.0.0.1", 4)], timeout=60)
async def test_session_graph_equals_calls_made(c: Client, s: Scheduler, a: Worker, b: Worker) -> None:
    await install(c)
    LOG.clear()
    planner, dev, tester = da.stub(Planner), da.stub(Developer), da.stub(Checker)
    driver_calls: dict[str, da.AgentFuture] = {}
    async with da.session(c, name="swe") as sess:
        subtasks = planner.plan("bug")
        driver_calls[subtasks.key] = subtasks
        for i in range(3):
            patch = dev.implement(subtasks, i)  # a future as argument: a dependency
            verdict = tester.test(patch)
            driver_calls[patch.key], driver_calls[verdict.key] = patch, verdict
            if not await verdict:  # retry with feedback
                patch = dev.implement(subtasks, i, feedback="tests failed")
                verdict = tester.test(patch)
                driver_calls[patch.key], driver_calls[verdict.key] = patch, verdict
                assert await verdict
    assert sum(1 for e in LOG if e["component"] == "Checker") == 4  # one retry happened

    graph = await async_wait_for(lambda: _completed(c, sess.id), timeout=20)
    nodes = {n.call_id: n for n in graph.nodes}
    made = {e["key"] for e in LOG}
    assert set(nodes) == made  # every call the components really ran, nothing else
    assert all(e["session"] == sess.id for e in LOG)
    for key, fut in driver_calls.items():
        assert nodes[key].creator == "driver"
        assert nodes[key].component == fut.meta.component
        assert nodes[key].dependencies == fut.meta.dependencies
    nested = [n for n in graph.nodes if n.component in ("doc_search", "code_exec")]
    assert len(nested) == 8  # 4 developer calls x 2 tools
    for n in nested:
        assert nodes[n.creator].component == "Developer"
    edges = {(e.src, e.dst, e.kind) for e in graph.edges}
    for n in graph.nodes:
        for d in n.dependencies:
            assert (d, n.call_id, "dependency") in edges
            assert n.call_id in nodes[d].consumers
    assert graph.progress == len(nodes) == 4 + 4 + 1 + 8
    assert graph.state == "completed"
    wf = await da.workflow_graph(c)
    visits = {cs.component: cs.visits_per_session for cs in wf.components}
    assert visits["Developer"] == 4 and visits["doc_search"] == 4 and visits["Planner"] == 1
    assert wf.edges["Developer->code_exec"] == 4 and wf.edges["Planner->Developer"] == 4


async def _completed(c: Client, sid: str):
    g = await da.session_graph(c, sid)
    return g if g.state == "completed" else None


BARRIER = threading.Barrier(4, timeout=20)


@da.agent
class Waiter:
    def work(self, i: int) -> int:
        BARRIER.wait()  # only passes if 4 calls run at the same time
        return i


@gen_cluster(client=True, nthreads=[("127.0.0.1", 4)], timeout=60)
async def test_independent_calls_overlap(c: Client, s: Scheduler, a: Worker) -> None:
    await install(c)
    BARRIER.reset()
    w = da.stub(Waiter)
    async with da.session(c) as sess:
        futs = [w.work(i) for i in range(4)]
        assert await c.gather(futs) == [0, 1, 2, 3]

    async def rows():
        df = await da.telemetry(c, sess.id)
        return (df,) if df["finished"].notna().sum() == 4 and df["started"].notna().sum() == 4 else None

    (df,) = await async_wait_for(rows)
    assert df["started"].max() < df["finished"].min()  # all four were running at once


@da.agent(stateful=True)
class Counter:
    def __init__(self) -> None:
        self.seen: list[int] = []

    def add(self, i: int) -> tuple[list[int], int]:
        self.seen.append(i)
        return list(self.seen), id(self)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 4), ("127.0.0.1", 4)], timeout=60)
async def test_stateful_order_and_instance_reuse(c: Client, s: Scheduler, a: Worker, b: Worker) -> None:
    await install(c)
    counter = da.stub(Counter)
    async with da.session(c) as sess:
        futs = [counter.add(i) for i in range(8)]
        results = await c.gather(futs)
        other = da.session(c)
        async with other:
            other_result = await counter.add(100)
    seen, ids = zip(*results)
    assert seen[-1] == list(range(8))  # all calls, in submission order, on one instance
    assert all(seen[i] == list(range(i + 1)) for i in range(8))
    assert len(set(ids)) == 1
    assert other_result[0] == [100]  # another session gets its own instance
    df = await da.telemetry(c, sess.id)
    assert df["worker"].nunique() == 1
    # the session's instance is released when the session completes
    await async_wait_for(lambda: sum(w.plugins[NAME].instances.stateful_count() for w in (a, b)) == 0)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 4), ("127.0.0.1", 4)], timeout=60)
async def test_a_stateful_component_outside_a_session_is_a_clear_error(c: Client, s: Scheduler, a: Worker,
                                                                       b: Worker) -> None:
    """Its state lives in a session: outside one there is none to keep it in (on e2edf8d the
    calls split their state over instances, [1, 1, 2, 3], with no error)."""
    await install(c)
    counter = da.stub(Counter)
    with pytest.raises(da.NoSessionError, match=r"Counter.add: Counter is stateful .*da.session"):
        counter.add(1)
    assert not s.plugins[NAME].state.calls  # nothing was submitted
    async with da.session(c):
        assert (await counter.add(1))[0] == [1]


def inc(x: int) -> int:
    return x + 1


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)], timeout=60)
async def test_plain_submit_is_not_a_call(c: Client, s: Scheduler, a: Worker) -> None:
    """Plain Dask work inside a session runs as Dask runs it: not recorded, not re-prioritized."""
    await install(c)
    async with da.session(c) as sess:
        fut = c.submit(inc, 1)
        assert await fut == 2
        call = da.stub(doc_search)("q")
        assert await call == "docs(q)"
    outside = c.submit(inc, 5)
    assert await outside == 6
    df = await da.telemetry(c, sess.id)
    assert list(df["component"]) == ["doc_search"] and list(df["creator"]) == ["driver"]
    plugin = s.plugins[NAME]
    assert fut.key not in plugin.state.calls and outside.key not in plugin.state.calls


@da.agent
class Nester:
    def outer(self, n: int) -> int:
        # waits on a nested call: must not hold the only worker thread
        return da.stub(Nester).inner(n).value(30) + 1

    def inner(self, n: int) -> int:
        return n * 10


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], timeout=60)
async def test_waiting_call_frees_its_thread(c: Client, s: Scheduler, a: Worker) -> None:
    await install(c)
    async with da.session(c):
        futs = [da.stub(Nester).outer(i) for i in range(3)]
        assert await c.gather(futs) == [1, 11, 21]


@da.agent
class Flaky:
    def run(self, x: int) -> int:
        if x < 0:
            raise ValueError("negative input")
        return x


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)], timeout=60)
async def test_component_error_names_call_and_session_survives(c: Client, s: Scheduler, a: Worker) -> None:
    await install(c)
    flaky = da.stub(Flaky)
    async with da.session(c) as sess:
        bad = flaky.run(-1)
        with pytest.raises(da.CallFailedError) as info:
            await bad
        msg = str(info.value)
        assert "Flaky.run" in msg and sess.id in msg and "ValueError: negative input" in msg
        assert isinstance(info.value.original, ValueError)
        assert await flaky.run(3) == 3  # the session and the cluster go on
    graph = await async_wait_for(lambda: _completed(c, sess.id))
    assert sorted(n.state for n in graph.nodes) == ["erred", "finished"]


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], timeout=60,
             config={"agents.scheduler.session-retention": "50ms", "agents.scheduler.housekeeping-interval": "20ms"})
async def test_completed_sessions_are_dropped_after_retention(c: Client, s: Scheduler, a: Worker) -> None:
    await install(c)
    async with da.session(c) as sess:
        assert await da.stub(Flaky).run(1) == 1
    plugin = s.plugins[NAME]
    await async_wait_for(lambda: sess.id not in plugin.state.sessions)
    assert not plugin.state.calls
    with pytest.raises(KeyError):
        await da.session_graph(c, sess.id)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], timeout=60)
async def test_install_is_idempotent(c: Client, s: Scheduler, a: Worker) -> None:
    await install(c)
    await install(c)
    assert isinstance(s.plugins[NAME], AgentsSchedulerPlugin)
    assert isinstance(a.plugins[NAME], AgentsWorkerPlugin)
    assert list(s.plugins).count(NAME) == 1


EMU = {"model": "emulated-llama", "engine": "emulated", "tokenizer": "byte", "emulation": {"time_scale": 0.001}}


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], timeout=60,
             config={"agents.llm.models": {"coder": EMU}})
async def test_an_install_typo_changes_nothing_and_the_corrected_install_works(c: Client, s: Scheduler,
                                                                             a: Worker) -> None:
    """On e2edf8d a typo left a worker plugin that could not start: the corrected install then
    failed ("engine for model 'codr' was not started") and LLM calls hung; on an installed cluster
    the same typo was ignored."""
    with pytest.raises(da.UnknownModelError, match=r"unknown model\(s\) 'codr'.*\(coder\); nothing was installed"):
        await da.install(c, models=["codr"])
    assert NAME not in s.plugins and NAME not in a.plugins
    assert await da.install(c, models=["coder"]) == {a.address: {"coder": a.plugins[NAME].engines._hosts["coder"].load_seconds}}
    with pytest.raises(da.UnknownModelError, match="'codr'"):  # installed already: still refused
        await da.install(c, models={"*": ["coder", "codr"]})
    async with da.session(c):
        assert (await da.llm("coder").generate("hi", max_tokens=2)).output_tokens == 2


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], timeout=60,
             config={"agents.llm.models": {"long": {"model": "builtin:tiny-llama", "max-model-len": 8192}}})
async def test_a_context_longer_than_the_models_is_explained_before_install(c: Client, s: Scheduler,
                                                                         a: Worker) -> None:
    """On e2edf8d ``max-model-len: 8192`` on the built-in model (its config allows 4,096) failed in
    the engine with vLLM's pydantic message about its own ModelConfig; now the install refuses it,
    naming the key, the limit and the way past it, and installs nothing."""
    with pytest.raises(da.ConfigError, match=r"agents\.llm\.models\.long: max-model-len 8192 is longer than "
                       r"builtin:tiny-llama's context: its config.json allows 4096 tokens .*"
                       r"VLLM_ALLOW_LONG_MAX_MODEL_LEN=1"):
        await da.install(c, models=["long"])
    assert NAME not in s.plugins and NAME not in a.plugins


@da.tool
def broken(x: int) -> int:
    raise ValueError(f"bad input {x}")


def plain_broken(x: int) -> int:
    raise ValueError(f"plain {x}")


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], timeout=60)
async def test_a_handled_call_failure_prints_no_worker_traceback(c: Client, s: Scheduler, a: Worker) -> None:
    """The caller gets the error, named, traceback included: the worker does not also log Dask's
    "Compute Failed" block for it (plain Dask tasks' failures it logs as Dask does)."""
    from distributed.utils_test import captured_logger

    await install(c)
    with captured_logger("distributed.worker", level=logging.ERROR) as log:
        async with da.session(c):
            with pytest.raises(da.CallFailedError, match="bad input 3"):
                await da.stub(broken)(3)
        with pytest.raises(ValueError, match="plain 4"):
            await c.submit(plain_broken, 4)
    text = log.getvalue()
    assert text.count("Compute Failed") == 1 and "plain_broken" in text and "bad input" not in text


ORDER: list[int] = []
GATE = threading.Event()


@da.tool
def ordered(i: int) -> int:
    if i == -1:
        GATE.wait(30)  # hold the only thread while the others queue up
    ORDER.append(i)
    return i


@pytest.mark.parametrize("saturation", [1.1, float("inf")])  # queued on the scheduler / on the worker
def test_calls_run_first_in_first_out(saturation):
    gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], timeout=60,
                config={"distributed.scheduler.worker-saturation": saturation})(_fifo)()


async def _fifo(c: Client, s: Scheduler, a: Worker) -> None:
    await install(c)
    ORDER.clear()
    GATE.clear()
    async with da.session(c):
        blocker = da.stub(ordered)(-1)
        await async_wait_for(lambda: a.state.executing_count == 1)
        futs = [da.stub(ordered)(i) for i in range(10)]  # all within Dask's 100 ms fifo window
        # queued on the scheduler (root-ish tasks) or on the worker's ready heap: all known, none run
        await async_wait_for(lambda: all(f.key in s.tasks and s.tasks[f.key].state in ("queued", "processing")
                                         for f in futs))
        GATE.set()
        await c.gather([blocker, *futs])
    assert ORDER == [-1, *range(10)]


BATCHES: list[int] = []


def _embed_batch(calls):
    BATCHES.append(len(calls))
    return [f"v({a[0]})" for a, _ in calls]


@da.tool(batching={"max_batch": 8, "max_wait": 0.5})
def embed(text: str) -> str:
    BATCHES.append(1)
    return f"v({text})"


embed.__dask_agents_batch__ = _embed_batch


@da.tool(batching={"max_batch": 4, "max_wait": 0.2})
def picky(x: int) -> int:
    if x == 2:
        raise ValueError("two is bad")
    return x


@gen_cluster(client=True, nthreads=[("127.0.0.1", 8)], timeout=60)
async def test_batchable_calls_coalesce_on_a_worker(c: Client, s: Scheduler, a: Worker) -> None:
    await install(c)
    BATCHES.clear()
    async with da.session(c):
        futs = [da.stub(embed)(f"t{i}") for i in range(8)]
        assert await c.gather(futs) == [f"v(t{i})" for i in range(8)]
        assert sum(BATCHES) == 8 and max(BATCHES) >= 2  # at least one real batch
        # without a batch form, calls of a batch still fail or succeed one by one
        outs = await c.gather([da.stub(picky)(i) for i in range(4)], errors="skip")
        assert outs == [0, 1, 3]
        with pytest.raises(da.CallFailedError, match="picky.*two is bad"):
            await da.stub(picky)(2)
    assert a.plugins[NAME].batcher.batches >= 2
