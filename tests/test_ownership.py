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
