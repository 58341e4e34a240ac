"""The workflow-aware KV manager (kv/runtime/manager.py) on a real vLLM engine (CPU build, tiny
dummy-weight model, in-process).

One engine for the module, 2 MiB of KV (16 blocks of 128 tokens, 15 usable) and a 4 MiB host
tier (32 blocks); each test switches the manager's policy (``KVManager.set_policy``) and cleans
up its sessions. Greedy decoding: KV restored from the host must give exactly the cold run's
tokens. The manager looks every 20 ms here (``agents.kv.tick``) and learns a tool's latency
from 3 pauses (``agents.kv.min-samples``).
"""

from __future__ import annotations

import time

import dask
import pytest

from dask_agents.kv.runtime import vllm_compat as vc
from dask_agents.kv.runtime.engine_kv import KVDirectiveError
from tests.conftest import wait_for
from tests.kv_helpers import generate as run
from tests.kv_helpers import prompt_ids as tokens
from dask_agents.worker_plugin.vllm_host import EngineHost
from dask_agents.worker_plugin.engines import Engines
from dask_agents.model_settings import ModelSettings

BLOCK = 128
MODEL = dict(model="builtin:tiny-llama", load_format="dummy", tokenizer="byte", dtype="bfloat16",
             max_model_len=1536, kv_cache_memory_bytes="2 MiB", kv_host_bytes="4 MiB", kv_pin_fraction=0.5,
             kv_policy="ours")
CONFIG = {"agents.kv.tick": "20ms", "agents.kv.min-samples": 3, "agents.kv.prefetch-margin": "200ms",
          "agents.emulation.time-scale": 1.0}


@pytest.fixture(scope="module")
def host():
    with dask.config.set(CONFIG):
        h = EngineHost("kvmgr", ModelSettings(**MODEL))
        h.start()
        h.wait_loaded(300)
        assert h.kv_manager is not None and h.kv_manager.tick_s == 0.02
        yield h
        h.close()


def on_engine(host: EngineHost, fn):
    """Run ``fn(kv, manager)`` on the engine thread between steps."""
    return host.kv_call(lambda kv: fn(kv, host.kv_manager)).result(30)


def use(host: EngineHost, policy: str) -> None:
    on_engine(host, lambda kv, m: m.set_policy(policy))


def hint(host: EngineHost, session: str, state: str, **kw) -> None:
    """Send a hint and wait until the engine loop has looked after it (the next iteration)."""
    fut = host.kv_hint(session, state, **kw)
    assert fut is not None, f"the manager does not know {session}"
    fut.result(30)
    on_engine(host, lambda kv, m: None)  # runs at the top of the next iteration, after the look


def residency(host: EngineHost, session: str):
    return on_engine(host, lambda kv, m: kv.inspect(session))


def forget(host: EngineHost, *sessions: str) -> None:
    on_engine(host, lambda kv, m: [kv.invalidate(s) for s in sessions])


def clear_stale(host: EngineHost) -> None:
    """Free cached blocks no session owns (left by earlier tests), for exact block counts."""
    def clear(kv, m):
        stale = [vc.block_hash(b) for b in vc.cached_free_blocks(kv.parts)]
        kv.offload_blocks([h for h in stale if not kv.owners(h)], None)

    on_engine(host, clear)


def test_a_paused_session_is_kept_within_its_tool_ttl_and_an_expired_one_is_evicted(host):
    use(host, "wa_lru")
    clear_stale(host)
    kept, lost = tokens(1, 520), tokens(2, 520)  # 4 full blocks each
    cold, _ = run(host, kept, "ttl-kept")
    hint(host, "ttl-kept", "paused", node="developer", wait_key="code_exec")  # TTL = P95 = 2.4 s
    run(host, lost, "ttl-lost")
    hint(host, "ttl-lost", "paused", node="developer", wait_key="file_io")  # TTL = P95 = 0.32 s
    assert residency(host, "ttl-kept").pinned_blocks == 4
    # its pin expires with its TTL, long before code_exec's
    wait_for(lambda: residency(host, "ttl-lost").pinned_blocks == 0, timeout=2)
    assert residency(host, "ttl-kept").pinned_blocks == 4
    # pressure: 13 of 15 blocks in use (above theta-low, below theta-high): expired sessions go
    # (40 output tokens keep the pressure on for a few of the manager's 20 ms looks: with 4, the
    # request could end between two looks and leave nothing to act on; 600 + 40 = 5 blocks)
    run(host, tokens(100, 600), max_tokens=40)
    assert residency(host, "ttl-kept").device_blocks == 4
    wait_for(lambda: residency(host, "ttl-lost").device_blocks < 4, timeout=1)
    assert residency(host, "ttl-kept").device_blocks == 4
    on_demand = host.kv.stats.restored_on_demand_bytes
    again, cached = run(host, kept, "ttl-kept")
    assert cached == 4 * BLOCK and again == cold  # a prefix hit on resume, from the device
    assert host.kv.stats.restored_on_demand_bytes == on_demand
    forget(host, "ttl-kept", "ttl-lost")


