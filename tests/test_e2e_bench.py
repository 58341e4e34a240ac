"""The end-to-end benchmark's harness (benchmarks/e2e.py) at a tiny scale: request specs, the
metrics, the JSON schema, and one tiny run of plain Dask and dask-agents. Never asserts on speed."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import e2e
from benchmarks import e2e_swe as swe
from benchmarks.e2e_peers import Router


def test_specs_are_reproducible_and_follow_the_workflow_rule():
    a, b = swe.make_specs(6, 3), swe.make_specs(6, 3)
    assert a == b and swe.make_specs(6, 4) != a
    for s in a:
        assert s.failing[-1] is None and len(s.failing) <= swe.MAX_RETRIES + 1
        assert all(f is None or 0 <= f < s.issue.n_subtasks for f in s.failing)
        assert len(s.doc_s) == len(s.code_s) == s.issue.n_subtasks
        assert all(len(x) == swe.MAX_RETRIES + 1 for x in s.doc_s + s.code_s)
        assert 0 < swe.ideal_latency(s) < 60
    arr = swe.poisson_arrivals(5, 2.0, 0)
    assert arr[0] == 0.0 and arr == sorted(arr) and swe.poisson_arrivals(5, 4.0, 0) == pytest.approx([x / 2 for x in arr])
    # Every run gets fresh ids of one length: the same prompt lengths, hence the same work.
    x, y = e2e.specs_for(a, "dask-L2"), e2e.specs_for(a, "dask-agents-no-reallocate-L2")
    assert [len(s.id) for s in x] == [len(s.id) for s in y] and x[0].id != y[0].id
    assert [s.failing for s in x] == [s.failing for s in a]
    assert [swe.ideal_latency(s) for s in x] == pytest.approx([swe.ideal_latency(s) for s in y])
    assert [swe.prompt_tokens(s) for s in x] == [swe.prompt_tokens(s) for s in y]


def test_prompts_carry_the_session_history():
    specs = swe.make_specs(12, 0)
    spec = next(s for s in specs if s.retries >= 1)
    calls = swe.session_calls(spec)
    plan = calls[0]["prompt"]
    assert plan.startswith(swe.SYSTEM) and spec.id in plan
    lo, hi = swe.CONTEXT_TOKENS
    assert lo <= len(swe.repo_context(spec)) == spec.context_tokens <= hi
    assert all(len(c["prompt"].encode()) == len(c["prompt"]) for c in calls)  # ASCII: one char, one token
    # Every later call extends the planner's prompt and the plan; a retry extends its own previous attempt.
    assert all(c["prompt"].startswith(plan + "Plan: " + swe.plan_text(spec)) for c in calls[1:])
    k = spec.failing[0]
    first, retry = calls[1 + k]["prompt"], calls[2 + spec.issue.n_subtasks]["prompt"]
    assert retry.startswith(first) and swe.patch_text(spec, k, 0) in retry
    assert swe.tester_report(spec, 0).log in retry and len(retry) > len(first) + swe.LOG_TOKENS[0]
    tester = calls[1 + spec.issue.n_subtasks]["prompt"]
    assert all(swe.patch_text(spec, j, 0) in tester for j in range(spec.issue.n_subtasks))
    # Deterministic: the same text for the same spec, whatever the process.
    again = swe.make_specs(12, 0)[specs.index(spec)]
    assert [c["prompt"] for c in swe.session_calls(again)] == [c["prompt"] for c in calls]
    st = swe.token_stats(specs)
    assert 2000 < st["mean_prompt_tokens_per_call"] < 5000
    assert 0.5 < st["reusable_share_from_session"] <= st["reusable_share_with_system_prompt"] < 1.0
    assert max(len(c["prompt"]) for s in specs for c in swe.session_calls(s)) + swe.PATCH_TOKENS <= swe.MAX_MODEL_LEN


def test_load_metrics_throughput_and_sustained():
    specs = swe.make_specs(20, 0)
    ideal = {s.id: swe.ideal_latency(s) for s in specs}
    arrivals = [0.5 * i for i in range(20)]

    def records(extra):  # extra(i): the delay beyond the ideal latency
        return [{"id": s.id, "arrival": a, "finish": a + ideal[s.id] + extra(i), "latency": ideal[s.id] + extra(i),
                 "ok": True} for i, (s, a) in enumerate(zip(specs, arrivals))]

    keep_up = e2e.load_metrics(records(lambda i: 0.2), specs, 2.0)
    assert keep_up["throughput_rps"] == pytest.approx(2.0) and keep_up["sustained"]
    assert keep_up["completed"] == 20 and keep_up["mean_excess_over_ideal_s"] == pytest.approx(0.2)
    behind = e2e.load_metrics(records(lambda i: 0.25 * i), specs, 2.0)  # falls 0.5 s/s behind
    assert behind["throughput_rps"] == pytest.approx(2.0 / 1.5) and not behind["sustained"]
    lost = records(lambda i: 0.0)
    lost[3] = {**lost[3], "ok": False, "error": "boom"}
    m = e2e.load_metrics(lost, specs, 2.0)
    assert m["completed"] == 19 and not m["sustained"] and m["failed"] == ["boom"]
    assert set(m) == set(keep_up)  # the verdict's inputs change, the stored keys do not


def test_sustained_detects_a_backlog_finished_together():
    """Saturation that a short run hides from a completion slope: after the warm-up, requests
    queue and the engines finish them together; the latency stops tracking the request's work."""
    specs = swe.make_specs(20, 0)
    ideal = {s.id: swe.ideal_latency(s) for s in specs}
    arrivals = [0.5 * i for i in range(20)]
    t_end = arrivals[-1] + 3.0

    def rec(s, a, finish):
        return {"id": s.id, "arrival": a, "finish": finish, "latency": finish - a, "ok": True}

    clump = [rec(s, a, a + ideal[s.id] + 0.2 if i < 5 else max(t_end, a + ideal[s.id]))
             for i, (s, a) in enumerate(zip(specs, arrivals))]
    m = e2e.load_metrics(clump, specs, 2.0)
    w = e2e.window_stats(clump, specs, m["offered_realized_rps"])
    assert m["p99_s"] <= m["p99_bound_s"] and not m["sustained"]
    assert not 1 / e2e.LATENCY_GROWTH_MAX < w["latency_growth"] < e2e.LATENCY_GROWTH_MAX
    # A backlog that builds only in the last third: the latency grows past 1.5x.
    late = [rec(s, a, a + ideal[s.id] + (0.2 if i < 15 else 3.0 * ideal[s.id]))
            for i, (s, a) in enumerate(zip(specs, arrivals))]
    w = e2e.window_stats(late, specs, 2.0)
    assert w["latency_growth"] > e2e.LATENCY_GROWTH_MAX and not e2e.load_metrics(late, specs, 2.0)["sustained"]


