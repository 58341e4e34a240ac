"""Control policies on synthetic views (no cluster): the right action, and none below thresholds."""

from __future__ import annotations

import pytest

from dask_agents.scheduler_plugin.actions import Migrate
from dask_agents.scheduler_plugin.control import load_policies
from dask_agents.scheduler_plugin.policies.balance import LateBindingBalance
from dask_agents.scheduler_plugin.policies.prioritize import Prioritize, fifo, priority
from dask_agents.scheduler_plugin.view import CallView, ClusterView, ComponentView, SessionView, WorkerView

NOW = 1000.0


def call(key, worker="A", session="s1", comp="Dev", prio=None, model=None, stateful=False, nbytes=0, arrival=0,
         tenant=None):
    return CallView(key=key, component=comp, kind="llm" if model else "agent", session=session, tenant=tenant,
                    worker=worker, priority=prio or fifo(0, arrival), created=NOW - 1, ready=NOW - 1,
                    stateful=stateful, model=model, input_bytes=nbytes)


def worker(addr, queued=(), nthreads=1, running=1, models=(), idle_since=None):
    return WorkerView(address=addr, nthreads=nthreads, processing=running + len(queued), running=running,
                      queued=tuple(queued), models=tuple(models), idle_since=idle_since)


def view(workers, calls, sessions=(), components=(), affinity=None, kv_tokens=None):
    return ClusterView.freeze(
        NOW, {w.address: w for w in workers}, {c.key: c for c in calls},
        {s.id: s for s in sessions}, {c.name: c for c in components}, affinity or {}, kv_tokens=kv_tokens,
    )


def session(sid, progress=0, created=NOW - 1, tenant=None, workflow=None):
    return SessionView(sid, tenant, created, progress, 1, "active", workflow)


# -- prioritization ----------------------------------------------------------------------------

def test_progress_orders_calls_and_fifo_breaks_ties():
    calls = [call("new", session="fresh", arrival=9), call("retry", session="old", arrival=10)]
    v = view([worker("A", ["new", "retry"])], calls, [session("fresh", 0), session("old", 7)])
    acts = {a.key: a.priority for a in Prioritize()(v)}
    assert acts == {"retry": priority(0, 7, 10)}  # "new" already has the right (FIFO) tuple
    assert sorted([acts["retry"], calls[0].priority])[0] == acts["retry"]  # the retry runs first


def test_no_action_when_priorities_are_already_right():
    c = call("x", session="s", prio=priority(0, 3, 5))
    v = view([worker("A", ["x"])], [c], [session("s", 3)])
    assert list(Prioritize()(v)) == []


def test_fair_share_lifts_a_starved_session_above_progress():
    comps = [ComponentView("Dev", 1.0, 10, 2.0)]  # expected session time 2 s
    calls = [call("long", session="agent50", arrival=1), call("short", session="chat", arrival=2)]
    sessions = [session("agent50", progress=40, created=NOW - 5), session("chat", progress=0, created=NOW - 9)]
    acts = {a.key: a for a in Prioritize(fair_share_slowdown=4.0)(view([worker("A", ["long", "short"])], calls, sessions, comps))}
    # chat waited 9 s > 4 x 2 s: starved, runs ahead of the 40-call agent
    assert acts["short"].priority < acts["long"].priority and acts["short"].reason == "fair-share"
    calm = Prioritize(fair_share_slowdown=10.0)(view([worker("A", ["long", "short"])], calls, sessions, comps))
    assert {a.key: a.priority for a in calm}["long"] == priority(0, 40, 1)  # below threshold: progress rules


def test_kv_resident_calls_go_first_among_equals():
    a = call("a", session="s1", model="coder", arrival=1)
    b = call("b", session="s2", model="coder", arrival=2)
    v = view([worker("A", ["a", "b"])], [a, b], [session("s1"), session("s2")], affinity={("s2", "coder"): "A"})
    acts = {x.key: x.priority for x in Prioritize()(v)}
    assert acts == {"b": priority(0, 0, 2, kv_resident=True)} and acts["b"] < a.priority


def test_held_llm_calls_of_sessions_bound_to_an_engine_go_first_among_equals():
    """Calls the scheduler holds for engine room (worker None): a session already bound to an
    engine (its KV is there) binds before a new session, all else equal."""
    new = call("new", worker=None, session="s1", model="coder", arrival=1)
    bound = call("bound", worker=None, session="s2", model="coder", arrival=2)
    v = view([worker("A")], [new, bound], [session("s1"), session("s2")], affinity={("s2", "coder"): "A"})
    acts = {x.key: x.priority for x in Prioritize()(v)}
    assert acts == {"bound": priority(0, 0, 2, kv_resident=True)} and acts["bound"] < new.priority


