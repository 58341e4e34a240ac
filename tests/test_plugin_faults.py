"""A fault in the scheduler plugin's own hooks never corrupts a session (issue 27).

Before: ``update_graph`` raising for 1 s let the session's stateful calls submitted meanwhile
run unpinned, on fresh instances elsewhere (4-5 of 8 sessions wrong); ``transition`` raising
for 1 s left sessions ``closing`` forever, their slots and instances held, and every later
session waiting admission's max wait. Now an unpinned stateful call is refused by its worker
(a clear error, never a fresh instance), and missed transitions are applied from Dask's own
task states by the next housekeeping (``AgentsSchedulerPlugin.reconcile``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import pytest
from distributed import Client, Scheduler, Worker
from distributed.utils_test import gen_cluster

import dask_agents as da
from dask_agents.scheduler_plugin.plugin import NAME
from tests.conftest import async_wait_for
from tests.test_sessions import FAST, call_states, stateful_instances

CONFIG = {**FAST, "agents.control.enabled": False, "agents.scheduler.instance-linger": "0s"}


@da.agent(stateful=True)
class Ledger:
    """Session state: the entries written, in order."""

    def __init__(self) -> None:
        self.entries: list[int] = []

    def write(self, x: int) -> list[int]:
        self.entries.append(x)
        return list(self.entries)


@da.tool
def double(x: int) -> int:
    return 2 * x


@contextlib.contextmanager
def failing(plugin: Any, hook: str) -> Iterator[list]:
    """``plugin.<hook>`` raises while the block runs (Dask logs it and goes on)."""
    calls: list = []

    def broken(*args: Any, **kwargs: Any) -> None:
        calls.append(kwargs.get("key", args[0] if args else None))
        raise RuntimeError(f"injected {hook} fault")

    setattr(plugin, hook, broken)
    try:
        yield calls
    finally:
        delattr(plugin, hook)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1), ("127.0.0.1", 1)], timeout=60, config=CONFIG)
async def test_a_stateful_call_the_plugin_did_not_pin_is_refused_not_run_fresh(c: Client, s: Scheduler,
                                                                                a: Worker, b: Worker):
    await da.install(c)
    plugin = s.plugins[NAME]
    ledger = da.stub(Ledger)
    async with da.session(c, name="pinless") as sess:
        assert await ledger.write(1) == [1]
        with failing(plugin, "update_graph") as seen:
            lost = [ledger.write(i) for i in (2, 3, 4)]  # two workers: unpinned, any could take them
            for fut in lost:
                with pytest.raises(da.CallFailedError, match="did not pin this stateful call") as ei:
                    await fut
                assert sess.id in str(ei.value) and "Ledger.write" in str(ei.value)
            assert seen  # the hook did fail
        assert await ledger.write(5) == [1, 5]  # the session's one instance, unchanged by the fault
    made = [w.plugins[NAME].instances for w in (a, b)]
    assert sum(slot.instance is not None for i in made for slot in i._stateful.values()) == 1  # no fresh one


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)], timeout=60, config=CONFIG)
async def test_missed_transitions_are_applied_from_dasks_task_states(c: Client, s: Scheduler, a: Worker):
    await da.install(c)
    plugin = s.plugins[NAME]
    ledger = da.stub(Ledger)
    with failing(plugin, "transition"):
        async with da.session(c, name="missed") as sess:
            assert await ledger.write(1) == [1]
            assert await da.stub(double)(4) == 8
    await async_wait_for(lambda: plugin.state.sessions[sess.id].state == "completed")
    states = {plugin.state.calls[k].component: v for k, v in call_states(s, sess.id).items()}
    # the pinned call's worker report says how it ran; the tool's could not be attributed to
    # its worker (the missed transitions never said where it ran): it is ended, as gone
    assert states["Ledger"] == "finished" and states["double"] in ("finished", "cancelled")
    reconciled = plugin.reconciled
    assert reconciled >= 1  # (a call forgotten after the fault ended is seen by the hook itself)
    await async_wait_for(lambda: stateful_instances(a) == 0)  # released with the session
    async with da.session(c, name="after") as later:  # later sessions are not held back
        assert await ledger.write(7) == [7]
    await async_wait_for(lambda: plugin.state.sessions[later.id].state == "completed")
    assert plugin.reconciled == reconciled  # nothing to reconcile without a fault
