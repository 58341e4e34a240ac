"""A driver's calls straight to their worker (dask_agents/direct.py, worker_plugin/direct.py,
scheduler_plugin/direct.py), on real worker processes: they behave as on the scheduler path
and are recorded the same way; anything without a route, a forged token, or a worker lost
mid-call ends on the scheduler path with the right answer."""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any

import dask
import pytest
from distributed import Client, LocalCluster
from distributed.client import FutureCancelledError

import dask_agents as da
from dask_agents.errors import CallFailedError, CallTimeoutError
from tests import direct_components as dc
from tests.test_fast_path import _count_graph_keys, _graph_keys
from tests.conftest import wait_for

EMU = {"model": "emulated-llama", "engine": "emulated", "tokenizer": "byte",
       "emulation": {"time_scale": 0.001, "kv_blocks": 256, "block_size": 16, "max_batch": 4}}
CONFIG = {"agents.llm.models": {"emu": EMU}, "agents.control.enabled": False}


def _cluster(n: int) -> LocalCluster:
    with dask.config.set(CONFIG):
        return LocalCluster(n_workers=n, threads_per_worker=4, processes=True, dashboard_address=":0",
                            worker_dashboard_address=":0")


@contextlib.contextmanager
def _installed(n: int) -> Any:
    """A client of a fresh ``n``-worker cluster with dask-agents installed (model ``emu`` on each)."""
    cluster = _cluster(n)
    try:
        with Client(cluster) as c:
            with dask.config.set(CONFIG):
                da.install(c, models=["emu"])
            yield c
    finally:
        cluster.close(timeout=30)


@pytest.fixture(scope="module")
def client():
    cluster = _cluster(1)
    try:
        with Client(cluster) as c:
            with dask.config.set(CONFIG):
                da.install(c, models=["emu"])
            c.run_on_scheduler(_count_graph_keys)
            with da.session(c):  # the scheduler gives the client its token with its first session
                wait_for(lambda: c._agents_routes.token)
            wait_for(lambda: _lease_out(c))  # once the engine reports, nothing of the model is short
            yield c
    finally:
        cluster.close(timeout=30)


def _lease_out(client: Client) -> bool:
    """Whether every worker holds the scheduler's lease of model ``emu``."""
    return all("emu" in v for v in client.run(lambda dask_worker: dask_worker.plugins["dask-agents"]
                                               .local.leases).values())


def _direct(fut: Any) -> Any:
    return fut.__dict__.get("_agents_direct")


def _calls(client: Client, session: Any, n: int) -> Any:
    """The session's telemetry rows once ``n`` calls are recorded, terminal and reported."""
    def ready():
        t = da.telemetry(client, session=session)
        ended = t["state"].isin(["finished", "erred", "cancelled"])
        reported = t["started"].notna() | (t["state"] != "finished")  # the workers' exact times are in
        return t if len(t) >= n and ended.all() and reported.all() else None

    return wait_for(lambda: (t := ready()) is not None and [t])[0]


def test_a_drivers_call_goes_straight_to_its_worker_and_is_recorded(client):
    """The engine's only worker is the route of an agent with ``model=``: the call and its LLM
    call run there without an update-graph, the session admitted by the worker itself (its LLM
    call on the fast path), and both are in the session's graph and telemetry as scheduler-path
    calls are."""
    with da.session(client) as s:
        fut = da.stub(dc.Writer).write([5] * 20)
        out = fut.value()
    call = _direct(fut)
    assert call is not None and call.state == "finished"
    assert out["worker"] == out["llm_worker"] == call.worker and out["output"] == 4
    assert out["thread"].startswith("agents-direct")
    t = _calls(client, s, 2)
    agent, llm = t[t.kind == "agent"].iloc[0], t[t.kind == "llm"].iloc[0]
    assert agent.key == fut.key and agent.creator == "driver" and agent.state == "finished"
    assert agent.worker == call.worker and agent.fast_path
    assert llm.creator == agent.key and llm.fast_path and llm.prompt_tokens == 20 and llm.output_tokens == 4
    assert not {agent.key, llm.key} & _graph_keys(client)  # neither crossed the scheduler
    g = wait_for(lambda: (g := da.session_graph(client, s)).state == "completed" and g)
    assert {n.call_id for n in g.nodes} == {agent.key, llm.key}
    counts = client.run_on_scheduler(lambda dask_scheduler: dict(dask_scheduler.plugins["dask-agents"]
                                                                  .admission.counts))
    assert counts["admitted_locally"] >= 1