def test_bad_prioritize_options():
    with pytest.raises(ValueError):
        Prioritize(fair_share_key="planet")
    with pytest.raises(ValueError):
        Prioritize(fair_share_slowdown=0)
    with pytest.raises(ValueError, match="fair_share_slo\\['acme'\\] must be a positive number"):
        Prioritize(fair_share_slo={"acme": "soon"})


def test_fair_share_orders_two_workflows_by_their_own_expected_times():
    """SAGA's Agent Fair Share per workflow: a chat session (its workflow's sessions took 1 s)
    that has waited 6 s is starved; a coding session (its workflow's took 60 s) that has waited
    60 s is not, although one budget for all (the flattened graph's 10 s) said the opposite of
    neither and starved the coding agent. The more starved (by budgets taken) run first."""
    comps = [ComponentView("Dev", 1.0, 10, 10.0)]  # the flattened graph: 10 s per session
    calls = [call("code", session="coder", arrival=1), call("chat", session="chat", arrival=2),
             call("chat2", session="chat2", arrival=3)]
    sessions = [session("coder", progress=30, created=NOW - 60, workflow="Planner"),
                session("chat", progress=0, created=NOW - 6, workflow="Router"),
                session("chat2", progress=0, created=NOW - 13, workflow="Router")]
    expected = {"Planner": 60.0, "Router": 1.0}
    v = ClusterView.freeze(NOW, {"A": worker("A", ["code", "chat", "chat2"])}, {c.key: c for c in calls},
                           {x.id: x for x in sessions}, {c.name: c for c in comps}, expected_times=expected)
    acts = {a.key: a.priority for a in Prioritize(fair_share_slowdown=4.0)(v)}
    assert acts["code"] == priority(0, 30, 1)  # 60 s of a 240 s budget: progress order only
    assert acts["chat"] == priority(0, 0, 2, starved=1)  # 6 s past 4 x 1 s: one budget
    assert acts["chat2"] == priority(0, 0, 3, starved=3)  # 13 s: three budgets, runs first
    assert acts["chat2"] < acts["chat"] < acts["code"]
    # one budget for all (no workflow history yet): the coding agent starves, the chats do not
    flat = ClusterView.freeze(NOW, {"A": worker("A", ["code", "chat", "chat2"])}, {c.key: c for c in calls},
                              {x.id: x for x in sessions}, {c.name: c for c in comps})
    acts = {a.key: a.priority for a in Prioritize(fair_share_slowdown=4.0)(flat)}
    assert acts == {"code": priority(0, 30, 1, starved=1)}


def test_a_tenants_slo_is_its_sessions_budget():
    calls = [call("gold", session="g", tenant="gold", arrival=1), call("free", session="f", tenant="free", arrival=2)]
    sessions = [session("g", created=NOW - 3, tenant="gold", workflow="Router"),
                session("f", created=NOW - 3, tenant="free", workflow="Router")]
    v = ClusterView.freeze(NOW, {"A": worker("A", ["gold", "free"])}, {c.key: c for c in calls},
                           {x.id: x for x in sessions}, {}, expected_times={"Router": 10.0})
    for key in ("session", "tenant"):
        acts = {a.key: a.priority for a in Prioritize(fair_share_key=key, fair_share_slo={"gold": 2.0})(v)}
        assert acts == {"gold": priority(0, 0, 1, starved=1)}  # 3 s past its 2 s SLO; free has 40 s


