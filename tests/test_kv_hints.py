"""What the scheduler tells the workers holding a session's KV (no cluster: fake call records)."""

from __future__ import annotations

from dataclasses import dataclass

import dask
import pytest

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


def after_an_llm_step():
    """Hints after one LLM step of session s1 on w1 (its KV is there, the session paused)."""
    h, sent = hints()
    llm = Rec("llm.coder-1", "llm")
    h.on_transition(llm, "processing", "w1", now=0.0)
    h.on_transition(llm, "memory", None, now=1.0)
    return h, sent, llm


def test_the_last_tool_returning_tells_the_holders_the_session_resumes():
    """A session's KV waits on its tools; when the last of them returns (and no LLM call of it
    runs) its next LLM call is coming: the holders hear ``running`` (restore now), not before."""
    h, sent, llm = after_an_llm_step()
    tests, lint = Rec("run_tests-1", "tool", tool_kind="code_exec"), Rec("lint-1", "tool", tool_kind="file_io")
    h.on_transition(tests, "processing", "w2", now=1.0)
    h.on_transition(lint, "processing", "w2", now=1.0)
    h.on_transition(lint, "memory", None, now=1.2)  # the tests still run: still paused
    assert [(m[1], m[3]) for m in sent] == [("running", None), ("paused", None), ("paused", "code_exec"),
                                            ("paused", "file_io")]
    h.on_transition(tests, "memory", None, now=9.0)
    assert sent[-1] == ("w1", "running", None, None) and not h.tools
    # and what they took is learned, per kind
    assert h.latency_of("code_exec").n == 1 and h.latency_of("file_io").n == 1
    assert h.latency_of("code_exec")._sorted == [pytest.approx(8.0)]


def test_remaining_is_the_longest_expected_rest_of_the_tools_in_flight():
    """The expected rest of a pause: per tool in flight its kind's latency given how long it
    ran (the prior until enough samples, then the samples); None while an LLM call of the
    session runs or it waits on no tool (nothing to predict from)."""
    with dask.config.set({"agents.kv.min-samples": 3}):
        h, _ = hints()
    assert h.remaining("s1", 0.0) is None
    for i, d in enumerate((10.0, 20.0, 30.0)):  # code_exec calls took 10, 20 and 30 s
        t = Rec(f"t-{i}", "tool", tool_kind="code_exec")
        h.on_transition(t, "processing", "w", now=0.0)
        h.on_transition(t, "memory", None, now=d)
    slow, fast = Rec("tests-9", "tool", tool_kind="code_exec"), Rec("read-9", "tool", tool_kind="file_io")
    h.on_transition(slow, "processing", "w", now=100.0)
    h.on_transition(fast, "processing", "w", now=100.0)
    assert h.remaining("s1", 100.0) == pytest.approx(20.0)  # mean of 10, 20, 30: the longest rest
    h.on_transition(fast, "memory", None, now=101.0)
    assert h.remaining("s1", 115.0) == pytest.approx(10.0)  # ran 15 s: 20 or 30, 10 s more expected
    assert h.remaining("s2", 115.0) is None
    llm = Rec("llm.coder-2", "llm")
    h.on_transition(llm, "processing", "w", now=116.0)  # an LLM call runs (a parallel branch)
    assert h.remaining("s1", 116.0) is None
    h.on_transition(llm, "erred", None, now=117.0)
    h.on_transition(slow, "erred", None, now=118.0)  # failed: not a latency sample
    assert h.latency_of("code_exec").n == 3 and "s1" not in h.tools
    h.on_transition(Rec("read-10", "tool", tool_kind="file_io"), "processing", "w", now=119.0)
    h.on_session_end("s1")
    assert h.remaining("s1", 120.0) is None and not h.tools


def test_tool_priors_are_scaled_by_the_emulation_time_scale():
    from dask_agents.kv.runtime.tool_latency import prior

    with dask.config.set({"agents.emulation.time-scale": 0.1}):
        h, _ = hints()
    assert h.latency_of("code_exec").prior.p50 == pytest.approx(prior("code_exec").p50 * 0.1)
    assert h.latency_of("no-such-kind").prior.p50 == pytest.approx(prior("custom").p50 * 0.1)


def test_latency_models_are_bounded_in_number():
    """Tool kinds are clients' strings: past ``MAX_KINDS`` models, unknown kinds share the
    default kind's (memory on the scheduler stays bounded)."""
    h, _ = hints()
    h.MAX_KINDS = 4
    models = [h.latency_of(f"kind-{i}") for i in range(10)]
    assert len(h.latency) == 5 and models[-1] is h.latency["custom"]
    assert h.latency_of("code_exec") is h.latency["code_exec"]  # a known kind always has its own


def test_only_a_tool_call_ending_in_flight_resumes_the_session():
    """``running`` goes out when a tool call that was in flight ends (memory or erred), not on a
    release after its result was used, a release to run it again (its worker was lost), nor
    the end of a call that never started; and not while another tool of the session runs."""
    h, sent, llm = after_an_llm_step()
    t1, t2 = Rec("t-1", "tool", tool_kind="code_exec"), Rec("t-2", "tool", tool_kind="code_exec")
    h.on_transition(t1, "processing", "w2", now=1.0)
    h.on_transition(t1, "released", None, now=2.0)  # its worker was lost: it runs again
    h.on_transition(Rec("never-1", "tool", tool_kind="file_io"), "released", None, now=2.0)  # cancelled unstarted
    assert [m[1] for m in sent] == ["running", "paused", "paused"]
    h.on_transition(t1, "processing", "w3", now=2.5)
    h.on_transition(t2, "processing", "w3", now=2.5)
    h.on_transition(t1, "memory", None, now=4.0)  # t2 still runs
    assert sent[-1][1] == "paused"
    h.on_transition(t2, "memory", None, now=5.0)
    assert sent[-1][1] == "running"
    n = len(sent)
    h.on_transition(llm, "processing", "w1", now=5.1)
    h.on_transition(llm, "memory", None, now=6.0)
    h.on_transition(t2, "released", None, now=6.1)  # its result released once used: nothing
    assert [m[1] for m in sent[n:]] == ["running", "paused"]
