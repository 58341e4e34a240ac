"""Prometheus metrics on the scheduler's /metrics: the dask_agents_* series against telemetry."""

from __future__ import annotations

import math
import threading

import dask
import pytest
from distributed import Client, Scheduler, Worker
from distributed.utils_test import gen_cluster

import dask_agents as da
from dask_agents.scheduler_plugin import metrics
from dask_agents.scheduler_plugin.metrics import Histogram
from dask_agents.scheduler_plugin.plugin import NAME
from tests.conftest import async_wait_for

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

EMU = {"emu": {"model": "emulated-llama", "engine": "emulated", "tokenizer": "byte",
               "emulation": {"time_scale": 0.001}}}
CONFIG = {"agents.llm.models": EMU, "agents.dashboard.engine-stats-interval": "100ms"}
DASHBOARD = {"dashboard": True, "dashboard_address": "127.0.0.1:0"}
PROMPT = "You are a careful analyst. Answer from the facts given, briefly and precisely. " * 2


@da.tool
def lookup(question: str) -> str:
    return f"facts about {question}"


@da.agent
class Analyst:
    def answer(self, question: str) -> str:
        facts = da.stub(lookup)(question).value(30)
        return da.llm("emu").generate(PROMPT + question + facts, max_tokens=4).value(30).text


@da.tool
def broken(question: str) -> str:
    raise ValueError(f"no facts about {question}")


def scrape_text(port: int) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


async def scrape(port: int) -> dict[str, dict[tuple, float]]:
    """sample name -> {sorted label items: value} of the dask_agents_* series."""
    from tornado.httpclient import AsyncHTTPClient

    body = (await AsyncHTTPClient().fetch(f"http://127.0.0.1:{port}/metrics")).body.decode()
    out: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(body):
        for s in fam.samples:
            if s.name.startswith("dask_agents_"):
                out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def value(series: dict, name: str, **labels: str) -> float:
    return series.get(name, {}).get(tuple(sorted(labels.items())), 0.0)


def test_histogram_is_cumulative_like_prometheus():
    h = Histogram((0.1, 1.0))
    for x in (0.05, 0.1, 0.5, 2.0, 3.0):
        h.observe(x)
    assert h.buckets() == [("0.1", 2), ("1.0", 3), ("+Inf", 5)]
    assert h.count == 5 and h.sum == pytest.approx(5.65) and h.mean() == pytest.approx(1.13)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 4), ("127.0.0.1", 4)], timeout=120, config=CONFIG,
             scheduler_kwargs=DASHBOARD)
