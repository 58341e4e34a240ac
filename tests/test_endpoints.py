"""The plugin's own endpoints trust nobody: every message, from a plain client or a worker,
through the real RPCs and streams of a running cluster.

- ``agents-report`` is accepted only on a worker's stream, for that worker's own calls, and
  the worker is the stream's, whatever the message says;
- an engine-stats record that is not what an engine reports is dropped (the others are kept)
  and nothing that reached the stores anyway breaks ``/metrics`` or the Agents page;
- session ids, session lists, the scale-request interval and worker hellos are checked
  before any state changes (a hello only counts from the worker itself).

Each check polls for state; a message on a stream is known to be handled once a later one on
the same stream was (Dask handles a stream's messages in order).
"""

from __future__ import annotations

import copy
import math
import os

import pytest
from distributed import Client, Scheduler, Worker
from distributed.utils_test import gen_cluster, inc

import dask_agents as da
from dask_agents.scheduler_plugin import validate
from dask_agents.scheduler_plugin.dashboard_data import DashboardModel
from dask_agents.scheduler_plugin.plugin import NAME
from tests.conftest import async_wait_for
from dask_agents.worker_plugin import dask_compat as wc

EMU = {"model": "emulated-llama", "engine": "emulated", "tokenizer": "byte", "emulation": {"time_scale": 0.001}}
CONFIG = {"agents.llm.models": {"emu": EMU, "emu2": EMU}, "agents.control.enabled": False}
DASHBOARD = {"dashboard": True, "dashboard_address": "127.0.0.1:0"}
GOOD_STATS = {"engine": "emulated", "emulated": True, "steps": 3, "running": 0, "waiting": 0,
              "kv_bytes": {"device": 4096}, "kv_capacity_bytes": {"device": 1 << 20}}
REFUSED_STREAM = ("agents-report", "not sent on a worker's stream")


@da.tool
def echo(x: object) -> object:
    """A plain tool."""
    return x


async def _ran(c: Client, plugin, name: str):
    """Run one tool call in a new session; return (session, call record) once its worker's
    own report is stored (``started`` is set only by a report)."""
    async with da.session(c, name=name) as sess:
        fut = da.stub(echo)(name)
        assert await fut == name
    rec = plugin.state.calls[fut.key]
    await async_wait_for(lambda: rec.started is not None and rec.finished is not None, timeout=20)
    return sess, rec


def _fields(rec) -> tuple:
    return rec.started, rec.finished, rec.worker, dict(rec.metrics)


async def _metrics(port: int) -> tuple[int, dict[str, dict[tuple, float]]]:
    """(HTTP status of /metrics, sample name -> {sorted label items: value} of dask_agents_*)."""
    from prometheus_client.parser import text_string_to_metric_families
    from tornado.httpclient import AsyncHTTPClient

    r = await AsyncHTTPClient().fetch(f"http://127.0.0.1:{port}/metrics", raise_error=False)
    out: dict[str, dict[tuple, float]] = {}
    if r.code == 200:
        for fam in text_string_to_metric_families(r.body.decode()):
            for smp in fam.samples:
                if smp.name.startswith("dask_agents_"):
                    out.setdefault(smp.name, {})[tuple(sorted(smp.labels.items()))] = smp.value
    return r.code, out


async def _page(port: int, query: str = "") -> int:
    from tornado.httpclient import AsyncHTTPClient

    r = await AsyncHTTPClient().fetch(f"http://127.0.0.1:{port}/agents{query}", raise_error=False)
    return r.code


# -- agents-report: worker streams only, each worker its own calls ---------------------------------

