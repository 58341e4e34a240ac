"""The end-to-end benchmark's workflows (benchmarks/e2e/workflows/): seeded specs, the ideal bound
in virtual time, one request on the in-process floor (EMULATED engines, tiny time scale), and the
prompt statistics each workflow promises. No fixed sleeps, no timing assertions."""

from __future__ import annotations

import pytest

from benchmarks.e2e.ideal import IdealRuntime, ideal
from benchmarks.e2e.program import Setup
from benchmarks.e2e.variants.common import InProcess
from benchmarks.e2e.workflows import finance, router, swe
from dask_agents.worker_plugin.emulated_kv import EmulationParams

WORKFLOWS = {"swe": swe, "finance": finance, "router": router}
PARAMS = EmulationParams().model_dump()
N = 12


def first_scenario(wf) -> str:
    return wf.scenarios[0]


def setup_for(wf) -> Setup:
    models = tuple((m, 1) for m in wf.models) if hasattr(wf, "models") else (("coder", 2),)
    return Setup(engine={"kv_blocks": 20000, "max_batch": 64}, replicas=2, models=models, time_scale=0.002,
                 max_model_len=131072, tool_threads=8)


@pytest.mark.parametrize("name", sorted(WORKFLOWS))
def test_specs_are_seeded(name: str) -> None:
    wf = WORKFLOWS[name].WORKFLOW
    for sc in wf.scenarios:
        a, b, c = wf.make_specs(N, 0, sc), wf.make_specs(N, 0, sc), wf.make_specs(N, 1, sc)
        assert a == b and len(a) == N
        assert a != c
        assert [s.id for s in a] == [f"{wf.name}-s0-{i:04d}" for i in range(N)]
        assert len({s.id for s in a + c}) == 2 * N


@pytest.mark.parametrize("name", sorted(WORKFLOWS))
def test_ideal_runs(name: str) -> None:
    wf = WORKFLOWS[name].WORKFLOW
    for spec in wf.make_specs(4, 3, first_scenario(wf)):
        latency, prefill = ideal(wf, spec, PARAMS)
        assert latency > 0 and prefill > 0


@pytest.mark.parametrize("name", sorted(WORKFLOWS))
def test_one_request_in_process(name: str) -> None:
    wf = WORKFLOWS[name].WORKFLOW
    specs = wf.make_specs(N, 5, first_scenario(wf))
    if name == "router":  # one request of each branch
        specs = [next(s for s in specs if s.branch == b) for b in ("code", "chat")]
    else:
        specs = specs[:1]
    with InProcess(setup_for(wf)) as v:
        for spec in specs:
            with v.session(spec.id) as rt:
                value = wf.program(rt, spec)
            wf.check(spec, value)
            calls = len(WORKFLOWS[name].prompts(spec)) if name != "swe" else None
            assert len(rt.rec.llm) == calls if calls is not None else len(rt.rec.llm) > 0
            assert all(o.prompt_tokens > 0 and o.output_tokens > 0 for o in rt.rec.llm)
        queried = [s["queries"] for s in v.engine_stats()]  # prompt tokens each engine was asked for
    assert len(queried) == 2
    if name == "router":
        assert all(q > 0 for q in queried)  # both models' engines got calls


def test_check_rejects_a_wrong_outcome() -> None:
    for mod in WORKFLOWS.values():
        wf = mod.WORKFLOW
        spec = wf.make_specs(1, 0, first_scenario(wf))[0]
        with pytest.raises(AssertionError):
            wf.check(spec, {"nothing": 0})


def test_finance_latency_leaves_think_time_out() -> None:
    wf = finance.WORKFLOW
    for spec in wf.make_specs(4, 2, "stationary"):
        think = wf.think_s(spec)
        assert think > 0 and len(spec.think) == len(spec.questions) >= 1
        assert all(finance.THINK_S[0] <= t <= finance.THINK_S[1] for t in spec.think)
        rt = IdealRuntime(spec.id, PARAMS, wf.shared_prefix)
        wf.check(spec, wf.program(rt, spec))
        assert rt.think_s == pytest.approx(think)
        latency, _ = ideal(wf, spec, PARAMS)
        assert latency == pytest.approx(rt.now - think)
        assert latency < rt.now  # the steps' sum with the think time is longer


