"""`dask-agents replay` and the replay table/JSON/plot behind it."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from dask_agents.cli import main
from dask_agents.kv.runtime.blocks import CostModel, Tiers
from dask_agents.kv.offline.replay import OFFLINE, OPTIMUM, format_table, load_trace, ratios, replay, resolve_tiers
from dask_agents.kv.offline.traces import GenParams, generate, save


@pytest.fixture
def small_trace(tmp_path):
    t = generate(GenParams(sessions=6, seed=4))
    return save(t, tmp_path / "small.jsonl"), t


def test_replay_command_prints_every_policy_beside_the_optimum(small_trace, tmp_path):
    path, _ = small_trace
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    res = CliRunner().invoke(main, ["replay", str(path), "--policy", "lru", "--policy", "ours",
                                    "--tiers", "accelerator=90%", "--tiers", "accelerator=95%,host=50%",
                                    "--json", str(out_json), "--plot", str(out_png)])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert sum("opt/" in line for line in lines) == 2
    assert sum(" lru " in line for line in lines) == 2 and sum(" ours " in line for line in lines) == 2
    assert sum(" offline " in line for line in lines) == 2
    data = json.loads(out_json.read_text())
    assert {r["policy"] for r in data["rows"]} == {OPTIMUM, "lru", "ours", OFFLINE}
    assert data["trace"]["sessions"] == 6 and set(data["summary"]["generated"]) >= {"lru", "ours"}
    for r in data["rows"]:
        assert r["ratio"] >= 1.0 - 1e-12  # nothing beats the optimum
    assert out_png.stat().st_size > 1000


def test_replay_command_errors(small_trace, tmp_path):
    path, _ = small_trace
    res = CliRunner().invoke(main, ["replay", str(path), "--policy", "fifo"])
    assert res.exit_code != 0 and "unknown KV policy 'fifo'" in res.output
    res = CliRunner().invoke(main, ["replay", str(path), "--tiers", "gpu=3GiB"])
    assert res.exit_code != 0 and "unknown tier 'gpu'" in res.output
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"format": "dask-agents-kv-trace", "block_size": 512}\n{"session": "a", "at": "x", "blocks": []}\n')
    res = CliRunner().invoke(main, ["replay", str(bad)])
    assert res.exit_code != 0 and "bad.jsonl: line 2: at must be a finite number >= 0" in res.output
    res = CliRunner().invoke(main, ["replay", str(tmp_path / "missing.jsonl")])
    assert res.exit_code != 0 and "no trace file" in res.output


def test_replay_rows_and_ratios():
    t = load_trace("generated:sessions=5,seed=2")
    assert len(t.sessions()) == 5
    cost = CostModel.from_config()
    base = Tiers.from_config()
    configs = [resolve_tiers(s, t, cost, base) for s in ("accelerator=90%", "accelerator=1TiB")]
    assert cost.blocks_in(configs[0].accelerator) == math.ceil(0.9 * t.peak_footprint())
    rows = replay(t, ["lru", "ours"], configs, cost)
    assert [r.policy for r in rows] == [OPTIMUM, "lru", "ours", OFFLINE] * 2
    big = rows[4:]
    assert all(r.recomputed_tokens == big[0].recomputed_tokens for r in big)  # everything fits
    assert all(r.ratio >= 1.0 for r in rows)
    summary = ratios(rows, ["lru", "ours"])
    assert set(summary["generated"]) >= {"lru", "ours", "lru_worst", OFFLINE}
    assert "opt/" in format_table(rows)
    with pytest.raises(ValueError, match="generated trace option 'bogus=1'"):
        load_trace("generated:bogus=1")


def test_replay_without_session_ends(small_trace, tmp_path):
    """Without the end signal no session is ever finished: the simulator keeps every one of them
    for the policy to judge, and the CLI says which way it replayed."""
    from dask_agents.kv.offline.simulator import Simulator
    from dask_agents.kv.runtime.policies import get_policy
    from tests.kv_helpers import PARAMS

    _, t = small_trace
    blind = t.without_session_ends()
    assert not any(s.last for s in blind.steps) and [s.blocks for s in blind.steps] == [s.blocks for s in t.steps]
    assert blind.family == "generated-no-ends" and blind.meta["session_ends"] is False
    cost = CostModel.from_config()
    tiers = resolve_tiers("accelerator=50%", t, cost, Tiers.from_config())
    ended = Simulator(t, tiers, get_policy("ours", PARAMS), cost)
    ended.run()
    never = Simulator(blind, tiers, get_policy("ours", PARAMS), cost)
    never.run()
    assert len(never.sessions) == 6 and len(ended.sessions) < 6
    path, _ = small_trace
    out_json = tmp_path / "r.json"
    res = CliRunner().invoke(main, ["replay", str(path), "--policy", "lru", "--without-session-ends",
                                    "--tiers", "accelerator=90%", "--no-offline", "--json", str(out_json)])
    assert res.exit_code == 0, res.output
    assert json.loads(out_json.read_text())["trace"]["family"] == "generated-no-ends"


def test_the_replay_table_cuts_nothing_and_explains_its_columns(small_trace):
    path, _ = small_trace
    res = CliRunner().invoke(main, ["replay", str(path), "--policy", "lru", "--no-offline",
                                    "--tiers", "accelerator=90%,host=50%"])
    assert res.exit_code == 0, res.output
    rows = [line for line in res.output.splitlines() if " lru " in line]
    assert rows and rows[0].startswith("generated(sessions=6,seed=4")  # the trace's whole name
    header = res.output.splitlines()[0]
    assert "offl GiB" in header and "GB " not in header  # one unit, the tiers' own
    assert "vs opt: recomputed / the optimum's" in res.output  # the columns explained
    tiers = rows[0].split()[1]
    assert tiers.startswith("accelerator=") and ",host=" in tiers  # not cut at 30 characters
