"""The EMULATED engine's KV model (worker_plugin/emulated_kv.py) and its KV control.

Cost-model tests step :class:`EmulatedScheduler` directly: block counts, token counts and
emulated seconds are exact (no clock, no thread). The host tests run the stepping thread and
poll for state with a deadline (never a fixed sleep): the KV manager (kv/runtime/manager.py, its own
code) drives the emulated engine's blocks through ``EmulatedEngineHost``.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import dask
import pytest

from dask_agents.kv.runtime.engine_kv import KVDirectiveError
from dask_agents.kv.runtime.manager import KVManager
from tests.conftest import wait_for
from dask_agents.worker_plugin.emulated import (
    EMULATED_COMPAT,
    EmulatedEngineHost,
    EmulatedEngineKV,
    EmulatedScheduler,
    EmulationParams,
    Sequence,
    block_hashes,
)
from dask_agents.worker_plugin.engines import Engines, make_host
from dask_agents.model_settings import ModelSettings

ROOT = Path(__file__).resolve().parent.parent
# Only what a test looks at costs anything: emulated seconds come out as exact small numbers.
# (prefill_s_per_token_pos, the attention term, defaults to the 8B/H100 value: zeroed here too.)
FREE = dict(prefill_s_per_token=0.0, prefill_s_per_token_pos=0.0, decode_s_per_step=0.0, decode_s_per_seq=0.0,
            decode_s_per_ctx_token=0.0)


def params(**kw) -> EmulationParams:
    return EmulationParams(**{"block_size": 4, **FREE, **kw})


def finish(sched: EmulatedScheduler) -> list[float]:
    """Step until idle; the steps' costs."""
    costs = []
    while sched.running or sched.waiting:
        costs.append(sched.step()[0])
    return costs


def run_alone(prompt: list[int], max_tokens: int, **kw) -> list[int]:
    s = Sequence("probe", prompt, max_tokens)
    sched = EmulatedScheduler(params(**kw), capacity_blocks=1000)
    sched.add(s)
    finish(sched)
    return s.output


# -- order within a step (vLLM's running list) ------------------------------------------------

def test_a_higher_priority_prompt_does_not_cut_in_front_of_running_decodes():
    """vLLM's running list is in admission order: a step gives its token budget to the decodes
    already running before a newly admitted prompt's chunks, whatever that prompt's priority
    (priority decides whom to admit and to preempt). The emulator had sorted running
    sequences by priority, so a high-priority long prompt took whole steps' budgets and the
    decodes behind it made no progress (the finance workflow: calls of advanced sessions
    stalled every other session's decode)."""
    sched = EmulatedScheduler(params(max_num_batched_tokens=8), capacity_blocks=64)
    low = Sequence("low", list(range(10, 14)), 20, priority=(0, 0, 0, 0, 1))
    sched.add(low)
    sched.step()  # its prompt, and its first token
    sched.add(Sequence("high", list(range(30, 62)), 4, priority=(0, 0, -5, 0, 2)))
    for expect in range(2, 6):  # the 32-token prompt takes 4 steps of 7 tokens and more: low decodes in each
        sched.step()
        assert len(low.output) == expect
    assert [s.request_id for s in sched.running] == ["low", "high"]


def test_preemption_takes_the_lowest_priority_even_if_it_ran_earlier_in_the_step():
    """vLLM's priority policy preempts the lowest-priority running request, wherever it is in
    the running list; a victim already scheduled in this step gives its tokens back."""
    sched = EmulatedScheduler(params(), capacity_blocks=4)
    low = Sequence("low", list(range(10, 17)), 8, priority=(0, 0, 0, 0, 1))  # 7 tokens: 2 blocks
    sched.add(low)
    sched.step()
    high = Sequence("high", list(range(30, 37)), 8, priority=(0, 0, -5, 0, 2))
    sched.add(high)
    sched.step()  # both run: 4 blocks taken
    assert [s.request_id for s in sched.running] == ["low", "high"] and sched.stats()["free_blocks"] == 0
    while not (low.preemptions or high.preemptions):
        sched.step()  # the first to need a third block
    assert low.preemptions == 1 and high.preemptions == 0 and low.status == "waiting"
    finish(sched)
    assert len(low.output) == len(high.output) == 8
    assert low.output == run_alone(low.prompt, 8) and high.output == run_alone(high.prompt, 8)


