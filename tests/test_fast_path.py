"""The worker-local fast path (worker_plugin/local.py): calls made inside a component that run
in their caller's thread, on real worker processes, behave as on the scheduler path and are
recorded the same way."""

from __future__ import annotations

import contextlib
import inspect
import os
from typing import Any

import dask
import pytest
from distributed import Client, LocalCluster

import dask_agents as da
from tests import fast_path_components as fp
from tests.conftest import wait_for


@pytest.fixture(scope="module")
def client():
    cluster = LocalCluster(n_workers=1, threads_per_worker=4, processes=True, dashboard_address=":0",
                           worker_dashboard_address=":0")
    try:
        with Client(cluster) as c:
            da.install(c)
            yield c
    finally:
        cluster.close(timeout=30)


def _count_graph_keys(dask_scheduler: Any) -> None:
    """Record every key the scheduler receives in an update-graph to run it (the scheduler path;
    not a direct call's key, in memory already, given its call as its task after it answered)."""
    dask_scheduler.agents_test_graph_keys = set()
    handler = dask_scheduler.stream_handlers["update-graph"]

    async def counted(*args: Any, _h: Any = handler, **kwargs: Any) -> Any:  # Dask awaits coroutine handlers
        tasks = dask_scheduler.tasks
        dask_scheduler.agents_test_graph_keys.update(
            k for k in kwargs.get("keys") or () if k not in tasks or tasks[k].state != "memory")
        out = _h(*args, **kwargs)
        return await out if inspect.isawaitable(out) else out

    dask_scheduler.stream_handlers["update-graph"] = counted


def _graph_keys(client: Client) -> set:
    return client.run_on_scheduler(lambda dask_scheduler: set(dask_scheduler.agents_test_graph_keys))


def _calls(client: Client, session: Any, wait_for_n: int) -> Any:
    """The session's telemetry rows once ``wait_for_n`` calls are recorded and terminal."""
    def ready():
        t = da.telemetry(client, session=session)
        ended = t["state"].isin(["finished", "erred", "cancelled"])
        reported = t["started"].notna() | (t["state"] == "cancelled")  # the workers' exact times are in
        return t if len(t) >= wait_for_n and ended.all() and reported.all() else None

    return wait_for(lambda: (t := ready()) is not None and [t])[0]


def _local_counts(client: Client) -> dict:
    def counts(dask_worker=None):
        return dict(dask_worker.plugins["dask-agents"].local.snapshot())

    return next(iter(client.run(counts).values()))


def test_a_nested_tool_call_runs_in_its_callers_thread_and_is_recorded(client):
    client.run_on_scheduler(_count_graph_keys)
    with da.session(client) as s:
        out = da.stub(fp.Caller).inline(5).value()
    assert out == {"value": 5, "same_thread": True, "same_worker": True}
    t = _calls(client, s, 2)
    by = {r.component: r for r in t.itertuples()}
    tool, caller = by["where"], by["Caller"]
    assert tool.fast_path and not caller.fast_path
    assert tool.state == "finished" and tool.creator == caller.key and tool.worker == caller.worker
    assert tool.started <= tool.finished and caller.started <= tool.started and tool.finished <= caller.finished
    keys = _graph_keys(client)
    assert caller.key in keys and tool.key not in keys  # no update-graph for the nested call
    g = da.session_graph(client, s)
    assert g.state == "completed" and {n.component for n in g.nodes} == {"Caller", "where"}
    assert [(e.src, e.dst, e.kind) for e in g.edges if e.src == caller.key] == [(caller.key, tool.key, "created")]


def test_a_call_made_by_a_fast_path_call_runs_here_too(client):
    """The fast path nests: a tool that runs in its caller's thread makes a tool call, which
    runs in the same thread, and the graph records each call's creator."""
    client.run_on_scheduler(_count_graph_keys)
    with da.session(client) as s:
        out = da.stub(fp.Caller).nested(4).value()
    assert out == {"value": 4, "inner_same_thread": True, "same_thread": True}
    t = _calls(client, s, 3)
    by = {r.component: r for r in t.itertuples()}
    caller, mid, inner = by["Caller"], by["via_where"], by["where"]
    assert mid.fast_path and inner.fast_path and not caller.fast_path
    assert mid.creator == caller.key and inner.creator == mid.key
    assert {mid.key, inner.key}.isdisjoint(_graph_keys(client))  # no update-graph for either
    g = da.session_graph(client, s)
    created = {(e.src, e.dst) for e in g.edges if e.kind == "created"}
    assert {(caller.key, mid.key), (mid.key, inner.key)} <= created and g.state == "completed"