def test_a_direct_future_as_an_argument_of_other_calls_and_plain_dask_work(client):
    with da.session(client):
        doubled = da.stub(dc.Writer).double(21)
        assert da.stub(dc.Plain).add(doubled, 1).value() == 43  # a scheduler-path call depending on it
        assert client.submit(lambda x: x + 100, doubled).result() == 142  # plain Dask work
        pending = da.stub(dc.Writer).double(5)  # not waited for before it is an argument
        assert client.submit(lambda x: -x, pending).result() == -10
        assert _direct(doubled) is not None and _direct(pending) is not None
        assert client.gather(doubled) == 42


def test_a_pending_direct_future_pickled_on_its_clients_loop_raises_a_clear_error():
    """Its answer is handled on the client's loop: waiting there for it could never end."""
    import asyncio
    import pickle
    from types import SimpleNamespace

    from distributed import Future

    from dask_agents import direct
    from dask_agents.futures import AgentFuture

    loop = asyncio.new_event_loop()
    call = direct.DirectCall(key="Writer-1", worker="tcp://w", session="s1", resubmit=None,
                             client=SimpleNamespace(loop=SimpleNamespace(asyncio_loop=loop)),
                             ann={"component": "Writer", "method": "double"})
    fut = AgentFuture.adopt(Future("Writer-1"), None)  # (no client: nothing to release)
    fut.__dict__["_agents_direct"] = call

    async def on_loop() -> None:
        pickle.dumps(fut)

    try:
        with pytest.raises(da.CallEscapeError, match=r"Writer\.double \(session s1\).*Writer-1.*event loop"):
            loop.run_until_complete(on_loop())
    finally:
        loop.close()
    call.done.set()  # answered: its key exists, pickling goes ahead anywhere
    assert pickle.loads(pickle.dumps(fut)).key == "Writer-1"


def test_errors_are_the_same_on_both_paths(client):
    with da.session(client) as s:
        direct, routed = da.stub(dc.Writer).fail(3), da.stub(dc.Plain).fail(3)
        errors = []
        for fut in (direct, routed):
            with pytest.raises(CallFailedError) as e:
                fut.value()
            errors.append(e.value)
        assert _direct(direct) is not None and _direct(routed) is None
        for fut, e in zip((direct, routed), errors):
            assert f"(session {s.id}) raised ValueError: bad input 3 (call {fut.key})" in str(e)
            assert isinstance(e.original, ValueError) and fut.status == "error" and fut.done()
        # an erred direct call as an argument: what depends on it fails with its error
        with pytest.raises(CallFailedError, match="bad input 3"):
            da.stub(dc.Plain).add(direct, 1).value()
    t = _calls(client, s, 3)
    assert set(t[t.component == "Writer"].state) == {"erred"}


def test_a_timeout_then_the_value(client, tmp_path):
    log, release = tmp_path / "log", tmp_path / "release"
    with da.session(client):
        fut = da.stub(dc.Writer).logged_wait(str(log), str(release))
        with pytest.raises(CallTimeoutError, match="Writer.logged_wait"):
            fut.value(timeout=0.05)
        assert fut.status == "pending" and not fut.available()
        release.write_text("go")
        assert fut.value() == _direct(fut).worker
        assert fut.status == "finished" and fut.available()