# -- preemption and recompute -----------------------------------------------------------------

def test_decode_outgrowing_the_cache_preempts_the_later_sequence_which_recomputes():
    # 8-token prompts, 12 tokens each: 5 blocks of 4 at most each (19 computed tokens), 10 for
    # both, 8 on the device. Both run until they hold 4 blocks each (step 9); at step 10 a's
    # decode needs a 5th block: b (admitted later) is preempted, its 4 full blocks stay cached
    # and a takes one of them (b's tail, the LRU's head). b waits until a finishes (step 12),
    # is readmitted with 17 tokens (8 prompt + 9 output): 3 blocks hit (12 tokens), 5 recomputed.
    sched = EmulatedScheduler(params(), capacity_blocks=8)
    a, b = Sequence("a", list(range(10, 18)), 12), Sequence("b", list(range(30, 38)), 12)
    sched.add(a)
    sched.add(b)
    for _ in range(9):
        sched.step()
    assert sched.running == [a, b] and sched.stats()["free_blocks"] == 0 and len(b.blocks) == 4
    sched.step()  # step 10
    assert sched.running == [a] and sched.waiting_sequences() == [b] and b.blocks == []
    assert len(b.output) == 9 and sched.counters["preemptions"] == 1 and sched.counters["evictions"] == 1
    hb = block_hashes(b.prompt + b.output, 4)
    assert [sched.contains(h) for h in hb] == [True, True, True, False]  # cached, its tail taken
    sched.step()
    sched.step()  # step 12: a finishes; b still does not fit before a frees its blocks
    assert a.status == "done" and b.status == "waiting" and sched.counters["recomputed_tokens"] == 0
    sched.step()  # step 13: b readmitted
    assert sched.running == [b] and b.preemptions == 1
    c = sched.counters
    assert (c["preempted_queries"], c["preempted_hits"], c["recomputed_tokens"]) == (17, 12, 5)
    finish(sched)
    assert sched.steps == 15 and c["preemptions"] == 1 and c["evictions"] == 2
    assert (c["queries"], c["hits"]) == (16, 0)  # first admissions only (vLLM counts preempted ones apart)
    assert c["prefill_tokens"] == 8 + 8 + 5 and c["decode_tokens"] == 24
    assert len(a.output) == len(b.output) == 12
    assert a.output == run_alone(a.prompt, 12) and b.output == run_alone(b.prompt, 12)
    assert b.result().num_cached_tokens == 0  # what its first admission hit, as vLLM reports


def test_incremental_allocation_admits_what_full_reservation_would_not():
    # Each request holds 2 blocks at admission and grows to 5 (8 + 12 tokens): with full
    # reservation only one would run in 8 blocks; both start at once here.
    sched = EmulatedScheduler(params(), capacity_blocks=8)
    seqs = [Sequence(f"r{i}", [10 + i] * 8, 12) for i in range(2)]
    for s in seqs:
        sched.add(s)
    sched.step()
    assert sched.running == seqs and sched.used_blocks == 4
    sched.step()  # a decode step crossing a block boundary: one more block each
    assert sched.used_blocks == 6 and [len(s.blocks) for s in seqs] == [3, 3]


def test_admission_waits_until_the_prompt_fits_and_check_fails_what_never_fits():
    sched = EmulatedScheduler(params(), capacity_blocks=4)
    with pytest.raises(ValueError, match="needs 5 KV blocks"):
        sched.add(Sequence("big", [5] * 17, 4))  # 20 computed tokens at most
    sched.add(Sequence("ok", [5] * 15, 2))  # 16 computed tokens at most: 4 blocks, exactly the capacity
    first = Sequence("first", [6] * 9, 3)
    sched.add(first)
    sched.step()
    assert [s.request_id for s in sched.running] == ["ok"] and sched.waiting_sequences() == [first]
    finish(sched)
    assert len(first.output) == 3 and sched.counters["preemptions"] == 0


# -- chunked prefill and the step cost --------------------------------------------------------

