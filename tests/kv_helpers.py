"""Small hand-made traces and tier setups shared by the kv tests (tiny blocks: fast and exact)."""

from __future__ import annotations

import itertools

from dask_agents.kv.runtime.blocks import HOST, CostModel, Tier, Tiers
from dask_agents.kv.runtime.policies import Params
from dask_agents.kv.runtime.sizing import KVGeometry
from dask_agents.kv.offline.traces import Step, Trace

BS = 4  # tokens per block
COST = CostModel(KVGeometry(1, 1, 1, 1, block_size=BS), prefill_tokens_per_s=100.0)  # 8 bytes a block
BPB = COST.bytes_per_block
PARAMS = Params(ttl_max=60.0, prefetch_margin=0.05)


def tiers(acc_blocks: int, host_blocks: int = 0, host_bw_blocks_per_s: float = 100.0) -> Tiers:
    """An accelerator of ``acc_blocks`` blocks and a host tier of ``host_blocks`` (restoring one
    block takes 1 / host_bw_blocks_per_s seconds, 0.01 s by default; recomputing one takes 0.04 s)."""
    return Tiers(Tier("accelerator", acc_blocks * BPB), Tier(HOST, host_blocks * BPB, host_bw_blocks_per_s * BPB))


def step(session: str, at: float, blocks, duration: float = 0.1, tool: str | None = "file_io",
         node: str = "act", last: bool = False, tail: int = 0) -> Step:
    """A step with full blocks ``blocks``."""
    return Step(session, at, tuple(blocks), tail, 1, duration, tool, node, last)


def trace(*steps: Step, name: str = "hand") -> Trace:
    """A trace of these steps with ``BS``-token blocks."""
    return Trace(name, "file", BS, tuple(steps))


# -- driving a real engine host directly (tests/test_kv_engine.py, tests/test_kv_manager.py) -----

_request_ids = itertools.count()


def prompt_ids(seed: int, n: int) -> list[int]:
    """``n`` token ids below the tiny model's vocabulary, a pure function of ``seed``."""
    return [(seed * 131 + i * 7) % 1000 + 3 for i in range(n)]


def generate(host, ids: list[int], session: str | None = None, max_tokens: int = 4) -> tuple[list[int], int]:
    """Run one greedy request on an ``EngineHost``; returns (output token ids, cached prompt tokens)."""
    out = host.submit(f"t{next(_request_ids)}", ids, host.sampling_params(max_tokens, 0.0, None),
                      session).result(120)
    return list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)
