"""Block hashing chains, tiers and byte/recompute costs."""

from __future__ import annotations

import os
import subprocess
import sys

import dask
import pytest

from dask_agents.kv.runtime.blocks import ROOT, CostModel, Tiers, block_hash, chain, common_prefix, extend
from dask_agents.kv.runtime.sizing import KVGeometry


def test_chains_share_their_common_prefix_and_only_full_blocks_hash():
    a = chain(list(range(10)), 4)  # 2 full blocks, a 2-token tail
    b = chain(list(range(8)) + [99, 98, 97, 96], 4)
    c = chain([1] + list(range(1, 8)), 4)
    assert len(a) == 2 and a == b[:2] and len(b) == 3
    assert common_prefix(a, b) == 2 and common_prefix(a, c) == 0
    # A block's id covers its whole prefix: equal blocks after different prefixes differ.
    assert chain([5] * 8, 4)[1] != chain([6] * 4 + [5] * 4, 4)[1]
    assert extend(a, ["x"]) == a + (block_hash(a[-1], "x"),) and extend((), [1])[0] == block_hash(ROOT, 1)


def test_block_ids_are_the_same_in_every_process():
    code = "from dask_agents.kv.runtime.blocks import chain; print(chain(list(range(12)), 4))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": ""},
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.stdout.strip() == str(chain(list(range(12)), 4))


def test_cost_model_from_config():
    cost = CostModel.from_config()
    # Llama-3-8B geometry, bf16, 512-token blocks: 128 KiB a token, 64 MiB a block.
    assert cost.geometry == KVGeometry(32, 8, 128, 2, 512)
    assert cost.bytes_per_block == 64 * 2**20 and cost.block_size == 512
    assert cost.recompute_s(10_000) == pytest.approx(1.0)
    tiers = Tiers.from_config()
    assert tiers.accelerator.capacity == 16 * 2**30 and tiers.lower == ()
    assert cost.blocks_in(tiers.accelerator) == 256
    assert tiers.host.bandwidth == 25e9 and tiers.disk.bandwidth == 3e9
    # Restoring a block from host (2.7 ms) beats recomputing 512 tokens (51 ms); from disk too.
    assert cost.transfer_s(1, tiers.host) == pytest.approx(64 * 2**20 / 25e9)
    assert cost.restore_wins(tiers.host) and cost.restore_wins(tiers.disk)
    assert cost.transfer_s(5, tiers.accelerator) == 0.0


def test_tier_specs():
    base = Tiers.from_config()
    t = base.parse("accelerator=8GiB,host=32GiB@10GB/s")
    assert t.accelerator.capacity == 8 * 2**30 and t.host.capacity == 32 * 2**30 and t.host.bandwidth == 10e9
    assert [x.name for x in t.lower] == ["host"]
    assert base.parse("4GiB").accelerator.capacity == 4 * 2**30
    assert t.describe() == "accelerator=8.00GiB,host=32.00GiB"
    with pytest.raises(ValueError, match="unknown tier 'gpu'"):
        base.parse("gpu=8GiB")
    with pytest.raises(ValueError, match="not a byte size"):
        base.parse("host=lots")
    with dask.config.set({"agents.kv.tiers.host.capacity": "1 TiB"}):
        assert Tiers.from_config().host.capacity == 2**40
    with pytest.raises(ValueError, match="unknown tier"):
        Tiers.from_config({"gpu": {"capacity": 1}})
