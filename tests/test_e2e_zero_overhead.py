"""The zero-overhead reference (benchmarks/e2e/zero_overhead.py): the requests of a unit replayed
on the EMULATED engines in virtual time with no framework. Alone it is exactly the cost model's
ideal; under load every request is at least its ideal, batching shows, and the replay is
deterministic. No wall clock anywhere."""

from __future__ import annotations

import pytest

from benchmarks.e2e import report, stats
from benchmarks.e2e.cli import references
from benchmarks.e2e.ideal import ideal, llm_seconds, run_shared
from benchmarks.e2e.program import LLMCall, Setup, ToolCall, call
from benchmarks.e2e.runner import arrivals
from benchmarks.e2e.workflows import finance
from benchmarks.e2e.zero_overhead import Replay, VirtualClock, oracle, replay
from dask_agents.worker_plugin.emulated_kv import EmulationParams

ENGINE = {"kv_blocks": 20000, "max_batch": 64, "max_num_batched_tokens": 512}
ONE = Setup(engine=ENGINE, replicas=1, models=(("coder", 1),), time_scale=1.0, max_model_len=131072, tool_threads=8)


class _Spec:
    def __init__(self, sid: str, prompts: tuple, tool_s: float = 0.0, think_s: float = 0.0, parallel: bool = False):
        self.id, self.prompts, self.tool_s, self.think_s, self.parallel = sid, prompts, tool_s, think_s, parallel


def _ask(ctx, spec: _Spec, k: int) -> int:
    if spec.tool_s:
        ctx.tool(ToolCall("db_query", spec.tool_s, "rows"))
    ctx.llm(LLMCall(ctx.session, "asker", spec.prompts[k], 20))
    return k


class _Tiny:
    """A workflow of LLM calls over distinct prompts: in sequence (a think time before the
    last), or all at once."""

    name, shared_prefix = "tiny", ""

    def program(self, rt, spec: _Spec) -> list:
        if spec.parallel:
            return rt.gather([rt.agent("asker", _ask, spec, k) for k in range(len(spec.prompts))])
        out = [call(rt, "asker", _ask, spec, k) for k in range(len(spec.prompts) - 1)]
        rt.think(spec.think_s)
        return out + [call(rt, "asker", _ask, spec, len(spec.prompts) - 1)]

    def check(self, spec: _Spec, value: list) -> None:
        assert value == list(range(len(spec.prompts)))

    def think_s(self, spec: _Spec) -> float:
        return spec.think_s


def _prompt(seed: int, n: int) -> str:
    import random

    rng = random.Random(seed)
    return "".join(chr(rng.randrange(97, 123)) for _ in range(n))


def test_a_request_alone_takes_exactly_the_cost_models_ideal():
    """In sequence, alone on its engine, tools and the user's pause included: every LLM call is
    the cost model's single-sequence time and nothing else is added (the think time is left out,
    as the runner leaves it out)."""
    wf = _Tiny()
    spec = _Spec("r0", (_prompt(1, 1500), _prompt(2, 900)), tool_s=0.25, think_s=30.0)
    lat = Replay(ONE).run(wf, [spec], [0.0])
    p = EmulationParams(**ENGINE)
    want = 2 * 0.25 + llm_seconds(p, 1500, 0, 20) + llm_seconds(p, 900, 0, 20)
    assert lat == [pytest.approx(want, rel=1e-9)]
    assert lat[0] == pytest.approx(ideal(wf, spec, ENGINE, shared="")[0], rel=1e-9)


def test_parallel_agents_share_steps_slower_than_alone_faster_than_in_turn():
    """Two agents of one request on one engine: their steps batch both sequences (each step
    reads both and carries both prefills in the token budget), so the request takes longer than
    its ideal (each agent with an engine to itself) and less than the two calls in turn."""
    wf = _Tiny()
    p = EmulationParams(**ENGINE)
    spec = _Spec("r1", (_prompt(3, 1200), _prompt(4, 1200)), parallel=True)
    lat = Replay(ONE).run(wf, [spec], [0.0])[0]
    alone = llm_seconds(p, 1200, 0, 20)
    assert ideal(wf, spec, ENGINE, shared="")[0] == pytest.approx(alone, rel=1e-9)
    assert alone < lat < 2 * alone


