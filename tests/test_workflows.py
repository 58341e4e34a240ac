"""The Financial Analyst and Router example workflows: the Azure trace loader (real files when
``../shared`` has them, small synthetic files otherwise) and both workflows end to end on the
EMULATED engine with an in-process cluster and a tiny time scale."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import dask
import pytest
from distributed import Client, LocalCluster

import dask_agents as da
from examples.finance.workflow import ASPECTS, analyze_company, make_requests as finance_requests
from examples.router import trace as tr
from examples.router.workflow import BRANCH, Models, make_requests as router_requests, replay, route_of
from tests.conftest import wait_for

TIME_SCALE = 0.01
HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def _row(i: int, ctx: int = 100, gen: int = 10, second: float = 0.0) -> str:
    s = 10 + i * 0.5 + second
    return f"2023-11-16 18:00:{int(s):02d}.{int((s % 1) * 1e7):07d},{ctx},{gen}\n"


def _write(path: Path, body: str) -> Path:
    path.write_text(body)
    return path


@pytest.fixture
def synthetic_dir(tmp_path) -> Path:
    """Both trace files, small: conversation every 0.5 s from 18:00:10, code in between."""
    d = tmp_path / "azure-llm-2023"
    d.mkdir()
    _write(d / tr.FILES["conversation"], HEADER + "".join(_row(i, 200 + i, 20 + i) for i in range(40)))
    _write(d / tr.FILES["code"], HEADER + "".join(_row(i, 900 + i, 5 + i, second=0.25) for i in range(40)))
    return d


@pytest.fixture(scope="module")
def real_trace() -> tr.Trace:
    return tr.Trace.load(tr.trace_dir())  # the copy the package ships (dask_agents/data/traces)


# -- (a) the trace loader --------------------------------------------------------------------

def test_loads_the_real_trace(real_trace):
    counts = real_trace.counts()
    assert counts["code"] > 0 and counts["conversation"] > 0
    assert len(real_trace) == counts["code"] + counts["conversation"]
    ats = [a.at for a in real_trace]
    assert ats == sorted(ats) and ats[0] == 0.0 and real_trace.duration > 0
    assert {a.source for a in real_trace} == set(tr.FILES.values())
    first = real_trace.of("code")[0]
    assert first.line == 2 and first.label == "code" and first.context_tokens >= 0


def test_env_var_and_default_locate_the_trace(synthetic_dir, monkeypatch):
    monkeypatch.setenv(tr.ENV, str(synthetic_dir.parent))  # a directory holding azure-llm-2023
    assert tr.trace_dir() == synthetic_dir
    assert len(tr.Trace.load()) == 80
    monkeypatch.setenv(tr.ENV, str(synthetic_dir.parent / "nowhere"))
    with pytest.raises(FileNotFoundError, match=tr.ENV):
        tr.trace_dir()
    assert tr.trace_dir(synthetic_dir) == synthetic_dir  # an argument beats the variable


@pytest.mark.parametrize("body, line, what", [
    (HEADER + _row(0) + "2023-11-16 25:99:00.0000000,10,1\n" + _row(2), 3, "TIMESTAMP"),
    (HEADER + _row(0) + "yesterday,10,1\n", 3, "TIMESTAMP"),
    (HEADER + _row(0) + _row(1) + _row(2) + "2023-11-16 18:00:30.0000000,-4,2\n" + _row(4), 5, "ContextTokens"),
    (HEADER + _row(0) + _row(1) + _row(2) + "2023-11-16 18:00:30.0000000,4,1.5\n", 5, "GeneratedTokens"),
    ("TIMESTAMP,ContextTokens\n2023-11-16 18:00:10.0000000,4\n", 1, "GeneratedTokens"),
    (HEADER + _row(0) + _row(1) + "2023-11-16 18:00:30.0000000,4\n", 4, "expected 3 fields"),
    (HEADER, 1, "no data rows"),
])
def test_malformed_rows_name_file_and_line(tmp_path, body, line, what):
    path = _write(tmp_path / "AzureLLMInferenceTrace_code.csv", body)
    with pytest.raises(ValueError) as err:
        tr.read_csv(path, "code")
    msg = str(err.value)
    assert msg.startswith(f"AzureLLMInferenceTrace_code.csv: line {line}:"), msg
    assert what in msg


def test_a_malformed_file_fails_the_whole_load(synthetic_dir):
    conv = synthetic_dir / tr.FILES["conversation"]
    lines = conv.read_text().splitlines(keepends=True)
    lines[6] = "2023-11-16 18:00:30.0000000,12,-1\n"  # line 7 of the file
    conv.write_text("".join(lines))
    with pytest.raises(ValueError, match=re.escape(f"{tr.FILES['conversation']}: line 7:")):
        tr.Trace.load(synthetic_dir)


def test_merge_window_and_time_scale(synthetic_dir):
    trace = tr.Trace.load(synthetic_dir)
    assert trace.counts() == {"code": 40, "conversation": 40}
    assert [a.label for a in trace[:4]] == ["conversation", "code"] * 2  # merged by time
    assert [a.at for a in trace[:3]] == pytest.approx([0.0, 0.25, 0.5])
    w = trace.window(2.0, 3.0)
    expected = [a for a in trace if 2.0 <= a.at < 5.0]
    assert len(w) == len(expected) == 12
    assert [a.at for a in w] == pytest.approx([a.at - 2.0 for a in expected])
    assert [(a.label, a.line) for a in w] == [(a.label, a.line) for a in expected]
    fast = trace.window(2.0, 3.0, time_scale=0.1)
    assert [a.at for a in fast] == pytest.approx([(a.at - 2.0) * 0.1 for a in expected])
    assert fast.duration == pytest.approx(w.duration * 0.1)
    assert len(trace.window(1000, 5)) == 0
    h = trace.window(2.0, 100).head(5)
    assert len(h) == 5 and h[0].at == 0.0
    with pytest.raises(ValueError):
        trace.scaled(-1)


@pytest.mark.parametrize("source", ["synthetic", "real"])
def test_skewed_phases_are_dominated_by_one_label(source, synthetic_dir, request):
    trace = tr.Trace.load(synthetic_dir) if source == "synthetic" else request.getfixturevalue("real_trace")
    n, phases = 60, 3
    s = tr.skewed(trace, n, phases=phases, seed=3, time_scale=0.5)
    assert len(s) == n
    ats = [a.at for a in s]
    assert ats == sorted(ats) and ats[0] == 0.0
    dominant = []
    for k in range(phases):
        labels = [a.label for a in s if a.phase == k]
        assert len(labels) == n // phases
        top = max(set(labels), key=labels.count)
        assert labels.count(top) / len(labels) > 0.9
        dominant.append(top)
    assert dominant == ["code", "conversation", "code"]
    assert s.counts()["code"] > 0 and s.counts()["conversation"] > 0
    assert tr.skewed(trace, n, phases=phases, seed=3, time_scale=0.5).arrivals == s.arrivals  # seeded
    with pytest.raises(ValueError):
        tr.skewed(trace, 10, first="email")


def test_synthetic_text_routes_as_labeled(synthetic_dir, request):
    trace = tr.Trace.load(synthetic_dir)
    trace = tr.Trace(list(trace) + list(request.getfixturevalue("real_trace")[:3000]))
    reqs = router_requests(trace, seed=5, max_prompt_tokens=600, max_output_tokens=16)
    assert all(route_of(r.text) == BRANCH[r.label] for r in reqs)
    assert all(24 <= len(r.text.encode()) <= 600 and 1 <= r.max_tokens <= 16 for r in reqs)


# -- (b) both workflows end to end on the EMULATED engine ------------------------------------

def _emulated_models() -> dict:
    entry = {"model": "emulated-llama-8b", "engine": "emulated", "tokenizer": "byte", "max-model-len": 16384,
             "kv-cache-memory-bytes": "16 GiB", "emulation": {"time_scale": TIME_SCALE}}
    return {"chat": dict(entry), "coder": dict(entry)}


@pytest.fixture(scope="module")
def client():
    settings = {"agents.llm.models": _emulated_models(), "agents.emulation.time-scale": TIME_SCALE}
    with dask.config.set(settings):  # before the cluster: in-process workers read it
        with LocalCluster(n_workers=2, processes=False, threads_per_worker=8, dashboard_address=":0") as cluster:
            with Client(cluster) as c:
                da.install(c, models=["chat", "coder"])
                yield c


def _settled(client, session):
    """``(telemetry,)`` of the session once every call finished and reported its timings and tokens
    (a tuple: a DataFrame has no truth value for ``wait_for``)."""
    df = da.telemetry(client, session)
    llm = df[df["kind"] == "llm"]
    if len(df) and (df["state"] == "finished").all() and df["started"].notna().all() \
            and llm["cached_tokens"].notna().all():
        return (df,)
    return None


def _completed(client, session):
    g = da.session_graph(client, session)
    return g if g.state == "completed" else None


def test_finance_follow_ups_reuse_the_session_kv(client):
    requests = finance_requests(4, seed=1)
    assert any(len(r.follow_ups) == 2 for r in requests) and all(r.follow_ups for r in requests)
    with ThreadPoolExecutor(len(requests)) as pool:
        outcomes = list(pool.map(lambda r: analyze_company(client, r, time_scale=TIME_SCALE), requests))
    for o in outcomes:
        assert len(o.analyses) == len(ASPECTS) and o.summary is not None
        assert len(o.follow_ups) == len(o.request.follow_ups)
        assert all(f.cached_tokens > 0 and f.emulated for f in o.follow_ups), o.follow_ups

        (df,) = wait_for(lambda: _settled(client, o.session), timeout=20)
        assert df["emulated"][df["kind"] == "llm"].eq(True).all()
        fu_keys = set(df.loc[df["method"] == "follow_up", "key"])
        fu_llm = df[(df["kind"] == "llm") & df["creator"].isin(fu_keys)]
        assert len(fu_llm) == len(o.request.follow_ups)
        assert (fu_llm["cached_tokens"] > 0).all() and (fu_llm["component"] == "llm.coder").all()
        assert int((df["component"] == "db_query_tool").sum()) == len(ASPECTS)

        g = wait_for(lambda: _completed(client, o.session), timeout=20)
        nodes = {n.call_id: n for n in g.nodes}
        analysts = [n for n in g.nodes if n.component == "Analyst" and n.method == "analyze"]
        (summary,) = [n for n in g.nodes if n.component == "Summarizer"]
        follow_ups = [n for n in g.nodes if n.method == "follow_up"]
        assert len(analysts) == len(ASPECTS) and len(follow_ups) == len(o.request.follow_ups)
        assert all(n.creator == "driver" and not n.dependencies for n in analysts)  # independent: parallel
        assert set(summary.dependencies) == {n.call_id for n in analysts}
        edges = {(e.src, e.dst, e.kind) for e in g.edges}
        assert all((n.call_id, summary.call_id, "dependency") in edges for n in analysts)
        for f in follow_ups:  # asked after the summary came back, in the same session
            assert f.created >= summary.finished and f.session == o.session
        for a in analysts:  # each analyst queried the database, then asked the LLM
            assert sorted(n.component for n in nodes.values() if n.creator == a.call_id) == ["db_query_tool", "llm.coder"]


def _router_trace(request) -> tr.Trace:
    return tr.Trace.load(tr.trace_dir()).window(270, 60).head(16)  # 10 conversation, then 6 code requests


def test_router_routes_by_trace_label_to_the_right_model(client, request):
    arrivals = _router_trace(request).head(16).scaled(0.05)
    assert min(arrivals.counts().values()) > 0  # both labels
    reqs = router_requests(arrivals, seed=2, max_prompt_tokens=2048, max_output_tokens=48)
    outcomes = replay(client, reqs, Models(router="coder", chat="chat", code="coder"))
    assert [o.request.id for o in outcomes] == [r.id for r in reqs]  # all complete, in order
    for o in outcomes:
        assert o.branch == BRANCH[o.request.label] == o.reply.branch
        assert o.reply.emulated and o.reply.output_tokens > 0
        (df,) = wait_for(lambda: _settled(client, o.session), timeout=20)
        by_key = df.set_index("key")
        llm = df[df["kind"] == "llm"]
        creators = llm["creator"].map(lambda k: by_key.loc[k, "component"] if k in by_key.index else k)
        assert (llm["component"][creators == "Classifier"] == "llm.coder").all()
        assert (creators == "Classifier").sum() == 1
        branch_llm = llm[creators != "Classifier"]
        if o.branch == "chat":
            assert list(branch_llm["component"]) == ["llm.chat"]
            assert set(creators[creators != "Classifier"]) == {"ChatAgent"}
            assert not (df["kind"] == "tool").any()
        else:
            assert list(branch_llm["component"]) == ["llm.coder"] * 2
            assert set(creators[creators != "Classifier"]) == {"CodeAgent"}
            assert list(df.loc[df["kind"] == "tool", "component"]) == ["code_exec_tool"]
            assert (branch_llm["cached_tokens"] > 0).sum() >= 1  # the answer reuses the draft's prefix