def test_the_state_learns_each_workflows_completion_time():
    """A session's workflow is the component of its first call; its completed sessions' times
    (the median of the latest) become that workflow's expected time, once there are enough."""
    from dask_agents.scheduler_plugin.state import WORKFLOW_MIN_SESSIONS, WorkflowState

    st = WorkflowState()
    runs = [("Planner", 50.0), ("Router", 1.0), ("Planner", 70.0), ("Router", 2.0), ("Planner", 60.0),
            ("Router", 3.0)]
    for i, (root, took) in enumerate(runs):
        sid, t0 = f"s{i}", 100.0 * i
        st.add_call(f"{root}-{i}", {"session": sid, "component": root}, (), t0)
        st.add_call(f"llm-{i}", {"session": sid, "component": "llm.coder"}, (), t0 + 0.1)  # not its root
        assert st.sessions[sid].workflow == root
        st.close_session(sid, t0)
        st.on_transition(f"llm-{i}", "memory", t0 + took / 2)
        st.on_transition(f"{root}-{i}", "memory", t0 + took)
        assert st.sessions[sid].state == "completed"
        if i < 2 * WORKFLOW_MIN_SESSIONS - 2:
            assert st.expected_times() == {}  # too few of either yet
    assert st.expected_times() == {"Planner": 60.0, "Router": 2.0}
    # a completed session reopened by a late call and completed again counts once; a session
    # with a failed call, or one the scheduler closed, does not count
    st.add_call("Router-late", {"session": "s1", "component": "Router"}, (), 900.0)
    st.on_transition("Router-late", "memory", 999.0)
    assert st.sessions["s1"].state == "completed" and len(st.workflow_times["Router"]) == 3
    st.add_call("Router-bad", {"session": "bad", "component": "Router"}, (), 1000.0)
    st.close_session("bad", 1000.0)
    st.on_transition("Router-bad", "erred", 1900.0, error="boom")
    assert st.sessions["bad"].state == "completed" and len(st.workflow_times["Router"]) == 3
    assert st.expected_times() == {"Planner": 60.0, "Router": 2.0}


# -- late-binding balance ---------------------------------------------------------------------

def test_moves_lowest_priority_calls_from_overloaded_to_idle():
    calls = [call(f"c{i}", arrival=i) for i in range(6)]
    v = view([worker("A", [c.key for c in calls]), worker("B", running=0)], calls)
    moves = list(LateBindingBalance()(v))
    assert moves and all(isinstance(m, Migrate) and m.source == "A" and m.target == "B" for m in moves)
    assert [m.key for m in moves] == ["c5", "c4", "c3"]  # last in line move; queues end 3 vs 3


def test_no_move_below_alpha_or_beta():
    calls = [call(f"c{i}", arrival=i) for i in range(5)]
    balanced = view([worker("A", ["c0", "c1", "c2"]), worker("B", ["c3", "c4"])], calls)
    assert list(LateBindingBalance(alpha=0.5)(balanced)) == []
    # gain (2 calls x 10 ms) does not beat a 1 s move cost
    cheap = [ComponentView("Dev", 0.01, 10, 1.0)]
    v = view([worker("A", ["c0", "c1"]), worker("B", running=0)], calls[:2], components=cheap)
    assert list(LateBindingBalance(move_overhead="1s")(v)) == []
    heavy = [call("h0", nbytes=10**9), call("h1", nbytes=10**9, arrival=1)]  # 10 s of data to move
    assert list(LateBindingBalance()(view([worker("A", ["h0", "h1"]), worker("B", running=0)], heavy))) == []


def test_stateful_calls_keep_their_instance():
    calls = [call(f"c{i}", stateful=True, arrival=i) for i in range(4)]
    assert list(LateBindingBalance()(view([worker("A", [c.key for c in calls]), worker("B", running=0)], calls))) == []


def test_llm_calls_move_only_to_workers_hosting_the_model():
    calls = [call(f"c{i}", model="coder", session=f"s{i}", arrival=i) for i in range(4)]
    ws = [worker("A", [c.key for c in calls], models=["coder"]), worker("B", running=0),
          worker("C", running=0, models=["coder"])]
    moves = list(LateBindingBalance()(view(ws, calls)))
    assert moves and {m.target for m in moves} == {"C"}


def test_kv_holding_llm_calls_need_an_idle_and_much_less_loaded_thief():
    calls = [call(f"c{i}", model="coder", arrival=i) for i in range(4)]
    affinity = {("s1", "coder"): "A"}
    busy_thief = [worker("A", [c.key for c in calls], models=["coder"]), worker("B", running=0, models=["coder"], idle_since=NOW - 0.01)]
    assert list(LateBindingBalance(t_idle="100ms")(view(busy_thief, calls, affinity=affinity))) == []
    idle_thief = [busy_thief[0], worker("B", running=0, models=["coder"], idle_since=NOW - 1)]
    assert list(LateBindingBalance(t_idle="100ms")(view(idle_thief, calls, affinity=affinity)))