def test_a_loaded_unit_is_deterministic_and_never_below_the_ideal():
    """Finance at a rate far above what two small engines sustain: every request at least its
    ideal (a lower bound of the same cost model), the load visible in the mean, and the same
    result on a second replay (virtual time: nothing depends on the machine)."""
    wf = finance.WORKFLOW
    setup = Setup(engine={"kv_blocks": 20000, "max_batch": 64}, replicas=2, time_scale=0.1, max_model_len=131072,
                  tool_threads=8)
    specs = wf.make_specs(8, 3, "stationary")
    offsets = arrivals(wf, "stationary", len(specs), 2.0, 3)
    first = Replay(setup).run(wf, specs, offsets)
    again = Replay(setup).run(wf, specs, offsets)
    assert first == again
    shared = run_shared(wf, specs)
    bounds = [ideal(wf, s, setup.engine, shared)[0] for s in specs]
    assert all(x >= b * (1 - 1e-9) for x, b in zip(first, bounds)), list(zip(first, bounds))
    assert sum(first) > 1.05 * sum(bounds)
    ref = replay(wf, specs, offsets, setup)
    assert ref["latencies_s"] == [round(x, 4) for x in first]
    w = stats.window([{"arrival": a, "latency": x} for a, x in zip(offsets, first)])  # the runner's window
    assert len(w) == 6 and ref["mean_s"] == pytest.approx(sum(r["latency"] for r in w) / len(w))
    assert 0 < ref["hit_rate"] < 1 and len(ref["engine_busy_s"]) == 2 and all(b > 0 for b in ref["engine_busy_s"])


def test_the_clock_runs_one_thread_at_a_time_in_wake_order():
    clock, seen = VirtualClock(), []

    def worker(name: str, naps: tuple) -> None:
        for nap in naps:
            seen.append((clock.now, name))
            clock.sleep(nap)
        seen.append((clock.now, name + " done"))

    clock.at(0.0, lambda: clock.spawn(worker, "a", (2.0, 1.0)))
    clock.at(0.0, lambda: clock.spawn(worker, "b", (1.0, 1.0)))
    clock.run()
    assert seen == [(0.0, "a"), (0.0, "b"), (1.0, "b"), (2.0, "a"), (2.0, "b done"), (3.0, "a done")]


def test_a_failure_in_the_replay_is_raised_not_hidden():
    clock = VirtualClock()

    def bad() -> None:
        clock.sleep(1.0)
        raise ValueError("boom")

    clock.at(0.0, lambda: clock.spawn(bad))
    with pytest.raises(ValueError, match="boom"):
        clock.run()


def test_the_summary_carries_the_reference_and_each_variants_mean_against_it(tmp_path):
    """Merge's references: one per unit (workflow, scenario, load, seed), recomputed from the
    units' seeds and rates; the summary pairs each variant's mean with its seed's reference."""
    from tests.test_e2e_runner import TINY, fake_metrics

    units = []
    for seed in (0, 1):
        for name, mean in (("dask", 40.0 + seed), ("dask-agents", 30.0 + seed)):
            m = {**fake_metrics(mean), "variant": {"setup": TINY.describe()}}
            units.append({"workflow": "finance", "scenario": "stationary", "factor": 0.8, "seed": seed,
                          "variant": name, "rate_rps": 1.0, "metrics": m})
    refs = references(units, 4, {"finance": TINY.describe()})
    per_seed = refs["finance"]["stationary"][0.8]
    assert sorted(per_seed) == ["0", "1"]
    e = report.summarize(units, references=refs)["finance"]["stationary"]["x0.8"]
    assert e["zero_overhead_mean_s"]["per_seed"] == {s: r["mean_s"] for s, r in per_seed.items()}
    got = e["variants"]["dask-agents"]["mean_vs_zero_overhead"]["per_seed"]
    assert got == {s: pytest.approx((30.0 + int(s)) / r["mean_s"]) for s, r in per_seed.items()}
    assert "zero-overhead mean" in report.table(report.summarize(units, references=refs))
    assert report.plot(report.summarize(units, references=refs), str(tmp_path / "e2e"))  # with its reference line
    # (best - reference) / (best - ideal): what taking every framework's overhead away would close
    assert e["best_baseline"] == "dask" and e["zero_overhead_gap_closed_mean"]["per_seed"] == {
        s: pytest.approx((40.0 + int(s) - r["mean_s"]) / (40.0 + int(s) - 1.0)) for s, r in per_seed.items()}
    # a real engine's run has no cost model to replay
    assert references(units, 4, {"finance": {**TINY.describe(), "entry": {"engine": "vllm"}}}) == {}