def test_session_pinner_spreads_requests_and_releases():
    from benchmarks.e2e_baselines import SessionPinner

    p = SessionPinner(["tcp://a", "tcp://b"])
    a, b = p.acquire(), p.acquire()
    assert {a, b} == {"tcp://a", "tcp://b"}
    p.release(a)
    assert p.acquire() == a and p.active == {"tcp://a": 1, "tcp://b": 1}
    with pytest.raises(ValueError, match="unknown routing"):
        e2e.DaskBackend(routing="random")


def test_router_rules():
    r = Router(2, "least_loaded")
    a, b = r.pick("s1"), r.pick("s2")
    assert {a, b} == {0, 1}
    r.done(a)
    assert r.pick("s3") == a
    s = Router(2, "session_sticky")
    first = s.pick("s1")
    s.pick("s2")
    assert s.pick("s1") == first
    with pytest.raises(ValueError, match="unknown routing"):
        Router(2, "random")


def test_replica_groups_of_a_static_split():
    from benchmarks.e2e_peers import replica_groups

    assert replica_groups(["coder"], 2, None) == {"coder": [0, 1]}
    assert replica_groups(["chat", "coder"], 4, {"chat": 1, "coder": 3}) == {"chat": [0], "coder": [1, 2, 3]}
    for bad in ({"chat": 0, "coder": 4}, {"chat": 2, "coder": 1}, {"coder": 4}):
        with pytest.raises(ValueError, match="split"):
            replica_groups(["chat", "coder"], 4, bad)


