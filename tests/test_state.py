"""The scheduler plugin's workflow state, fed events directly (no cluster)."""

from __future__ import annotations

from dask_agents.scheduler_plugin.state import WorkflowState


def ann(key, comp, session="s1", creator="driver", deps=()):
    return {"call": key, "component": comp, "method": "m", "kind": "agent", "session": session,
            "creator": creator, "deps": list(deps), "created": 1.0}


def run(state, key, t):
    state.on_transition(key, "waiting", t)
    state.on_transition(key, "processing", t, worker="w1")
    state.on_report(key, t, t + 1, "w1", None)
    return state.on_transition(key, "memory", t + 1)


def test_session_lifecycle_and_progress():
    st = WorkflowState()
    st.add_call("a-1", ann("a-1", "A"), [], 0.0)
    st.add_call("b-1", ann("b-1", "B", deps=["a-1"]), ["a-1"], 0.0)
    st.add_call("c-1", ann("c-1", "C", creator="b-1"), [], 0.0)
    assert st.sessions["s1"].open_calls == 3
    assert run(st, "a-1", 1.0)
    st.close_session("s1", 2.0)
    assert st.sessions["s1"].state == "closing"  # calls still open
    run(st, "b-1", 2.0)
    run(st, "c-1", 3.0)
    g = st.session_graph("s1")
    assert g.state == "completed" and g.progress == 3
    assert {(e.src, e.dst, e.kind) for e in g.edges} == {("a-1", "b-1", "dependency"), ("b-1", "c-1", "created")}
    assert g.node("a-1").consumers == ["b-1"] and g.node("b-1").ready == 2.0
    wf = st.workflow_graph()
    assert wf.edges == {"A->B": 1, "B->C": 1}
    assert [c.mean_duration for c in wf.components] == [1.0, 1.0, 1.0]


def test_cancelled_and_erred_calls_close_the_session():
    st = WorkflowState()
    st.add_call("a-1", ann("a-1", "A"), [], 0.0)
    st.add_call("b-1", ann("b-1", "B"), [], 0.0)
    st.on_transition("a-1", "erred", 1.0)
    st.on_transition("b-1", "forgotten", 1.0)
    st.close_session("s1", 2.0)
    g = st.session_graph("s1")
    assert g.state == "completed" and g.progress == 0
    assert sorted(n.state for n in g.nodes) == ["cancelled", "erred"]
    assert not st.on_transition("a-1", "memory", 3.0)  # terminal stays terminal


def test_retention_and_caps_bound_memory():
    st = WorkflowState(max_loose_calls=3)
    for i in range(5):
        sid = f"s{i}"
        st.add_call(f"k-{i}", ann(f"k-{i}", "A", session=sid), [], 0.0)
        run(st, f"k-{i}", float(i))
        st.close_session(sid, float(i))
    assert st.expire(now=4.5, retention=1.0, max_retained=100) == ["s0", "s1", "s2", "s3"]
    assert list(st.sessions) == ["s4"] and list(st.calls) == ["k-4"]
    st.add_call("x-1", ann("x-1", "A", session="s9"), [], 0.0)
    st.close_session("s9", 5.0)
    run(st, "x-1", 5.0)
    assert st.expire(now=5.0, retention=100.0, max_retained=1) == ["s4"]
    for i in range(5):  # calls outside sessions are capped
        st.add_call(f"loose-{i}", ann(f"loose-{i}", "L", session=None), [], 0.0)
    assert [k for k in st.calls if k.startswith("loose")] == ["loose-2", "loose-3", "loose-4"]


def test_late_call_reopens_a_completed_session():
    st = WorkflowState()
    st.add_call("a-1", ann("a-1", "A"), [], 0.0)
    run(st, "a-1", 0.0)
    st.close_session("s1", 1.0)
    assert st.sessions["s1"].state == "completed"
    st.add_call("b-1", ann("b-1", "B", creator="a-1"), [], 2.0)
    assert st.sessions["s1"].state == "closing" and "s1" not in st.completed
    run(st, "b-1", 2.0)
    assert st.sessions["s1"].state == "completed"