def test_a_cancelled_direct_call_is_dropped_and_its_value_forgotten(client, tmp_path):
    log, release = tmp_path / "log", tmp_path / "release"
    with da.session(client):
        fut = da.stub(dc.Writer).logged_wait(str(log), str(release))
        wait_for(log.exists)
        fut.cancel()
        with pytest.raises(FutureCancelledError):
            fut.value()
        assert fut.status == "cancelled"
        release.write_text("go")
        key = fut.key

        def held(dask_worker=None):
            return key in dask_worker.data

        wait_for(lambda: client.run(lambda dask_worker: dask_worker.plugins["dask-agents"].direct.counts["forgotten"])
                 and not any(client.run(held).values()))


def test_no_route_no_session_or_another_clients_token_take_the_scheduler_path(client):
    assert _direct(da.stub(dc.Writer).double(1)) is None  # no session
    with da.session(client):
        fut = da.stub(dc.Plain).add(1, 2)  # no model: no route
        assert fut.value() == 3 and _direct(fut) is None

    # a forged call straight to the worker: refused without the scheduler's token for it
    worker = next(iter(client.scheduler_info()["workers"]))

    async def forge():
        from distributed.protocol import to_serialize

        from dask_agents.runtime import run_method
        header = ("Writer", "double", "someone-else", "Writer-forged", False, None, 1)
        ann = {"call": "Writer-forged", "component": "Writer", "kind": "agent", "session": "someone-else"}
        return await client.rpc(worker).agents_direct(key="Writer-forged", ann=ann, client=client.id,
                                                      token="0" * 32, model="emu",
                                                      payload=to_serialize((run_method, header, dc.Writer, (1,), {})))

    assert client.sync(forge) == {"status": "busy", "why": "no token"}


def test_disabled_direct_calls_take_the_scheduler_path(client):
    with dask.config.set({"agents.client.direct-calls": False}):
        with da.session(client):
            fut = da.stub(dc.Writer).double(4)
            assert fut.value() == 8 and _direct(fut) is None


def test_a_worker_killed_mid_direct_call_runs_it_again_through_the_scheduler(tmp_path):
    """Two engines: the session's first call asks for its route and goes straight to the engine
    it was bound to, the next one too, and that worker dies while it runs: the driver sends it
    again down the scheduler path under the same key, it runs on the other worker, and the
    graph has it once, finished."""
    log, release = tmp_path / "log", tmp_path / "release"
    with _installed(2) as c, dask.config.set({"agents.client.route-first-calls": True,
                                              "agents.client.bind-first-calls": False}):
        with da.session(c) as s:
            wait_for(lambda: c._agents_routes.token)
            first = da.stub(dc.Writer).write([3] * 16)
            bound = first.value()["worker"]
            assert _direct(first) is not None and _direct(first).worker == bound  # routed, then straight
            assert c._agents_routes.bound.get((s.id, "emu")) == bound
            fut = da.stub(dc.Writer).logged_wait(str(log), str(release))
            assert _direct(fut) is not None and _direct(fut).worker == bound
            wait_for(lambda: log.exists() and log.read_text().strip())
            with contextlib.suppress(Exception):  # it dies before it answers
                c.run(os._exit, 1, workers=[bound])
            release.write_text("go")
            where = fut.value()
        assert where != bound
        lines = [ln.split() for ln in log.read_text().splitlines()]
        assert [k for k, _ in lines] == [fut.key, fut.key] and lines[1][1] == where  # again, same key
        g = wait_for(lambda: (g := da.session_graph(c, s)).state == "completed" and g)
        states = [n.state for n in g.nodes if n.call_id == fut.key]
        assert states == ["finished"]