def test_a_waiting_component_leaves_dasks_profiler_while_it_waits(client, tmp_path):
    """A component parked on a scheduler-path call is not in the worker's ``active_threads``
    (what Dask's profiler walks every 10 ms); the call it waits for, running, is; both end
    normally (the waiter is back under its key for Dask's own bookkeeping)."""
    release = str(tmp_path / "open")

    def active(dask_worker=None):
        return sorted(str(k).split("-")[0] for k in dask_worker.active_threads.values())

    with da.session(client):
        f = da.stub(fp.waits_on_gate)(release)
        wait_for(lambda: next(iter(client.run(active).values())) == ["Gate"])
        open(release, "w").close()
        assert f.value(timeout=60) == release
    wait_for(lambda: next(iter(client.run(active).values())) == [])


def test_a_chain_of_local_calls_runs_here_only_while_its_root_task_runs():
    """``runs_here``: a call running on the fast path counts as a live caller only while the
    task at the root of its chain of callers still runs (a cancelled task's thread runs on)."""
    from dask_agents.worker_plugin.local import LocalCall, LocalCalls

    local = LocalCalls(worker=None, max_wait=0.005)

    def call(key: str, creator: str) -> LocalCall:
        return LocalCall(key=key, creator=creator, ann={}, run=lambda: None, submit=lambda: None,
                         submit_error=lambda: None, client=None, controller=local)

    local._running.update({"b": call("b", "a"), "c": call("c", "b")})
    tasks = {"a"}
    assert local.runs_here("c", tasks.__contains__) and local.runs_here("b", tasks.__contains__)
    tasks.clear()  # the root task was cancelled
    assert not local.runs_here("c", tasks.__contains__)
    assert not local.runs_here("x", lambda k: True)  # not running here at all


def test_a_running_calls_future_sent_where_waiting_cannot_end_raises_a_clear_error():
    """Pickling the future of a call that is running (it must end before its key exists) from
    the thread running it, or from the worker's event loop, could never end: a
    ``da.CallEscapeError`` naming the call, never a wedged thread or loop."""
    import asyncio
    import pickle
    import threading
    from types import SimpleNamespace

    from distributed import Future

    from dask_agents.futures import AgentFuture
    from dask_agents.worker_plugin.local import RUNNING, LocalCall, LocalCalls

    loop = asyncio.new_event_loop()
    local = LocalCalls(worker=SimpleNamespace(loop=SimpleNamespace(asyncio_loop=loop)), max_wait=0.005)
    call = LocalCall(key="where-1", creator="Caller-1", ann={"component": "where", "session": "s1"},
                     run=lambda: None, submit=lambda: None, submit_error=lambda: None, client=None,
                     controller=local, state=RUNNING, thread=threading.get_ident())
    fut = AgentFuture.adopt(Future("where-1"), None)  # (no client: nothing to release)
    fut.__dict__["_agents_local"] = call
    with pytest.raises(da.CallEscapeError, match="where .*session s1.*where-1.*the thread running it"):
        pickle.dumps(fut)

    call.thread = None  # run by another thread; pickled on the loop

    async def on_loop() -> None:
        pickle.dumps(fut)

    try:
        with pytest.raises(da.CallEscapeError, match="the worker's event loop"):
            loop.run_until_complete(on_loop())
    finally:
        loop.close()
    call.done.set()  # ended meanwhile: pickling it from any other thread goes ahead
    assert pickle.loads(pickle.dumps(fut)).key == "where-1"