def test_chunked_prefill_spreads_a_long_prompt_over_the_token_budget():
    budget, n = 16, 40
    sched = EmulatedScheduler(params(max_num_batched_tokens=budget, prefill_s_per_token=1.0), 100)
    s = Sequence("long", [7] * n, 2)
    sched.add(s)
    costs, computed = [], []
    while not s.output:
        costs.append(sched.step()[0])
        computed.append(s.num_computed)
    assert len(costs) == math.ceil(n / budget) == 3
    assert computed == [16, 32, 40] and costs == [16.0, 16.0, 8.0]  # the last chunk samples the first token
    finish(sched)
    assert sched.counters["prefill_tokens"] == n and sched.steps == 4


@pytest.mark.parametrize("arrives", ["same step", "mid prefill"])
def test_a_sibling_hits_the_blocks_a_step_schedules_not_only_those_computed_before(arrives):
    """vLLM caches a block when a step allocates it for the tokens it schedules
    (``KVCacheManager.allocate_slots`` -> ``cache_blocks``): a sibling admitted after the first
    request, in the same step or while the first is still in prefill, hits every block the first
    has been scheduled for and prefills only the rest (a fan-out over one long document computes
    the document once). Caching blocks only once computed charged siblings the shared prefix
    again: the yardstick's finance analysts prefilled 1.20x the floor."""
    budget, doc = 16, [7] * 36  # the document: 9 blocks of 4 tokens, prefilled over 3 steps
    sched = EmulatedScheduler(params(max_num_batched_tokens=budget), 100)
    a, b = Sequence("a", doc + [1, 2, 3, 4], 2), Sequence("b", doc + [5, 6, 7, 8], 2)
    sched.add(a)
    if arrives == "mid prefill":
        sched.step()  # a's first chunk (16 tokens) is computed
    sched.add(b)
    finish(sched)
    # b is admitted once a's chunks leave it budget: every block of the document a was
    # scheduled for by then, in that step included, is a hit
    assert b.cached_tokens == 36 and a.cached_tokens == 0
    assert sched.counters["prefill_tokens"] == 36 + 4 + 4 == sched.counters["queries"] - sched.counters["hits"]
    assert b.output and a.output


@pytest.mark.parametrize("arrives", ["same step", "mid prefill"])
def test_the_old_rule_is_kept_only_to_compare_with_runs_made_under_it(arrives):
    """``cache_on_schedule=False`` is the emulator before f58ac1c: a block is cached once
    computed, so the same sibling misses what the first had only been scheduled for and prefills
    it again (the yardstick's Open-SWE and router runs were made under it)."""
    budget, doc = 16, [7] * 36
    sched = EmulatedScheduler(params(max_num_batched_tokens=budget, cache_on_schedule=False), 100)
    a, b = Sequence("a", doc + [1, 2, 3, 4], 2), Sequence("b", doc + [5, 6, 7, 8], 2)
    sched.add(a)
    if arrives == "mid prefill":
        sched.step()
    sched.add(b)
    finish(sched)
    assert b.cached_tokens < 36 and b.output and a.output
    assert sched.counters["prefill_tokens"] == 36 + 4 + 4 + (36 - b.cached_tokens)


def test_running_decodes_take_the_budget_before_a_waiting_prompt():
    sched = EmulatedScheduler(params(max_num_batched_tokens=16), 100)
    r = Sequence("r", [5] * 4, 10)
    sched.add(r)
    sched.step()  # r decodes from now on
    long = Sequence("long", [6] * 40, 2)
    sched.add(long)
    sched.step()
    assert long.num_computed == 15 and len(r.output) == 2  # 1 decode token + 15 prefill
    sched.step()
    assert long.num_computed == 30


def test_decode_cost_grows_with_context():
    sched = EmulatedScheduler(params(decode_s_per_ctx_token=1.0), 100)
    sched.add(Sequence("a", [5] * 10, 4))
    assert finish(sched) == [10.0, 11.0, 12.0, 13.0]  # every step reads the whole context once
    p = EmulationParams()  # the defaults: a longer context costs more per step
    assert p.decode_s_per_ctx_token == pytest.approx(128 * 1024 / 3e12, rel=0.02)

    def decode_step_cost(ctx: int) -> float:
        sched = EmulatedScheduler(p, 2_000)
        s = Sequence("x", [5] * ctx, 2)
        sched.add(s)
        while not s.output:  # (a long prompt takes several steps: chunked prefill)
            sched.step()
        return sched.step()[0]

    short, long = decode_step_cost(100), decode_step_cost(20_000)
    assert long - short == pytest.approx(p.decode_s_per_ctx_token * (20_001 - 101))
    assert short == pytest.approx(p.decode_s_per_step + p.decode_s_per_seq + 101 * p.decode_s_per_ctx_token)


