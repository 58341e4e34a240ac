"""EMULATED tools and the EMULATED engine: latency priors, cost model, KV prefix reuse, cluster path."""

from __future__ import annotations

import pickle
import random

import cloudpickle
import dask
import pytest
from distributed import Client, LocalCluster

import dask_agents as da
from dask_agents import emulation
from dask_agents.kv.runtime.tool_latency import PRIORS, ToolLatency, prior
from tests.conftest import wait_for
from dask_agents.worker_plugin.emulated import (
    EmulatedEngineHost,
    EmulatedScheduler,
    EmulationParams,
    Sequence,
    block_hashes,
)
from dask_agents.model_settings import ModelSettings
from dask_agents.worker_plugin.engines import make_host

SAGA_MS = {"file_io": (45, 320, 1200), "code_exec": (180, 2400, 28000),
           "web_api": (850, 4500, 45000), "db_query": (120, 890, 3500)}


# -- (a) tool latency model and emulated tools ---------------------------------------------

@pytest.mark.parametrize("kind", sorted(SAGA_MS))
def test_prior_quantiles_match_saga(kind):
    lat = prior(kind)
    for q, ms in zip((0.5, 0.95, 0.99), SAGA_MS[kind]):
        assert lat.quantile(q) == pytest.approx(ms / 1000, rel=0.01)
        assert lat.cdf(ms / 1000) == pytest.approx(q, abs=1e-9)
    rng = random.Random(7)
    xs = sorted(lat.sample(rng) for _ in range(20_000))
    for q, ms in zip((0.5, 0.95, 0.99), SAGA_MS[kind]):
        assert xs[int(q * len(xs))] == pytest.approx(ms / 1000, rel=0.10)
    assert lat.floor <= xs[0] and xs[-1] <= lat.cap
    assert lat.mean() == pytest.approx(sum(xs) / len(xs), rel=0.10)


def test_quantile_and_cdf_are_inverse_and_bounded():
    lat = PRIORS["custom"]
    assert (lat.p50, lat.p95, lat.p99) == (0.1, 0.8, 3.0)
    for q in (0.0, 0.01, 0.3, 0.5, 0.7, 0.95, 0.97, 0.99, 0.995, 1.0):
        assert lat.cdf(lat.quantile(q)) == pytest.approx(q, abs=1e-12)
    assert lat.cdf(0.0) == 0.0 and lat.cdf(1e9) == 1.0
    with pytest.raises(ValueError):
        lat.quantile(1.5)
    with pytest.raises(ValueError, match="p50 < p95 < p99"):
        ToolLatency(1.0, 0.5, 2.0)
    with pytest.raises(ValueError, match="known: file_io"):
        prior("teleport")


def test_sampling_is_deterministic_for_a_seed():
    lat = prior("web_api")
    a = [lat.sample(random.Random(3)) for _ in range(3)]
    assert a[0] == a[1] == a[2]
    r1, r2 = random.Random(11), random.Random(11)
    assert [lat.sample(r1) for _ in range(50)] == [lat.sample(r2) for _ in range(50)]


def test_emulated_tool_sleeps_scaled_and_is_deterministic():
    f = emulation.emulated_tool("code_exec", name="emu_test_code_exec", time_scale=0.001)
    out = f("run tests", seed=1)
    assert out["emulated"] is True and out["kind"] == "code_exec" and out["name"] == "emu_test_code_exec"
    assert out["slept_s"] == pytest.approx(out["latency_s"] * 0.001)
    lat = prior("code_exec")
    assert lat.floor <= out["latency_s"] <= lat.cap
    assert f("run tests", seed=1)["latency_s"] == out["latency_s"]
    assert len({f("run tests", seed=s)["latency_s"] for s in range(10)}) > 1
    # asking again returns the same function; the same name with other settings is an error
    assert emulation.emulated_tool("code_exec", name="emu_test_code_exec", time_scale=0.001) is f
    with pytest.raises(ValueError, match="already exists"):
        emulation.emulated_tool("web_api", name="emu_test_code_exec", time_scale=0.001)
    with pytest.raises(ValueError, match="clashes"):
        emulation.emulated_tool("web_api", name="emulated_tool")