def test_a_running_calls_future_pickled_under_the_clients_lock_lets_the_call_finish():
    """A graph is serialized under ``Client._refcount_lock``; pickling the future of a call that
    another thread runs waits for that call, which takes the same lock to make any future: the
    wait lets the lock go (else both wait for good)."""
    import pickle
    import threading
    from types import SimpleNamespace

    from distributed import Future

    from dask_agents.futures import AgentFuture
    from dask_agents.worker_plugin.local import RUNNING, LocalCall, LocalCalls

    lock = threading.RLock()
    local = LocalCalls(worker=None, max_wait=0.005)
    call = LocalCall(key="where-2", creator="Caller-2", ann={"component": "where"}, run=lambda: None,
                     submit=lambda: None, submit_error=lambda: None, client=SimpleNamespace(_refcount_lock=lock),
                     controller=local, state=RUNNING)
    fut = AgentFuture.adopt(Future("where-2"), None)
    fut.__dict__["_agents_local"] = call

    def running_call() -> None:
        with lock:  # a future made by the running call (Future.__init__ -> Client._inc_ref)
            pass
        call.done.set()

    def sender() -> None:
        with lock:  # Client._graph_to_futures
            threading.Thread(target=running_call, daemon=True).start()
            pickle.dumps(fut)

    t = threading.Thread(target=sender, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive() and call.done.is_set()


def test_an_escape_error_reaches_the_caller_as_itself(client):
    """Dask's serializers wrap what a ``__reduce__`` raises in a TypeError of their own: the
    caller still gets the ``da.CallEscapeError`` naming the call."""
    with da.session(client):
        with pytest.raises(da.CallEscapeError, match="from nowhere"):
            da.stub(fp.add)(fp.Escaping(), 1)


def test_a_scheduler_path_call_made_by_a_fast_path_call_is_its_child(client):
    """A fast-path tool makes a stateful call (scheduler path): that call's update-graph can
    reach the scheduler before the tool's record; the graph still has the tool as its creator,
    and the stateful order holds across both paths."""
    with da.session(client) as s:
        assert da.stub(fp.Caller).tally_twice(3).value() == [3, 6]
    t = _calls(client, s, 5)
    tools = t[t.component == "via_tally"]
    tallies = t[t.component == "Tally"]
    assert tools.fast_path.all() and not tallies.fast_path.any() and len(tallies) == 2
    assert set(tallies.creator) == set(tools.key)
    g = da.session_graph(client, s)
    created = {(e.src, e.dst) for e in g.edges if e.kind == "created"}
    assert all((r.creator, r.key) in created for r in tallies.itertuples())


def test_an_error_names_the_call_as_on_the_scheduler_path(client):
    with da.session(client) as s:
        text = da.stub(fp.Caller).fail(3).value()
    kind, message = text.split("|", 1)
    assert kind == "ValueError" and "boom 3" in message and "boom" in message and "(call boom-" in message
    t = _calls(client, s, 2)
    row = t[t.component == "boom"].iloc[0]
    assert row.state == "erred" and "boom 3" in row.error and row.fast_path


@pytest.mark.parametrize("method,arg,expected", [("chain", 1, 12), ("chain_after", 4, 13)])
def test_local_futures_as_arguments_of_other_calls(client, method, arg, expected):
    with da.session(client) as s:
        assert getattr(da.stub(fp.Caller), method)(arg).value() == expected
    t = _calls(client, s, 3)
    assert set(t.component) == {"Caller", "add", "total"} if method == "chain_after" else {"Caller", "add"}
    assert (t.state == "finished").all()


@pytest.mark.parametrize("deferred", [True, False])
def test_a_local_future_passed_to_plain_dask_work(client, deferred):
    """Plain ``client.submit`` inside a component, given a fast-path future (still deferred, or
    already run here): the plain task gets its value."""
    with da.session(client):
        assert da.stub(fp.Caller).plain_submit(20, deferred).value() == 42


def test_a_future_hidden_in_a_siblings_argument_does_not_wedge_its_caller(client):
    """``b = unbox(Box(a))`` then ``a.value()``: waiting for ``a`` sends its sibling ``b`` first,
    and pickling ``b`` carries ``a``'s future, so ``a`` must exist on the scheduler by then. It
    used to be taken to run here before the siblings went, so that pickling waited for ``a`` to
    finish in the very thread that was to run it, holding the client's lock (the worker's
    event loop then stalled on that lock too)."""
    with da.session(client):
        assert da.stub(fp.Caller).hidden(1).value(timeout=60) == 2 + 102


def test_fan_out_runs_the_waited_call_here_and_the_rest_meanwhile(client):
    before = _local_counts(client)
    with da.session(client) as s:
        out = da.stub(fp.Caller).fan_out(4).value()
    assert out["values"] == [0, 1, 2, 3]
    assert out["same_thread"][0] and not any(out["same_thread"][1:])  # the others ran in parallel
    after = _local_counts(client)
    assert after.get("submitted:sibling", 0) - before.get("submitted:sibling", 0) == 3
    t = _calls(client, s, 5)
    assert sorted(t[t.component == "where"].fast_path) == [False, False, False, True]


def test_a_timeout_is_honoured_on_the_scheduler_path(client):
    with da.session(client):
        text = da.stub(fp.Caller).with_timeout(5.0).value()
    kind, message = text.split("|", 1)
    assert kind == "timeout" and "slow" in message and "did not finish within 0.05s" in message


def test_a_cancelled_deferred_call_never_runs(client, tmp_path):
    path = str(tmp_path / "cancelled")
    with da.session(client) as s:
        out = da.stub(fp.Caller).cancelled(path).value()
    assert out == {"status": "cancelled", "done": True, "error": "FutureCancelledError", "ran": False}
    t = _calls(client, s, 2)
    assert t[t.component == "mark"].iloc[0].state == "cancelled"


def test_a_call_made_after_its_caller_was_cancelled_does_not_run_here(client, tmp_path):
    """Ending a session with cancel=True cancels its running calls, but a thread runs on: a call
    it makes then takes the scheduler path, which knows the session is over, instead of running
    here unseen."""
    started, out, path = tmp_path / "started", tmp_path / "out", tmp_path / "ran"
    s = da.session(client)
    with s:
        fut = da.stub(fp.Caller).after_cancel(str(started), str(out), str(path))
        wait_for(started.exists)
        s.end(cancel=True)
    wait_for(out.exists)
    outcome = out.read_text()
    assert fut.status in ("cancelled", "error") and not path.exists(), outcome
    assert outcome.startswith(("SessionClosedError|", "CancelledError|", "FutureCancelledError|")), outcome


def test_a_call_its_caller_never_waited_for_still_runs(client, tmp_path):
    path = tmp_path / "kept"
    with da.session(client):
        assert da.stub(fp.Caller).forgotten_but_kept(str(path)).value() == "left"
    wait_for(path.exists)


def test_a_call_handed_to_fire_and_forget_runs(client, tmp_path):
    path = tmp_path / "fired"
    with da.session(client):
        assert da.stub(fp.Caller).fire_and_forgotten(str(path)).value() == "left"
    wait_for(path.exists)


def test_status_and_available_before_and_after(client):
    with da.session(client):
        before, after = da.stub(fp.Caller).status(1).value()
    assert tuple(before) == ("pending", False) and tuple(after) == ("finished", True)


def test_disabled_fast_path_takes_the_scheduler_path():
    with dask.config.set({"agents.worker.fast-path.enabled": False}):
        cluster = LocalCluster(n_workers=1, threads_per_worker=2, processes=True, dashboard_address=":0",
                               worker_dashboard_address=":0")
    try:
        with Client(cluster) as c:
            with dask.config.set({"agents.worker.fast-path.enabled": False}):
                da.install(c)
            with da.session(c) as s:
                out = da.stub(fp.Caller).inline(2).value()
            assert out["value"] == 2 and not out["same_thread"]
            t = _calls(c, s, 2)
            assert not t.fast_path.any()
    finally:
        cluster.close(timeout=30)


def test_a_worker_killed_mid_fast_path_call_loses_no_call_and_runs_none_twice(tmp_path):
    """The worker running a component and, in its thread, a fast-path tool call dies: Dask
    runs the component again elsewhere, which makes a new call; the call that died with its
    worker ends in the graph (not open forever), each call ran once, the session completes."""
    log, release = tmp_path / "log", tmp_path / "release"
    cluster = LocalCluster(n_workers=2, threads_per_worker=2, processes=True, dashboard_address=":0",
                           worker_dashboard_address=":0")
    try:
        with Client(cluster) as c:
            da.install(c)
            with da.session(c) as s:
                fut = da.stub(fp.calls_logged_wait)(str(log), str(release))
                first = wait_for(lambda: log.exists() and log.read_text().splitlines())[0]
                key, victim = first.split()
                # the scheduler knows it runs there (its record came in a report): the worse case
                wait_for(lambda: key in {n.call_id for n in da.session_graph(c, s).nodes})
                with contextlib.suppress(Exception):  # the worker dies before it answers
                    c.run(os._exit, 1, workers=[victim])
                release.write_text("go")
                where = fut.value()
            assert where != victim
            lines = [ln.split() for ln in log.read_text().splitlines()]
            keys = [k for k, _w in lines]
            assert len(keys) == 2 and len(set(keys)) == 2 and lines[1][1] != victim  # a new call, elsewhere
            g = wait_for(lambda: (g := da.session_graph(c, s)).state == "completed" and g)
            states = {n.call_id: n.state for n in g.nodes}
            assert states[keys[1]] == "finished" and states[keys[0]] in ("erred", "cancelled")
    finally:
        cluster.close(timeout=30)


EMU = {"model": "emulated-llama", "engine": "emulated", "tokenizer": "byte",
       "emulation": {"time_scale": 0.001, "kv_blocks": 256, "block_size": 16, "max_batch": 4}}


def test_an_llm_call_under_the_admission_lease_runs_on_the_engine_here():
    """The session's first LLM call admits it to the engine beside its agent (scheduler path);
    under the lease that follows, the next call goes straight to that engine, in the agent's
    thread, and is recorded with its tokens like a scheduler-path call. A model that runs short
    loses its lease."""
    with dask.config.set({"agents.llm.models": {"emu": EMU}, "agents.control.enabled": False}):
        cluster = LocalCluster(n_workers=1, threads_per_worker=4, processes=True, dashboard_address=":0",
                               worker_dashboard_address=":0")
    try:
        with Client(cluster) as c:
            with dask.config.set({"agents.llm.models": {"emu": EMU}}):
                da.install(c, models=["emu"])
            c.run_on_scheduler(_count_graph_keys)
            with da.session(c) as s:
                out = da.stub(fp.llm_under_lease)("emu", [5] * 40).value()
            assert out["leased"] and out["workers"] == [out["here"], out["here"]] and out["output"] == [8, 8]
            assert out["cached"] >= 32  # the same engine: the session's prefix (its full blocks) was there
            # the engine orders it by its session's progress, as its caller was (not last, as a stranger)
            assert out["priority"] == [tuple(out["caller_priority"])] and len(out["caller_priority"]) == 5
            t = _calls(c, s, 3)
            llm = t[t.kind == "llm"].sort_values("created")
            assert list(llm.fast_path) == [False, True]
            assert list(llm.prompt_tokens) == [40, 56] and list(llm.output_tokens) == [8, 8]
            second = llm.iloc[1]
            assert second.key not in _graph_keys(c)  # no update-graph for the leased call
            g = da.session_graph(c, s)
            assert g.state == "completed" and len(g.nodes) == 3

            def admission(dask_scheduler):
                adm = dask_scheduler.plugins["dask-agents"].admission
                return {"counts": dict(adm.counts), "inflight": [len(r.inflight) for r in adm.engines.values()],
                        "open": dict(adm.open)}

            st = wait_for(lambda: (a := c.run_on_scheduler(admission))["inflight"] == [0] and a)
            assert st["counts"]["leased_calls"] == 1 and st["open"] == {"emu": True}

            def run_short(fill: bool, dask_scheduler=None):  # the engine's slots taken, then freed
                adm = dask_scheduler.plugins["dask-agents"].admission
                (r,) = adm.engines.values()
                if fill:
                    r.inflight.update(f"blocker-{i}" for i in range(r.slots))
                else:
                    r.inflight -= {k for k in r.inflight if k.startswith("blocker-")}
                adm.tick()

            def lease(dask_worker):
                return {m: sorted(v) for m, v in dask_worker.plugins["dask-agents"].local.leases.items()}

            c.run_on_scheduler(run_short, True)
            wait_for(lambda: list(c.run(lease).values()) == [{}])  # withdrawn: the calls come to the scheduler
            c.run_on_scheduler(run_short, False)
            wait_for(lambda: list(c.run(lease).values()) == [{"emu": []}])  # out again (no live session)
    finally:
        cluster.close(timeout=30)