# -- the host tier --------------------------------------------------------------------------------

def test_lru_host_tier_keeps_what_the_device_evicts_and_restoring_it_stalls_the_step():
    sched = EmulatedScheduler(params(host_kv_blocks=8, host_restore_s_per_block=0.5), capacity_blocks=4)
    a, b = [5] * 9, [6] * 9  # 3 full blocks each once finished (12 computed tokens)
    sched.add(Sequence("a", a, 4)); finish(sched)
    sched.add(Sequence("b", b, 4)); finish(sched)  # evicts a's tail (2 blocks): copied to the host
    ha = block_hashes(a + run_alone(a, 4), 4)
    assert sched.counters["evictions"] == 2 and sched.counters["offloaded_blocks"] == 2
    assert [sched.contains(h) for h in ha] == [True, False, False] and all(sched.on_host(h) for h in ha[1:])
    again = Sequence("a2", a, 4)
    sched.add(again)
    cost, _ = sched.step()
    assert again.cached_tokens == 8  # block 0 from the device, block 1 restored from the host
    assert cost == 0.5 and sched.counters["stall_s"] == 0.5  # the batch waited for the restore
    c = sched.counters
    assert (c["restored_blocks"], c["host_hits"], c["offloaded_blocks"]) == (1, 4, 4)  # (b's blocks went down)
    st = sched.stats()
    assert st["host_used_blocks"] == 4 and st["host_capacity_blocks"] == 8


def test_directed_host_tier_takes_only_what_is_offloaded():
    sched = EmulatedScheduler(params(host_kv_blocks=8, host_policy="directed"), capacity_blocks=4)
    sched.add(Sequence("a", [5] * 9, 4)); finish(sched)
    sched.add(Sequence("b", [6] * 9, 4)); finish(sched)
    assert sched.counters["evictions"] == 2 and sched.stats()["host_used_blocks"] == 0
    again = Sequence("a2", [5] * 9, 4)
    sched.add(again); finish(sched)
    assert again.cached_tokens == 4 and sched.counters["restored_blocks"] == 0


def offloaded(**kw) -> tuple[EmulatedScheduler, list[int]]:
    """A session's 3 blocks offloaded to a directed host tier; one step costs 1 s, a restore 1 s/block."""
    sched = EmulatedScheduler(params(host_kv_blocks=8, host_policy="directed", host_restore_s_per_block=1.0,
                                     decode_s_per_step=1.0, **kw), capacity_blocks=8)
    sched.add(Sequence("s-1", [5] * 9, 4, session="s")); finish(sched)
    assert sched.offload("s") == 3 and sched.residency("s") == {"blocks": 3, "device": 0, "host": 3, "pinned": 0}
    return sched, sched.session_blocks("s")


def test_prefetch_overlaps_the_restore_and_a_partial_one_costs_only_the_rest():
    def admission_cost(prefetch: bool, idle: float) -> float:
        sched, _ = offloaded()
        if prefetch:
            assert sched.prefetch("s") == 3 and sched.stats()["prefetched_blocks"] == 3
        sched.advance(idle)
        s = Sequence("s-2", [5] * 9, 4, session="s")
        sched.add(s)
        cost = sched.step()[0]
        assert s.cached_tokens == 8 and sched.counters["host_hits"] == 8
        return cost

    assert admission_cost(prefetch=False, idle=10.0) == 1.0 + 2.0  # on demand: both hit blocks, in the step
    assert admission_cost(prefetch=True, idle=10.0) == 1.0  # arrived while idle: nothing to wait for
    assert admission_cost(prefetch=True, idle=1.5) == 1.0 + 0.5  # block 0 in, block 1 half-way: the rest
    sched, hashes = offloaded()
    sched.prefetch("s")
    for _ in range(2):  # transfers progress under running steps too
        sched.add(Sequence(f"other-{_}", [9] * 3, 1))
        sched.step()
    s = Sequence("s-2", [5] * 9, 4, session="s")
    sched.add(s)
    assert sched.step()[0] == 1.0 and sched.counters["restore_s"] == 3.0