def test_a_direct_value_lost_with_its_worker_is_computed_again_for_what_depends_on_it():
    """A direct call answered, then its worker died: its value lived only there. Work given its
    future afterwards (a call on the scheduler path, plain Dask work) still gets the right value:
    the key has the call as its task, so Dask runs it again elsewhere, as for any task's lost
    value (scattered data would fail them with lost dependencies)."""
    with _installed(2) as c:
        with da.session(c) as s:
            wait_for(lambda: c._agents_routes.token)
            bound = da.stub(dc.Writer).write([3] * 16).value()["worker"]  # binds the session
            wait_for(lambda: c._agents_routes.bound.get((s.id, "emu")) == bound)
            fut = da.stub(dc.Writer).double(21)
            assert fut.value() == 42 and _direct(fut) is not None and _direct(fut).worker == bound
            wait_for(lambda: c.run_on_scheduler(lambda dask_scheduler, k=fut.key:
                                                getattr(dask_scheduler.tasks.get(k), "run_spec", None) is not None))
            with contextlib.suppress(Exception):
                c.run(os._exit, 1, workers=[bound])
            wait_for(lambda: bound not in c.scheduler_info()["workers"])
            assert da.stub(dc.Plain).add(fut, 1).value(timeout=60) == 43
            assert c.submit(lambda x: x + 100, fut).result(timeout=60) == 142
            assert fut.value() == 42


def _route_answers(on: bool, dask_scheduler: Any = None) -> None:
    """Make the scheduler drop route requests unanswered (a lost answer), or answer them again."""
    from dask_agents.direct import ROUTE_OP

    handlers = dask_scheduler.stream_handlers
    if not on:
        dask_scheduler._test_route, handlers[ROUTE_OP] = handlers[ROUTE_OP], lambda **msg: None
    else:
        handlers[ROUTE_OP] = dask_scheduler._test_route


def _admission(on: bool, dask_scheduler: Any = None) -> None:
    dask_scheduler.plugins["dask-agents"].admission.enabled = on


def test_a_sessions_first_calls_wait_for_one_route_then_go_straight():
    """Two engines of the model, no binding yet: a fan-out of a session's first calls sends one
    route request; the scheduler binds the session (as the first call's arrival would) and
    answers, and every call goes straight to that engine's worker, their LLM calls beside them.
    With no answer (lost), or no route to give (admission off: nothing binds a session before its
    first LLM call), the calls take the scheduler path under their keys, and answer right.
    With ``agents.client.route-first-calls: false`` (read where the call is made) they take the
    scheduler path, which binds the session. (The client binding sessions itself, the default,
    is off here: ``test_a_sessions_first_calls_go_straight_to_the_engine_its_client_binds``.)"""
    with _installed(2) as c, dask.config.set({"agents.client.route-first-calls": True,
                                              "agents.client.bind-first-calls": False}):
        c.run_on_scheduler(_count_graph_keys)
        routes = c._agents_routes
        with da.session(c):
            wait_for(lambda: routes.token)
        wait_for(lambda: _lease_out(c), timeout=120)  # both engines report first (slow under a loaded machine)
        sent_before = c.run_on_scheduler(lambda dask_scheduler: dask_scheduler.plugins["dask-agents"].direct.sent)
        with da.session(c) as s:
            futs = [da.stub(dc.Writer).write([7] * (16 + i)) for i in range(3)]
            outs = [f.value() for f in futs]
        bound = outs[0]["worker"]
        for f, out in zip(futs, outs):
            call = _direct(f)
            assert call is not None and call.state == "finished" and call.worker == bound
            assert out["worker"] == out["llm_worker"] == bound and out["output"] == 4
        assert not {f.key for f in futs} & _graph_keys(c)  # none crossed the scheduler
        # the session's open, one route answer (and its binding): not one per call
        sent = c.run_on_scheduler(lambda dask_scheduler: dask_scheduler.plugins["dask-agents"].direct.sent)
        assert sent - sent_before <= 3
        g = wait_for(lambda: (g := da.session_graph(c, s)).state == "completed" and g)
        assert {n.call_id for n in g.nodes if n.kind == "agent"} == {f.key for f in futs}

        with dask.config.set({"agents.client.route-first-calls": False}), da.session(c) as s:
            first = da.stub(dc.Writer).double(1)
            assert first.value() == 2 and _direct(first) is None and first.key in _graph_keys(c)
            bound = wait_for(lambda: routes.bound.get((s.id, "emu")))
            then = da.stub(dc.Writer).double(2)  # bound now: straight there
            assert then.value() == 4 and _direct(then) is not None and _direct(then).worker == bound

        for off in (_route_answers, _admission):
            c.run_on_scheduler(off, False)
            try:
                with da.session(c) as s:
                    futs = [da.stub(dc.Writer).double(i) for i in range(3)]
                    assert [f.value() for f in futs] == [0, 2, 4]
                assert all(_direct(f).state == "scheduler" for f in futs), off.__name__
                assert {f.key for f in futs} <= _graph_keys(c)
                assert not routes.awaiting
                g = wait_for(lambda: (g := da.session_graph(c, s)).state == "completed" and g)
                assert sorted(n.state for n in g.nodes) == ["finished"] * 3
            finally:
                c.run_on_scheduler(off, True)