def test_emulated_tools_are_declared_and_pickle_by_reference():
    for kind in ("file_io", "code_exec", "web_api", "db_query", "custom"):
        f = getattr(emulation, f"{kind}_tool")
        spec = da.spec_of(f)
        assert spec.kind == "tool" and spec.hints.kind == kind and spec.name == f"{kind}_tool"
    g = emulation.emulated_tool("db_query", name="emu_test_lookup")
    assert emulation.emu_test_lookup is g
    for dumps in (pickle.dumps, cloudpickle.dumps):
        blob = dumps(g)
        assert len(blob) < 200 and pickle.loads(blob) is g  # a module + name reference
    with dask.config.set({"agents.emulation.time-scale": 0.0}):
        out = emulation.file_io_tool("x")
    assert out["slept_s"] == 0.0 and out["time_scale"] == 0.0 and out["latency_s"] > 0


# -- (b) the emulated engine -----------------------------------------------------------------

def settings(**emulation_params) -> ModelSettings:
    return ModelSettings(model="emulated-llama", engine="emulated", tokenizer="byte",
                         emulation={"time_scale": 0.001, **emulation_params})


def run_to_end(host: EmulatedEngineHost, prompt: list[int], max_tokens: int = 8, rid: str = "r"):
    return host.submit(rid, prompt, host.sampling_params(max_tokens, 0.0, None), None).result(10)


@pytest.fixture
def host_factory():
    hosts = []

    def make(**params) -> EmulatedEngineHost:
        h = make_host("emu", settings(**params))
        hosts.append(h)
        h.start()
        h.wait_loaded(5)
        return h

    yield make
    for h in hosts:
        h.close()


def test_host_interface_geometry_and_defaults(host_factory):
    h = host_factory()
    assert isinstance(h, EmulatedEngineHost) and h.loaded.is_set() and h.load_error is None
    assert h.tokenizer is not None and h.max_model_len == 2048 and h.started_at is not None
    # Llama-3-8B-like: 128 KiB per token, 16-token blocks; capacity from kv-cache-memory-bytes (256 MiB)
    assert h.geometry.bytes_per_token == 128 * 1024 and h.geometry.block_size == 16
    assert h.stats()["capacity_blocks"] == 256 * 2**20 // (16 * 128 * 1024)
    out = run_to_end(h, h.tokenizer.encode("hello emulated world"), 8)
    comp = out.outputs[0]
    assert len(comp.token_ids) == 8 and comp.finish_reason == "length" and out.request_id == "r"
    assert all(3 <= t < 259 for t in comp.token_ids) and isinstance(h.tokenizer.decode(comp.token_ids), str)
    assert run_to_end(h, h.tokenizer.encode("hello emulated world"), 8).outputs[0].token_ids == comp.token_ids


def test_bad_emulation_settings_fail_like_a_load_error():
    h = make_host("emu", settings(max_btach=4))
    h.start()
    with pytest.raises(RuntimeError, match="max_btach"):
        h.wait_loaded(5)
    assert EmulationParams(**{"time-scale": 0.5, "kv-blocks": 8}).kv_blocks == 8


def test_shared_prefix_reports_cached_full_blocks(host_factory):
    h = host_factory(block_size=16)
    base = list(range(3, 3 + 40))  # 40 tokens: 2 full blocks + 8
    first = run_to_end(h, base, rid="a")
    assert first.num_cached_tokens == 0
    second = run_to_end(h, base[:35] + [200] * 30, rid="b")  # shares 35 tokens: 2 full blocks
    assert second.num_cached_tokens == 32
    s = h.stats()
    assert s["hits"] == 32 and s["queries"] == 40 + 65 and s["prefill_tokens"] == 40 + 65 - 32
    assert s["decode_tokens"] == 16 and s["running"] == s["waiting"] == 0


