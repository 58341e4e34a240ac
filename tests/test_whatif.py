"""What-if planning (dask_agents/whatif.py, ``dask-agents whatif``) on hand-made telemetry."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
from click.testing import CliRunner

from dask_agents import whatif as w
from dask_agents.cli import main

FIT = w.EngineFit(decode_s_per_step=0.01, decode_s_per_seq=0.0, prefill_s_per_token=0.0, calls=0, r2=1.0)


def row(key, session, component, kind, created, started, finished, creator=None, model=None,
        prompt=None, cached=None, out=None, worker="w1"):
    return {"key": key, "session": session, "component": component, "kind": kind, "creator": creator,
            "created": created, "started": started, "finished": finished, "model": model,
            "prompt_tokens": prompt, "cached_tokens": cached, "output_tokens": out, "worker": worker}


def agent_session(sid: str, t0: float, worker: str = "w1") -> list[dict]:
    """An agent call that runs a 2 s tool, then 0.5 s later an LLM call (100 tokens), then a 0.2 s tail."""
    return [
        row(f"{sid}-agent", sid, "Dev", "agent", t0, t0, t0 + 4.0, worker="a"),
        row(f"{sid}-tool", sid, "run_tests", "tool", t0, t0, t0 + 2.0, creator=f"{sid}-agent", worker="a"),
        row(f"{sid}-llm", sid, "llm.coder", "llm", t0 + 2.5, t0 + 2.5, t0 + 3.8, creator=f"{sid}-agent",
            model="coder", prompt=500, cached=0, out=100, worker=worker),
    ]


def test_one_session_replays_exactly():
    scripts = w.scripts_from_frame(pd.DataFrame(agent_session("s1", 100.0)))
    assert [s.id for s in scripts] == ["s1"] and scripts[0].latency == pytest.approx(4.0)
    pred = w.predict(scripts, {"coder": FIT}, {"coder": 1})
    # tool 2 s, gap 0.5 s, 100 decode steps of 10 ms, the agent's tail 0.2 s
    assert pred.session_latency == [pytest.approx(2.0 + 0.5 + 1.0 + 0.2)]
    assert pred.llm_latency == [pytest.approx(1.0)]


def test_more_replicas_help_under_load_and_faster_arrivals_hurt():
    frame = pd.DataFrame([r for i in range(40) for r in agent_session(f"s{i}", 0.05 * i)])
    scripts = w.scripts_from_frame(frame)
    fit = w.EngineFit(0.01, 0.002, 1e-4, 0, 1.0)  # the batch slows every step: contention
    one = w.predict(scripts, {"coder": fit}, {"coder": 1}).summary()
    two = w.predict(scripts, {"coder": fit}, {"coder": 2}).summary()
    assert two["mean_s"] < one["mean_s"] and two["llm_mean_s"] < one["llm_mean_s"]
    slow = w.predict(scripts, {"coder": fit}, {"coder": 2}, load_scale=0.1).summary()
    fast = w.predict(scripts, {"coder": fit}, {"coder": 2}, load_scale=10).summary()
    assert fast["mean_s"] > slow["mean_s"]
    assert slow["throughput_per_s"] < fast["throughput_per_s"]


def test_calibration_fits_recorded_llm_times():
    rows, start = [], 0.0
    for i in range(30):  # one call after another on one worker: 12 ms a token, 0.1 ms a prefill token
        out, prompt, cached = 20 + i, 400 + 37 * (i % 7), 128 * (i % 2)
        dur = out * 0.012 + 1e-4 * (prompt - cached)
        rows.append(row(f"c{i}", f"s{i}", "llm.coder", "llm", start, start, start + dur, model="coder",
                        prompt=prompt, cached=cached, out=out))
        start += dur
    fits = w.calibrate(w.scripts_from_frame(pd.DataFrame(rows)))
    f = fits["coder"]
    assert f.calls == 30 and f.r2 > 0.999
    assert f.decode_s_per_step + f.decode_s_per_seq == pytest.approx(0.012, rel=1e-3)
    assert f.prefill_s_per_token == pytest.approx(1e-4, rel=1e-2)


def test_validation_replays_the_recorded_allocation():
    frame = pd.DataFrame([r for i in range(6) for r in agent_session(f"s{i}", 3.0 * i, worker=f"w{i % 2}")])
    scripts = w.scripts_from_frame(frame)
    assert w.recorded_replicas(scripts) == {"coder": 2}
    fits = w.calibrate(scripts)
    check = w.validate(scripts, fits)
    assert check["measured"]["mean_s"] == pytest.approx(4.0)
    # every recorded LLM call took 1.3 s with nothing else in service: the fit reproduces it
    assert abs(check["errors"]["llm_mean_s"]) < 0.05 and abs(check["errors"]["mean_s"]) < 0.05


def test_bad_input_is_a_clear_error():
    with pytest.raises(w.WhatIfError, match="lacks column.*started"):
        w.scripts_from_frame(pd.DataFrame([{"key": "k", "session": "s", "component": "c", "kind": "agent",
                                            "created": 0.0, "finished": 1.0}]))
    unfinished = pd.DataFrame([row("k", "s", "c", "agent", 0.0, 0.0, None)])
    with pytest.raises(w.WhatIfError, match="no session whose calls all finished"):
        w.scripts_from_frame(unfinished)
    scripts = w.scripts_from_frame(pd.DataFrame(agent_session("s1", 0.0)))
    with pytest.raises(w.WhatIfError, match="MODEL=N"):
        w.parse_replicas(["coder:2"], None, scripts)
    with pytest.raises(w.WhatIfError, match="never called.*chat"):
        w.predict(scripts, {"coder": FIT}, {"coder": 1, "chat": 1})
    with pytest.raises(w.WhatIfError, match="at least one replica"):
        w.predict(scripts, {"coder": FIT}, {"coder": 0})
    assert w.parse_replicas([], 3, scripts) == {"coder": 3}


def test_cli_prints_and_writes_json(tmp_path):
    path = tmp_path / "t.csv"
    pd.DataFrame([r for i in range(8) for r in agent_session(f"s{i}", 0.5 * i)]).to_csv(path, index=False)
    out = tmp_path / "w.json"
    res = CliRunner().invoke(main, ["whatif", str(path), "--gpus", "2", "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert "prediction error on the recording" in res.output and "EMULATED" in res.output
    doc = json.loads(out.read_text())
    assert doc["whatif"]["replicas"] == {"coder": 2} and doc["emulated"] is True
    assert math.isfinite(doc["whatif"]["predicted"]["mean_s"])
    bad = CliRunner().invoke(main, ["whatif", str(path), "--replicas", "gpt=1"])
    assert bad.exit_code != 0 and "never called" in bad.output


def test_a_child_never_starts_before_its_creator():
    """The creator started after an earlier call finished; in the replay that call finishes
    sooner, yet the child still waits for its creator to run."""
    frame = pd.DataFrame([
        row("q", "s1", "llm.coder", "llm", 0.0, 0.0, 2.5, model="coder", prompt=300, cached=0, out=100),
        row("p", "s1", "Dev", "agent", 2.0, 2.0, 4.0),
        row("c", "s1", "run_tests", "tool", 3.0, 3.0, 3.5, creator="p"),
    ])
    pred = w.predict(w.scripts_from_frame(frame), {"coder": w.EngineFit(0.001, 0, 0, 0, 1.0)}, {"coder": 1})
    # q takes 0.1 s now; p still starts at 2.0 (2.0 after the session start), c 1.0 after p,
    # p ends its 0.5 s tail after c
    assert pred.session_latency == [pytest.approx(4.0)]


def test_gpus_are_split_exactly_by_recorded_work():
    rows = []
    for i, (model, dur) in enumerate([("a", 6.0), ("b", 1.0), ("c", 1.0)]):
        rows.append(row(f"k{i}", f"s{i}", f"llm.{model}", "llm", 0.0, 0.0, dur, model=model, prompt=10, cached=0, out=5))
    scripts = w.scripts_from_frame(pd.DataFrame(rows))
    assert w.parse_replicas([], 3, scripts) == {"a": 1, "b": 1, "c": 1}
    got = w.parse_replicas([], 8, scripts)
    assert sum(got.values()) == 8 and got["a"] > got["b"] >= 1
    assert w.parse_replicas(["a=2"], 4, scripts) == {"a": 2, "b": 1, "c": 1}


def test_concurrency_is_the_mean_number_in_service():
    calls = [w.Call("a", "llm", "llm", None, 0.0, 0.0, 4.0), w.Call("b", "llm", "llm", None, 1.0, 1.0, 3.0),
             w.Call("c", "llm", "llm", None, 5.0, 5.0, 6.0)]
    # a: 2 s alone, 2 s with b -> 1.5; b: always with a -> 2; c: alone -> 1
    assert w._concurrency(calls) == [pytest.approx(1.5), pytest.approx(2.0), pytest.approx(1.0)]


def test_a_poor_fit_or_self_check_warns_loudly_and_says_what_recording_fixes_it(tmp_path, monkeypatch):
    good = {"coder": w.EngineFit(1e-3, 1e-4, 1e-6, 40, 0.93)}
    assert w.warnings_for(good, {"errors": {"mean_s": 0.05, "p95_s": -0.1}}) == []
    poor = {"coder": w.EngineFit(1e-3, 1e-4, 1e-6, 40, -0.001)}
    why = w.warnings_for(poor, {"errors": {"mean_s": 1.61, "p95_s": 0.1}})
    assert why == ["the calibration of coder explains -0% of the recorded LLM call times (R^2 -0.00 < 0.5)",
                   "replayed on its own allocation, the recording is predicted mean_s +161% off (more than 25%)"]
    # the command line: the warnings and the hint, trusted: false in the JSON (no fit reaches R^2 2)
    path = tmp_path / "t.csv"
    pd.DataFrame([r for i in range(8) for r in agent_session(f"s{i}", 0.5 * i)]).to_csv(path, index=False)
    monkeypatch.setattr(w, "MIN_R2", 2.0)
    res = CliRunner().invoke(main, ["whatif", str(path), "--gpus", "2", "--json", str(tmp_path / "w.json")])
    assert res.exit_code == 0, res.output
    doc = json.loads((tmp_path / "w.json").read_text())
    assert doc["trusted"] is False and doc["warnings"][0].startswith("the calibration of coder explains")
    assert "WARNING: do not trust these predictions: the calibration of coder" in res.output
    assert "WARNING: to fix it, record a run whose LLM calls vary" in res.output