def test_summary_with_skipped_peers_and_strict_json(tmp_path):
    m = {"mean_s": 2.0, "p99_s": 4.0, "sustained": True, "offered_rps": 2.0}
    variants = {"dask": {"loads": {"2": {**m, "mean_s": 3.0, "p99_s": 5.0}}, "max_sustained_rps": 2.0},
                "dask-agents": {"loads": {"2": m}, "max_sustained_rps": 2.0},
                "dask-agents-no-balance": {"loads": {"2": {**m, "mean_s": float("nan")}}, "max_sustained_rps": 0.0},
                "ray": {"skipped": "not importable (ModuleNotFoundError: No module named 'ray')"}}
    s = e2e.summarize(variants, 2.0)
    assert s["mean_speedup_vs_dask"] == pytest.approx(1.5) and s["p99_reduction_vs_dask"] == pytest.approx(0.2)
    assert s["sustained_load_ratio_vs_dask"] == 1.0
    assert s["mean_speedup_vs_ray"] is None and "ray" in s["skipped"]
    assert s["mean_speedup_vs_langgraph"] is None
    doc = e2e.write_json(str(tmp_path / "x.json"), {"emulated": True}, variants, {}, {"swe": s})
    assert json.loads((tmp_path / "x.json").read_text()) == doc  # strict JSON: NaN became null
    assert doc["results"]["swe"]["variants"]["dask-agents-no-balance"]["loads"]["2"]["mean_s"] is None


SUMMARY_KEYS = [f"{m}_vs_{o}" for o in ("dask", "ray", "langgraph")
                for m in ("mean_speedup", "p99_reduction", "sustained_load_ratio")]


@pytest.mark.timeout(120)
def test_tiny_run_of_plain_dask_and_dask_agents(tmp_path):
    preset = {"loads": [3.0], "requests": 3, "calibration_load": 3.0, "warmup": 1,
              "dask_sweep": [{"threads": 8, "llm_slots": 8, "routing": "none"},
                             {"threads": 8, "llm_slots": 8, "routing": "session_sticky"}],
              "peer_sweep": ["least_loaded"]}
    lines: list[str] = []
    results, sweeps = e2e.run_benchmark(preset, ["dask", "dask-agents"], seed=1, log=lines.append)
    summary = {"swe": e2e.summarize(results, 3.0)}
    config = e2e.build_config(preset, "test", 1, ["dask", "dask-agents"])
    doc = e2e.write_json(str(tmp_path / "e2e.json"), config, results, sweeps, summary)
    doc = json.loads((tmp_path / "e2e.json").read_text())

    assert set(doc) == {"config", "results", "summary"} and doc["config"]["emulated"] is True
    assert doc["config"]["engine"]["max_batch"] == 8 and doc["config"]["engine"]["replicas"] == 2
    variants = doc["results"]["swe"]["variants"]
    assert set(variants) == {"dask", "dask-agents"}
    assert [r["config"] for r in doc["results"]["swe"]["sweeps"]["dask"]] == preset["dask_sweep"]
    assert variants["dask"]["best_config"] in preset["dask_sweep"]
    assert variants["dask"]["description"]["routing"] == variants["dask"]["best_config"]["routing"]
    for r in doc["results"]["swe"]["sweeps"]["dask"]:  # both routings ran every request
        assert r["metrics"]["completed"] == r["metrics"]["requests"] == 3, r
    for name, v in variants.items():
        m = v["loads"]["3"]
        assert m["completed"] == m["requests"] == 3, (name, m["failed"])
        for k in ("mean_s", "p50_s", "p95_s", "p99_s", "throughput_rps", "offered_realized_rps", "kv_hit_rate"):
            assert isinstance(m[k], (int, float)) and math.isfinite(m[k]) and m[k] >= 0, (name, k, m[k])
        assert m["engines"] == 2 and isinstance(m["sustained"], bool)
        # Every variant sends exactly the prompts the spec defines (by length; the text is single-sourced).
        assert m["prompt_tokens"] == sum(swe.prompt_tokens(s) for s in e2e.specs_for(swe.make_specs(3, 1), "any")), name
        assert v["max_sustained_rps"] in (0.0, 3.0)
    s = doc["summary"]["swe"]
    for k in SUMMARY_KEYS:
        assert k in s
    for k in ("mean_speedup_vs_dask", "p99_reduction_vs_dask"):
        assert math.isfinite(s[k])
    assert s["reference_load_rps"] == 3.0 and s["mean_speedup_vs_ray"] is None
    assert any("dask-agents" in line for line in lines)
    assert len(variants["dask-agents"]["loads"]["3"]["latencies_s"]) == 3
    files, note = e2e.plot(str(tmp_path / "e2e"), "swe", doc["results"]["swe"]["variants"])
    assert note is None and [f.rsplit("_", 1)[1] for f in files] == ["latency.png", "cdf.png"]
    assert all((tmp_path / f.rsplit("/", 1)[1]).stat().st_size > 10_000 for f in files)