@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], timeout=60, config=CONFIG)
async def test_a_client_cannot_send_reports_or_engine_stats(c: Client, s: Scheduler, a: Worker):
    await da.install(c)
    plugin = s.plugins[NAME]
    await async_wait_for(lambda: a.address in plugin.ready_workers)
    _sess, rec = await _ran(c, plugin, "real")
    before, engines = _fields(rec), copy.deepcopy(plugin.aggregates.engines)
    forged = {"op": "agents-report", "worker": a.address,
              "reports": [{"key": rec.key, "started": 0.0, "finished": 1e9, "metrics": {"prompt_tokens": 10**12}}],
              "engines": {"emu": "junk", "emu2": GOOD_STATS}}
    c._send_to_scheduler(dict(forged))  # claims to come from the worker
    c._send_to_scheduler({k: v for k, v in forged.items() if k != "worker"})  # claims nothing
    # the client's next submit travels the same stream: once it ran, both were handled
    assert await c.submit(inc, 1, pure=False) == 2
    assert _fields(rec) == before
    assert plugin.aggregates.engines == engines
    assert plugin.aggregates.rejected.counts[REFUSED_STREAM] == 2
    assert c.status == "running" and a.address in s.workers and a.address in plugin.ready_workers


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1), ("127.0.0.1", 1)], timeout=60, config=CONFIG)
async def test_a_worker_reports_only_its_own_calls_under_its_own_name(c: Client, s: Scheduler, a: Worker, b: Worker):
    await da.install(c)
    plugin = s.plugins[NAME]
    await async_wait_for(lambda: {a.address, b.address} <= set(plugin.ready_workers))
    _sess, rec = await _ran(c, plugin, "own")
    runner, other = (a, b) if rec.worker == a.address else (b, a)
    before = _fields(rec)
    wc.send_to_scheduler(other, {
        "op": "agents-report", "worker": runner.address,  # claims to be the worker that ran it
        "reports": [{"key": rec.key, "started": 0.0, "finished": 1e9},  # not its call
                    {"key": "echo-00000000000000000000000000000000", "started": 1.0, "finished": 2.0},  # no call
                    "junk", {"key": rec.key}],
        "engines": {"emu": GOOD_STATS, "emu2": {"steps": "many"}, "nope": GOOD_STATS},
    })
    # the stats are stored under the stream's worker: when they are there, the message was handled
    await async_wait_for(lambda: other.address in plugin.aggregates.engines, timeout=15)
    assert _fields(rec) == before
    assert runner.address not in plugin.aggregates.engines  # no engines there: nothing was stored in its name
    assert set(plugin.aggregates.engines[other.address]["models"]) == {"emu"}  # emu2 malformed, nope unknown
    counts = plugin.aggregates.rejected.counts
    assert counts[("agents-report", "call not on this worker")] == 2
    assert ("agents-report", validate.UNKNOWN_CALL) not in counts  # routine (expired sessions): dropped quietly
    assert counts[("agents-report", "report is not a mapping")] == 1
    assert counts[("engines", "unknown model")] == 1 and counts[("engines", "bad engine 'steps'")] == 1
    assert {a.address, b.address} <= set(s.workers)  # nobody lost its stream


# -- nothing stored breaks a page -------------------------------------------------------------------

