"""benchmarks/kv_information.py: with each session's true next arrival, ours' mechanism meets the
optimum (what is left of its distance is prediction), and the variants see the same trace."""

from __future__ import annotations

import dask_agents.config as c
from benchmarks import kv_information as ki
from dask_agents.kv.offline.traces import load_mooncake, mooncake_path
from dask_agents.kv.runtime.blocks import CostModel
from dask_agents.kv.runtime.policies import Params


def test_exact_return_times_reach_the_optimum_and_online_does_not_beat_them():
    cost = CostModel.from_config()
    trace = load_mooncake(mooncake_path(), limit=600, decode_s_per_token=cost.decode_s_per_token)
    out = ki.run(trace, cost, Params.from_config(), c.seconds("kv.tick"), int(c.get("kv.min-samples")))
    assert out["exact"]["ratio_gmean"] < 1.02
    assert out["online"]["ratio_gmean"] >= out["exact"]["ratio_gmean"]
    assert all(r >= 1 - 1e-9 for v in ki.VARIANTS for r in out[v]["ratio"])  # nobody beats the lower bound


def test_the_last_gap_feature_is_known_online():
    trace = load_mooncake(mooncake_path(), limit=300)
    labelled = ki.with_last_gap(trace)
    firsts = {}
    for st in labelled.steps:
        firsts.setdefault(st.session, st)
    assert all("|" not in st.node for st in firsts.values())  # a session's first step has no previous pause
    assert [(s.session, s.at, s.blocks) for s in labelled.steps] == [(s.session, s.at, s.blocks) for s in trace.steps]