def test_a_long_pause_offloads_to_host_and_resumes_with_identical_tokens(host):
    use(host, "ours")
    long, short = tokens(3, 520), tokens(4, 520)
    cold, _ = run(host, long, "long")
    hint(host, "long", "paused", node="planner", wait_key="web_api")  # seconds away
    run(host, short, "short")
    hint(host, "short", "paused", node="developer", wait_key="file_io")
    before = host.kv.stats.offloaded_bytes
    run(host, tokens(5, 1400), "big")  # needs 12 blocks: 11 are free of "short"
    res = residency(host, "long")
    assert (res.device_blocks, res.host_blocks) == (0, 4)  # the furthest next use went to host first
    assert host.kv.stats.offloaded_bytes - before >= 4 * res.bytes_per_block
    again, cached = run(host, long, "long")
    assert cached == 4 * BLOCK and again == cold
    forget(host, "long", "short", "big")


def test_prefetch_completes_before_the_predicted_resume(host):
    use(host, "ours")
    pause = 0.6
    prompt = tokens(6, 300)
    for i in range(3):  # learn: "pf-tool" pauses last 0.6 s
        out, _ = run(host, prompt, "pf")
        prompt = prompt + out + tokens(60 + i, 40)
        hint(host, "pf", "paused", node="tester", wait_key="pf-tool")
        time.sleep(pause)  # the tool runs (the workload's pause, what the manager learns)
    out, _ = run(host, prompt, "pf")
    finished = time.monotonic()
    hint(host, "pf", "paused", node="tester", wait_key="pf-tool")
    n = on_engine(host, lambda kv, m: kv.offload("pf", "host"))  # it went to host meanwhile
    assert n >= 2 and residency(host, "pf").device_blocks == 0
    learned = on_engine(host, lambda kv, m: m.graph.latency("pf-tool"))
    assert learned.empirical and abs(learned.mean() - pause) < 0.2
    on_demand = host.kv.stats.restored_on_demand_bytes
    # prefetched back to the device by itself (no request asked for it)
    wait_for(lambda: residency(host, "pf").device_blocks == n, timeout=5, interval=0.005)
    time.sleep(max(0.0, finished + learned.mean() - time.monotonic()))  # the tool's pause ends
    _, cached = run(host, prompt + out + tokens(99, 40), "pf")
    assert cached >= n * BLOCK
    assert host.kv.stats.restored_on_demand_bytes == on_demand  # nothing left to restore on admission
    forget(host, "pf")


def test_session_end_frees_its_blocks_at_once_and_a_sharer_keeps_its_hits(host):
    use(host, "ours")
    shared = tokens(7, 256)  # a 2-block system prompt
    a, b = shared + tokens(8, 264), shared + tokens(9, 264)
    run(host, a, "end-a")
    run(host, b, "end-b")
    own = on_engine(host, lambda kv, m: kv.blocks_of("end-a")[2:4])
    hint(host, "end-a", "finished", node="tester")  # applied by the look right after the hint
    assert on_engine(host, lambda kv, m: not kv.knows("end-a") and not m.knows("end-a"))
    assert on_engine(host, lambda kv, m: [vc.lookup(kv.parts, h) for h in own]) == [None, None]
    assert run(host, b, "end-b")[1] == 4 * BLOCK  # the shared prompt and its own blocks
    forget(host, "end-b")


