"""benchmarks/engine_kv.py's yardstick: the recompute floor is what vLLM really recomputes with
unbounded KV memory (real vLLM CPU engine), so the reduction bounds the benchmark prints hold."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from benchmarks import engine_kv as ek


def _plan(system: int) -> list[ek.Script]:
    steps = (ek.Step("planner", 8, "file_io", 0.0, tuple(range(3, 103))),
             ek.Step("developer", 16, "code_exec", 0.0, tuple(range(5, 205))),
             ek.Step("tester", 8, None, 0.0, ()))
    return [ek.Script("s0", 0.0, tuple(range(10, 210)), steps)]


def test_recompute_floor_by_hand():
    # system 128 + task 200 = 328 cold; 2 full blocks cached after 8 output tokens (335 computed);
    # next prompt 436: 180 recomputed; cached 3 blocks (451 computed); next 652: 268
    assert ek.recompute_floor(_plan(128), 128) == 328 + 180 + 268
    # a second session reuses the system prompt only (its first block)
    two = _plan(128) + [ek.Script("s1", 0.0, tuple(range(20, 220)), _plan(128)[0].steps)]
    assert ek.recompute_floor(two, 128) == 2 * (328 + 180 + 268) - 128


def test_the_floor_is_what_a_real_engine_recomputes_with_room_for_everything():
    ek.SYSTEM = ek._tokens(__import__("random").Random("floor"), 128)
    try:
        args = argparse.Namespace(max_model_len=2048, device="16 MiB", host="0 MiB")
        out = ek.run_variant("prefix_caching", _plan(128), args)
    finally:
        ek.SYSTEM = ()
    assert not out.errors and out.calls == 3
    assert out.recomputed_tokens == ek.recompute_floor(_plan(128), 128)


def test_the_live_working_set_by_hand():
    # s0: 200-token task under a 128-token system prompt; steps at t=0 (328 + 8 = 336 tokens: 3
    # blocks, 2 its own) and t=1 after a 1 s pause (336 + 100 + 16 = 452: 4 blocks, 3 its own),
    # ends at t=1; s1 starts at t=0.5 with the same steps: 2 own blocks, then 3 at 1.5, ends at 1.5
    plan = [ek.Script("s0", 0.0, tuple(range(10, 210)), (
        ek.Step("planner", 8, "file_io", 1.0, tuple(range(3, 103))), ek.Step("tester", 16, None, 0.0, ()))),
        ek.Script("s1", 0.5, tuple(range(20, 220)), (
            ek.Step("planner", 8, "file_io", 1.0, tuple(range(3, 103))), ek.Step("tester", 16, None, 0.0, ())))]
    got = ek.context_blocks(plan, 128)
    # live: [0, .5) 2 own; [.5, 1) 4; at 1 s0 grows to 3 and ends; [1, 1.5) 2; ends at 1.5; + 1 shared
    assert got["live_peak"] == 4 + 1
    assert got["live_mean"] == (2 * 0.5 + 4 * 0.5 + 2 * 0.5) / 1.5 + 1
    assert got["total"] == 3 + 3 + 1


def test_arrivals_keep_the_sessions_and_spread_them_by_the_mean_length():
    plan = ek.scripts(40, (5, 8), (768, 1280), (192, 384), 1.0, 3, 0.0, 512, 4096)
    timed = ek.with_arrivals(plan, 10, 3)
    assert [dataclasses.replace(s, start_s=0.0) for s in timed] == plan  # only the start times change
    starts = [s.start_s for s in timed]
    assert starts == sorted(starts) and starts[0] == 0.0
    mean_len = sum(sum(st.pause_s for st in s.steps) for s in plan) / len(plan)
    gap = starts[-1] / (len(starts) - 1)
    assert 0.5 * mean_len / 10 < gap < 2 * mean_len / 10  # about 10 live at once
    assert ek.with_arrivals(plan, 10, 3) == timed  # a pure function of the seed


def test_the_simulated_sweep_orders_bound_schedule_and_lru(tmp_path):
    path = tmp_path / "sweep.json"
    assert ek.main(["--quick", "--families", "excess", "current", "--seeds", "0", "--sweep", "0.3,0.6",
                    "--json", str(path)]) == 0
    rows = __import__("json").loads(path.read_text())["sweep"]
    assert list(rows) == ["excess"]  # the current family has fixed sizes: nothing to sweep
    assert [r["share"] for r in rows["excess"]] == [0.3, 0.6]
    for r in rows["excess"]:
        assert 1.0 - 1e-9 <= r["lower_bound"] <= r["offline"] + 1e-9 and r["offline"] <= r["lru"] + 1e-9
    small, big = rows["excess"]
    assert big["lru"] <= small["lru"]  # more memory, less recomputed


def test_tier_sizes_are_shares_or_bytes_and_nothing_else():
    assert ek.tier_size("0.5") == 0.5 and ek.tier_size("30%") == 0.3 and ek.tier_size(0.4) == 0.4
    assert ek.tier_size("5 MiB") == "5 MiB"
    for bad in ("2", "0", "150%", "lots"):
        with pytest.raises(ValueError, match="tier size"):
            ek.tier_size(bad)