def test_batching_takes_fewer_iterations_than_sequential():
    # Stepped directly: iteration counts are exact, no clock involved.
    def run(concurrent: bool) -> int:
        sched = EmulatedScheduler(EmulationParams(max_batch=4), capacity_blocks=1000)
        seqs = [Sequence(f"r{i}", [10 + i] * 20, 8) for i in range(4)]
        for s in seqs:
            sched.add(s)
            if not concurrent:
                while sched.running or sched.waiting:
                    sched.step()
        while sched.running or sched.waiting:
            sched.step()
        assert all(len(s.output) == 8 for s in seqs)
        return sched.steps

    assert run(concurrent=True) == 8 and run(concurrent=False) == 32


def test_batching_through_the_host_thread(host_factory):
    h = host_factory(max_batch=4)
    params = h.sampling_params(8, 0.0, None)
    futs = [h.submit(f"r{i}", [10 + i] * 20, params, None) for i in range(4)]
    assert all(len(f.result(10).outputs[0].token_ids) == 8 for f in futs)
    assert h.steps < 4 * 8  # at least two of them shared iterations


def test_max_batch_bounds_the_running_sequences():
    sched = EmulatedScheduler(EmulationParams(max_batch=2), capacity_blocks=1000)
    for i in range(4):
        sched.add(Sequence(f"r{i}", [10 + i] * 20, 8))
    sched.step()
    assert len(sched.running) == 2 and len(sched.waiting) == 2
    while sched.running or sched.waiting:
        sched.step()
    assert sched.steps == 16


def finish(sched: EmulatedScheduler) -> None:
    while sched.running or sched.waiting:
        sched.step()


def test_kv_pressure_evicts_lru_prefix_blocks_tail_first():
    sched = EmulatedScheduler(EmulationParams(block_size=4), capacity_blocks=7)
    # 9 prompt + 4 output tokens: 12 computed (the last sampled token's KV never is) = 3 full blocks each
    a, b = [5] * 9, [6] * 9
    for rid, prompt in (("a", a), ("b", b), ("a2", a)):  # a2 touches a: b is now least recently used
        sched.add(Sequence(rid, prompt, 4))
        finish(sched)
    assert sched.counters["hits"] == 8 and sched.counters["evictions"] == 0
    assert sched.stats()["used_blocks"] == 6 and sched.stats()["cached_blocks"] == 6
    sched.add(Sequence("c", [7] * 5, 3))  # 2 blocks, 1 free: evicts one
    finish(sched)
    assert sched.counters["evictions"] == 1
    hb = block_hashes(b + sched_output(b), 4)
    assert not sched.contains(hb[2]) and sched.contains(hb[0]) and sched.contains(hb[1])  # b's tail went first
    for h in block_hashes(a + sched_output(a), 4):
        assert sched.contains(h)  # a was used more recently than b
    sched.add(Sequence("b2", b, 4))
    finish(sched)
    assert sched.counters["hits"] == 16  # b's prompt prefix survived the eviction


def sched_output(prompt: list[int], n: int = 4) -> list[int]:
    """The tokens the engine generates for ``prompt`` (deterministic)."""
    sched = EmulatedScheduler(EmulationParams(), capacity_blocks=100)
    s = Sequence("probe", prompt, n)
    sched.add(s)
    finish(sched)
    return s.output