def test_a_session_completes_only_after_the_records_of_its_direct_calls(client):
    """A driver ends its session as soon as its direct call answers: the worker's records of the
    call travel on the worker's stream, the end on the driver's, so the end can come first. The
    end names the session's direct calls and the session completes only after their records:
    none is refused for arriving after it, every graph has its call."""
    def rejected(dask_scheduler=None):
        return dict(dask_scheduler.plugins["dask-agents"].aggregates.rejected.counts)

    before = client.run_on_scheduler(rejected)
    sessions, keys = [], []
    for i in range(30):
        with da.session(client) as s:
            fut = da.stub(dc.Writer).double(i)
            assert fut.value() == 2 * i and _direct(fut) is not None
        sessions.append(s)
        keys.append(fut.key)
    for s, key in zip(sessions, keys):
        g = wait_for(lambda s=s: (g := da.session_graph(client, s)).state == "completed" and g)
        assert [(n.call_id, n.state) for n in g.nodes] == [(key, "finished")]
    assert client.run_on_scheduler(rejected) == before


def _fast_path(on: bool, dask_worker: Any = None) -> bool:
    plugin = dask_worker.plugins["dask-agents"]
    if not on and plugin.local is not None:
        plugin._test_local, plugin.local = plugin.local, None
    elif on and plugin.local is None:
        plugin.local = plugin._test_local
    return plugin.local is not None


def test_a_worker_that_cannot_take_direct_calls_is_left_alone_for_a_while(client):
    """A worker whose fast path is off refuses a direct call (``not ready``): the call takes the
    scheduler path with its key, and the next ones go there at once, not through a refusal."""
    client.run(_fast_path, False)
    try:
        with da.session(client):
            first = da.stub(dc.Writer).double(1)
            assert first.value() == 2 and _direct(first) is not None and _direct(first).state == "scheduler"
            second = da.stub(dc.Writer).double(2)
            assert second.value() == 4 and _direct(second) is None
    finally:
        client.run(_fast_path, True)
        client._agents_routes.resting.clear()