def test_device_kv_stays_in_budget_and_retention_never_blocks_admission(host):
    use(host, "wa_lru")
    for i, s in enumerate(("pin-a", "pin-b")):
        run(host, tokens(20 + i, 520), s)
        hint(host, s, "paused", node="developer", wait_key="web_api")  # TTL 4.5 s
    assert on_engine(host, lambda kv, m: kv.pinned_blocks()) == 8  # the whole pin budget
    released = host.kv.stats.pins_released_for_admission
    out, _ = run(host, tokens(11, 1000), "pin-big")  # needs 8 blocks + 1: only 7 are not pinned
    assert len(out) == 4
    assert host.kv.stats.pins_released_for_admission > released
    m = host.kv_manager
    parts = host.kv.parts
    assert parts.num_blocks * host.kv.bytes_per_block <= host.settings.kv_bytes()
    assert m.stats.peak_device_blocks <= parts.num_blocks - 1
    assert m.stats.peak_host_blocks * host.kv.bytes_per_block <= host.kv.tiers.host_bytes
    assert on_engine(host, lambda kv, m: kv.tier_bytes()["host"]) <= host.kv.tiers.host_bytes
    forget(host, "pin-a", "pin-b", "pin-big")


def test_state_is_inferred_without_hints_and_hints_in_flight_wait_for_the_finish(host):
    use(host, "ours")
    prompt = tokens(12, 300)
    out, _ = run(host, prompt, "infer")
    st = on_engine(host, lambda kv, m: m.session_state("infer"))
    assert (st["state"], st["wait_key"], st["live"]) == ("paused", "after:llm", 0)
    fut = host.submit("infer-2", prompt + out, host.sampling_params(64, 0.0, None), "infer")
    hint_fut = host.kv_hint("infer", "paused", node="planner", wait_key="db_query")
    hint_fut.result(30)
    if not fut.done():  # the request was still running: the hint waits for its finish
        assert on_engine(host, lambda kv, m: m.session_state("infer"))["state"] in ("running", "paused")
    fut.result(60)
    on_engine(host, lambda kv, m: None)
    st = on_engine(host, lambda kv, m: m.session_state("infer"))
    assert (st["state"], st["node"], st["wait_key"]) == ("paused", "planner", "db_query")
    learned = on_engine(host, lambda kv, m: m.graph.latency("after:llm").n)
    assert learned >= 1  # the pause between the two requests was observed
    forget(host, "infer")


def test_view_matches_the_engine(host):
    use(host, "ours")
    run(host, tokens(13, 520), "view-a")

    def check(kv, m):
        view = m.view()
        parts = kv.parts
        assert view.capacity["accelerator"] == parts.num_blocks - 1
        assert view.capacity["host"] == kv.tiers.host_bytes // kv.bytes_per_block
        assert view.used["accelerator"] == vc.used_blocks(parts)
        s = view.sessions["view-a"]
        r = kv.inspect("view-a")
        assert (s.state, s.chain, s.accelerator, s.host) == ("paused", r.blocks, r.device_blocks, r.host_blocks)
        lru = list(view.lru_blocks())
        assert lru == [b.block_id for b in vc.cached_free_blocks(parts)]
        assert set(view.stale_blocks()) <= set(lru)
        return view.move_s(4) > 0

    assert on_engine(host, check)
    forget(host, "view-a")


def test_bad_hints_are_clear_errors(host):
    with pytest.raises(KVDirectiveError, match="unknown session state 'sleeping'"):
        host.kv_hint("x", "sleeping")
    assert host.kv_hint("never-seen", "paused") is None  # no KV here: nothing to do
    with pytest.raises(KVDirectiveError, match="no KV for session 'never-seen'"):
        on_engine(host, lambda kv, m: m.hint("never-seen", "paused"))
    with pytest.raises(ValueError, match="unknown KV policy 'bogus'"):
        on_engine(host, lambda kv, m: m.set_policy("bogus"))
    with pytest.raises(ValueError, match="kv-policy|kv_policy"):
        ModelSettings(**{**MODEL, "kv_policy": "bogus"})
    engines = Engines("test-worker", [])
    with pytest.raises(KVDirectiveError, match="unknown session state"):
        engines.kv_hint("s", "done")
    with pytest.raises(KVDirectiveError, match="needs a session id"):
        engines.kv_hint("", "paused")
    run(host, tokens(14, 300), "fwd")
    engines._hosts["kvmgr"] = host  # forwarded to every engine that saw the session
    assert engines.kv_hint("fwd", "paused", wait_key="file_io") == ["kvmgr"]
    assert engines.kv_hint("nobody", "paused") == []
    forget(host, "fwd")
    # the engine keeps serving after bad hints
    assert len(run(host, tokens(15, 100))[0]) == 4