async def test_metrics_match_telemetry(c: Client, s: Scheduler, a: Worker, b: Worker):
    await da.install(c, models=["emu"])
    n = 4
    for i in range(n):
        async with da.session(c, name=f"m{i}"):
            analyst = da.stub(Analyst)
            first = analyst.answer(f"question {i}")
            second = analyst.answer(f"question {i}")  # same prompt prefix: prefix-cache hits
            await c.gather([first, second])
    async with da.session(c, name="failing"):  # a failed call: counted, and its session failed
        with pytest.raises(da.CallFailedError, match="no facts about x"):
            await da.stub(broken)("x")
    plugin = s.plugins[NAME]

    async def settled():
        df = await da.telemetry(c)
        done = df["state"].isin(["finished", "erred"]).all() and df["started"].notna().all()
        return done and plugin.state.sessions_completed == n + 1 and len(plugin.aggregates.engines) == 2

    await async_wait_for(settled, timeout=30)
    df = await da.telemetry(c)
    series = await scrape(s.http_server.port)

    # failures: the erred call (with its error in telemetry) and its session
    erred = df[df["state"] == "erred"]
    assert list(erred["component"]) == ["broken"] and "no facts about x" in erred["error"].iloc[0]
    assert df.loc[df["state"] != "erred", "error"].isna().all()
    assert value(series, "dask_agents_calls_failed_total") == 1
    assert value(series, "dask_agents_sessions_failed_total") == 1
    assert value(series, "dask_agents_calls_ended_total", component="broken", state="erred") == 1
    for kind in ("workers_lost", "rerouted", "failed"):
        assert value(series, "dask_agents_faults_total", kind=kind) == 0
    df = df[df["state"] != "erred"]

    # calls by component and state
    for comp, k in df.groupby("component").size().items():  # (the finished calls)
        assert value(series, "dask_agents_calls_created_total", component=comp) == k
        assert value(series, "dask_agents_calls_ended_total", component=comp, state="finished") == k
        rows = df[df["component"] == comp]
        assert value(series, "dask_agents_call_service_seconds_count", component=comp) == len(rows)
        assert value(series, "dask_agents_call_service_seconds_sum", component=comp) == pytest.approx(
            rows["service_s"].sum(), rel=1e-6, abs=1e-9)
        assert value(series, "dask_agents_call_queue_seconds_count", component=comp) == rows["queue_s"].notna().sum()
        assert value(series, "dask_agents_call_queue_seconds_sum", component=comp) == pytest.approx(
            rows["queue_s"].sum(), rel=1e-6, abs=1e-9)
        buckets = [v for (lbl, v) in sorted(
            ((dict(k)["le"], v) for k, v in series["dask_agents_call_service_seconds_bucket"].items()
             if dict(k)["component"] == comp), key=lambda t: float(t[0]))]
        assert buckets == sorted(buckets) and buckets[-1] == len(rows)
    assert set(df["component"]) == {"Analyst", "lookup", "llm.emu"}
    assert not any(k[0][1] for k in series.get("dask_agents_calls", {}))  # nothing open any more

    # sessions
    assert value(series, "dask_agents_sessions", state="completed") == n + 1
    assert value(series, "dask_agents_sessions", state="active") == 0
    assert value(series, "dask_agents_sessions_completed_total") == n + 1
    assert value(series, "dask_agents_session_latency_seconds_count") == n + 1

    # LLM tokens per worker and model, against the calls' own numbers
    llm = df[df["kind"] == "llm"]
    assert llm["cached_tokens"].sum() > 0
    names = {a.address: str(a.name), b.address: str(b.name)}  # series are labelled by worker name
    for addr, rows in llm.groupby("worker"):
        w = names[addr]
        prompt, cached = rows["prompt_tokens"].sum(), rows["cached_tokens"].sum()
        assert value(series, "dask_agents_llm_calls_total", worker=w, model="emu") == len(rows)
        assert value(series, "dask_agents_llm_prompt_tokens_total", worker=w, model="emu") == prompt
        assert value(series, "dask_agents_llm_cached_tokens_total", worker=w, model="emu") == cached
        assert value(series, "dask_agents_llm_recomputed_tokens_total", worker=w, model="emu") == prompt - cached
        assert value(series, "dask_agents_llm_output_tokens_total", worker=w, model="emu") == rows["output_tokens"].sum()

    # LLM latencies per model, like vLLM's: every call's time to first token and time per
    # output token, as its worker measured them, and its end-to-end time
    assert llm["ttft_s"].notna().all() and llm["tpot_s"].notna().all()  # 4 tokens each: both
    assert (llm["ttft_s"] <= llm["service_s"]).all()  # the first token comes within the call
    assert (llm["ttft_s"] + 3 * llm["tpot_s"] <= llm["service_s"] + 1e-6).all()
    for key, column in (("time_to_first_token", "ttft_s"), ("time_per_output_token", "tpot_s"),
                        ("e2e_request_latency", "service_s")):
        name = f"dask_agents_llm_{key}_seconds"
        assert value(series, f"{name}_count", model="emu") == len(llm)
        assert value(series, f"{name}_sum", model="emu") == pytest.approx(llm[column].sum(), rel=1e-6, abs=1e-9)
        assert value(series, f"{name}_bucket", model="emu", le="+Inf") == len(llm)
    for addr, w in names.items():  # no engine crashed
        assert value(series, "dask_agents_engine_restarts_total", worker=w, model="emu") == 0
        assert ("worker", w) in {k for key in series["dask_agents_engine_restarts_total"] for k in key}
    assert value(series, "dask_agents_admission_waits_total", model="emu") == \
        plugin.admission.waits_by_model.get("emu", 0)

    # KV bytes per tier: the emulated engines' own accounting, the latest sample of each
    kv = await da.telemetry(c, table="kv")
    assert set(kv["tier"]) == {"device"}
    for addr, w in names.items():
        latest = plugin.aggregates.engines[addr]["models"]["emu"]
        assert value(series, "dask_agents_kv_bytes", worker=w, model="emu", tier="device") == \
            latest["kv_bytes"]["device"]
        assert value(series, "dask_agents_kv_capacity_bytes", worker=w, model="emu", tier="device") > 0
        assert value(series, "dask_agents_engine_emulated", worker=w, model="emu") == 1
        assert value(series, "dask_agents_engine_requests_running", worker=w, model="emu") == latest["running"]
        assert ("worker", w) in dict.fromkeys(k for key in series["dask_agents_engine_requests_waiting"] for k in key)
        assert kv[kv["worker"] == addr]["bytes"].iloc[-1] >= 0
    assert not any(dict(k).get("tier") in ("host", "disk") for k in series.get("dask_agents_kv_bytes", {}))

    # the control loop
    stats = await da.control(c).stats()
    assert value(series, "dask_agents_control_tick_seconds_count") > 0
    assert value(series, "dask_agents_control_tick_seconds_count") <= stats["ticks"]
    for kind, k in stats["applied"].items():
        assert value(series, "dask_agents_control_decisions_total", kind=kind, outcome="applied") == k
    assert not math.isnan(value(series, "dask_agents_control_tick_seconds_sum"))


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], config=CONFIG, scheduler_kwargs=DASHBOARD)
async def test_queue_lengths_while_calls_wait(c: Client, s: Scheduler, a: Worker):
    await da.install(c)
    gate = GATE
    gate.clear()
    async with da.session(c):
        futs = [da.stub(held)(i) for i in range(3)]  # one runs, two wait on the single thread
        plugin = s.plugins[NAME]
        await async_wait_for(lambda: metrics.queue_counts(plugin)[1].get(("held", a.address)) == 1, timeout=15)
        series = await scrape(s.http_server.port)
        # waiting: on the worker (assigned, not started) or held back on the scheduler (Dask's queuing)
        # labelled by worker name, not by its (ephemeral) address
        on_worker = value(series, "dask_agents_calls_queued", component="held", worker=str(a.name))
        on_scheduler = value(series, "dask_agents_calls_queued", component="held", worker="scheduler")
        assert on_worker + on_scheduler == 2 and on_worker >= 0
        assert value(series, "dask_agents_calls_running", component="held", worker=str(a.name)) == 1
        assert not any(a.address in line for line in series if "calls_running" in line)
        assert value(series, "dask_agents_calls", component="held", state="processing") == 1 + on_worker
        assert value(series, "dask_agents_calls", component="held", state="queued") == on_scheduler
        gate.set()
        await c.gather(futs)
    assert isinstance(gate, threading.Event)