def test_the_recompute_of_a_moved_sessions_kv_is_priced_into_the_move():
    # Same queues, idle thief: a short context moves, a long one (its recompute costs more
    # than the wait it saves) stays with its KV.
    calls = [call(f"c{i}", model="coder", arrival=i) for i in range(4)]
    affinity = {("s1", "coder"): "A"}
    ws = [worker("A", [c.key for c in calls], models=["coder"]), worker("B", running=0, models=["coder"], idle_since=NOW - 1)]
    short = list(LateBindingBalance(prefill_rate=8000)(view(ws, calls, affinity=affinity, kv_tokens={("s1", "coder"): 800})))
    assert short and short[0].target == "B"
    long = list(LateBindingBalance(prefill_rate=8000)(view(ws, calls, affinity=affinity, kv_tokens={("s1", "coder"): 80_000})))
    assert long == []
    # KV that lives elsewhere costs nothing to leave
    elsewhere = {("s1", "coder"): "C"}
    assert list(LateBindingBalance()(view(ws, calls, affinity=elsewhere, kv_tokens={("s1", "coder"): 80_000})))
    with pytest.raises(ValueError, match="prefill_rate"):
        LateBindingBalance(prefill_rate=0)


# -- configuration -------------------------------------------------------------------------------

def test_policies_load_by_dotted_path_with_options():
    pols = load_policies({
        "prioritize": {"class": "dask_agents.scheduler_plugin.policies.prioritize.Prioritize", "options": {"fair-share-slowdown": 2}},
        "balance": {"class": "dask_agents.scheduler_plugin.policies.balance.LateBindingBalance", "enabled": False},
    })
    assert list(pols) == ["prioritize"] and pols["prioritize"].slowdown == 2.0
    with pytest.raises(ValueError, match="agents.control.policies.x: cannot import"):
        load_policies({"x": {"class": "no.such.Policy"}})
    # a class path written before the modules moved under dask_agents: the error says where
    # (from the repository's root the old folder would still import: try from anywhere else)
    with pytest.raises(ValueError, match=r"'dask_agents\.scheduler_plugin\.policies\.nope\.Policy'"):
        load_policies({"x": {"class": "scheduler_plugin.policies.nope.Policy"}})
    with pytest.raises(ValueError, match="bad options"):
        load_policies({"p": {"class": "dask_agents.scheduler_plugin.policies.prioritize.Prioritize", "options": {"nope": 1}}})


# -- reallocation ------------------------------------------------------------------------------
from dask_agents.scheduler_plugin.actions import Reassign  # noqa: E402
from dask_agents.scheduler_plugin.policies.reallocate import Reallocate  # noqa: E402
from dask_agents.scheduler_plugin.view import ModelView  # noqa: E402


def realloc_views(chat_rate, code_rate, ticks, replicas=None, start=0.0, counters=None):
    """Views one second apart where chat/code calls arrive at these rates and each replica
    completes 1 call per second while it has work."""
    replicas = replicas or {"chat": ("A", "B"), "coder": ("C",)}
    counters = counters if counters is not None else {"chat": [0, 0, 0], "coder": [0, 0, 0]}  # created, completed, open
    rates = {"chat": chat_rate, "coder": code_rate}
    out = []
    for t in range(ticks):
        comps = {}
        for m, (cr, done, open_) in counters.items():
            cr += rates[m]
            served = min(open_ + rates[m], len(replicas[m]))
            done += served
            open_ = open_ + rates[m] - served
            counters[m] = [cr, done, open_]
            comps[f"llm.{m}"] = ComponentView(f"llm.{m}", 1.0, cr, 1.0, open_, done)
        ws = [worker(w, running=0) for ws_ in replicas.values() for w in ws_]
        models = {m: ModelView(m, f"llm.{m}", tuple(r)) for m, r in replicas.items()}
        v = ClusterView.freeze(start + t, {w.address: w for w in ws}, {}, {}, comps, {}, False, models)
        out.append(v)
    return out, counters


def test_reallocation_moves_a_replica_to_the_persistent_bottleneck():
    pol = Reallocate(persistence=4, window="5s", min_completions=2)
    views, _ = realloc_views(chat_rate=0.2, code_rate=3, ticks=8)
    acts = [list(pol(v)) for v in views]
    fired = [i for i, a in enumerate(acts) if a]
    assert fired and fired[0] >= 4  # not before K ticks of the same bottleneck (1 warm-up tick)
    a = acts[fired[0]][0]
    assert isinstance(a, Reassign) and a.source == "chat" and a.target == "coder" and a.worker in ("A", "B")