def test_the_reference_phase_puts_any_files_units_against_their_references(tmp_path):
    """``e2e.py reference FILES``: a diagnostic's units too (each with the setup its variant
    recorded), each point's mean against its unit's reference; units of one workflow on two
    setups are refused."""
    import json

    from benchmarks.e2e.cli import main
    from tests.test_e2e_runner import TINY, fake_metrics

    units = [{"workflow": "finance", "scenario": "bursty", "factor": 0.5, "seed": 2, "variant": v, "rate_rps": 1.0,
              "metrics": {**fake_metrics(mean), "variant": {"setup": TINY.describe()}}}
             for v, mean in (("ray", 20.0), ("dask-agents", 21.0))]
    (tmp_path / "units.json").write_text(json.dumps({"units": units}))
    out = tmp_path / "ref.json"
    assert main(["reference", str(tmp_path / "units.json"), "--requests", "4", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    ref = got["references"]["finance"]["bursty"]["0.5"]["2"]["mean_s"]
    assert [(r["variant"], r["mean_vs_zero_overhead"]) for r in got["rows"]] == [
        ("ray", pytest.approx(20.0 / ref)), ("dask-agents", pytest.approx(21.0 / ref))]
    other = {**units[1], "metrics": {**units[1]["metrics"], "variant": {"setup": {**TINY.describe(), "replicas": 4}}}}
    (tmp_path / "two.json").write_text(json.dumps({"units": [units[0], other]}))
    with pytest.raises(SystemExit, match="different setups"):
        main(["reference", str(tmp_path / "two.json"), "--requests", "4"])


def test_the_reference_at_given_loads_and_engine_knobs_is_never_below_the_ideal(tmp_path):
    """``e2e.py reference --rates``: the replay at any load with an engine knob changed, against
    the ideal of the run's own engine: at least the bound, and a smaller batch cap can only
    stretch a request set that batches (its steps are the same or fewer sequences at a time)."""
    import json

    from benchmarks.e2e.cli import main

    rows = {}
    for batch in (256, 1):
        out = tmp_path / f"b{batch}.json"
        assert main(["reference", "--workflow", "finance", "--rates", "0.5", "--seeds", "1", "--requests", "4",
                     "--engine", f"max_batch={batch}", "--json", str(out)]) == 0
        got = json.loads(out.read_text())
        assert got["engine_changed"] == {"max_batch": batch} and len(got["rows"]) == 1
        rows[batch] = got["rows"][0]
    assert rows[256]["ideal_mean_s"] == rows[1]["ideal_mean_s"]
    assert 1.0 <= rows[256]["zero_overhead_vs_ideal"] < rows[1]["zero_overhead_vs_ideal"]
    for bad in ("max_batch", "max_batch=eight"):  # a clear error, not a traceback
        with pytest.raises(SystemExit, match="--engine"):
            main(["reference", "--workflow", "finance", "--rates", "0.5", "--engine", bad])


def test_the_oracles_priority_is_the_requests_ideal_work_left_its_pauses_left_out():
    """``srpt``: a call ranks by its request's ideal time from the call's start to the end, the
    user's pauses after it left out; the first call's is the whole ideal latency less the tool
    before it, the last one's that call alone. ``sjf``: every call the whole latency. An unknown
    order is refused."""
    wf = _Tiny()
    spec = _Spec("r0", (_prompt(1, 1500), _prompt(2, 900)), tool_s=0.25, think_s=30.0)
    whole = ideal(wf, spec, ENGINE, shared="")[0]
    srpt = oracle(wf, [spec], ENGINE, "srpt")
    model = LLMCall("r0", "asker", "", 1).model
    assert srpt("r0", model, spec.prompts[0]) == (pytest.approx(whole - spec.tool_s, rel=1e-9),)  # its tool done
    assert srpt("r0", model, spec.prompts[1]) == (pytest.approx(llm_seconds(EmulationParams(**ENGINE), 900, 0, 20),
                                                                rel=1e-9),)
    assert srpt.misses == 0
    assert srpt("r0", model, "a prompt it never sent") == (pytest.approx(whole, rel=1e-9),) and srpt.misses == 1
    assert oracle(wf, [spec], ENGINE, "sjf")("r0", model, spec.prompts[1]) == (pytest.approx(whole, rel=1e-9),)
    assert oracle(wf, [spec], ENGINE, "fcfs") is None
    with pytest.raises(ValueError, match="order"):
        oracle(wf, [spec], ENGINE, "lifo")


def test_an_oracles_order_lets_the_short_request_pass_the_long_one():
    """One engine admitting one sequence at a time, a long request queued just before a short
    one: first come first served makes the short one wait the long one's whole call; the
    oracle's order serves the short one at its ideal and the mean drops, the work unchanged."""
    wf = _Tiny()
    setup = Setup(engine={**ENGINE, "max_batch": 1}, replicas=1, models=(("coder", 1),), time_scale=1.0,
                  max_model_len=131072, tool_threads=8)
    long, short = _Spec("long", (_prompt(5, 3000),)), _Spec("short", (_prompt(6, 200),))
    p = EmulationParams(**setup.engine)
    alone = {"long": llm_seconds(p, 3000, 0, 20), "short": llm_seconds(p, 200, 0, 20)}
    fcfs = Replay(setup).run(wf, [long, short], [0.0, 0.0])
    assert fcfs == [pytest.approx(alone["long"]), pytest.approx(alone["long"] + alone["short"])]
    for order in ("sjf", "srpt"):
        got = Replay(setup, priority=oracle(wf, [long, short], setup.engine, order)).run(wf, [long, short], [0.0, 0.0])
        assert got == [pytest.approx(alone["short"] + alone["long"]), pytest.approx(alone["short"])], order


def test_the_reference_phase_replays_each_queue_order_asked(tmp_path):
    """``--order fcfs,srpt``: one row per order, labelled; an oracle's order is never below the
    ideal; an unknown order is a clear error."""
    import json

    from benchmarks.e2e.cli import main

    out = tmp_path / "orders.json"
    assert main(["reference", "--workflow", "finance", "--rates", "0.5", "--seeds", "1", "--requests", "4",
                 "--order", "fcfs,srpt", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["order"] for r in rows] == ["fcfs", "srpt"] and all(r["oracle_misses"] == 0 for r in rows)
    assert rows[0]["ideal_mean_s"] == rows[1]["ideal_mean_s"] and all(r["zero_overhead_vs_ideal"] >= 1.0 for r in rows)
    with pytest.raises(SystemExit, match="--order"):
        main(["reference", "--workflow", "finance", "--rates", "0.5", "--order", "fcfs,lifo"])
    # a file's units: per point, the best baseline's gap to the ideal closed by each order's replay
    from tests.test_e2e_runner import TINY, fake_metrics

    units = [{"workflow": "finance", "scenario": "bursty", "factor": 0.8, "seed": 2, "variant": v, "rate_rps": 1.0,
              "metrics": {**fake_metrics(mean), "variant": {"setup": TINY.describe()}}}
             for v, mean in (("ray", 20.0), ("dask-agents", 21.0))]
    (tmp_path / "units.json").write_text(json.dumps({"units": units}))
    assert main(["reference", str(tmp_path / "units.json"), "--requests", "4", "--order", "fcfs,srpt",
                 "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert [(r["variant"], r["order"]) for r in got["rows"]] == [
        ("ray", "fcfs"), ("ray", "srpt"), ("dask-agents", "fcfs"), ("dask-agents", "srpt")]
    (point,) = got["points"]
    assert point["best_baseline"] == "ray" and point["load"] == "x0.8"
    for o in ("fcfs", "srpt"):
        ref = got["references_by_order"][o]["finance"]["bursty"]["0.8"]["2"]["mean_s"]
        ideal_mean = fake_metrics(20.0)["ideal_mean_s"]
        assert point["zero_overhead_gap_closed_mean"][o]["median"] == pytest.approx((20.0 - ref) / (20.0 - ideal_mean))


def test_the_reference_at_a_load_says_whether_it_is_sustained_without_any_framework(tmp_path):
    """``zero_overhead_sustained``: the runner's test on the replay's latencies. Requests far
    apart are sustained; all arriving within a second on two engines that run one call at a
    time are not (latency grows along the arrivals), so a capacity goal above that load is
    beyond every scheduler."""
    import json

    from benchmarks.e2e.cli import main

    out = tmp_path / "sust.json"
    assert main(["reference", "--workflow", "finance", "--rates", "0.02,20", "--seeds", "1", "--requests", "12",
                 "--engine", "max_batch=1", "--json", str(out)]) == 0
    rows = {r["rate_rps"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows[0.02]["zero_overhead_sustained"] is True
    assert rows[20.0]["zero_overhead_sustained"] is False
    assert rows[20.0]["zero_overhead_vs_ideal"] > rows[0.02]["zero_overhead_vs_ideal"]