def test_retain_keeps_a_session_through_pressure_that_evicts_others():
    sched = EmulatedScheduler(params(), capacity_blocks=6)
    sched.add(Sequence("1", [5] * 9, 4, session="s1")); finish(sched)
    sched.add(Sequence("2", [6] * 9, 4, session="s2")); finish(sched)
    assert sched.retain("s1") == 3 and sched.stats()["pinned_blocks"] == 3
    sched.add(Sequence("c", [7] * 9, 4)); finish(sched)  # needs 3: s1's are the older ones, but pinned
    assert sched.counters["evictions"] == 3
    assert sched.residency("s1")["device"] == 3 and sched.residency("s2")["device"] == 0
    assert sched.stats()["retained_blocks"] == 3
    big = Sequence("big", [8] * 21, 4)  # 6 blocks: only with s1's pin gone (nothing else runs)
    sched.add(big)
    finish(sched)
    assert len(big.output) == 4 and sched.counters["pins_released"] == 1 and sched.pinned("s1") == 0


def test_offload_moves_a_session_to_the_host_and_invalidate_drops_it_everywhere():
    sched = EmulatedScheduler(params(host_kv_blocks=8, host_policy="directed"), capacity_blocks=16)
    system = [3] * 8  # 2 blocks both sessions share
    sched.add(Sequence("1", system + [5] * 9, 4, session="s1")); finish(sched)
    sched.add(Sequence("2", system + [6] * 9, 4, session="s2")); finish(sched)
    shared = block_hashes(system, 4)
    assert sched.owners(shared[0]) == {"s1", "s2"} and sched.residency("s1")["blocks"] == 5
    assert sched.offload("s1") == 3  # its own 3; the shared ones stay for s2
    assert sched.residency("s1") == {"blocks": 5, "device": 2, "host": 3, "pinned": 0}
    assert sched.counters["offloaded_blocks"] == 3 and sched.stats()["host_used_blocks"] == 3
    assert sched.invalidate("s1") == 3 and not sched.knows("s1")
    assert sched.stats()["host_used_blocks"] == 0 and all(sched.contains(h) for h in shared)
    assert sched.owners(shared[0]) == {"s2"}
    assert sched.invalidate("s2") == 5 and sched.used_blocks == 0  # nothing of either session is left
    assert sched.invalidate("never-seen") == 0


def test_abort_frees_the_slot_and_blocks():
    sched = EmulatedScheduler(params(max_batch=1), capacity_blocks=8)
    r, w = Sequence("r", [5] * 9, 20), Sequence("w", [6] * 9, 2)
    sched.add(r); sched.add(w)
    sched.step()
    assert sched.running == [r] and sched.pinned_blocks == 3
    assert sched.abort("r") is r and r.status == "aborted" and sched.pinned_blocks == 0
    assert sched.abort("r") is None
    finish(sched)
    assert len(w.output) == 2


def test_stats_report_the_kv_state_every_step():
    sched = EmulatedScheduler(params(host_kv_blocks=4), capacity_blocks=8)
    sched.add(Sequence("a", [5] * 9, 4))
    sched.step()
    st = sched.stats()
    for k in ("queries", "hits", "prefill_tokens", "decode_tokens", "evictions", "preemptions", "recomputed_tokens",
              "host_hits", "restored_blocks", "offloaded_blocks", "host_evictions", "used_blocks", "pinned_blocks",
              "free_blocks", "cached_blocks", "capacity_blocks", "host_used_blocks", "host_capacity_blocks",
              "running", "waiting", "steps", "emulated_s"):
        assert k in st, k
    assert (st["used_blocks"], st["pinned_blocks"], st["free_blocks"], st["cached_blocks"]) == (3, 3, 5, 0)
    finish(sched)
    st = sched.stats()
    assert (st["used_blocks"], st["pinned_blocks"], st["free_blocks"], st["cached_blocks"]) == (3, 0, 8, 3)


# -- KV control through the host ---------------------------------------------------------------------