GATE = threading.Event()


@da.tool
def held(i: int) -> int:
    GATE.wait(30)
    return i


def test_collector_is_unregistered_when_the_scheduler_closes():
    import asyncio

    from dask_agents.scheduler_plugin.plugin import AgentsSchedulerPlugin

    async def main() -> tuple[str, str, bool]:
        s = Scheduler(dashboard=True, dashboard_address="127.0.0.1:0")
        s.add_plugin(AgentsSchedulerPlugin())  # as the preload does: started with the scheduler
        async with s:
            assert metrics.registered()
            port = s.http_server.port
            loop = asyncio.get_running_loop()
            during = await loop.run_in_executor(None, scrape_text, port)
        after = prometheus_client.generate_latest().decode()
        return during, after, metrics.registered()

    with dask.config.set(CONFIG):
        during, after, still = asyncio.run(main())
    assert "dask_agents_sessions" in during and "dask_agents_control_decisions" in during
    assert not still and "dask_agents_" not in after


def test_engines_kv_directives_become_decisions_and_counters():
    from types import SimpleNamespace

    from dask_agents.scheduler_plugin.dashboard_data import DashboardModel

    agg = metrics.Aggregates()
    st = {"kv_policy": "ours", "kv_actions": {"evict": 2, "prefetch": 1}}
    agg.on_engine_stats("tcp://w1", {"coder": st}, 10.0)
    agg.on_engine_stats("tcp://w1", {"coder": {**st, "kv_actions": {"evict": 5, "prefetch": 1}}}, 11.0)
    # a restarted engine counts from zero: its counts are new decisions, not negative ones
    agg.on_engine_stats("tcp://w1", {"coder": {**st, "kv_actions": {"evict": 1}}}, 12.0)
    got = [(d["time"], d["action"], d["count"]) for d in agg.kv_decisions]
    assert got == [(10.0, "kv evict", 2), (10.0, "kv prefetch", 1), (11.0, "kv evict", 3), (12.0, "kv evict", 1)]
    assert agg.kv_decisions[0]["policy"] == "kv:ours" and agg.kv_decisions[0]["worker"] == "tcp://w1"

    model = DashboardModel(SimpleNamespace(control=None, aggregates=agg))
    seen, rows = model.new_decisions((0, 0))
    assert seen == (0, 4) and [r["action"] for r in rows] == ["kv evict", "kv prefetch", "kv evict", "kv evict"]
    assert "count=3" in rows[2]["details"] and "model=coder" in rows[2]["details"]
    agg.on_engine_stats("tcp://w1", {"coder": {**st, "kv_actions": {"evict": 1, "drop": 1}}}, 13.0)
    seen, rows = model.new_decisions(seen)
    assert seen == (0, 5) and [r["action"] for r in rows] == ["kv drop"]
    assert model.new_decisions(seen) == (seen, [])


