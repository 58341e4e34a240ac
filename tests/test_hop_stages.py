"""benchmarks/hop_stages.py: a direct call's stamps become per-stage times per agent role; a call
missing a stamp (still running when the run ended) is left out rather than counted short."""

from __future__ import annotations

import json

from benchmarks.hop_stages import STAGES, summarize


def _write(path, key: str, times: list[float]) -> None:
    with open(path, "a") as f:
        for stage, t in zip(STAGES, times):
            f.write(json.dumps([key, stage, t]) + "\n")


def test_stages_are_the_gaps_between_stamps_and_the_body_is_not_overhead(tmp_path):
    # one call: each stage 1 ms after the one before, except the body (w_t0 -> w_t1): 100 ms
    t = [0.0, 0.001, 0.002, 0.003, 0.004, 0.005, 0.006, 0.106, 0.107, 0.108, 0.109, 0.110]
    _write(tmp_path / "1.jsonl", "analyst-aa", t)
    _write(tmp_path / "1.jsonl", "analyst-bb", [x + 1.0 for x in t[:5]] + [x + 1.002 for x in t[5:]])
    _write(tmp_path / "2.jsonl", "summarizer-cc", t[:11])  # never woke: incomplete
    out = summarize(str(tmp_path))
    assert out["calls"] == 3 and out["complete"] == 2 and list(out["roles"]) == ["analyst"]
    a = out["roles"]["analyst"]
    assert a["calls"] == 2
    assert a["stages_ms"]["w_t1"]["p50"] == 100.0
    assert a["stages_ms"]["w_recv"]["mean"] == 2.0  # 1 ms and 3 ms
    assert a["overhead_ms"]["mean"] == 11.0  # issued -> woke less the body: 10 ms and 12 ms
