"""Sessions are owned, cluster-wide changes are the scheduler's, worker handlers the scheduler's.

Issue 27 found, on plain TCP and with TLS alike: a second client ended and cancelled another
client's session (an ``agents_session_end`` RPC without a ``client`` field skipped the owner
check, and a stream message could name the victim's client id), stopped the control loop for
every driver, and destroyed instances and engines by calling a worker's handlers directly; a
page URL with undecodable bytes answered 500. Each test here failed before the fix. The model
is stated in ``docs/production.md`` ("Trust model"): this prevents one driver from interfering
with another by accident; it adds no isolation Dask lacks (any client can run code on the
scheduler).
"""

from __future__ import annotations

import threading

import dask
import pytest
from distributed import Client, Scheduler, Worker
from distributed.utils_test import gen_cluster

import dask_agents as da
from dask_agents.scheduler_plugin.plugin import NAME
from dask_agents.worker_plugin import dask_compat as wc
from tests.conftest import async_wait_for
from tests.test_endpoints import CONFIG, DASHBOARD, _page

RELEASE = threading.Event()


@da.tool
def held(x: object) -> object:
    """Returns ``x`` once the test releases it."""
    RELEASE.wait(30)
    return x


@da.agent(stateful=True)
class Tally:
    """Session state: a running total."""

    def __init__(self) -> None:
        self.total = 0

    def add(self, k: int) -> int:
        self.total += k
        return self.total


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)], timeout=60, config=CONFIG)
async def test_only_the_owner_ends_or_cancels_its_session(c: Client, s: Scheduler, a: Worker):
    """Another client's end with ``cancel`` (as itself, naming the owner's client id, or sent
    on a worker's stream) changes nothing: the owner's call runs to its answer and the session
    ends when the owner leaves its block. The old RPC that skipped the check is gone."""
    await da.install(c)
    plugin = s.plugins[NAME]
    RELEASE.clear()
    refused_on_worker_stream = ("agents-session-end", "not sent on a client's stream")
    async with Client(s.address, asynchronous=True) as other:
        async with da.session(c, name="victim") as sess:
            tally = da.stub(Tally)
            assert await tally.add(5) == 5
            fut = da.stub(held)("kept")
            await async_wait_for(lambda: any(r.component == "held" for r in plugin.state.calls.values()))
            end = {"op": "agents-session-end", "session": sess.id, "cancel": True}
            other._send_to_scheduler(dict(end))  # as itself
            other._send_to_scheduler({**end, "client": c.id})  # naming the owner
            wc.send_to_scheduler(a, {**end, "client": c.id})  # from a worker's stream
            await async_wait_for(lambda: plugin.sessions.refused == 2
                                 and plugin.aggregates.rejected.counts[refused_on_worker_stream] == 1)
            assert "agents_session_end" not in s.handlers  # the RPC that skipped the check is gone
            assert plugin.state.sessions[sess.id].state == "active"
            RELEASE.set()
            assert await fut == "kept"
            assert await tally.add(1) == 6  # the instance is the same one: its state was kept
        await async_wait_for(lambda: plugin.state.sessions[sess.id].state == "completed")
    assert plugin.state.sessions[sess.id].closed_reason is None  # ended by its owner, not aborted


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], timeout=60, config=CONFIG)
async def test_a_joining_client_leaving_its_block_ends_nothing(c: Client, s: Scheduler, a: Worker):
    """A second client entering the owner's session (same id) and leaving it, even with an
    exception, does not end or cancel it."""
    await da.install(c)
    plugin = s.plugins[NAME]
    async with Client(s.address, asynchronous=True) as other:
        async with da.session(c, name="owned") as sess:
            tally = da.stub(Tally)
            assert await tally.add(2) == 2
            joined = da.session(other)
            joined.id = sess.id  # the same session, entered by another driver
            with pytest.raises(RuntimeError, match="joiner gives up"):
                async with joined:
                    raise RuntimeError("joiner gives up")
            await async_wait_for(lambda: plugin.sessions.refused == 1)
            assert plugin.state.sessions[sess.id].state == "active"
            assert await tally.add(3) == 5
        await async_wait_for(lambda: plugin.state.sessions[sess.id].state == "completed")


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], timeout=60,
             config={**CONFIG, "agents.control.enabled": True})
