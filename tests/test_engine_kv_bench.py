"""benchmarks/engine_kv.py's yardstick: the recompute floor is what vLLM really recomputes with
unbounded KV memory (real vLLM CPU engine), so the reduction bounds the benchmark prints hold."""

from __future__ import annotations

import argparse

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