def test_missing_peer_is_skipped_and_said_so(monkeypatch):
    monkeypatch.setattr(e2e, "peer_available", lambda name: (False, f"not importable (no module {name})"))
    lines: list[str] = []
    preset = {"loads": [3.0], "requests": 2, "calibration_load": 3.0, "warmup": 0, "dask_sweep": [],
              "peer_sweep": ["least_loaded"]}
    results, sweeps = e2e.run_benchmark(preset, ["ray", "langgraph"], log=lines.append)
    assert results == {"ray": {"skipped": "not importable (no module ray)"},
                       "langgraph": {"skipped": "not importable (no module langgraph)"}}
    assert sweeps == {"ray": [], "langgraph": []}
    assert any("ray: SKIPPED" in line for line in lines)
    s = e2e.summarize(results, 3.0)
    assert s["mean_speedup_vs_ray"] is None and set(s["skipped"]) == {"ray", "langgraph"}


def test_tiny_langgraph_run_if_installed():
    pytest.importorskip("langgraph")
    from benchmarks import e2e_peers

    specs = e2e.specs_for(swe.make_specs(2, 5), "lg-test")
    with e2e_peers.make("langgraph", routing="session_sticky") as peer:
        sent: list[str] = []
        for host in peer.engines:  # record what reaches the engines
            submit = host.submit
            host.submit = lambda rid, ids, params, session, submit=submit: (
                sent.append(host.tokenizer.decode(ids)), submit(rid, ids, params, session))[1]
        records = peer.run(specs, [0.0, 0.1], timeout=60)
        stats = peer.engine_stats()
    assert [r["ok"] for r in records] == [True, True], records
    assert len(stats) == 2 and sum(s["decode_tokens"] for s in stats) > 0
    # Byte-identical to the spec's prompts (the order between the two requests may interleave).
    assert sorted(sent) == sorted(c["prompt"] for s in specs for c in swe.session_calls(s))


@pytest.mark.timeout(90)
def test_tiny_router_run_schema_and_completion(tmp_path, monkeypatch):
    """--workflow router at a tiny scale: every variant completes every request; the JSON keeps
    the summary keys per workflow (a missing peer null, reported skipped). No speed assertions."""
    from benchmarks import e2e_router as router

    monkeypatch.setattr(e2e, "peer_available", lambda name: (False, f"not importable (no module {name})"))

    try:
        router.make_specs(6, 0, 2)
    except FileNotFoundError as e:  # the Azure trace lives outside the repository (../shared)
        pytest.skip(str(e))
    preset = {"loads": [4.0], "calibration_load": 4.0, "requests": 6, "phases": 2, "warmup": 0, "threads": 4,
              "splits": [[1, 3], [2, 2]]}
    variants = ["dask", "dask-agents", "dask-agents-no-reallocate", "ray"]
    lines: list[str] = []
    results, sweeps = router.run_benchmark(preset, variants, seed=0, log=lines.append)
    summary = {"router": e2e.summarize(results, 4.0)}
    config = {**e2e.base_config("test", 0, "router"), "router": router.build_config(preset, 0, variants)}
    e2e.write_json(str(tmp_path / "r.json"), config, results, sweeps, summary, workflow="router")
    doc = json.loads((tmp_path / "r.json").read_text())
    v = doc["results"]["router"]["variants"]
    assert set(v) == set(variants) and v["ray"]["skipped"]
    assert [r["config"] for r in doc["results"]["router"]["sweeps"]["dask"]] == [
        {"chat_workers": 1, "coder_workers": 3}, {"chat_workers": 2, "coder_workers": 2}]
    for name in ("dask", "dask-agents", "dask-agents-no-reallocate"):
        m = v[name]["loads"]["4"]
        assert m["completed"] == m["requests"] == 6, (name, m["failed"])
        assert math.isfinite(m["mean_s"]) and set(m["phases"]) == {"0", "1"}
    assert v["dask-agents"]["loads"]["4"]["reassign_done"] >= 0
    assert v["dask-agents-no-reallocate"]["loads"]["4"]["reassign_done"] == 0
    s = doc["summary"]["router"]
    for k in SUMMARY_KEYS:
        assert k in s
    assert math.isfinite(s["mean_speedup_vs_dask"]) and s["mean_speedup_vs_ray"] is None
    assert doc["config"]["router"]["engine"]["engine_workers"] == 4


# -- finance workflow -----------------------------------------------------------------------------