def model(**emulation) -> dict:
    return {"model": "emulated-llama", "engine": "emulated", "tokenizer": "byte", "kv-policy": "ours",
            "emulation": {"time_scale": 0.001, "kv_blocks": 64, "host_kv_blocks": 64, "host_policy": "directed",
                          **emulation}}


@pytest.fixture
def kv_config():
    with dask.config.set({"agents.kv.tick": "20ms", "agents.kv.min-samples": 3}):
        yield


def on_engine(host, fn):
    return host.kv_call(fn).result(30)


def test_the_compat_layer_covers_what_the_manager_calls_and_needs_no_vllm():
    used = set(re.findall(r"\bvc\.([a-z_]+)\(", (ROOT / "kv" / "runtime" / "manager.py").read_text()))
    assert used and all(hasattr(EMULATED_COMPAT, name) for name in used), used - set(dir(EMULATED_COMPAT))
    code = ("import sys; from dask_agents.worker_plugin.emulated import EmulatedEngineHost;"
            "from dask_agents.model_settings import ModelSettings;"
            "h = EmulatedEngineHost('e', ModelSettings(model='m', engine='emulated', tokenizer='byte', kv_policy='ours',"
            " emulation={'time_scale': 0.0})); h.start();"
            "out = h.submit('r', [5] * 40, h.sampling_params(4, 0.0, None), 's').result(30);"
            "assert len(out.outputs[0].token_ids) == 4 and h.kv_manager is not None; h.close();"
            "assert 'vllm' not in sys.modules and 'torch' not in sys.modules, 'imported';"
            "assert not [m for m in sys.modules if m.startswith('dask_agents.kv.offline')], 'offline KV tools imported'")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


