"""One session or call cannot cost the others without bound (issue 27, "bounded cost").

Before: a tool that hung kept its session open and its thread busy forever (no per-call
timeout); an agent calling itself forever parked ~760 worker threads in 25 s; a 100k-call
session grew the scheduler from 103 MB to 1,003 MB; a 50 MB prompt failed only after 4.4 s of
shipping and stalled another client's session. Each limit fails clearly, naming its setting.
"""

from __future__ import annotations

import threading

import dask
import pytest
from distributed import Client, Scheduler, Worker
from distributed.utils_test import gen_cluster

import dask_agents as da
from dask_agents.scheduler_plugin.plugin import NAME
from tests.conftest import async_wait_for
from tests.test_plugin_faults import CONFIG, double


STUCK = threading.Event()


@da.tool(timeout=0.3)
def hangs(x: int) -> int:
    """A tool that does not return until the test lets it (a hung web call)."""
    STUCK.wait(30)
    return x


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)], timeout=60, config=CONFIG)
async def test_a_call_past_its_timeout_fails_clearly_and_its_session_goes_on(c: Client, s: Scheduler, a: Worker):
    await da.install(c)
    plugin = s.plugins[NAME]
    STUCK.clear()
    async with da.session(c, name="hung") as sess:
        stuck = da.stub(hangs)(1)
        with pytest.raises(da.CallTimeoutError) as ei:
            await stuck
        text = str(ei.value)
        assert "hangs" in text and sess.id in text and "0.3s" in text and "timeout hint" in text and stuck.key in text
        assert await da.stub(double)(5) == 10  # the session goes on
    await async_wait_for(lambda: plugin.state.sessions[sess.id].state == "completed")
    assert plugin.state.calls[stuck.key].state == "erred" and plugin.timed_out == 1
    STUCK.set()


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)], timeout=60,
             config={**CONFIG, "agents.scheduler.call-timeout": "300ms"})
async def test_the_default_call_timeout_bounds_calls_without_a_hint(c: Client, s: Scheduler, a: Worker):
    await da.install(c)
    STUCK.clear()
    async with da.session(c, name="default"):
        with pytest.raises(da.CallTimeoutError, match=r"within 0.3s .*agents.scheduler.call-timeout"):
            await da.stub(stalls)(1)
    STUCK.set()


@da.tool
def stalls(x: int) -> int:
    """The same without a timeout hint."""
    STUCK.wait(30)
    return x


@da.agent
class Recurser:
    """An agent that calls itself ``n`` more times (without end when n is huge)."""

    def down(self, n: int) -> int:
        return 0 if n == 0 else 1 + da.stub(Recurser).down(n - 1).value(30)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 8)], timeout=60,
             config={**CONFIG, "agents.client.max-call-depth": 4})
async def test_calls_nest_only_as_deep_as_allowed(c: Client, s: Scheduler, a: Worker):
    """Before: an agent calling itself forever parked a worker thread per level (~760 in 25 s)."""
    await da.install(c)
    async with da.session(c, name="deep"):
        assert await da.stub(Recurser).down(3) == 3  # 4 levels: allowed
        with pytest.raises(da.CallFailedError, match=r"nested 5 deep, past agents.client.max-call-depth \(4\)"):
            await da.stub(Recurser).down(10**6)
    await async_wait_for(lambda: a.state.executing_count == 0)  # every level let its thread go


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)], timeout=60,
             config={**CONFIG, "agents.scheduler.max-calls-per-session": 3})
async def test_a_session_past_its_call_limit_is_refused_clearly(c: Client, s: Scheduler, a: Worker):
    await da.install(c)
    plugin = s.plugins[NAME]
    async with da.session(c, name="runaway") as sess:
        assert [await da.stub(double)(i) for i in range(3)] == [0, 2, 4]
        with pytest.raises(da.LimitError, match=r"made 3 calls, agents.scheduler.max-calls-per-session \(3\)") as ei:
            await da.stub(double)(9)
        assert sess.id in str(ei.value) and "double" in str(ei.value)
    await async_wait_for(lambda: plugin.state.sessions[sess.id].state == "completed")
    assert len(plugin.state.sessions[sess.id].calls) == 3  # the refused call cost no record
    async with da.session(c, name="fresh"):  # other sessions are not affected
        assert await da.stub(double)(1) == 2


def test_a_prompt_past_the_size_limit_is_refused_before_it_travels():
    from dask_agents.llm import check_generate_args

    with dask.config.set({"agents.llm.max-prompt-bytes": "1 KiB"}):
        assert check_generate_args("m", "x" * 1024, 4, 0.0, None)[0] == "x" * 1024
        for prompt in ("x" * 1025, "\u00e9" * 600, list(range(257))):  # 1025 B, 1200 B (UTF-8), 1028 B
            with pytest.raises(da.PromptTooLongError, match=r"past agents.llm.max-prompt-bytes \(1.00 kiB\)"):
                check_generate_args("m", prompt, 4, 0.0, None)
    with pytest.raises(da.PromptTooLongError, match=r"50.00 MiB, past agents.llm.max-prompt-bytes \(16.00 MiB\)"):  # the default 16 MiB
        check_generate_args("m", "x" * (50 * 2**20), 4, 0.0, None)


GATE = threading.Event()


@da.tool
def gated(x: int) -> int:
    """Held open until the test lets it finish."""
    GATE.wait(30)
    return x


@gen_cluster(client=True, nthreads=[("127.0.0.1", 8)], timeout=60,
             config={**CONFIG, "agents.scheduler.max-live-calls-per-client": 3})
async def test_a_client_past_its_live_call_limit_is_refused_and_others_are_not(c: Client, s: Scheduler, a: Worker):
    await da.install(c)
    plugin = s.plugins[NAME]
    GATE.clear()
    async with da.session(c, name="greedy") as sess:
        held = [da.stub(gated)(i) for i in range(3)]
        await async_wait_for(lambda: plugin.state.open_per_client.get(c.id) == 3)
        with pytest.raises(da.LimitError, match=r"3 calls open, agents.scheduler.max-live-calls-per-client \(3\)") as ei:
            await da.stub(double)(9)
        assert c.id in str(ei.value) and sess.id in str(ei.value)
        async with Client(s.address, asynchronous=True) as other:  # another driver is not held back
            async with da.session(other, name="polite"):
                assert await da.stub(double)(1) == 2
        GATE.set()
        assert [await f for f in held] == [0, 1, 2]
        await async_wait_for(lambda: c.id not in plugin.state.open_per_client)  # counted down, entry gone
        assert await da.stub(double)(4) == 8  # room again
    assert not plugin.state.open_per_client  # every call counted down once
