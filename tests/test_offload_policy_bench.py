"""benchmarks/offload_policy.py: a replay through vLLM's offloading manager accounts for every
prompt block once, and no policy recomputes less than the floor."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm.v1.kv_offload.cpu.policies.base")


def test_every_block_is_a_device_hit_a_host_hit_or_recomputed(tmp_path):
    from benchmarks import offload_policy

    out = tmp_path / "r.json"
    assert offload_policy.main(["--sessions", "6", "--seeds", "0", "--host", "0.2", "0.5", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert {r["policy"] for r in rows} == set(offload_policy.POLICIES) and len(rows) == 6
    for r in rows:
        assert r["prompt_blocks"] == r["device_hits"] + r["host_hits"] + r["recomputed"]
        assert r["recomputed"] >= r["floor"] > 0
    assert {r["floor"] for r in rows} == {rows[0]["floor"]}  # the same trace for every policy
    assert set(result["summary"]) == {"0.2", "0.5"}