@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], timeout=60, config=CONFIG, scheduler_kwargs=DASHBOARD)
async def test_one_bad_record_never_breaks_metrics_or_the_agents_page(c: Client, s: Scheduler, a: Worker):
    await da.install(c)
    plugin = s.plugins[NAME]
    port = s.http_server.port
    await async_wait_for(lambda: a.address in plugin.ready_workers)
    sess, rec = await _ran(c, plugin, "page")
    # 1. from the worker's own stream: one engine's record is malformed, the other is fine
    bad = {**GOOD_STATS, "kv_bytes": {"device": "lots"}}
    wc.send_to_scheduler(a, {"op": "agents-report", "engines": {"emu": GOOD_STATS, "emu2": bad}})
    await async_wait_for(lambda: a.address in plugin.aggregates.engines, timeout=15)
    code, series = await _metrics(port)
    assert code == 200
    assert series["dask_agents_kv_bytes"] == {(("model", "emu"), ("tier", "device"), ("worker", str(a.name))): 4096}
    assert series["dask_agents_calls_created_total"] == {(("component", "echo"),): 1}
    # 2. records that reached the stores without a check (as a bug elsewhere could put them there)
    plugin.aggregates.engines["tcp://127.0.0.1:9"] = {"time": "later", "models": {"emu": bad, 7: None}}
    rec.started = "soon"
    code, series = await _metrics(port)
    assert code == 200  # the other records and every other series are still served
    assert series["dask_agents_kv_bytes"] == {(("model", "emu"), ("tier", "device"), ("worker", str(a.name))): 4096}
    assert series["dask_agents_sessions_started_total"] == {(): 1}
    assert series["dask_agents_render_skipped_total"][()] >= 2  # the bad engine records were left out
    assert await _page(port) == 200 and await _page(port, f"?session={sess.id}") == 200
    rows = {(r["worker"], r["model"]): r for r in DashboardModel(plugin).engines()}
    assert rows[("127.0.0.1:9", "emu")]["engine"] == "invalid stats"  # flagged, not dropped silently
    assert rows[(a.address.split("://")[1], "emu")]["kv_device"] == "4.0 KiB"
    _version, layout = DashboardModel(plugin).graph(sess.id)
    assert math.isnan(layout["nodes"]["duration"][layout["nodes"]["key"].index(rec.key)])


# -- RPC arguments ------------------------------------------------------------------------------

@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], timeout=60, config=CONFIG)
async def test_session_ids_and_lists_are_bounded(c: Client, s: Scheduler, a: Worker):
    await da.install(c)
    plugin = s.plugins[NAME]
    sess, _rec = await _ran(c, plugin, "bounded")
    sessions = dict(plugin.state.sessions)
    for bad in ["x" * 10**6, "<b>x</b>-0123456789abcdef", "no-suffix", "", 42]:
        for op in ("agents_session_graph", "agents_telemetry"):
            with pytest.raises(ValueError, match="session"):
                await getattr(c.scheduler, op)(session=bad)
    with pytest.raises(ValueError, match="at most"):
        await c.scheduler.agents_progress(sessions=[sess.id] * (validate.MAX_SESSIONS + 1))
    with pytest.raises(ValueError, match="session id"):
        await c.scheduler.agents_progress(sessions=[sess.id, "x" * 10**6])
    assert plugin.state.sessions == sessions  # nothing was created or ended
    assert (await c.scheduler.agents_progress(sessions=[sess.id]))[sess.id]["calls"] == 1
    assert len(await c.scheduler.agents_telemetry(session=sess.id)) == 1


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], timeout=60, config=CONFIG)
async def test_the_scale_request_interval_is_checked_before_anything_changes(c: Client, s: Scheduler, a: Worker):
    await da.install(c)
    plugin = s.plugins[NAME]
    plugin.pending_add = 3  # what the control plane asked for, waiting for the cluster link
    for bad in [float("nan"), float("inf"), -1.0, 0, "1s", True, None]:
        with pytest.raises(ValueError, match="interval"):
            await c.scheduler.agents_scale_requests(interval=bad)
    assert plugin.pending_add == 3 and plugin.link_seen is None  # not drained by a bad call
    assert (await c.scheduler.agents_scale_requests(interval=1e308))["add"] == 3
    assert plugin.link_interval == validate.INTERVAL[1]