def test_a_client_binds_its_new_session_to_the_engine_its_calls_load_least():
    """``Routes.bind``: a session this client opened, with no binding of a model with several
    engines, is bound to the engine with fewest of this client's calls in flight, then fewest of
    its sessions; resting engines are passed over; a session of another client, or the knob off,
    is not bound here (None); the scheduler's binding, when it comes, wins."""
    from dask_agents.direct import DirectCall, Routes

    r = Routes()
    r.update(token="t", models={"coder": ["w1", "w2", "w3"]}, components={"Coder": "coder"})
    for sid in ("s1", "s2", "s3", "s4"):
        r.update(session=sid)
        r.opened.add(sid)
    r.pending["k1"] = DirectCall("k1", "w1", "s0", None, None)
    r.pending["k2"] = DirectCall("k2", "w2", "s0", None, None)
    assert r.target("s1", "Coder", None) == ("w3", "t", "coder")  # no call in flight there
    assert r.bound[("s1", "coder")] == "w3" and r.target("s1", "Coder", None)[0] == "w3"  # it stays
    del r.pending["k2"]
    assert r.target("s2", "Coder", None)[0] == "w2"  # tied with w3 on calls, fewer sessions
    r.resting["w3"] = r.resting["w2"] = float("inf")
    assert r.target("s3", "Coder", None)[0] == "w1"  # the only one not resting
    r.resting["w1"] = float("inf")
    assert r.target("s4", "Coder", None) is None and ("s4", "coder") not in r.bound
    r.resting.clear()
    assert r.target("someone-elses", "Coder", None) is None  # not opened by this client
    with dask.config.set({"agents.client.bind-first-calls": False}):
        assert r.target("s4", "Coder", None) is None
    r.update(bound=[["s1", "coder", "w1"]])  # the scheduler bound it elsewhere: its word wins
    assert r.target("s1", "Coder", None)[0] == "w1"


def test_routes_send_a_call_to_its_sessions_engine_or_the_models_only_one():
    """The client's routes (dask_agents/direct.py): a session's binding for its component's
    model wins; else the model's only engine; several engines and no binding, no model, no
    token, or a worker resting after a lasting refusal: the scheduler path (None)."""
    from dask_agents.direct import Routes

    r = Routes()
    assert r.target("s1", "Coder", None) is None  # no token yet
    r.update(token="t", session="s1", models={"coder": ["w1", "w2"], "chat": ["w3"]},
             components={"Coder": "coder", "Chatter": "chat"})
    assert r.target("s1", "Chatter", None) == ("w3", "t", "chat")  # the model's only engine
    assert r.target("s1", "Coder", None) is None  # two engines, no binding
    assert r.target("s1", "Planner", None) is None  # a component with no model
    r.update(bound=[["s1", "coder", "w2"], ["s-unknown", "coder", "w1"]])
    assert r.target("s1", "Coder", None) == ("w2", "t", "coder")
    assert ("s-unknown", "coder") not in r.bound  # bindings only of sessions routed for
    assert r.target("s1", "Anything", "chat") == ("w3", "t", "chat")  # a model= hint
    r.update(bound=[["s1", "coder", None]])
    assert r.target("s1", "Coder", None) is None  # the binding went
    r.resting["w3"] = float("inf")
    assert r.target("s1", "Chatter", None) is None
    r.forget("s1")
    assert "s1" not in r.sessions


def _admitted_on(sid: str, dask_scheduler: Any = None) -> str | None:
    return dask_scheduler.plugins["dask-agents"].admission.admitted_on.get((sid, "emu"))