def test_finance_prompts() -> None:
    for spec in finance.WORKFLOW.make_specs(N, 0, "stationary"):
        assert 3 <= len(spec.aspects) <= 5 and 1 <= len(spec.questions) <= 3
        summary = finance.summary_prompt(spec)
        ctx = finance.context(spec)
        assert summary.startswith(ctx) and ctx.startswith(finance.SYSTEM)
        assert all(finance.analyst_prompt(spec, k).startswith(ctx) for k in range(len(spec.aspects)))
        prev = summary
        for p in finance.followup_prompts(spec):
            assert p.startswith(prev) and len(p) > len(prev)  # each follow-up extends the previous prompt
            prev = p
        assert 6_000 < len(ctx) - len(finance.SYSTEM) < 17_000
        assert len(prev) < 131072


def test_swe_prompts_fit_the_context() -> None:
    for sc in ("stationary", "phase"):
        for spec in swe.WORKFLOW.make_specs(N, 0, sc):
            assert swe.longest_prompt(spec) < 131072


def test_swe_scaled_keeps_the_draws_and_fits_a_small_engine() -> None:
    """The real-engine check's Open-SWE (benchmarks/e2e_real.py) is the realistic requests shrunk:
    the same draws, every length and tool latency scaled, every prompt plus its output within the
    tiny model's 4,096 positions, on the measure seeds and the sweep seed alike."""
    small = swe.SWE(tokens=0.05, tools=0.05, max_len=4096)
    assert small.name == "swe-x0.05" and swe.WORKFLOW.name == "swe"
    for seed in (0, 1, 2, 1000):
        big, specs = swe.WORKFLOW.make_specs(40, seed, "stationary"), small.make_specs(40, seed, "stationary")
        for x, y in zip(big, specs):
            assert y == swe.scaled(x, 0.05, 0.05) and y.failing == x.failing and len(y.steps) == len(x.steps)
            assert y.test_s[0] == pytest.approx(0.05 * x.test_s[0]) and y.context == round(0.05 * x.context)
            assert swe.longest_prompt(y) + swe.max_output(y) <= 4096
            assert swe.plan_prompt(y).startswith(small.shared_prefix + "\nSession ")
    with pytest.raises(ValueError, match="do not fit 4096"):
        swe.SWE(tokens=0.2, max_len=4096).make_specs(4, 0, "stationary")


def test_router_prompts_and_phases() -> None:
    wf = router.WORKFLOW
    specs = wf.make_specs(60, 0, "skew")
    assert wf.models == ("chat", "coder")
    shares = [sum(s.branch == "code" for s in specs if s.phase == k) / 20 for k in range(3)]
    assert shares[0] >= 0.9 and shares[1] <= 0.1 and shares[2] >= 0.9  # coding, chat, coding
    for s in specs:
        assert set(wf.models_of(s)) <= set(wf.models) and wf.models_of(s)[0] == "coder"
        assert router.route_of(router.request_text(s)) == s.branch
        assert 500 <= len(router.request_text(s)) <= 2_000 and 5 <= s.route <= 20
        assert 100 <= s.out <= 800
        assert router.classifier_prompt(s).startswith(router.SYSTEM)
        body = len(router.branch_prompt(s)) - len(router.SYSTEM)
        assert 2_000 <= body <= 12_200
        if s.branch == "code":
            assert router.final_prompt(s).startswith(router.branch_prompt(s)) and s.tool_s > 0
    offs = wf.arrivals("skew", 60, 2.0, 0)
    assert len(offs) == 60 and offs[0] == 0.0
    assert all(b >= a for a, b in zip(offs, offs[1:]))
    assert (len(offs) - 1) / offs[-1] == pytest.approx(2.0)
    assert wf.arrivals("skew", 60, 4.0, 0)[-1] == pytest.approx(offs[-1] / 2)