def test_no_runtime_module_imports_the_offline_kv_tools():
    """Every module a worker or the scheduler loads (the plugins, the engine hosts, the KV
    manager and policies, the user-facing package) imports nothing of dask_agents.kv.offline."""
    import pkgutil

    names = ["dask_agents", "dask_agents.kv", "dask_agents.kv.runtime"]
    # source folder -> the module it installs as (setup.cfg's package_dir)
    for folder, pkg in (("dask_agents", "dask_agents"), ("scheduler_plugin", "dask_agents.scheduler_plugin"),
                        ("worker_plugin", "dask_agents.worker_plugin"), ("kv/runtime", "dask_agents.kv.runtime")):
        names += [f"{pkg}.{m.name}" for m in pkgutil.iter_modules([str(ROOT / folder)])]
    code = (f"import importlib, sys\nfor n in {names!r}:\n    importlib.import_module(n)\n"
            "bad = sorted(m for m in sys.modules if m.startswith('dask_agents.kv.offline'))\n"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


def test_kv_manager_runs_on_the_emulated_engine_and_its_actions_change_the_kv(kv_config):
    h = make_host("emu", ModelSettings(**model()))
    try:
        h.start()
        h.wait_loaded(5)
        assert isinstance(h.kv_manager, KVManager) and isinstance(h.kv, EmulatedEngineKV)
        assert h.kv_control is True and h.kv_control_reason is None
        prompt = list(range(3, 43))  # 40 tokens + 9 output: 48 computed, 3 full blocks
        first = h.submit("r1", prompt, h.sampling_params(9, 0.0, None), "s1").result(30)
        assert first.num_cached_tokens == 0
        wait_for(lambda: h.kv_manager.knows("s1"), timeout=30)
        h.kv_hint("s1", "paused", wait_key="code_exec").result(30)
        moved = on_engine(h, lambda kv: kv.offload("s1"))
        r = on_engine(h, lambda kv: kv.inspect("s1"))
        assert moved == r.blocks == r.host_blocks == 3 and r.device_blocks == 0
        h.kv_hint("s1", "running").result(30)  # the manager prefetches what is below
        wait_for(lambda: on_engine(h, lambda kv: kv.inspect("s1")).device_blocks == 3, timeout=30)
        assert h.stats()["prefetched_blocks"] == 3
        turn = prompt + list(first.outputs[0].token_ids) + [99] * 8  # the next turn: history + more
        second = h.submit("r2", turn, h.sampling_params(4, 0.0, None), "s1").result(30)
        assert second.num_cached_tokens == 48 and h.stats()["host_hits"] == 48
        wait_for(lambda: h.kv_manager.session_state("s1")["state"] == "paused", timeout=30)
        h.kv_hint("s1", "finished").result(30)  # "ours" drops a finished session's KV at its next look
        wait_for(lambda: not on_engine(h, lambda kv: kv.knows("s1")), timeout=30)
        st = h.stats()
        assert st["host_used_blocks"] == 0 and st["cached_blocks"] == 0 and st["used_blocks"] == 0
        report = h.kv_report()
        assert report["kv_policy"] == "ours" and report["kv_actions"].get("Drop", 0) >= 1
        assert report["kv_traffic_bytes"]["offloaded"] == 3 * h.geometry.bytes_per_block
        assert set(report["kv_capacity_bytes"]) == {"device", "host"}
    finally:
        h.close()


def test_engines_directives_hints_and_session_end_reach_the_emulated_engine(kv_config):
    with dask.config.set({"agents.llm.models": {"emu": model()}}):
        engines = Engines("tcp://127.0.0.1:0", ["emu"])
        try:
            host = engines.start("emu")
            host.wait_loaded(5)
            host.submit("r1", list(range(3, 43)), host.sampling_params(9, 0.0, None), "s1").result(30)
            wait_for(lambda: host.kv_manager.knows("s1"), timeout=30)
            out = engines.kv_directive("emu", "inspect", "s1")
            assert out["result"]["blocks"] == 3 and out["residency"]["device_blocks"] == 3
            assert engines.kv_directive("emu", "retain", "s1", ttl_s=60)["residency"]["pinned_blocks"] == 3
            out = engines.kv_directive("emu", "offload", "s1")  # drops the pin, moves every block
            assert out["result"] == 3 and out["residency"]["host_blocks"] == 3
            assert engines.kv_directive("emu", "prefetch", "s1")["result"] == 3
            with pytest.raises(KVDirectiveError, match="no disk tier"):
                engines.kv_directive("emu", "offload", "s1", tier="disk")
            assert engines.kv_hint("s1", "paused", wait_key="web_api") == ["emu"]
            engines.end_session("s1")
            wait_for(lambda: not host.kv_call(lambda kv: kv.knows("s1")).result(30), timeout=30)
            assert host.stats()["host_used_blocks"] == 0
        finally:
            engines.close()


def test_without_prefix_caching_there_is_no_kv_control():
    h = EmulatedEngineHost("emu", ModelSettings(**{**model(), "enable-prefix-caching": False}))
    try:
        h.start()
        assert h.kv is None and h.kv_manager is None and h.kv_report() is None
        assert h.kv_control is False and "prefix caching is off" in h.kv_control_reason
        with pytest.raises(KVDirectiveError, match="no per-session KV control"):
            h.kv_call(lambda kv: kv.inspect("s")).result(30)
    finally:
        h.close()


def test_abort_between_steps(kv_config):
    h = EmulatedEngineHost("emu", ModelSettings(**{**model(max_batch=1, decode_s_per_step=0.05, time_scale=1.0)}))
    try:
        h.start()
        fut = h.submit("r1", [5] * 40, h.sampling_params(500, 0.0, None), "s1")  # ~25 s of steps
        wait_for(lambda: h.stats()["running"] == 1, timeout=30)
        h.abort("r1")
        with pytest.raises(RuntimeError, match="request r1 aborted"):
            fut.result(30)
        wait_for(lambda: h.stats()["running"] == 0 and h.stats()["pinned_blocks"] == 0, timeout=30)
        assert len(h.submit("r2", [6] * 20, h.sampling_params(1, 0.0, None), None).result(30).outputs[0].token_ids) == 1
    finally:
        h.close()


def test_unset_kv_policy_is_the_configured_one_as_on_a_vllm_engine():
    """An emulated engine models the vLLM host: a model entry without ``kv-policy`` runs
    ``agents.kv.policy`` (a benchmark's dask-agents engines once ran no policy at all)."""
    for configured, want in (("ours", "ours"), ("lru", "lru"), ("none", "none")):
        with dask.config.set({"agents.kv.policy": configured}):
            h = EmulatedEngineHost("emu", ModelSettings(**{**model(), "kv-policy": None}))
            try:
                h.start()
                assert h.kv_report()["kv_policy"] == want
            finally:
                h.close()


def test_report_shapes_match_the_vllm_host():
    h = EmulatedEngineHost("emu", ModelSettings(**{**model(host_kv_blocks=0), "kv-policy": "none"}))
    try:
        h.start()
        report = h.kv_report()
        assert set(report) == {"kv_policy", "kv_actions", "kv_bytes", "kv_capacity_bytes", "kv_traffic_bytes"}
        assert report["kv_policy"] == "none" and set(report["kv_bytes"]) == {"device"}  # no host tier: not shown
        assert report["kv_capacity_bytes"] == {"device": 64 * h.geometry.bytes_per_block}
    finally:
        h.close()


# -- bookkeeping under a random (seeded) mix of requests and directives ------------------------------

def check_invariants(sched: EmulatedScheduler) -> None:
    """Every block is in exactly one place and its reference count is what holds it."""
    refs: dict[int, int] = {}
    for s in sched.running:
        for b in s.blocks:
            refs[b.block_id] = refs.get(b.block_id, 0) + 1
    for blocks in sched._pins.values():
        for b in blocks:
            refs[b.block_id] = refs.get(b.block_id, 0) + 1
    empty = {b.block_id for b in sched._empty}
    lru = {b.block_id for b in sched._lru.values()}
    assert len(empty) == len(sched._empty) and not empty & lru and not empty & set(refs) and not lru & set(refs)
    assert len(empty) + len(lru) + len(refs) == sched.capacity
    for b in sched.blocks[1:]:
        assert b.ref_cnt == refs.get(b.block_id, 0), b
        if b.block_hash is not None:
            assert sched._cached[b.block_hash] is b
        else:
            assert b.block_id not in lru
    assert all(b.block_hash == h for h, b in sched._cached.items()) and all(h in sched._cached for h in sched._lru)
    assert len(sched.host) <= sched.host_capacity
    for s in sched.waiting_sequences():
        assert not s.blocks and s.status == "waiting"
    sched.check_residency()  # the per-session device/host counts equal a recount


@pytest.mark.parametrize("host_policy", ["lru", "directed"])
def test_random_mix_keeps_the_books(host_policy):
    import random

    rng = random.Random(f"emulated-kv-{host_policy}")
    sched = EmulatedScheduler(params(host_kv_blocks=24, host_policy=host_policy, max_num_batched_tokens=24,
                                     max_batch=6, host_restore_s_per_block=0.1, decode_s_per_step=0.01),
                              capacity_blocks=40)
    sessions = [f"s{i}" for i in range(6)]
    history = {s: [3 + i] * 8 for i, s in enumerate(sessions)}
    outputs: dict[str, tuple[list[int], int]] = {}
    n = 0
    for step in range(3000):
        if rng.random() < 0.15 and len(sched.requests) < 10:
            s = rng.choice(sessions)
            prompt = history[s] + [rng.randrange(3, 259) for _ in range(rng.randrange(1, 12))]
            if len(prompt) > 100:
                prompt = history[s] = [3 + sessions.index(s)] * 8
            seq = Sequence(f"r{n}", prompt, rng.randrange(1, 30), session=s)
            n += 1
            sched.add(seq)
            outputs[seq.request_id] = (prompt, seq.max_tokens)
            history[s] = prompt
        op = rng.random()
        s = rng.choice(sessions)
        if op < 0.03:
            sched.retain(s, rng.choice([None, 3]))
        elif op < 0.05:
            sched.release(s)
        elif op < 0.08:
            sched.offload(s, rng.choice([None, 2]), copy=rng.random() < 0.7)
        elif op < 0.11:
            sched.prefetch(s, rng.choice([None, 4]))
        elif op < 0.12:
            sched.invalidate(s)
        elif op < 0.13 and sched.requests:
            sched.abort(rng.choice(sorted(sched.requests)))
        elif op < 0.15:
            sched.advance(rng.random())
        _, done = sched.step()
        for seq in done:
            prompt, max_tokens = outputs[seq.request_id]
            assert seq.output == run_alone(prompt, max_tokens)  # pressure never changes the tokens
        check_invariants(sched)
    finish(sched)
    check_invariants(sched)
    c = sched.counters
    assert c["preemptions"] > 0 and c["evictions"] > 0 and c["restored_blocks"] > 0 and c["recomputed_tokens"] > 0
