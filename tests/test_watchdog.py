"""The control loop's watchdog (scheduler_plugin/watchdog.py) on a fake scheduler: no cluster.

A real :class:`ControlLoop` with a stand-in plugin and view, so the timings under test are the
watchdog's own (stall deadlines, quarantine, backoff, one thread per policy). Margins are
generous: each assertion separates the fixed behaviour from the broken one by a wide gap
(a livelock restarts every cycle, a crash loop every 100 ms), never by a few milliseconds.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from types import SimpleNamespace
from typing import Any, Callable

import dask
import pytest

from dask_agents.scheduler_plugin.control import ControlLoop
from dask_agents.scheduler_plugin.placement import Placement
from dask_agents.scheduler_plugin.recovery import Recovery
from dask_agents.scheduler_plugin.roster import Roster
from dask_agents.scheduler_plugin.state import WorkflowState


class FakeScheduler:
    """What the watchdog touches on a scheduler: periodic callbacks, events, worker RPCs."""

    def __init__(self) -> None:
        self.periodic_callbacks: dict = {}
        self.events: list[tuple[str, dict]] = []
        self.rpc_calls: list[str] = []
        self.info_delay = 0.0

    def log_event(self, topic: str, msg: dict) -> None:
        self.events.append((topic, msg))

    def rpc(self, address: str) -> Any:
        self.rpc_calls.append(address)
        return SimpleNamespace(agents_worker_info=self._info)

    async def _info(self) -> dict:
        await asyncio.sleep(self.info_delay)
        return {"models": []}


def empty_view() -> Any:
    return SimpleNamespace(calls={}, truncated=False)


def make_loop(policies: dict[str, Callable], build: Callable[[], Any] = empty_view, **control: Any) -> ControlLoop:
    """A control loop over a fake plugin; ``control`` sets ``agents.control.*`` (dashes as _)."""
    roster = Roster()
    roster.scheduler, roster.ready["tcp://w:1"] = FakeScheduler(), {}
    state = WorkflowState()
    recovery = Recovery(roster, state)
    placement = recovery.placement = Placement(roster, state, recovery, lambda component: None)
    plugin = SimpleNamespace(roster=roster, state=state, placement=placement, admission=None, view_index=None,
                             view_sources=None, set_worker_models=lambda address, models: None,
                             push_routes=lambda workers=None: None)
    config = {f"agents.control.{k.replace('_', '-')}": v for k, v in control.items()}
    with dask.config.set(config):
        ctl = ControlLoop(plugin, policies)
    ctl.build_view = build
    return ctl


def run(coro: Any, timeout: float = 60) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


def kinds(ctl: ControlLoop, kind: str) -> list[dict]:
    return [i for i in ctl.watchdog.incidents if i["action"] == kind]


async def until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {timeout}s")
        await asyncio.sleep(0.01)


class Counting:
    """A policy that counts its calls and the most threads ever inside it at once."""

    def __init__(self, seconds: float = 0.0, gate: threading.Event | None = None):
        self.seconds = seconds
        self.gate = gate
        self.calls = 0
        self.active = 0
        self.max_active = 0
        self._lock = threading.Lock()

    def __call__(self, view: Any) -> list:
        with self._lock:
            self.calls += 1
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        try:
            if self.gate is not None:
                self.gate.wait(30)
            time.sleep(self.seconds)
            return []
        finally:
            with self._lock:
                self.active -= 1


def test_an_interval_longer_than_the_stall_timeout_is_not_a_stall():
    fine = Counting()
    ctl = make_loop({"fine": fine}, interval="1s", stall_timeout="750ms", watchdog_interval="50ms")

    async def main():
        ctl.start()
        # three passes: two sleeps of 1 s in between, each outlasting the stall timeout
        await until(lambda: ctl.ticks >= 3 and fine.calls >= 3, timeout=20)
        ctl.close()

    run(main())
    assert ctl.watchdog.restarts == 0 and not kinds(ctl, "loop-stalled")


def test_a_slow_view_and_a_hung_policy_quarantine_it_and_passes_go_on():
    gate = threading.Event()
    hang, fine = Counting(gate=gate), Counting()

    def slow_view() -> Any:
        time.sleep(0.3)  # blocks the event loop, as a large synchronous build would
        return empty_view()

    ctl = make_loop({"hang": hang, "fine": fine}, slow_view, interval="100ms")

    async def main():
        ctl.start()
        try:
            await until(lambda: kinds(ctl, "policy-timeout"), timeout=20)
            ticks = ctl.ticks
            await until(lambda: ctl.ticks >= ticks + 3, timeout=20)  # three slow passes after it
            # quarantined after one timeout, not resubmitted by restarts: the other policy goes on
            assert ctl.watchdog.restarts == 0 and not kinds(ctl, "loop-stalled")
            assert hang.calls == 1 and list(ctl.watchdog.hung) == ["hang"]
            assert len(kinds(ctl, "policy-timeout")) == 1
            assert ctl.ticks >= 3 and fine.calls >= 3
            gate.set()  # its thread returns: it is called again
            await until(lambda: hang.calls >= 2)
            assert kinds(ctl, "policy-recovered") and not ctl.watchdog.hung
        finally:
            gate.set()
            ctl.close()

    run(main())


def test_a_crash_loop_backs_off_and_asks_the_workers_once():
    crashes = {"n": 0, "on": True}

    def view() -> Any:
        if crashes["on"]:
            crashes["n"] += 1
            raise RuntimeError("view bug")
        return empty_view()

    ctl = make_loop({"fine": Counting()}, view, interval="50ms", watchdog_interval="50ms")
    wd = ctl.watchdog
    scheduler = ctl.host.roster.scheduler

    async def main():
        ctl.start()
        try:
            await until(lambda: len(kinds(ctl, "loop-died")) >= 4, timeout=20)
            # each restart of the streak waits twice as long as the one before (0, 0.25, 0.5, 1 s, ...),
            # and every crash is one restart, not one per watchdog check
            delays = [i.get("retry_in", 0.0) for i in kinds(ctl, "loop-died")]
            assert delays[:4] == [0.0, 0.25, 0.5, 1.0], delays
            assert wd.restarts <= crashes["n"] <= wd.restarts + 1
            assert scheduler.rpc_calls == ["tcp://w:1"]  # one refresh for the whole streak
            crashes["on"] = False  # fixed: the next restart (within its backoff) completes passes
            ticks = ctl.ticks
            await until(lambda: ctl.ticks > ticks + 1)
            assert wd.stats()["loop_alive"] and wd.stats()["restart_in"] is None
            # a completed pass ended the streak: the next crash is restarted at once, workers asked again
            restarts = wd.restarts
            crashes["on"] = True
            await until(lambda: wd.restarts > restarts, timeout=2)
            assert kinds(ctl, "loop-died")[-1].get("retry_in") is None
            await until(lambda: len(scheduler.rpc_calls) >= 2)  # the refresh runs in the background
            crashes["on"] = False
            ticks = ctl.ticks
            await until(lambda: ctl.ticks >= ticks + 3)  # passes go on: no further refresh
            assert len(scheduler.rpc_calls) == 2
        finally:
            ctl.close()

    run(main())


def test_close_cancels_a_worker_refresh_and_run_once_after_close_fails():
    ctl = make_loop({"fine": Counting()}, interval="50ms")
    wd = ctl.watchdog
    ctl.host.roster.scheduler.info_delay = 30.0  # a worker that does not answer

    async def main():
        ctl.start()
        await until(lambda: ctl.ticks >= 1)
        wd.task.cancel()  # the loop dies: restarted, the workers are asked
        await until(lambda: wd.restarts >= 1)
        refresh = wd._refresh
        assert refresh is not None and not refresh.done()
        ctl.close()
        await until(refresh.done)
        assert refresh.cancelled()
        policy_threads = sum(t.name == "dask-agents-policy" for t in threading.enumerate())
        with pytest.raises(RuntimeError, match="closed"):
            await ctl.run_pass()
        # no new threads for a closed loop
        assert sum(t.name == "dask-agents-policy" for t in threading.enumerate()) <= policy_threads
        with pytest.raises(RuntimeError, match="closed"):
            ctl.start()

    run(main())


def test_a_policy_never_runs_twice_at_once_across_restarts_stop_start_and_run_once():
    slow, fast = Counting(seconds=0.2), Counting()  # well under the policy timeout
    ctl = make_loop({"slow": slow, "fast": fast}, interval="20ms", policy_timeout="1s", stall_timeout="1500ms")
    wd = ctl.watchdog

    async def in_pass() -> None:  # a new call of slow, now running: a pass is waiting on it
        calls = slow.calls
        await until(lambda: slow.calls > calls and slow.active == 1)

    async def main():
        ctl.start()
        try:
            for _ in range(3):
                await in_pass()
                once = asyncio.create_task(ctl.run_pass())  # run_once during the loop's pass
                task = wd.task
                ctl.start()  # on a running loop: a no-op, the pass is not cancelled
                await asyncio.sleep(0.02)
                assert wd.task is task and not task.done()
                ctl.stop()  # cut the pass short, start again at once: its thread still runs
                ctl.start()
                await asyncio.sleep(0.05)  # passes meanwhile must skip slow
                wd._restart(died=False)  # as on a stall
                out = await once
                assert set(out["applied"]) | set(out["skipped"]) == {"slow", "fast"}
            ticks = ctl.ticks
            await until(lambda: ctl.ticks >= ticks + 3)
        finally:
            ctl.close()

    run(main())
    assert slow.max_active == 1 and fast.max_active == 1
    assert slow.calls >= 3
    # the cut-short threads returned in time: not reported as timeouts, and no thread starved
    # a healthy policy in the pool
    assert not kinds(ctl, "policy-timeout") and "fast" not in ctl.errors


def test_tick_seconds_is_event_loop_time_and_policy_time_is_separate():
    ctl = make_loop({"busy": Counting(seconds=0.3)}, interval="1s", policy_timeout="2s", stall_timeout="3s")

    async def main():
        out = await ctl.run_pass()
        ctl.close()
        return out

    out = run(main())
    # the policy slept 300 ms in its thread; the event loop was held only for view + enforcement
    assert out["policy_seconds"] >= 0.25 and out["seconds"] < 0.15
    assert list(ctl.tick_seconds) == [out["seconds"]] and list(ctl.policy_seconds) == [out["policy_seconds"]]
    inline = ctl.tick()  # inline, the policy holds the calling thread: it is in tick_seconds
    assert inline["seconds"] >= 0.25 and inline["policy_seconds"] >= 0.25
    stats = ctl.stats()
    assert stats["policy_seconds_max"] >= 0.25 and stats["tick_seconds_max"] >= 0.25


def test_tick_shares_the_pass_reporting_and_skips_quarantined_policies():
    def broken(view: Any) -> list:
        raise RuntimeError("policy bug")

    gate = threading.Event()
    hang, fine = Counting(gate=gate), Counting()
    ctl = make_loop({"broken": broken, "hang": hang, "fine": fine})
    ctl.policies.pop("hang")
    first = ctl.tick()
    assert first["applied"] == {"fine": 0} and "policy bug" in ctl.errors["broken"]
    assert kinds(ctl, "policy-error")[0]["policy"] == "broken"
    assert ("agents-control", kinds(ctl, "policy-error")[0]) in ctl.host.roster.scheduler.events

    ctl.policies["hang"] = hang

    async def main():
        out = await ctl.run_pass()  # times out: quarantined
        assert "hang" not in out["applied"] and list(ctl.watchdog.hung) == ["hang"]
        inline = ctl.tick()
        assert inline["skipped"] == ["hang"] and hang.calls == 1  # the inline pass skips it too
        gate.set()
        await until(lambda: ctl.watchdog.hung["hang"].done())
        again = ctl.tick()
        assert "hang" in again["applied"] and hang.calls == 2 and kinds(ctl, "policy-recovered")
        ctl.close()

    try:
        run(main())
    finally:
        gate.set()


def test_a_policy_timeout_not_below_the_stall_timeout_is_clamped(caplog):
    with caplog.at_level(logging.WARNING, logger="dask_agents.scheduler_plugin.watchdog"):
        ctl = make_loop({}, policy_timeout="2s", stall_timeout="750ms")
    assert ctl.watchdog.policy_timeout < ctl.watchdog.stall_timeout
    assert "policy-timeout" in caplog.text and "stall-timeout" in caplog.text


def test_a_hung_policy_never_keeps_the_scheduler_process_alive():
    """Policies run in daemon threads: one that never returns cannot block interpreter exit
    (a thread pool's workers are joined at exit)."""
    from dask_agents.scheduler_plugin.watchdog import _in_daemon_thread

    gate = threading.Event()
    fut = _in_daemon_thread(gate.wait)
    runner = [t for t in threading.enumerate() if t.name == "dask-agents-policy" and t.is_alive()]
    assert runner and all(t.daemon for t in runner)
    gate.set()
    assert fut.result(5) is True
    assert _in_daemon_thread(lambda: 1 / 0).exception(5).__class__ is ZeroDivisionError