class _Comm:
    """Just what a handler reads of an RPC's comm."""

    def __init__(self, peer: str):
        self.peer_address = peer


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], timeout=60, config=CONFIG)
async def test_only_the_worker_itself_says_hello(c: Client, s: Scheduler, a: Worker):
    await da.install(c, models=["emu"])
    plugin = s.plugins[NAME]
    await async_wait_for(lambda: plugin.model_workers.get("emu") == {a.address}, timeout=20)

    def state() -> tuple:
        return ({w: dict(i) for w, i in plugin.ready_workers.items()},
                {m: set(ws) for m, ws in plugin.model_workers.items() if ws})

    before = state()
    # a client saying hello in the worker's name: the worker is asked, and what it hosts counts
    for claim in (["emu2"], ["unknown-model"], []):
        assert (await c.scheduler.agents_worker_hello(worker=a.address, models=claim))["ok"]
        assert {m: set(ws) for m, ws in plugin.model_workers.items() if ws} == before[1]
    for bad in [dict(worker="tcp://127.0.0.1:1", models=[]),
                dict(worker=a.address, models=["emu"] * (validate.MAX_MODELS + 1)),
                dict(worker=a.address, models=["x" * 10**4]), dict(worker=a.address, models=[7]),
                dict(worker=a.address, models="emu"), dict(worker=a.address, models=["emu"], pid="me"),
                dict(worker=a.address, models=["emu"], pid=os.getpid() + 1),  # not the worker's process
                dict(worker="x" * 10**5, models=[])]:
        with pytest.raises(ValueError, match="agents_worker_hello"):
            await c.scheduler.agents_worker_hello(**bad)
    assert state()[1] == before[1] and state()[0].keys() == before[0].keys()
    # from another host the worker is not even asked
    with pytest.raises(validate.Invalid, match="only .* may say hello for itself"):
        await validate.hello(plugin, _Comm("tcp://10.255.0.1:4444"), a.address, ["emu"], None)
    with pytest.raises(validate.Invalid, match="only .* may say hello for itself"):
        await validate.hello(plugin, None, a.address, ["emu"], None)
    got = await validate.hello(plugin, _Comm("tcp://127.0.0.1:1"), a.address, [], None)
    assert got == (a.address, ["emu"], os.getpid())  # same host: the worker's own models and pid


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], timeout=60, config=CONFIG)
async def test_a_hello_for_a_worker_without_the_plugin_does_not_stick(c: Client, s: Scheduler, a: Worker):
    """A first hello is registered at once (it may come from the worker's own start-up, when
    the worker cannot answer yet), then the worker is asked: one without the dask-agents
    worker plugin cannot confirm, and is unregistered."""
    from dask_agents.scheduler_plugin.plugin import AgentsSchedulerPlugin

    await c.register_plugin(AgentsSchedulerPlugin())  # the scheduler's half only
    plugin = s.plugins[NAME]
    assert (await c.scheduler.agents_worker_hello(worker=a.address, models=["emu"]))["ok"]
    await async_wait_for(lambda: a.address not in plugin.ready_workers and not plugin.model_workers.get("emu"),
                         timeout=20)
    assert a.address in s.workers and list((await c.scheduler.agents_ping())["workers"]) == []


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], timeout=60, config=CONFIG)
async def test_a_swap_on_the_worker_reaches_the_scheduler(c: Client, s: Scheduler, a: Worker):
    """Before: a worker's ``agents_swap_model`` changed what it hosts behind the scheduler's
    back, which kept placing the model's calls there. (Only the scheduler may call it now,
    tests/test_ownership.py; what a swap changes is announced to it all the same.)"""
    await da.install(c, models=["emu"])
    plugin = s.plugins[NAME]
    await async_wait_for(lambda: a.address in plugin.model_workers.get("emu", ()))
    hosted = await plugin.roster.call_worker(a.address, "agents_swap_model", remove="emu", add="emu2")
    assert list(hosted) == ["emu2"]
    await async_wait_for(lambda: a.address not in plugin.model_workers.get("emu", ())
                         and a.address in plugin.model_workers.get("emu2", ()))


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1), ("127.0.0.1", 1)], timeout=60, config=CONFIG)
async def test_fast_path_records_only_for_calls_made_on_that_worker(c: Client, s: Scheduler, a: Worker, b: Worker):
    """A worker reports calls that ran on its fast path: only tool or stateless agent calls (or
    LLM calls on an engine it hosts), made by a call running on that worker, in that call's
    session; any other record is dropped and counted, and the good one is recorded as a
    fast-path call of its creator."""
    import time as _time

    await da.install(c)
    plugin = s.plugins[NAME]
    await async_wait_for(lambda: {a.address, b.address} <= set(plugin.ready_workers))
    sess, creator = await _ran(c, plugin, "fast")
    runner, other = (a, b) if creator.worker == a.address else (b, a)
    now = _time.time()

    def record(key: str, **ann_over) -> dict:
        ann = {"call": key, "component": key.split("-")[0], "method": None, "kind": "tool", "session": sess.id,
               "creator": creator.key, "deps": [], "created": now, "stateful": False, **ann_over}
        return {"key": key, "ann": ann, "state": "memory", "started": now, "finished": now + 0.001}

    good = record("echo-" + "1" * 32)
    bad = [record("echo-" + "2" * 32, kind="llm", llm_model="emu"),  # an LLM call: no engine of it there
           record("echo-" + "3" * 32, component="other"),  # not a key of that component
           record("echo-" + "4" * 32, session="someone-else"),  # another session than its creator's
           record("echo-" + "5" * 32, stateful=True),
           {**record("echo-" + "6" * 32), "started": now + 5},  # started after it finished
           "junk"]
    counts = plugin.aggregates.rejected.counts
    wc.send_to_scheduler(other, {"op": "agents-report", "reports": [], "calls": [good]})  # its creator ran elsewhere
    await async_wait_for(lambda: counts[("agents-report", "creator not on this worker")] == 1, timeout=15)
    assert good["key"] not in plugin.state.calls
    wc.send_to_scheduler(runner, {"op": "agents-report", "reports": [], "calls": bad + [good]})
    await async_wait_for(lambda: good["key"] in plugin.state.calls, timeout=15)
    assert counts[("agents-report", "not local")] == 2
    assert counts[("agents-report", "bad local annotation")] == 1
    assert counts[("agents-report", "session is not the creator's")] == 1
    assert counts[("agents-report", "bad report times")] == 1
    assert counts[("agents-report", "record is not a mapping")] == 1
    rec = plugin.state.calls[good["key"]]
    assert rec.local and rec.worker == runner.address and rec.state == "finished" and rec.session == sess.id
    assert good["key"] in creator.children and all(r["key"] not in plugin.state.calls for r in bad[:-1])
    assert {a.address, b.address} <= set(s.workers)  # nobody lost its stream


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], timeout=60, config=CONFIG)
async def test_a_fast_path_calls_outcome_comes_from_its_record_not_its_published_key(c: Client, s: Scheduler,
                                                                                      a: Worker):
    """The value of a call that ran on a worker's fast path is published as an ordinary key,
    released when its futures are: that release (on the client's stream) may reach the
    scheduler before the worker's record that the call finished. The call must still end
    finished, with the worker's times (it ended cancelled, without times)."""
    import time as _time

    await da.install(c)
    plugin = s.plugins[NAME]
    await async_wait_for(lambda: a.address in plugin.ready_workers)
    sess, creator = await _ran(c, plugin, "race")
    now = _time.time()
    key = "echo-" + "7" * 32
    ann = {"call": key, "component": "echo", "method": None, "kind": "tool", "session": sess.id,
           "creator": creator.key, "deps": [], "created": now, "stateful": False}
    wc.send_to_scheduler(a, {"op": "agents-report", "calls": [
        {"key": key, "ann": ann, "state": "processing", "started": now, "finished": None}]})
    await async_wait_for(lambda: key in plugin.state.calls, timeout=15)
    for start, finish in (("memory", "released"), ("released", "forgotten")):  # the published key let go
        plugin.transition(key, start, finish)
    wc.send_to_scheduler(a, {"op": "agents-report", "calls": [
        {"key": key, "ann": ann, "state": "memory", "started": now, "finished": now + 0.002}]})
    rec = plugin.state.calls[key]
    await async_wait_for(lambda: rec.finished is not None, timeout=15)
    assert rec.state == "finished" and rec.started == now and rec.finished == now + 0.002 and rec.local