def test_blocks_of_running_sequences_are_never_evicted():
    p = EmulationParams(block_size=4)
    sched = EmulatedScheduler(p, capacity_blocks=6)
    sched.add(Sequence("old", [5] * 9, 4)); finish(sched)  # 3 cached, unreferenced blocks
    r = Sequence("r", [6] * 9, 4)  # 3 blocks at admission, and never more (12 computed tokens)
    sched.add(r); sched.step()
    assert r in sched.running and sched.used_blocks == 6 and sched.stats()["pinned_blocks"] == 3
    c = Sequence("c", [7] * 9, 4)
    sched.add(c); sched.step()  # needs 3: evicts the cached ones, not r's
    assert c in sched.running and sched.counters["evictions"] == 3
    assert all(sched.contains(h) for h in block_hashes(r.prompt, 4))
    d = Sequence("d", [8] * 9, 4)
    sched.add(d); sched.step()  # nothing evictable: d waits, nothing of r or c is taken
    assert sched.waiting_sequences() == [d] and sched.counters["evictions"] == 3
    assert sched.stats()["free_blocks"] == 0 and sched.stats()["pinned_blocks"] == 6
    assert all(sched.contains(h) for h in block_hashes(r.prompt, 4) + block_hashes(c.prompt, 4))
    finish(sched)
    assert len(d.output) == 4 and sched.used_blocks <= 6 and sched.counters["preemptions"] == 0


def test_request_larger_than_kv_fails_clearly(host_factory):
    h = host_factory(kv_blocks=4, block_size=16)
    fut = h.submit("big", [5] * 60, h.sampling_params(8, 0.0, None), None)  # 68 tokens = 5 blocks
    with pytest.raises(ValueError, match="needs 5 KV blocks.*only 4 blocks"):
        fut.result(5)
    assert run_to_end(h, [5] * 40, 8).outputs[0].token_ids  # the engine goes on


def test_close_fails_in_flight_and_queued_requests():
    h = make_host("emu", settings(max_batch=1, decode_s_per_step=3600.0, time_scale=1.0))
    h.start()
    params = h.sampling_params(4, 0.0, None)
    running = h.submit("r1", [5] * 10, params, None)
    queued = h.submit("r2", [6] * 10, params, None)
    wait_for(lambda: h.stats()["running"] == 1, timeout=5)
    h.close()  # interrupts the hour-long iteration
    for f in (running, queued):
        with pytest.raises(RuntimeError, match="closed"):
            f.result(5)
    late = h.submit("r3", [5] * 10, params, None)
    with pytest.raises(RuntimeError, match="closed"):
        late.result(1)


def test_prefix_caching_off_means_no_hits():
    sched = EmulatedScheduler(EmulationParams(block_size=4), capacity_blocks=10, prefix_caching=False)
    for rid in ("a", "b"):
        sched.add(Sequence(rid, [5] * 9, 3)); finish(sched)
    assert sched.counters["hits"] == 0 and sched.used_blocks == 0


# -- (c) through a cluster ---------------------------------------------------------------------

def test_emulated_model_on_a_cluster():
    emu = {"emu": {"model": "emulated-llama", "engine": "emulated", "tokenizer": "byte",
                   "emulation": {"time_scale": 0.001}}}
    prompt = "You are a careful engineer. Read the issue and answer with a patch. " * 2
    with dask.config.set({"agents.llm.models": emu}):  # before the cluster: in-process workers share it
        with LocalCluster(n_workers=1, processes=False, threads_per_worker=4, dashboard_address=":0") as cluster:
            with Client(cluster) as client:
                da.install(client, models=["emu"])
                with da.session(client):
                    r1 = da.llm("emu").generate(prompt + "Issue 1.", max_tokens=8).value(30)
                    r2 = da.llm("emu").generate(prompt + "Issue 1. Now add a test.", max_tokens=8).value(30)
                    tool = da.stub(emulation.emulated_tool("web_api", name="emu_test_web", time_scale=0.001))
                    t = tool("query", seed=3).value(30)
    assert isinstance(r1, da.LLMResult) and r1.output_tokens == 8 and len(r1.token_ids) == 8
    assert r1.model == "emu" and r1.finish_reason == "length"
    assert r2.cached_tokens > 0 and r2.cached_tokens % 16 == 0
    assert r1.emulated and r2.emulated  # labeled as emulation wherever the numbers go
    assert t["emulated"] is True and t["kind"] == "web_api"


