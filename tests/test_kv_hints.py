"""What the scheduler tells the workers holding a session's KV (no cluster: fake call records)."""

from __future__ import annotations

from dataclasses import dataclass

from dask_agents.scheduler_plugin.kv_hints import HINT_OP, KVHints


@dataclass
class Rec:
    key: str
    kind: str
    session: str | None = "s1"
    creator: str = "Developer.implement-1234"
    tool_kind: str | None = None


def hints():
    sent = []
    return KVHints(lambda w, m: sent.append((w, m["state"], m["node"], m["wait_key"]))), sent


def test_llm_start_and_end_then_tool_wait():
    h, sent = hints()
    llm = Rec("llm.coder-1", "llm")
    h.on_transition(llm, "processing", "w1")
    h.on_transition(llm, "memory", None)
    h.on_transition(Rec("run_tests-1", "tool", tool_kind="code_exec"), "processing", "w2")
    assert sent == [("w1", "running", None, None), ("w1", "paused", "Developer.implement", None),
                    ("w1", "paused", None, "code_exec")]


def test_paused_only_when_no_llm_call_of_the_session_is_in_flight():
    h, sent = hints()
    a, b = Rec("llm.coder-a", "llm"), Rec("llm.coder-b", "llm")
    h.on_transition(a, "processing", "w1")
    h.on_transition(b, "processing", "w1")
    h.on_transition(a, "memory", None)
    h.on_transition(Rec("t-1", "tool", tool_kind="file_io"), "processing", "w2")  # b still runs: no hint
    assert [s for _, s, _, _ in sent] == ["running", "running"]
    h.on_transition(b, "erred", None)
    assert sent[-1][1] == "paused"


def test_no_hints_for_sessions_without_kv_or_without_session():
    h, sent = hints()
    h.on_transition(Rec("t-1", "tool", tool_kind="web_api"), "processing", "w1")  # no KV anywhere yet
    h.on_transition(Rec("llm.coder-x", "llm", session=None), "processing", "w1")
    h.on_transition(Rec("llm.coder-y", "llm"), "memory", None)  # never seen processing: ignored
    assert sent == []


def test_every_holder_hears_and_end_forgets():
    h, sent = hints()
    for i, w in enumerate(("w1", "w2")):  # a migrated call: the session's KV is on both
        r = Rec(f"llm.coder-{i}", "llm")
        h.on_transition(r, "processing", w)
        h.on_transition(r, "memory", None)
    sent.clear()
    h.on_transition(Rec("t", "tool", tool_kind="db_query"), "processing", "w3")
    assert sorted(w for w, *_ in sent) == ["w1", "w2"]
    h.on_session_end("s1")
    sent.clear()
    h.on_transition(Rec("t2", "tool", tool_kind="db_query"), "processing", "w3")
    assert sent == [] and HINT_OP == "agents-kv-hint"


def test_late_transitions_of_an_ended_session_leave_nothing_behind():
    h, sent = hints()
    r = Rec("llm.coder-z", "llm")
    h.on_transition(r, "processing", "w1")
    h.on_session_end("s1")
    h.on_transition(r, "memory", None)  # finishes after the session ended
    h.on_transition(Rec("llm.coder-w", "llm"), "processing", "w2")
    assert [m[1] for m in sent] == ["running"]
    assert not h.holders and not h.llm_open and not h._last and not h._processing


def test_forget_ends_a_call_whose_record_was_dropped():
    h, sent = hints()
    a, b = Rec("llm.coder-a", "llm"), Rec("llm.coder-b", "llm")
    h.on_transition(a, "processing", "w1")
    h.on_transition(b, "processing", "w1")
    h.forget("llm.coder-a")  # its end arrives after the workflow state dropped its record
    assert h.llm_open["s1"] == 1 and h._processing["s1"] == {"llm.coder-b"}
    assert [m[1] for m in sent] == ["running", "running"]  # b still runs: no pause yet
    h.forget("llm.coder-b")
    assert sent[-1][1] == "paused" and not h.llm_open and not h._processing and not h._session_of
    h.forget("llm.coder-b")  # twice, or any other task: nothing
    h.forget("plain-task-1")
    assert len(sent) == 3


def test_session_end_drops_the_key_index_too():
    h, _ = hints()
    h.on_transition(Rec("llm.coder-a", "llm"), "processing", "w1")
    h.on_session_end("s1")
    assert not h._session_of