async def test_clients_change_the_control_loop_only_if_the_scheduler_allows(c: Client, s: Scheduler, a: Worker):
    await da.install(c)
    plugin = s.plugins[NAME]
    ctl = da.control(c)
    for action in (ctl.stop, ctl.run_once, ctl.start):
        with pytest.raises(da.NotAllowedError, match="agents.control.client-actions"):
            await action()
    assert plugin.control.running
    assert (await ctl.stats())["running"] is True  # reading is fine
    with dask.config.set({"agents.control.client-actions": True}):  # the scheduler's config (same process here)
        await ctl.stop()
        assert not plugin.control.running
        await ctl.start()
        assert plugin.control.running


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], timeout=60, config=CONFIG)
async def test_worker_handlers_accept_only_the_scheduler(c: Client, s: Scheduler, a: Worker):
    """Ending sessions, swapping engines and KV directives on a worker: refused to a client
    calling the worker (no secret, a guessed one, a near miss); the scheduler's own calls
    (with the secret it sent on the worker's stream) work."""
    await da.install(c, models=["emu"])
    plugin = s.plugins[NAME]
    worker_plugin = a.plugins[NAME]
    await async_wait_for(lambda: a.address in plugin.model_workers.get("emu", ())
                         and worker_plugin._secret == plugin.roster.secret)
    async with da.session(c, name="kept") as sess:
        assert await da.stub(Tally).add(4) == 4
        assert worker_plugin.instances.stateful_count() == 1
        w = c.rpc(a.address)
        for secret in (None, "guess", plugin.roster.secret[:-1] + "!"):
            kw = {} if secret is None else {"secret": secret}
            with pytest.raises(PermissionError, match="only the scheduler may call it"):
                await w.agents_end_session(sessions=[sess.id], **kw)
            with pytest.raises(PermissionError, match="only the scheduler may call it"):
                await w.agents_swap_model(remove="emu", add="emu2", **kw)
            with pytest.raises(PermissionError, match="only the scheduler may call it"):
                await w.agents_kv(model="emu", directive="inspect", session=sess.id, **kw)
        assert worker_plugin.instances.stateful_count() == 1
        assert list(worker_plugin.engines.announced()) == ["emu"]
        assert list((await w.agents_worker_info())["models"]) == ["emu"]  # reading stays open
        assert await da.stub(Tally).add(1) == 5
    hosted = await plugin.roster.call_worker(a.address, "agents_swap_model", remove="emu", add="emu2")
    assert list(hosted) == ["emu2"]


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], timeout=60, config=CONFIG, scheduler_kwargs=DASHBOARD)
async def test_a_page_url_that_is_not_a_session_id_is_a_400(c: Client, s: Scheduler, a: Worker):
    await da.install(c)
    port = s.http_server.port
    assert await _page(port) == 200
    for query in ("?session=%00%ff", "?session=%ff", "?session=%3Cb%3Ex", "?session=" + "a" * 5000):
        assert await _page(port, query) == 400, query
    async with da.session(c, name="page") as sess:
        assert await da.stub(Tally).add(1) == 1
    assert await _page(port, f"?session={sess.id}") == 200


# -- the same across real processes: a second driver in its own process -----------------------
_INTRUDER = r'''
import asyncio, json, sys
from distributed import Client
import dask_agents as da

address, sid, owner, worker = sys.argv[1:5]
out = {}
with Client(address, timeout="30s") as other:
    end = {"op": "agents-session-end", "session": sid, "cancel": True}
    other._send_to_scheduler(dict(end))
    other._send_to_scheduler({**end, "client": owner})  # a forged client field
    try:
        da.control(other).stop()
        out["stop"] = "allowed"
    except da.NotAllowedError as e:
        out["stop"] = "refused"

    async def end_on_worker():
        return await other.rpc(worker).agents_end_session(sessions=[sid])

    try:
        other.sync(end_on_worker)
        out["worker"] = "allowed"
    except PermissionError as e:
        out["worker"] = "refused: " + str(e)
    import time
    deadline = time.monotonic() + 30  # the refusals come on the stream; poll until both are counted
    while True:
        out["refused"] = other.run_on_scheduler(
            lambda dask_scheduler: dask_scheduler.plugins["dask-agents"].sessions.refused)
        if out["refused"] >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
print("RESULT " + json.dumps(out))
'''


def test_a_driver_in_another_process_cannot_end_a_session_or_stop_the_loop(tmp_path):
    import json
    import os
    import subprocess
    import sys

    from tests import fault_components as fc
    from tests.test_preload import DASK, PRELOAD, Proc, _env, agents_ping
    from tests.test_preload import wait_for as pwait

    env = _env()
    sched_file = str(tmp_path / "scheduler.json")
    procs = [Proc([DASK, "scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard", "--scheduler-file",
                   sched_file, "--preload", PRELOAD], str(tmp_path / "scheduler.log"), env)]
    try:
        pwait(lambda: os.path.exists(sched_file) and os.path.getsize(sched_file) > 0, "the scheduler file",
              procs=tuple(procs))
        procs.append(Proc([DASK, "worker", "--scheduler-file", sched_file, "--host", "127.0.0.1", "--nthreads", "2",
                           "--no-dashboard", "--preload", PRELOAD], str(tmp_path / "worker.log"), env))
        with Client(scheduler_file=sched_file, timeout="30s") as client:
            pwait(lambda: agents_ping(client)["workers"], "the worker's hello", procs=tuple(procs))
            (worker,) = client.scheduler_info()["workers"]
            counter = da.stub(fc.Counter)
            with da.session(client, name="owned") as s:
                assert counter.bump(str(tmp_path)).value(timeout=60)[0] == 1
                run = subprocess.run([sys.executable, "-c", _INTRUDER, client.scheduler.address, s.id, client.id,
                                      worker], env=env, capture_output=True, text=True, timeout=120)
                line = next((x for x in run.stdout.splitlines() if x.startswith("RESULT ")), None)
                assert line is not None, run.stdout + run.stderr
                out = json.loads(line[len("RESULT "):])
                assert out["stop"] == "refused" and out["worker"].startswith("refused: "), out
                assert "only the scheduler" in out["worker"] and out["refused"] == 2, out
                # the owner's session and its instance are untouched
                assert counter.bump(str(tmp_path)).value(timeout=60)[0] == 2
    finally:
        for p in reversed(procs):
            p.kill()
