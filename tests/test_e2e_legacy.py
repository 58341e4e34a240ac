"""The end-to-end benchmark's harness (benchmarks/e2e.py) at a tiny scale: request specs, the
metrics, the JSON schema, and one tiny run of plain Dask and dask-agents. Never asserts on speed."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.legacy import e2e
from benchmarks.legacy import e2e_swe as swe
from benchmarks.legacy.e2e_peers import Router
from tests.conftest import wait_for


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
    assert arr[0] == 0.0 and arr == sorted(arr)
    assert swe.poisson_arrivals(5, 4.0, 0) == pytest.approx([x / 2 for x in arr])
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
    from benchmarks.legacy.e2e_baselines import SessionPinner

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
    from benchmarks.legacy.e2e_peers import replica_groups

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


# -- scenarios, the cap baseline, seeds and paired ratios ----------------------------------------

def test_mmpp_arrivals_alternate_are_seeded_and_keep_the_nominal_mean_rate():
    a, seg = swe.mmpp_arrivals(400, 3.0, 7, hold_s=(1.5, 3.0), with_states=True)
    assert a[0] == 0.0 and a == sorted(a) and len(a) == 400
    assert swe.mmpp_arrivals(400, 3.0, 7, hold_s=(1.5, 3.0)) == a  # seeded
    assert swe.mmpp_arrivals(400, 3.0, 8, hold_s=(1.5, 3.0)) != a
    # The rate alternates between the two states, segments back to back covering every arrival.
    factors = [f for _, _, f in seg]
    assert set(factors) == {2.0, 0.5} and all(x != y for x, y in zip(factors, factors[1:]))
    assert all(b0 == pytest.approx(a1) for (_, b0, _), (a1, _, _) in zip(seg, seg[1:]))
    assert seg[0][0] == 0.0 and seg[-1][1] >= a[-1]
    # Over many draws: the time-average rate is the nominal one, each state's rate its factor x it.
    a, seg = swe.mmpp_arrivals(30_000, 3.0, 1, hold_s=(1.5, 3.0), with_states=True)
    assert (len(a) - 1) / a[-1] == pytest.approx(3.0, rel=0.05)
    counts, spans, j = {2.0: 0, 0.5: 0}, {2.0: 0.0, 0.5: 0.0}, 0
    for x in a:  # both sorted: walk the segments alongside the arrivals
        while seg[j][1] <= x:
            j += 1
        counts[seg[j][2]] += 1
    for s0, e, f in seg:
        spans[f] += max(0.0, min(e, a[-1]) - s0)
    for f in (2.0, 0.5):
        assert counts[f] / spans[f] == pytest.approx(3.0 * f, rel=0.1)
    assert spans[2.0] / (spans[2.0] + spans[0.5]) == pytest.approx(1 / 3, rel=0.1)
    with pytest.raises(ValueError):
        swe.mmpp_arrivals(5, 0.0, 0)


def test_phase_scenario_lengthens_the_second_half_context():
    base = swe.make_specs(12, 3)
    ph = swe.phase_specs(base, 2.0)
    assert ph == swe.phase_specs(swe.make_specs(12, 3), 2.0)  # deterministic
    assert ph[:6] == base[:6]
    for a, b in zip(base[6:], ph[6:]):
        assert b.context_tokens <= 2 * a.context_tokens and b.context_tokens > 1.5 * a.context_tokens
        assert (b.issue, b.failing, b.doc_s, b.code_s, b.test_s) == (a.issue, a.failing, a.doc_s, a.code_s, a.test_s)
        assert swe.max_prompt_tokens(b) + swe.PATCH_TOKENS <= swe.MAX_MODEL_LEN
        assert swe.prompt_tokens(b) > swe.prompt_tokens(a)
        assert swe.repo_context(b).startswith(swe.repo_context(a))
    # A context that would overflow max_model_len is cut back to fit.
    big = swe.phase_specs(base, 10.0)
    assert all(swe.max_prompt_tokens(s) + swe.PATCH_TOKENS == swe.MAX_MODEL_LEN for s in big[6:])
    # The scenario helpers: the same requests per (scenario, seed), the arrival process per scenario.
    wf, preset = e2e.swe_workflow(), {**e2e.QUICK, "requests": 12}
    assert e2e.scenario_specs(wf, preset, "phase", 3) == ph and e2e.scenario_specs(wf, preset, "bursty", 3) == base
    assert e2e.scenario_arrivals(wf, preset, "bursty", 12, 3.0, 3) == swe.mmpp_arrivals(
        12, 3.0, 3, tuple(preset["mmpp_hold_s"]))
    assert e2e.scenario_arrivals(wf, preset, "phase", 12, 3.0, 3) == swe.poisson_arrivals(12, 3.0, 3)
    assert e2e.scenario_loads({"loads": [1.0, 2.0], "calibration_load": 3.0, "scenario_loads": {"phase": [1.0]}},
                              "phase") == [1.0, 3.0]
    with pytest.raises(ValueError, match="unknown scenario"):
        e2e.scenario_specs(wf, preset, "diurnal", 0)


def test_capped_pinner_bounds_live_requests_per_engine_under_threads():
    import threading

    from benchmarks.legacy.e2e_baselines import CappedPinner

    p = CappedPinner(["tcp://a", "tcp://b"], cap=3)
    lock, live, peak, done = threading.Lock(), {"tcp://a": 0, "tcp://b": 0}, [0], threading.Event()

    def request():
        addr = p.acquire()
        try:
            with lock:
                live[addr] += 1
                peak[0] = max(peak[0], live[addr])
            done.wait()
            with lock:
                live[addr] -= 1
        finally:
            p.release(addr)

    threads = [threading.Thread(target=request) for _ in range(30)]
    for t in threads:
        t.start()
    wait_for(lambda: len(p.queue) == 24 and sum(live.values()) == 6)
    assert p.active == {"tcp://a": 3, "tcp://b": 3}  # full, and the rest wait
    done.set()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert peak[0] <= 3 and max(p.peak.values()) == 3 and p.active == {"tcp://a": 0, "tcp://b": 0}
    st = p.stats()
    assert st["requests"] == 30 and st["waited"] >= 24 and st["peak_live_per_engine"] == 3
    with pytest.raises(ValueError):
        p.release("tcp://a")
    with pytest.raises(ValueError):
        CappedPinner(["tcp://a"], cap=0)


def test_capped_pinner_is_fifo_and_close_wakes_waiters():
    import threading

    from benchmarks.legacy.e2e_baselines import CappedPinner, PinnerClosed

    p = CappedPinner(["tcp://a", "tcp://b"], cap=1)
    held = [p.acquire(), p.acquire()]
    assert sorted(held) == ["tcp://a", "tcp://b"]
    tickets = [object() for _ in range(4)]
    got: dict[int, str] = {}
    threads = []
    for i, ticket in enumerate(tickets):  # queued one after the other: arrival order is known
        t = threading.Thread(target=lambda i=i, ticket=ticket: got.__setitem__(i, p.acquire(ticket)))
        t.start()
        threads.append(t)
        wait_for(lambda ticket=ticket: ticket in p.queue)
    assert list(p.queue) == tickets
    for k in range(4):  # each freed slot goes to the oldest waiter
        p.release(held.pop(0) if held else got[k - 2])
        wait_for(lambda k=k: k in got)
        assert set(got) == set(range(k + 1)), got
    assert p.order[2:] == tickets
    for t in threads:
        t.join(30)
    # A request waiting when the run ends gives up with PinnerClosed, and leaves the queue.
    errors: list[BaseException] = []

    def late():
        try:
            p.acquire()
        except PinnerClosed as e:
            errors.append(e)

    t = threading.Thread(target=late)
    t.start()
    wait_for(lambda: len(p.queue) == 1)
    p.close()
    t.join(30)
    assert len(errors) == 1 and not p.queue


def test_capped_pinner_slot_released_when_the_request_fails():
    from benchmarks.legacy.e2e_baselines import CappedPinner, solve_dask

    class Broken:  # a client whose first submit fails
        def submit(self, *a, **kw):
            raise RuntimeError("scheduler gone")

    p = CappedPinner(["tcp://a"], cap=1)
    spec = swe.make_specs(1, 0)[0]
    for _ in range(3):  # without the release, the second call would wait forever
        with pytest.raises(RuntimeError, match="scheduler gone"):
            solve_dask(Broken(), spec, None, p)
    assert p.active == {"tcp://a": 0} and p.stats()["requests"] == 3


def _variant(means, p99s, sustained=None):
    """A variant entry with one point per seed at load "3" (and max sustained per seed)."""
    seeds = {}
    for i, (m, q) in enumerate(zip(means, p99s)):
        ms = {"mean_s": m, "p99_s": q, "sustained": True, "completed": 4, "requests": 4,
              "kv_hit_rate": 0.5, "prefill_tokens_per_request": 4000.0,
              "admission": {"counts": {"admitted": 4, "held": 1}, "wait_p50_s": 0.01, "wait_p99_s": 0.1 * (i + 1)}}
        seeds[str(i)] = {"loads": {"3": ms}, "max_sustained_rps": (sustained or [3.0] * len(means))[i]}
    return {"seeds": seeds}


def test_paired_ratios_take_the_median_over_seeds_with_the_spread():
    ours, other = _variant([1.0, 2.0, 4.0], [2.0, 4.0, 5.0]), _variant([2.0, 3.0, 4.0], [4.0, 5.0, 4.0])
    r = e2e.paired_ratios(ours, other, "3", [0, 1, 2])
    assert r["mean_speedup"]["per_seed"] == pytest.approx([2.0, 1.5, 1.0])
    assert (r["mean_speedup"]["median"], r["mean_speedup"]["min"], r["mean_speedup"]["max"]) == (1.5, 1.0, 2.0)
    assert r["p99_reduction"]["per_seed"] == pytest.approx([0.5, 0.2, -0.25])
    assert r["p99_reduction"]["median"] == pytest.approx(0.2)  # the median, not the best seed
    assert r["p99_reduction"]["min"] == pytest.approx(-0.25) and r["p99_reduction"]["n"] == 3
    # A seed with no finite value is kept as None and left out of the median and spread.
    ours["seeds"]["1"]["loads"]["3"]["mean_s"] = float("nan")
    r = e2e.paired_ratios(ours, other, "3", [0, 1, 2])
    assert r["mean_speedup"]["per_seed"][1] is None and r["mean_speedup"]["median"] == pytest.approx(1.5)
    assert e2e.paired_ratios(ours, other, "9", [0])["mean_speedup"] == {
        "median": None, "min": None, "max": None, "n": 0, "per_seed": [None]}
    sus = e2e.paired_sustained(_variant([1, 1], [1, 1], [3.0, 1.5]), _variant([1, 1], [1, 1], [1.5, 0.0]), [0, 1])
    assert sus["per_seed"] == [2.0, None] and sus["median"] == 2.0
    assert e2e.spread([]) == {"median": None, "min": None, "max": None, "n": 0, "per_seed": []}


SCENARIO_KEYS = ["mean_speedup_vs_best_static", "p99_reduction_vs_best_static", "sustained_load_ratio_vs_best_static",
                 "mean_speedup_vs_tuned_cap", "p99_reduction_vs_tuned_cap", "mean_speedup_vs_ray",
                 "p99_reduction_vs_ray", "mean_speedup_vs_langgraph", "p99_reduction_vs_langgraph"]


def _scenario_results(peers: dict):
    variants = {"dask": _variant([2.0, 3.0], [4.0, 6.0]), "dask-capped": {**_variant([1.5, 2.0], [3.0, 4.0]),
                                                                          "tuned_cap": 6},
                "dask-agents": _variant([1.0, 2.0], [2.0, 3.0]),
                "dask-agents-no-admission": _variant([1.2, 2.2], [2.5, 3.5]), **peers}
    sc = {"loads_rps": [3.0], "seeds": [0, 1], "variants": variants}
    return {"capacity_rps": 3.0, "capacity_note": "test",
            "scenarios": {name: json.loads(json.dumps(sc)) for name in e2e.SCENARIOS}, "sweeps": {}}


def test_scenario_summary_keys_per_workflow_and_scenario(tmp_path):
    wres = _scenario_results({"ray": {"skipped": "not importable (no module ray)"}})
    s = e2e.summarize_scenarios(wres, 3.0, no_peers=False)
    assert s["scenarios"] == list(e2e.SCENARIOS) and s["capacity_rps"] == 3.0 and s["seeds"] == [0, 1]
    for sc in e2e.SCENARIOS:
        x = s[sc]
        for k in SCENARIO_KEYS:
            assert k in x, (sc, k)
        assert x["mean_speedup_vs_best_static"] == pytest.approx(1.75)  # median of 2.0, 1.5
        assert x["mean_speedup_vs_best_static_spread"]["min"] == pytest.approx(1.5)
        assert x["p99_reduction_vs_tuned_cap"] == pytest.approx(0.5 * (1 / 3 + 1 / 4))
        assert x["sustained_load_ratio_vs_best_static"] == 1.0 and x["tuned_cap"] == 6
        assert x["mean_speedup_vs_ray"] is None and "no module ray" in x["null_reasons"]["ray"]
        assert x["mean_speedup_vs_langgraph"] is None and "not among" in x["null_reasons"]["langgraph"]
        assert x["ablations"]["admission"]["mean_ratio_off_vs_on"] == pytest.approx(1.15)
        assert x["admission"]["counts"] == {"admitted": 8, "held": 2}
        assert x["admission"]["wait_p99_s"] == pytest.approx(0.15)
        assert x["at_reference"]["dask"]["prefill_tokens_per_request"] == 4000.0
        assert x["at_reference"]["dask-agents"]["kv_hit_rate"] == 0.5
        assert set(x["by_load"]["3"]) >= {"mean_speedup_vs_best_static", "p99_reduction_vs_tuned_cap"}
    s = e2e.summarize_scenarios(_scenario_results({}), 3.0, no_peers=True)
    assert "--no-peers" in s["bursty"]["null_reasons"]["ray"] and s["bursty"]["p99_reduction_vs_langgraph"] is None
    doc = e2e.jsonable({"summary": {"swe": s}})
    (tmp_path / "s.json").write_text(json.dumps(doc, allow_nan=False))
    assert json.loads((tmp_path / "s.json").read_text()) == doc


def test_main_writes_the_json_then_fails_on_a_missing_peer(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(e2e, "run_scenarios", lambda preset, variants, scenarios, seeds, log=print: _scenario_results(
        {"ray": {"skipped": "not importable (no module ray)"}} if "ray" in variants else {}))
    monkeypatch.setattr(e2e, "plot", lambda stem, name, variants: ([], None))
    out = tmp_path / "e.json"
    rc = e2e.main(["--quick", "--json", str(out), "--variants", "dask,dask-capped,dask-agents,ray"])
    assert rc != 0 and "--no-peers" in capsys.readouterr().err
    doc = json.loads(out.read_text())
    assert doc["summary"]["swe"]["phase"]["mean_speedup_vs_ray"] is None
    assert doc["config"]["seeds"] == [0] and set(doc["config"]["scenarios"]) == set(e2e.SCENARIOS)
    assert e2e.main(["--quick", "--no-peers", "--json", str(out), "--scenarios", "bursty", "--seeds", "2"]) == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["seeds"] == [0, 1] and "ray" not in doc["config"]["variants"]
    assert doc["config"]["variants"] == e2e.CORE_VARIANTS


@pytest.mark.timeout(180)
def test_tiny_scenario_run_of_every_dask_variant(tmp_path):
    """The swe path at a tiny scale: plain Dask (swept), the cap baseline (caps swept after the
    fact), dask-agents with and without admission, two scenarios on the same requests; every
    request completes with the spec's prompts, the summary and admission counters are there.
    No speed assertions."""
    preset = {"loads": [3.0], "requests": 3, "calibration_load": 3.0, "warmup": 1,
              "dask_sweep": [{"threads": 8, "llm_slots": None, "routing": "session_sticky"}],
              "peer_sweep": ["least_loaded"], "caps": [1, 2], "mmpp_hold_s": [1.5, 3.0]}
    variants = ["dask", "dask-capped", "dask-agents", "dask-agents-no-admission"]
    lines: list[str] = []
    wres = e2e.run_scenarios(preset, variants, ["stationary", "phase"], [1], log=lines.append)
    summary = {"swe": e2e.summarize_scenarios(wres, 3.0, no_peers=True)}
    config = e2e.build_config(preset, "test", 1, variants, ["stationary", "phase"], [1])
    doc = e2e.jsonable({"config": config, "results": {"swe": wres}, "summary": summary})
    (tmp_path / "e2e.json").write_text(json.dumps(doc, allow_nan=False))
    doc = json.loads((tmp_path / "e2e.json").read_text())

    r = doc["results"]["swe"]
    assert [x["config"] for x in r["sweeps"]["dask"]] == preset["dask_sweep"]
    assert set(r["sweeps"]["dask-capped"]) == {"stationary", "phase"}
    assert r["capacity_rps"] == 3.0 and "calibration" in r["capacity_note"]
    base = swe.make_specs(3, 1)
    sent = {"stationary": sum(swe.prompt_tokens(s) for s in e2e.specs_for(base, "any")),
            "phase": sum(swe.prompt_tokens(s) for s in e2e.specs_for(swe.phase_specs(base), "any"))}
    assert sent["phase"] > sent["stationary"]
    for sc in ("stationary", "phase"):
        vs = r["scenarios"][sc]["variants"]
        assert set(vs) == set(variants)
        assert [x["cap"] for x in r["sweeps"]["dask-capped"][sc]] == [1, 2] and vs["dask-capped"]["tuned_cap"] in (1, 2)
        assert vs["dask-capped"]["best_config"]["routing"] == "session_sticky"
        for name, v in vs.items():
            m = v["seeds"]["1"]["loads"]["3"]
            assert m["completed"] == m["requests"] == 3, (sc, name, m["failed"])
            assert m["prompt_tokens"] == sent[sc], (sc, name)  # exactly the scenario's prompts
            assert m["prefill_tokens_per_request"] == pytest.approx(m["prefill_tokens"] / 3)
            assert 0 <= m["kv_hit_rate"] <= 1 and math.isfinite(m["mean_s"])
        assert vs["dask-capped"]["seeds"]["1"]["loads"]["3"]["cap_stats"]["peak_live_per_engine"] <= 2
        adm = vs["dask-agents"]["seeds"]["1"]["loads"]["3"]["admission"]
        assert adm["enabled"] is True and adm["counts"]["admitted"] == 3 and adm["wait_p99_s"] is not None
        assert vs["dask-agents-no-admission"]["seeds"]["1"]["loads"]["3"]["admission"]["enabled"] is False
        assert vs["dask-agents"]["admission"]["counts"]["admitted"] >= 3  # the run's extra (cluster life)
        s = doc["summary"]["swe"][sc]
        for k in SCENARIO_KEYS:
            assert k in s
        for k in ("mean_speedup_vs_best_static", "p99_reduction_vs_best_static", "mean_speedup_vs_tuned_cap"):
            assert math.isfinite(s[k])
        assert s["mean_speedup_vs_ray"] is None and "--no-peers" in s["null_reasons"]["ray"]
        assert s["admission"]["counts"]["admitted"] == 3
    assert any("tuned cap" in line for line in lines)


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
    from benchmarks.legacy import e2e_peers

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
    from benchmarks.legacy import e2e_router as router

    monkeypatch.setattr(e2e, "peer_available", lambda name: (False, f"not importable (no module {name})"))

    try:
        router.make_specs(6, 0, 2)
    except FileNotFoundError as e:  # (the Azure trace ships with the package: DASK_AGENTS_TRACES elsewhere)
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
    from benchmarks.legacy import e2e_finance as fin

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
    from benchmarks.legacy import e2e_finance as fin

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
    from benchmarks.legacy import e2e_finance as fin

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
    from benchmarks.legacy import e2e_finance as fin

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
    from benchmarks.legacy import e2e_finance as fin

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
    from benchmarks.legacy import e2e_router as router

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