def test_a_sessions_first_calls_go_straight_to_the_engine_its_client_binds(tmp_path):
    """Two engines of the model, no binding yet: with ``agents.client.bind-first-calls`` (the
    default) the client binds a new session itself, to the engine its own calls in flight load
    least, and the session's first calls (a fan-out) go straight there, nothing through the
    scheduler and no route request, their LLM calls beside them; the scheduler's admission binds
    the session to that engine from the records. A session opened while another's call is in
    flight on one engine goes to the other."""
    log, release = tmp_path / "log", tmp_path / "release"
    with _installed(2) as c:
        c.run_on_scheduler(_count_graph_keys)
        routes = c._agents_routes
        with da.session(c):
            wait_for(lambda: routes.token)
        wait_for(lambda: _lease_out(c), timeout=120)  # both engines report first (slow under a loaded machine)
        with da.session(c) as s:
            futs = [da.stub(dc.Writer).write([7] * (16 + i)) for i in range(3)]
            outs = [f.value() for f in futs]
            bound = outs[0]["worker"]
            assert wait_for(lambda: c.run_on_scheduler(_admitted_on, s.id)) == bound
        for f, out in zip(futs, outs):
            call = _direct(f)
            assert call is not None and call.state == "finished" and call.worker == bound
            assert out["worker"] == out["llm_worker"] == bound and out["output"] == 4
        assert not {f.key for f in futs} & _graph_keys(c) and not routes.awaiting

        held: dict = {}

        def first_session() -> None:
            with da.session(c):
                fut = da.stub(dc.Writer).logged_wait(str(log), str(release))
                held["call"] = _direct(fut)
                held["where"] = fut.value()

        t = threading.Thread(target=first_session)
        t.start()
        try:
            wait_for(lambda: log.exists() and log.read_text().strip())
            with da.session(c):
                other = da.stub(dc.Writer).write([8] * 16).value()
        finally:
            release.write_text("go")
            t.join(60)
        assert held["call"] is not None and held["where"] == held["call"].worker
        assert other["worker"] == other["llm_worker"] != held["where"]

        # something of the model short (no lease out on the workers): the worker cannot admit
        # the session the client bound, refuses the call, and it takes the scheduler path,
        # where admission binds the session; the client's binding goes, the scheduler's comes
        # (once the sessions above have ended there and their leases went out: nothing changes
        # the leases again until the next session's call)
        wait_for(lambda: c.run_on_scheduler(_no_sessions_admitted))
        c.run(_withdraw_leases)
        with da.session(c) as s:
            f = da.stub(dc.Writer).write([9] * 16)
            out = f.value()
            assert _direct(f).state == "scheduler" and f.key in _graph_keys(c)
            bound = wait_for(lambda: c.run_on_scheduler(_admitted_on, s.id))
            assert out["llm_worker"] == bound and (s.id, "emu") not in routes.provisional
            assert wait_for(lambda: routes.bound.get((s.id, "emu"))) == bound
        refused = c.run(lambda dask_worker: dask_worker.plugins["dask-agents"].direct.counts["refused:not admitted"])
        assert sum(refused.values()) == 1


def _no_sessions_admitted(dask_scheduler: Any = None) -> bool:
    admission = dask_scheduler.plugins["dask-agents"].admission
    return not admission.admitted_on and not admission._lease_soon


def _withdraw_leases(dask_worker: Any = None) -> None:
    dask_worker.plugins["dask-agents"].local.leases = {}


def test_routes_ask_for_a_route_only_where_the_binding_alone_is_missing():
    """A call may wait for a route request's answer only in a session this client opened, when
    its model is known and has several engines not resting and its session has no binding of
    it, and unless ``agents.client.route-first-calls`` is off; the answer is a binding."""
    from dask_agents.direct import Routes

    r = Routes()
    r.opened.add("s1")
    r.update(token="t", session="s1", models={"coder": ["w1", "w2"], "chat": ["w3"]}, components={"Coder": "coder"})
    with dask.config.set({"agents.client.route-first-calls": False, "agents.client.bind-first-calls": False}):
        assert r.unrouted("s1", "Coder", None) is None  # turned off
    with dask.config.set({"agents.client.route-first-calls": True, "agents.client.bind-first-calls": False}):
        assert r.unrouted("s1", "Coder", None) == (None, "t", "coder")
        assert r.unrouted("s-not-opened-here", "Coder", None) is None  # another client's session
        assert r.unrouted("s1", "Planner", None) is None  # no model
        assert r.unrouted("s1", "Planner", "chat") is None  # one engine: routed already (target)
        r.resting["w2"] = float("inf")
        assert r.unrouted("s1", "Coder", None) is None  # one engine left to choose: the scheduler path
        r.resting.clear()
        r.update(routed=["s1", "coder", "w2"])
        assert r.unrouted("s1", "Coder", None) is None and r.target("s1", "Coder", None) == ("w2", "t", "coder")
        r.update(routed=["s2", "coder", None])
        assert ("s2", "coder") not in r.bound
        assert Routes().unrouted("s1", "Coder", None) is None  # no token