def test_admission_follows_priority_then_arrival():
    sched = EmulatedScheduler(EmulationParams(max_batch=1, block_size=4), capacity_blocks=64)
    for rid, prio in [("new1", (0, 0, 0, 0, 1)), ("new2", (0, 0, 0, 0, 2)), ("retry", (0, 0, -5, 0, 3))]:
        sched.add(Sequence(rid, [5] * 8, 1, priority=prio))
    order = []
    while sched.waiting or sched.running:
        order += [s.request_id for s in sched.step()[1]]
    assert order == ["retry", "new1", "new2"]  # progress first, then FIFO


def _break_engine(how: str, model: str = "emu", dask_worker=None) -> None:
    """``crash``: the engine's next step raises (it dies; the plugin restarts it); ``stop``:
    the engine is closed on purpose while a call waits on it."""
    import threading as _threading

    engines = dask_worker.plugins["dask-agents"].engines
    host = engines.start(model)
    if how == "crash":
        real = host._sched.step

        def step():
            host._sched.step = real
            raise RuntimeError("injected emulated failure")

        host._sched.step = step
    else:
        _threading.Timer(0.3, engines.stop, args=(model,)).start()


def test_emulated_engine_crash_is_retried_and_a_stop_is_a_clear_error():
    emu = {"emu": {"model": "emulated-llama", "engine": "emulated", "tokenizer": "byte",
                   "emulation": {"time_scale": 0.001}},
           "slow": {"model": "emulated-llama", "engine": "emulated", "tokenizer": "byte",
                    "emulation": {"time_scale": 1.0}}}
    prompt = "You are a careful engineer. Read the issue and answer with a patch. " * 2
    with dask.config.set({"agents.llm.models": emu}):
        with LocalCluster(n_workers=1, processes=False, threads_per_worker=4, dashboard_address=":0") as cluster:
            with Client(cluster) as client:
                da.install(client, models=["emu"])
                with da.session(client) as s:
                    ref = da.llm("emu").generate(prompt, max_tokens=8).value(30)
                    client.run(_break_engine, "crash")
                    again = da.llm("emu").generate(prompt, max_tokens=8).value(30)
                    assert again.token_ids == ref.token_ids  # served by the restarted engine
                    restarts = client.run(lambda dask_worker: dask_worker.plugins["dask-agents"].engines.restarts)
                    assert list(restarts.values()) == [{"emu": 1}]
                    # ... and reported with the engine's stats (dask_agents_engine_restarts_total)
                    from dask_agents.scheduler_plugin.plugin import NAME as PLUGIN

                    agg = cluster.scheduler.plugins[PLUGIN].aggregates
                    wait_for(lambda: any((rep.get("models", {}).get("emu") or {}).get("restarts") == 1
                                         for rep in agg.engines.values()))
                    client.run(_break_engine, "stop", "slow")
                    with pytest.raises(da.EngineStoppedError) as info:
                        da.llm("slow").generate(prompt, max_tokens=200).value(30)  # seconds: outlives the stop
                    msg = str(info.value)
                    assert s.id in msg and "llm.slow.generate" in msg and "closed" in msg and not info.value.crashed
                    # a later call starts the engine again
                    assert da.llm("slow").generate(prompt, max_tokens=4).value(30).output_tokens == 4
                    # an engine that keeps crashing is not reloaded forever (budget: 1 restart here)
                    import dask_agents.worker_plugin.engines as engine_module

                    old_max, engine_module.RESTARTS_MAX = engine_module.RESTARTS_MAX, 1
                    try:
                        client.run(_break_engine, "crash")
                        with pytest.raises(da.EngineStoppedError, match="not restarting"):
                            da.llm("emu").generate(prompt, max_tokens=8).value(30)
                    finally:
                        engine_module.RESTARTS_MAX = old_max