def test_no_host_tier_discards_instead_of_offloading(host):
    """Evict without a lower tier frees blocks (no copy); offload to a missing tier is an error."""
    run(host, tokens(16, 520), "no-tier")

    def check(kv, m):
        with pytest.raises(KVDirectiveError, match="no disk tier"):
            kv.offload("no-tier", "disk")
        before = kv.stats.offloaded_bytes
        assert kv.evict("no-tier", 2) == 2  # tail first
        r = kv.inspect("no-tier")
        assert (r.device_blocks, r.host_blocks, kv.stats.offloaded_bytes) == (2, 0, before)
        return [vc.lookup(kv.parts, h) is not None for h in kv.blocks_of("no-tier")]

    assert on_engine(host, check) == [True, True, False, False]
    forget(host, "no-tier")


def test_compat_internals_the_manager_uses(host):
    prompt = tokens(17, 300)  # 2 full blocks
    run(host, prompt, "compat")

    def check(kv, m):
        parts = kv.parts
        assert vc.token_budget(parts) >= BLOCK
        assert vc.waiting(parts) == [] and vc.running(parts) == []
        hashes = kv.blocks_of("compat")
        blocks = [vc.lookup(parts, h) for h in hashes]
        assert [vc.block_hash(b) for b in blocks] == hashes
        lru = vc.cached_free_blocks(parts)
        assert all(b in lru for b in blocks)
        assert lru.index(blocks[1]) < lru.index(blocks[0])  # a chain's tail is evicted before its head
        empty = vc.empty_free_blocks(parts)
        assert vc.used_blocks(parts) == parts.num_blocks - 1 - empty
        assert vc.evict(parts, blocks) == 2
        queue = parts.block_pool.free_block_queue
        head = [queue.fake_free_list_head.next_free_block, queue.fake_free_list_head.next_free_block.next_free_block]
        assert {b.block_id for b in head} == {b.block_id for b in blocks}  # freed blocks are handed out first
        assert vc.empty_free_blocks(parts) == empty + 2
        assert vc.empty_free_blocks(parts, at_least=1) == 1
        iid = host._engine.add_request("compat-probe", __import__("vllm.inputs", fromlist=["TokensPrompt"])
                                       .TokensPrompt(prompt_token_ids=prompt), host.sampling_params(2, 0.0, None)[0])
        (rid, ntok, probe_hashes), = vc.waiting(parts)
        host._engine.step()  # admitted: one prefill step, one token out, one to go
        running, allocated = vc.running(parts), vc.allocated_blocks(parts, iid)
        host._engine.abort_request([iid])
        assert running == [(iid, 301, 300)] and allocated == 3
        assert (rid, ntok, list(probe_hashes)) == (iid, 300, hashes)

    on_engine(host, check)
    forget(host, "compat")


def test_a_retained_sessions_pin_holds_until_its_queued_request_runs(host):
    """vLLM's waiting requests reference no blocks: the session's pin must outlive add_request
    (or the step's allocations could evict the prefix the request is about to hit)."""
    from concurrent.futures import Future

    from dask_agents.worker_plugin.vllm_host import _Request

    use(host, "lru")
    clear_stale(host)
    ids = tokens(71, 3 * BLOCK + 5)
    run(host, ids, session="q1")
    assert on_engine(host, lambda kv, m: kv.retain("q1", 30)) == 3

    def admit(kv, m):  # between two steps: added to vLLM, not yet scheduled
        req = _Request("q1-next", ids + tokens(72, 10), host.sampling_params(8, 0.0, None), "q1", Future())
        host._admit(req)
        return req, kv.pinned("q1"), vc.allocated_blocks(kv.parts, req.engine_id)

    req, pinned_while_queued, allocated = on_engine(host, admit)
    assert allocated == 0 and pinned_while_queued == 3
    out = req.future.result(120)
    assert out.num_cached_tokens == 3 * BLOCK  # the pinned prefix was hit
    assert on_engine(host, lambda kv, m: kv.pinned("q1")) == 0  # released once it ran, not leaked
    forget(host, "q1")