def test_the_scheduler_tells_a_sessions_owner_its_token_engines_and_bindings():
    from dask_agents.scheduler_plugin import direct as sd
    from dask_agents.tokens import direct_token

    sent: list[tuple[str, dict]] = []

    class Scheduler:
        def client_send(self, client: str, msg: dict) -> None:
            sent.append((client, msg))

    routes = sd.DirectRoutes(lambda: Scheduler(), lambda: "secret", lambda: {"coder": {"w2", "w1"}, "gone": set()},
                             lambda: {"Coder": "coder"})
    routes.opened("s1", "client-a")
    routes.opened("s3", "client-a")  # nothing changed since: only the session
    routes.bound("s1", "llm:coder", "w1")
    routes.bound("s1", "Stateful", "w1")  # not an engine binding: not told
    routes.bound("s2", "llm:coder", "w2")  # not a session of a client that takes routes
    routes.ended("s1")
    routes.bound("s1", "llm:coder", "w2")
    assert sent == [("client-a", {"op": "agents-direct", "token": direct_token("secret", "client-a"), "session": "s1",
                                  "models": {"coder": ["w1", "w2"]}, "components": {"Coder": "coder"}}),
                    ("client-a", {"op": "agents-direct", "session": "s3"}),
                    ("client-a", {"op": "agents-direct", "bound": [["s1", "coder", "w1"]]})]


def test_only_the_driver_a_value_was_held_for_can_have_it_forgotten(client, tmp_path):
    """``agents_direct_forget`` from anyone else (no token, or a key not held for that client:
    another client's direct value, an ordinary task's result) leaves the data alone."""
    worker = next(iter(client.scheduler_info()["workers"]))
    plain = client.submit(lambda: 41, pure=False, key="ordinary-result")
    assert plain.result() == 41
    with da.session(client):
        held = da.stub(dc.Writer).double(3)
        assert held.value() == 6

    async def forget(key: str, token: str):
        await client.rpc(worker).agents_direct_forget(key=key, client=client.id, token=token)

    real = client._agents_routes.token
    for key, token in (("ordinary-result", real), (held.key, "0" * 32), ("ordinary-result", "0" * 32)):
        client.sync(forget, key, token)
    def present(dask_worker=None, keys=(plain.key, held.key)):
        return [k in dask_worker.data for k in keys]

    assert next(iter(client.run(present).values())) == [True, True]
    assert plain.result() == 41 and held.value() == 6
    refused = client.run(lambda dask_worker: dask_worker.plugins["dask-agents"].direct.counts["refused:forget"])
    assert next(iter(refused.values())) >= 3


def test_leaving_a_session_with_an_exception_drops_its_running_direct_calls(client, tmp_path):
    """The driver gives up on its session while a direct call runs: the call's future is
    cancelled at once, its worker's answer is dropped (the value forgotten), and the session
    still completes once the worker's records of the call arrive."""
    log, release = tmp_path / "log", tmp_path / "release"
    with pytest.raises(RuntimeError, match="driver gave up"):
        with da.session(client) as s:
            fut = da.stub(dc.Writer).logged_wait(str(log), str(release))
            assert _direct(fut) is not None
            wait_for(log.exists)
            raise RuntimeError("driver gave up")
    assert fut.status == "cancelled"
    with pytest.raises(FutureCancelledError):
        fut.value()
    release.write_text("go")
    g = wait_for(lambda: (g := da.session_graph(client, s)).state == "completed" and g)
    assert [n.call_id for n in g.nodes] == [fut.key]
    key = fut.key
    wait_for(lambda: not any(client.run(lambda dask_worker: key in dask_worker.data).values()))