def test_finance_specs_and_prompts_carry_the_session_history():
    from benchmarks import e2e_finance as fin

    a, b = fin.make_specs(6, 3, fin.THINK_QUICK), fin.make_specs(6, 3, fin.THINK_QUICK)
    assert a == b and fin.make_specs(6, 4, fin.THINK_QUICK) != a
    for s in a:
        r = s.request
        assert 1 <= len(r.follow_ups) == len(r.think_s) <= 2 and len(s.db_s) == len(s.db_tokens) == len(s.aspects) == 4
        assert all(fin.THINK_QUICK[0] <= t <= fin.THINK_QUICK[1] for t in r.think_s)
        assert s.pause_s == pytest.approx(sum(r.think_s))
        calls = fin.session_calls(s)
        assert [c["role"] for c in calls] == ["analysis"] * 4 + ["summary"] + ["follow_up"] * len(r.follow_ups)
        ctx = fin.context(s)
        assert ctx.startswith(fin.SYSTEM + f"Session {s.id}\n") and all(c["prompt"].startswith(ctx) for c in calls)
        assert all(c["prompt"].isascii() for c in calls)  # one character, one token
        # Every follow-up extends the previous call's prompt: the session's KV is reusable.
        summary, fus = calls[4]["prompt"], [c["prompt"] for c in calls[5:]]
        assert fus[0].startswith(summary + " " + fin.summary_text(s))
        assert all(y.startswith(x + " " + fin.answer_text(s, j)) for j, (x, y) in enumerate(zip(fus, fus[1:])))
        assert all(fin.analysis_text(s, k) in summary for k in range(4))
        assert 0 < fin.ideal_latency(s) < 10
        assert max(len(c["prompt"]) for c in calls) + fin.SUMMARY_TOKENS <= fin.swe.MAX_MODEL_LEN
    x, y = fin.specs_for(a, "finance-dask-L3"), fin.specs_for(a, "finance-dask-agents-no-balance-L3")
    assert x[0].id != y[0].id and [fin.prompt_tokens(s) for s in x] == [fin.prompt_tokens(s) for s in y]
    assert [fin.ideal_latency(s) for s in x] == pytest.approx([fin.ideal_latency(s) for s in y])
    st = fin.token_stats(x)
    assert 0.5 < st["reusable_share_perfect_cache"] < st["reusable_share_follow_ups"] < 1.0


def test_finance_record_excludes_think_time_and_run_metrics():
    from benchmarks import e2e_finance as fin

    spec = fin.make_specs(1, 0, fin.THINK_QUICK)[0]
    stats = {"analysis": [400, 100], "summary": [100, 90], "follow_up": [200, 190], "follow_up_s": [0.1, 0.3]}
    rec = e2e.make_record(spec, 1.0, 5.0, {"stats": stats}, None)
    assert rec["latency"] == pytest.approx(4.0 - spec.pause_s) and rec["ok"] and rec["stats"] == stats
    m = fin.run_metrics([rec, {**rec, "ok": False}], [spec])
    assert m["followup_kv_hit_rate"] == pytest.approx(0.95) and m["analysis_kv_hit_rate"] == pytest.approx(0.25)
    assert m["followup_mean_s"] == pytest.approx(0.2) and m["followup_prompt_tokens"] == 200


@pytest.mark.timeout(90)
def test_tiny_finance_run_schema_completion_and_kv_reuse(tmp_path):
    """--workflow finance at a tiny scale: plain Dask (session-sticky) and dask-agents complete
    every request, send exactly the spec's prompts, and the follow-ups hit the session's KV."""
    from benchmarks import e2e_finance as fin

    preset = {"loads": [3.0], "requests": 3, "calibration_load": 3.0, "warmup": 0, "think_s": [0.05, 0.15],
              "dask_sweep": [{"threads": 4, "llm_slots": None, "routing": "session_sticky"}],
              "peer_sweep": ["session_sticky"]}
    variants = ["dask", "dask-agents"]
    lines: list[str] = []
    results, sweeps = fin.run_benchmark(preset, variants, seed=1, log=lines.append)
    summary = {"finance": e2e.summarize(results, 3.0)}
    config = {**e2e.base_config("test", 1, "finance"), "finance": fin.build_config(preset, 1, variants)}
    e2e.write_json(str(tmp_path / "f.json"), config, results, sweeps, summary, workflow="finance")
    doc = json.loads((tmp_path / "f.json").read_text())
    v = doc["results"]["finance"]["variants"]
    assert set(v) == set(variants) and v["dask"]["best_config"] == preset["dask_sweep"][0]
    sent = sum(fin.prompt_tokens(s) for s in fin.specs_for(fin.make_specs(3, 1, (0.05, 0.15)), "any"))
    for name in variants:
        m = v[name]["loads"]["3"]
        assert m["completed"] == m["requests"] == 3, (name, m["failed"])
        assert m["prompt_tokens"] == sent, name  # exactly the spec's prompts
        assert m["followup_kv_hit_rate"] > 0 and m["followup_prompt_tokens"] > 0, (name, m)
        assert 0 < m["kv_hit_rate"] < 1 and math.isfinite(m["followup_mean_s"])
    s = doc["summary"]["finance"]
    for k in SUMMARY_KEYS:
        assert k in s
    assert math.isfinite(s["mean_speedup_vs_dask"]) and s["mean_speedup_vs_ray"] is None
    assert doc["config"]["emulated"] is True and doc["config"]["finance"]["engine"]["replicas"] == 2
    assert doc["config"]["finance"]["policies_ablated"] == ["prioritize", "balance"]