def test_no_reallocation_when_balanced_or_below_min_replicas():
    pol = Reallocate(persistence=2, window="5s", min_completions=2)
    views, _ = realloc_views(chat_rate=2, code_rate=1, ticks=10)
    assert not any(list(pol(v)) for v in views)  # capacity matches demand: nothing to gain
    pol = Reallocate(persistence=2, window="5s", min_completions=2)
    views, _ = realloc_views(chat_rate=0.1, code_rate=5, ticks=10, replicas={"chat": ("A",), "coder": ("C",)})
    assert not any(list(pol(v)) for v in views)  # the donor would fall below its minimum (1)


# -- batching ----------------------------------------------------------------------------------
from dask_agents.scheduler_plugin.policies.batching import Batching  # noqa: E402


def bcall(key, worker, arrival=0, cap=4):
    return CallView(key=key, component="Embed", kind="tool", session=None, tenant=None, worker=worker,
                    priority=fifo(0, arrival), created=NOW, ready=NOW, batch_max=cap)


def test_batching_gathers_spread_calls_on_one_worker_up_to_max_batch():
    calls = [bcall("a1", "A", 1), bcall("a2", "A", 2), bcall("b1", "B", 3), bcall("c1", "C", 4), bcall("c2", "C", 5)]
    v = view([worker("A", ["a1", "a2"]), worker("B", ["b1"]), worker("C", ["c1", "c2"], running=2)], calls)
    moves = list(Batching()(v))
    assert [(m.key, m.target) for m in moves] == [("b1", "A"), ("c1", "A")]  # A fills to 4
    together = [bcall("a1", "A"), bcall("a2", "A", 1)]
    assert list(Batching()(view([worker("A", ["a1", "a2"]), worker("B")], together))) == []


def test_balance_leaves_batchable_calls_to_batching():
    calls = [bcall(f"a{i}", "A", i) for i in range(6)]
    assert list(LateBindingBalance()(view([worker("A", [c.key for c in calls]), worker("B", running=0)], calls))) == []


def test_reallocation_provisions_when_no_donor_and_allowed():
    from dask_agents.scheduler_plugin.actions import Provision

    reps = {"chat": ("A",), "coder": ("C",)}
    pol = Reallocate(persistence=2, window="5s", min_completions=2, provision=True, provision_cooldown="100s")
    views, _ = realloc_views(chat_rate=0.1, code_rate=5, ticks=12, replicas=reps)
    acts = [a for v in views for a in pol(v)]
    assert acts == [Provision(1, "coder", reason=acts[0].reason)]  # once: then the cooldown
    off = Reallocate(persistence=2, window="5s", min_completions=2)
    views, _ = realloc_views(chat_rate=0.1, code_rate=5, ticks=12, replicas=reps)
    assert not [a for v in views for a in off(v)]  # opt-in


def test_engine_priority_keeps_the_workflow_order():
    from dask_agents.worker_plugin.host import engine_priority

    new, advanced, starved = priority(0, 0, 1), priority(0, 5, 9), priority(0, 0, 10, starved=True)
    assert engine_priority(starved) < engine_priority(advanced) < engine_priority(new)
    assert engine_priority(priority(-1, 0, 1)) < engine_priority(starved)  # user priority still wins
    assert engine_priority((0, 3, 1)) == 0  # not ours: neutral
    # the most starved (a deficit of 4) stays within its user priority, in the engine as in Dask
    most = priority(0, 0, 10, starved=4)
    assert engine_priority(priority(-1, 0, 1)) < engine_priority(most) < engine_priority(priority(0, 9, 2, starved=3))
    assert engine_priority(most) < engine_priority(priority(1, 0, 1, starved=4))
    assert priority(-1, 0, 1) < most < priority(1, 0, 1, starved=4)


def test_reallocation_ignores_too_few_completions():
    """A tick with 0 or 1 completions says little: no service rate until the window holds enough."""
    pol = Reallocate(persistence=1, window="3s", min_completions=50)
    views, _ = realloc_views(chat_rate=0.2, code_rate=3, ticks=8)
    assert not [a for v in views for a in pol(v)] and pol.mu == {}


def test_a_kv_holding_call_that_is_its_engines_only_work_stays():
    """One LLM call queued for a moment on its session's engine, an idle engine beside it: the
    move would only trade a thread slot's wait for a recompute."""
    c = call("c0", model="coder")
    ws = [worker("A", ["c0"], running=0, nthreads=4, models=["coder"]),
          worker("B", running=0, nthreads=4, models=["coder"], idle_since=NOW - 10)]
    assert list(LateBindingBalance()(view(ws, [c], affinity={("s1", "coder"): "A"}))) == []
    assert list(LateBindingBalance()(view(ws, [c])))  # without KV there it may go