def test_engine_stats_are_checked_before_they_are_stored():
    """One bad model record is dropped (and counted); the worker's other engines are kept, and
    a non-mapping changes nothing. Stored unchecked, one such record failed every scrape."""
    agg = metrics.Aggregates()
    good = {"engine": "emulated", "emulated": True, "steps": 2, "kv_bytes": {"device": 1024}}
    agg.on_engine_stats("tcp://w1", {"coder": good, "chat": {"kv_bytes": {"device": float("nan")}},
                                     "x" * 1000: good, "tiny": "junk"}, 10.0)
    assert set(agg.engines["tcp://w1"]["models"]) == {"coder"}
    assert agg.engines["tcp://w1"]["models"]["coder"]["kv_bytes"] == {"device": 1024}
    assert [s[1:5] for s in agg.kv_samples] == [("tcp://w1", "coder", "device", 1024)]
    agg.on_engine_stats("tcp://w1", ["not", "a", "mapping"], 11.0)
    assert agg.engines["tcp://w1"]["time"] == 10.0  # kept as it was
    assert agg.rejected.total() == 4
    assert {why for (what, why) in agg.rejected.counts if what == "engines"} >= {
        "bad engine 'kv_bytes'", "bad engine model name", "engine stats not a mapping"}


def test_an_engine_without_per_session_kv_control_says_so():
    """An engine the compat check refused runs with plain prefix caching: /metrics and the
    Agents page say so, with the reason."""
    from types import SimpleNamespace

    from prometheus_client.core import GaugeMetricFamily  # noqa: F401  (the module's dependency)

    from dask_agents.scheduler_plugin.dashboard_data import DashboardModel

    agg = metrics.Aggregates()
    agg.on_engine_stats("tcp://w1", {"coder": {"engine": "vllm", "kv_control": False,
                                               "kv_control_reason": "vLLM 9.9 is not supported"},
                                     "chat": {"engine": "vllm", "kv_control": True, "kv_control_reason": None}}, 10.0)
    plugin = SimpleNamespace(aggregates=agg, control=None, bindings={}, model_workers={"coder": {"tcp://w1"}},
                             admission=SimpleNamespace(held={}, held_by_model={}, engines={}))
    fams = {f.name: f for f in metrics._engine_families(plugin)}  # noqa: SLF001
    got = {tuple(s.labels.values()): s.value for s in fams["dask_agents_kv_control"].samples}
    assert got == {("tcp://w1", "coder"): 0, ("tcp://w1", "chat"): 1}
    rows = {r["model"]: r for r in DashboardModel(plugin).engines(now=11.0)}
    assert rows["coder"]["kv_control"] == "off: vLLM 9.9 is not supported" and rows["chat"]["kv_control"] == "on"
