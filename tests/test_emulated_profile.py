"""The benchmark's engine profiles (``benchmarks/e2e/profile.py``) and the cost model's prefill
attention term, on a real EmulatedScheduler stepped deterministically (no thread, no clock)."""

from __future__ import annotations

import pytest

from benchmarks.e2e import profile as prof
from dask_agents.worker_plugin.emulated_kv import (
    EmulatedScheduler,
    EmulationParams,
    Sequence,
    decode_step_cost,
    prefill_cost,
)


def chunks(sched: EmulatedScheduler, seq: Sequence) -> list[float]:
    """Step until ``seq`` has its first token; each step's cost."""
    costs = []
    while not seq.output:
        costs.append(sched.step()[0])
    return costs


@pytest.mark.parametrize("decode_terms", [False, True])
def test_a_prefill_chunk_costs_the_closed_form(decode_terms):
    extra = dict(decode_s_per_step=0.25, decode_s_per_seq=0.125, decode_s_per_ctx_token=1e-3) if decode_terms else \
        dict(decode_s_per_step=0.0, decode_s_per_seq=0.0, decode_s_per_ctx_token=0.0)
    p = EmulationParams(block_size=4, max_num_batched_tokens=10, prefill_s_per_token=0.5,
                        prefill_s_per_token_pos=0.001, **extra)
    sched = EmulatedScheduler(p, capacity_blocks=100)
    first = Sequence("a", list(range(3, 28)), 1)  # 25 tokens: chunks [0, 10) [10, 20) [20, 25)
    sched.add(first)
    bounds = [(0, 10), (10, 20), (20, 25)]
    for cost, (s, e) in zip(chunks(sched, first), bounds, strict=True):
        assert prefill_cost(p, s, e) == pytest.approx(sum(0.5 + 0.001 * i for i in range(s, e)), rel=1e-12)
        assert cost == pytest.approx(prefill_cost(p, s, e) + decode_step_cost(p, 1, e), rel=1e-12)
    # A prefix hit: the prefill starts past the cached blocks, its attention still reads them.
    second = Sequence("b", list(range(3, 23)) + [200] * 7, 1)  # 20 tokens in common: 5 blocks
    sched.add(second)
    costs = chunks(sched, second)
    assert second.cached_tokens == 20
    assert costs == [pytest.approx(prefill_cost(p, 20, 27) + decode_step_cost(p, 1, 27), rel=1e-12)]
    assert prefill_cost(p, 20, 27) > prefill_cost(p, 0, 7)  # same tokens, later positions


def test_the_default_attention_term_is_the_physics():
    p = EmulationParams()
    assert p.prefill_s_per_token_pos == pytest.approx(4 * 32 * 4096 / 400e12, rel=0.01)
    # closed form = the per-token sum, for a long chunk far into a context
    assert prefill_cost(p, 30_000, 38_192) == pytest.approx(
        sum(p.prefill_s_per_token + p.prefill_s_per_token_pos * i for i in range(30_000, 38_192)), rel=1e-9)


def test_profiles_are_valid_and_cited():
    for name in ("realistic", "SMALL"):
        EmulationParams(**prof.profile(name))
    with pytest.raises(KeyError, match="realistic"):
        prof.profile("huge")
    assert set(prof.CITATIONS) == set(prof.REALISTIC)
    # the previous regime's profile: 2,048 blocks, batch 8, no host tier, no attention term
    assert prof.SMALL["kv_blocks"] == 2048 and prof.SMALL["max_batch"] == 8
    assert prof.SMALL["prefill_s_per_token_pos"] == 0.0 and "host_kv_blocks" not in prof.SMALL


def test_realistic_kv_capacity_and_decode_step():
    r = prof.REALISTIC
    assert 400_000 <= prof.kv_tokens(r) <= 500_000
    assert prof.kv_tokens(r) * 128 * 1024 == pytest.approx(60e9, rel=0.05)  # ~60 GB of KV
    for batch in (8, 12, 20):  # a batch holding 400k tokens of context
        assert 0.015 <= prof.step_time(r, batch, 400_000) <= 0.025
    assert prof.step_time(r, 0, 0) == pytest.approx(16.06e9 / 3.35e12 + 1.5e-3)  # weights once + overhead


def test_realistic_decode_step_on_the_engine():
    """10 sequences of 40k tokens (400k of the 464k tokens of KV), all decoding: a step costs ~22 ms."""
    p = prof.params(prof.REALISTIC)
    sched = EmulatedScheduler(p, p.kv_blocks)
    seqs = [Sequence(f"s{i}", [3 + i] * 40_000, 500) for i in range(10)]
    for s in seqs:
        sched.add(s)
    while not all(s.output for s in seqs):
        sched.step()
    cost, _ = sched.step()
    ctx = sum(s.num_computed for s in seqs)
    assert 400_000 <= ctx <= 400_500  # (the first ones decode while the last ones prefill)
    assert cost == pytest.approx(decode_step_cost(p, 10, ctx), rel=1e-12)
    assert 0.015 <= cost <= 0.025


def test_a_30k_context_restores_from_the_host_in_a_fraction_of_its_recompute():
    r = prof.REALISTIC
    n = 30_000
    recompute = prof.prefill_time(r, 0, n)  # (plus the steps' own costs: left out, in its favour)
    assert prof.restore_time(r, n) / recompute < 0.25
    # the same on the engine: a context recomputed from scratch vs restored from the host tier
    p = prof.params(r)
    prompt = [7] * n + [9] * 16

    def first_token(warm: bool) -> float:
        sched = EmulatedScheduler(p, p.kv_blocks)
        if warm:
            sched.add(Sequence("before", prompt[:n], 1, session="s"))
            chunks(sched, sched.requests["before"])  # (one output token: done, its blocks cached)
            assert sched.offload("s") == n // p.block_size  # every block to the host
        seq = Sequence("after", prompt, 1, session="s")
        sched.add(seq)
        t0 = sched.now
        chunks(sched, seq)
        return sched.now - t0

    cold, warm = first_token(False), first_token(True)
    assert cold > recompute
    assert warm / cold < 0.25