def test_finance_missing_peer_is_skipped_and_said_so(monkeypatch):
    from benchmarks import e2e_finance as fin

    monkeypatch.setattr(e2e, "peer_available", lambda name: (False, f"not importable (no module {name})"))
    lines: list[str] = []
    preset = {**fin.QUICK, "requests": 2, "warmup": 0, "dask_sweep": []}
    results, _ = fin.run_benchmark(preset, ["ray", "langgraph", "dask-agents-no-batching"], log=lines.append)
    assert results == {"ray": {"skipped": "not importable (no module ray)"},
                       "langgraph": {"skipped": "not importable (no module langgraph)"}}
    assert any("ray (finance): SKIPPED" in line for line in lines)
    s = e2e.summarize(results, fin.QUICK["calibration_load"])
    assert s["mean_speedup_vs_langgraph"] is None and set(s["skipped"]) == {"ray", "langgraph"}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("peer", ["langgraph", "ray"])
def test_tiny_finance_peer_if_installed(peer):
    pytest.importorskip(peer)
    from benchmarks import e2e_finance as fin

    specs = fin.specs_for(fin.make_specs(2, 5, (0.05, 0.1)), f"{peer}-test")
    with fin.make_peer(peer, routing="session_sticky") as b:
        records = b.run(specs, [0.0, 0.1], timeout=60)
        stats = b.engine_stats()
    assert [r["ok"] for r in records] == [True, True], records
    assert len(stats) == 2 and sum(s["queries"] for s in stats) == sum(fin.prompt_tokens(s) for s in specs)
    m = fin.run_metrics(records, specs)
    assert m["followup_kv_hit_rate"] > 0.5  # the session's KV is on the replica its follow-ups go to


@pytest.mark.timeout(60)
@pytest.mark.parametrize("peer", ["langgraph", "ray"])
def test_tiny_router_peer_if_installed(peer):
    """Router peers: the static split sweep runs, every request completes with the spec's prompts."""
    pytest.importorskip(peer)
    from benchmarks import e2e_router as router

    try:
        base, _ = router.make_specs(6, 0, 2)
    except FileNotFoundError as e:
        pytest.skip(str(e))
    preset = {"loads": [4.0], "calibration_load": 4.0, "requests": 6, "phases": 2, "warmup": 0, "threads": 4,
              "splits": [[1, 3], [2, 2]]}
    results, sweeps = router.run_benchmark(preset, [peer], seed=0, log=lambda line: None)
    v = results[peer]
    assert not v.get("skipped"), v
    assert [r["config"] for r in sweeps[peer]] == [{"chat_workers": 1, "coder_workers": 3},
                                                   {"chat_workers": 2, "coder_workers": 2}]
    assert v["best_config"] in [r["config"] for r in sweeps[peer]]
    m = v["loads"]["4"]
    assert m["completed"] == m["requests"] == 6, m["failed"]
    sent = 0
    for s in router.specs_for(base, "any"):
        sent += len(router.classifier_prompt(s)) + (len(router.chat_prompt(s)) if s.branch == "chat" else
                                                   len(router.draft_prompt(s)) + len(router.final_prompt(s)))
    assert m["prompt_tokens"] == sent and set(m["phases"]) == {"0", "1"}
    s = e2e.summarize({"dask-agents": v, peer: v}, 4.0)
    assert s[f"mean_speedup_vs_{peer}"] == pytest.approx(1.0)
