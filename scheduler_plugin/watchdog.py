"""Fault tolerance of the global control loop: the loop as a supervised task, policies off the
event loop, incidents in telemetry and logs.

Nalar's rule: if the global controller fails, components keep serving on their last installed
policies while a replacement rebuilds its view. Here:

- **The loop** runs as an asyncio task on the scheduler's event loop (one pass every
  ``agents.control.interval``). A *watchdog* (a periodic callback every
  ``agents.control.watchdog-interval``) restarts it when the task died (an exception escaped
  a pass) or made no progress for ``agents.control.stall-timeout``. "No progress" is measured
  per phase, against a deadline the loop sets as it enters each phase: the view is built
  (synchronously) before the clock starts, the wait for the policies' threads may take
  ``policy-timeout`` + ``stall-timeout``, the sleep between passes ``interval`` +
  ``stall-timeout``, anything else ``stall-timeout``. So a long interval or a slow view build
  is never mistaken for a stall, while a pass stuck on an await is restarted within
  ``stall-timeout`` plus one watchdog period (under 1 s with the defaults, 100 ms + 750 ms).
  ``policy-timeout`` is kept below ``stall-timeout`` (clamped, with a warning), so no phase
  waits by design longer than the stall timeout. On restart the loop forgets what it derived
  (:meth:`ControlLoop.rebuild`) and asks the workers what they host, so its next view is
  rebuilt from scheduler and worker state.
- **Crash loops back off**: a loop that dies again before completing a pass is restarted after
  ``BACKOFF_BASE`` seconds, doubling each time up to ``BACKOFF_MAX``; the workers are asked
  once per such streak (not on every restart). A completed pass ends the streak. The
  ``loop-died`` incident then carries ``retry_in`` and ``stats()`` ``restart_in``.
- **Policies** run in threads, never on the event loop: a policy that sleeps or waits on I/O
  cannot block heartbeats, transitions or client traffic. Views are frozen and policies are
  pure functions of them, so running them in a thread is safe; their actions are validated
  and applied back on the event loop (the enforcer). A policy still running after
  ``agents.control.policy-timeout`` is skipped for the pass and quarantined (not called again)
  until its thread returns; its late result is dropped. A policy never runs in two threads at
  once: passes are serialised (the loop and ``run_once``), and a thread left behind by a
  cancelled pass (restart, stop) keeps its policy out of later passes until it returns. A
  CPU-bound endless loop in a policy still takes its share of the GIL: that slows the
  scheduler, it does not stop it.
- **Failing policies back off**: a policy that raises is skipped for the next pass, then 2,
  4, ... passes while it keeps raising, up to ``POLICY_BACKOFF_MAX`` passes; a run that
  returns ends the backoff (incident ``policy-recovered`` with the count). Its traceback is
  logged once per streak, then at most every ``ERROR_LOG_INTERVAL`` seconds one line with the
  count. So a broken policy costs neither a traceback per pass in the log nor the
  ``agents-control`` topic: it reports at most one ``policy-error`` event per backoff period,
  each with ``failures`` (the streak so far) and ``skip_passes`` (its next backoff).
- **Serving never depends on the loop**: placement, priorities at creation and the routes the
  enforcer installed stay as they were while the loop is down (the last decisions stand).
- **Incidents** (``policy-error``, ``policy-timeout``, ``policy-recovered`` (a hung policy's
  thread returned, or a raising policy ran again without raising), ``loop-died``,
  ``loop-stalled``, ``loop-restarted``) go to the log, to the ``agents-control`` event topic,
  and to ``da.control(client).stats()`` (``incidents``, ``restarts``, ``hung_policies``,
  ``failing_policies``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import dask_agents.config as agents_config
from dask_agents.scheduler_plugin import dask_compat

if TYPE_CHECKING:
    from dask_agents.scheduler_plugin.control import ControlLoop

logger = logging.getLogger(__name__)

TOPIC = "agents-control"
WATCHDOG = "dask-agents-control-watchdog"


def _in_daemon_thread(fn: Any, *args: Any) -> concurrent.futures.Future:
    """Run ``fn(*args)`` in a new daemon thread; its future holds the outcome. Not a pool: a
    pool's threads are joined at interpreter exit, so one policy hanging forever would keep
    the scheduler process from exiting. (A policy never has two threads at once: the
    watchdog skips one still in flight, so threads stay few.)"""
    fut: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn(*args))
        except BaseException as e:
            fut.set_exception(e)

    threading.Thread(target=run, name="dask-agents-policy", daemon=True).start()
    return fut


def run_policy(policy: Callable, view: Any, max_actions: int) -> tuple[list, float]:
    """Call one policy: its actions (at most ``max_actions``) and how long it took.

    Runs in a policy thread for the loop's passes, inline for :meth:`ControlLoop.tick`."""
    t0 = time.perf_counter()
    actions = []
    for a in policy(view):
        actions.append(a)
        if len(actions) >= max_actions:
            break
    return actions, time.perf_counter() - t0


@dataclass
class Failing:
    """The backoff of a policy that raised on its last run."""

    failures: int = 0  # runs in a row that raised
    skip: int = 0  # passes still to skip before the next run
    logged: float = 0.0  # monotonic time of its last log line
    unlogged: int = 0  # failures since that line


def consume(fut: asyncio.Future) -> None:
    # the outcome is read from the thread's own future; this only marks the wrapper's
    # exception as retrieved, so asyncio does not log it a second time
    if not fut.cancelled():
        fut.exception()


class Watchdog:
    """Runs and supervises one :class:`~dask_agents.scheduler_plugin.control.ControlLoop`: restarts a
    dead or stalled loop task, and watches the policies of each pass (threads, timeouts,
    quarantine, backoff). The pass itself is the control loop's (:meth:`ControlLoop.run_pass`)."""

    BACKOFF_BASE = 0.25  # seconds before the 2nd restart of a loop that keeps dying, doubling
    BACKOFF_MAX = 30.0
    POLICY_BACKOFF_MAX = 64  # most passes a raising policy skips (6.4 s at the default interval)
    ERROR_LOG_INTERVAL = 60.0  # seconds between the log lines of a policy that keeps raising

    def __init__(self, control: "ControlLoop", history: int = 200):
        self.control = control
        self.policy_timeout = agents_config.seconds("control.policy-timeout")
        self.check_interval = agents_config.seconds("control.watchdog-interval")
        self.stall_timeout = agents_config.seconds("control.stall-timeout")
        self._validate()
        self.task: asyncio.Task | None = None
        # the loop task must make its next progress by this monotonic time (per phase, see expect)
        self.deadline = math.inf
        self.phase = "idle"
        self.phase_since = time.monotonic()
        self.restarts = 0
        self.incidents: deque[dict] = deque(maxlen=history)
        # policy -> the thread of the pass now waiting on it (collected by that pass)
        self.inflight: dict[str, concurrent.futures.Future] = {}
        # policy -> a thread no pass will collect: past its deadline, or left by a cancelled pass;
        # the policy is not called again until it returns
        self.hung: dict[str, concurrent.futures.Future] = {}
        self._abandoned: dict[str, float] = {}  # hung by a cancelled pass -> when it was submitted
        self.failing: dict[str, Failing] = {}  # policy -> its backoff, while it keeps raising
        self._refresh: asyncio.Task | None = None
        self._crashes = 0  # loop-died restarts since the loop last completed a pass
        self._restart_at: float | None = None  # when a dead loop is restarted (backoff)
        self._last_check = time.monotonic()
        self.enabled = False
        self.closed = False

    @property
    def scheduler(self) -> Any:
        """The scheduler the loop runs in."""
        return self.control.host.roster.scheduler

    def _validate(self) -> None:
        """Check the timeouts; clamp ``policy_timeout`` below ``stall_timeout``.

        The wait on the policies is the one phase of a pass that is long by design; keeping it
        under the stall timeout keeps ``stall-timeout`` the bound on how long any phase of the
        loop goes without progress (and how long ``run_once`` may wait for a running pass)."""
        if not self.stall_timeout > 0 or not self.check_interval > 0:
            raise ValueError("agents.control.stall-timeout and agents.control.watchdog-interval must be "
                             f"positive (got {self.stall_timeout}s and {self.check_interval}s)")
        if self.policy_timeout >= self.stall_timeout:
            clamped = self.stall_timeout * 2 / 3
            logger.warning("dask-agents: agents.control.policy-timeout (%.3gs) must be below "
                           "agents.control.stall-timeout (%.3gs); using %.3gs", self.policy_timeout,
                           self.stall_timeout, clamped)
            self.policy_timeout = clamped

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the loop task and the watchdog (on the scheduler's event loop).

        A no-op for a loop task that is alive: starting again must not cancel a pass."""
        if self.closed:
            raise RuntimeError("dask-agents: the control loop was closed; it cannot be started again")
        self._validate()
        self.enabled = True
        self._last_check = time.monotonic()
        if self.task is None or self.task.done():
            self._crashes, self._restart_at = 0, None
            self._spawn()
        dask_compat.add_periodic(self.scheduler, WATCHDOG, self.check, self.check_interval)

    def stop(self) -> None:
        """Stop the loop and the watchdog; decisions already applied stand. Policy threads of a
        pass cut short run on and keep their policies out of later passes until they return."""
        self.enabled = False
        self._restart_at = None
        dask_compat.remove_periodic(self.scheduler, WATCHDOG)
        if self.task is not None:
            self.task.cancel()
            self.task = None
        self.deadline, self.phase = math.inf, "idle"

    def close(self) -> None:
        """Stop for good and release the policy threads (a hung one is abandoned, not joined)."""
        self.stop()
        self.closed = True
        if self._refresh is not None:
            self._refresh.cancel()
            self._refresh = None

    def _spawn(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()
        self.deadline, self.phase, self.phase_since = math.inf, "starting", time.monotonic()
        self.task = asyncio.get_running_loop().create_task(self._run(), name="dask-agents-control-loop")

    async def _run(self) -> None:
        while True:
            self.expect(self.stall_timeout, "pass")
            if not self.control.in_pass():  # else run_once is in a pass right now: this one would repeat it
                await self.control.run_pass()
                self._crashes = 0  # a completed pass ends a crash streak
            self.expect(self.control.interval + self.stall_timeout, "sleep")
            await asyncio.sleep(self.control.interval)

    def expect(self, budget: float, phase: str) -> None:
        """The loop enters ``phase``: it must make progress within ``budget`` seconds.

        Only the loop task moves its deadline; a ``run_once`` pass must not (it would shorten
        the deadline of a loop that is asleep)."""
        if self.task is not None and asyncio.current_task() is self.task:
            now = time.monotonic()
            self.deadline, self.phase, self.phase_since = now + budget, phase, now

    # -- supervision -------------------------------------------------------------------------------
    def check(self) -> None:
        """Restart the loop if its task died (with backoff) or stalled (a periodic callback)."""
        if not self.enabled:
            return
        now = time.monotonic()
        # A late check means the event loop itself was blocked (a long synchronous step, a
        # collection): the loop task could not make progress either, so do not count it
        # (only a missed period, not the usual jitter of a periodic callback).
        late = now - self._last_check - self.check_interval
        self._last_check = now
        if late > self.check_interval:
            self.deadline += late
        task = self.task
        if task is None or task.done():
            if self._restart_at is None:  # just found dead: report it once, schedule the restart
                exc = None if task is None or task.cancelled() else task.exception()
                why = "no loop task" if task is None else "cancelled" if exc is None else f"{type(exc).__name__}: {exc}"
                if exc is not None:
                    logger.error("dask-agents: the control loop died", exc_info=exc)
                delay = self.backoff()
                self.incident("loop-died", error=why, **({"retry_in": delay} if delay else {}))
                self._restart_at = now + delay
            if now >= self._restart_at:
                self._restart(died=True)
        elif now > self.deadline:
            self.incident("loop-stalled", error=f"no progress for {now - self.phase_since:.2f}s ({self.phase})")
            self._restart(died=False)

    def backoff(self) -> float:
        """Seconds before restarting a loop that just died: none after a loop that completed a
        pass since its last restart, then ``BACKOFF_BASE`` doubling up to ``BACKOFF_MAX``."""
        if self._crashes == 0:
            return 0.0
        return min(self.BACKOFF_BASE * 2 ** (self._crashes - 1), self.BACKOFF_MAX)

    def _restart(self, died: bool) -> None:
        t0 = time.monotonic()
        self._restart_at = None
        if died:
            self._crashes += 1
        self.restarts += 1
        self.control.rebuild()
        self._spawn()
        self.incident("loop-restarted", restarts=self.restarts, seconds=time.monotonic() - t0)
        # the hosted models as the workers see them now (a swap may have finished while the loop
        # was down); in the background, bounded, so the restart itself is immediate. Once per
        # crash streak: a loop that keeps dying must not turn into an RPC storm on the workers.
        if self._crashes <= 1 and (self._refresh is None or self._refresh.done()):
            self._refresh = asyncio.get_running_loop().create_task(self._refresh_workers())

    async def _refresh_workers(self, timeout: float = 2.0) -> None:
        host = self.control.host

        async def one(addr: str) -> None:
            try:
                info = await asyncio.wait_for(
                    dask_compat.call_worker(self.scheduler, addr, "agents_worker_info"), timeout)
            except Exception as e:  # gone or slow: the next hello or removal updates it
                logger.debug("dask-agents: worker info of %s unavailable: %s", addr, e)
                return
            if addr in host.roster.ready and addr not in self.control.enforcer.drainer.drains:
                host.set_worker_models(addr, list(info.get("models") or []))

        await asyncio.gather(*(one(a) for a in list(host.roster.ready)))

    def incident(self, kind: str, *, quiet: bool = False, **details: Any) -> None:
        """Record an incident: log (unless ``quiet``: the caller logs it), ``agents-control``
        event, ``stats()["incidents"]``."""
        record = {"action": kind, "time": time.time(), **details}
        self.incidents.append(record)
        dask_compat.add_event(self.scheduler, TOPIC, record)
        if not quiet:
            log = logger.info if kind in ("loop-restarted", "policy-recovered") else logger.warning
            log("dask-agents control loop: %s %s", kind, details)

    # -- watching the policies of a pass (the pass itself is ControlLoop's) ----------------------
    def launch(self, name: str, policy: Callable, view: Any, max_actions: int) -> concurrent.futures.Future:
        """Run ``policy`` on ``view`` in a thread of its own; the pass collects its future."""
        fut = self.inflight[name] = _in_daemon_thread(run_policy, policy, view, max_actions)
        return fut

    def abandon(self, mine: dict[str, concurrent.futures.Future], submitted: float) -> None:
        """The pass that launched ``mine`` was cancelled (a restart, stop()): the threads run on.
        Park the unfinished ones as hung, so no later pass calls the same policy while this
        thread still runs it."""
        for name, fut in mine.items():
            if self.inflight.get(name) is fut:
                del self.inflight[name]
            if not fut.done():
                self.hung[name] = fut
                self._abandoned[name] = submitted

    def collected(self, mine: dict[str, concurrent.futures.Future]) -> None:
        """The pass stopped waiting for ``mine`` (done or past ``policy_timeout``)."""
        for name, fut in mine.items():
            if self.inflight.get(name) is fut:
                del self.inflight[name]

    def eligible(self, policies: dict[str, Callable]) -> tuple[dict[str, Callable], list[str]]:
        """The policies a pass may call now, and the names of those it skips (quarantined,
        still running in another pass's thread, or backing off); hung threads that came back
        are released here."""
        now = time.monotonic()
        for name, fut in list(self.hung.items()):
            submitted = self._abandoned.get(name)
            if fut.done():  # its thread came back: call it again from this pass (its result is stale)
                del self.hung[name]
                if self._abandoned.pop(name, None) is None:
                    self.incident("policy-recovered", policy=name)
            elif submitted is not None and now - submitted > self.policy_timeout:
                # left by a cancelled pass and now past its deadline too: a real timeout
                del self._abandoned[name]
                self._timed_out(name)
        backing_off = set()
        for name, f in self.failing.items():
            if f.skip > 0:  # this pass is one of those it skips
                f.skip -= 1
                backing_off.add(name)
        eligible = {name: p for name, p in policies.items()
                    if name not in self.hung and name not in self.inflight and name not in backing_off}
        return eligible, sorted(set(policies) - set(eligible))

    def outcome(self, name: str, fut: concurrent.futures.Future) -> tuple[list, float] | None:
        """What policy ``name`` returned in this pass ((actions, seconds)), or None: it timed
        out (quarantined until its thread returns) or raised (reported, backing off)."""
        if not fut.done():
            self.hung[name] = fut
            self._timed_out(name)
            return None
        exc = fut.exception()
        if exc is not None:  # keep serving: log, report, back off, let earlier decisions stand
            self._policy_failed(name, exc)
            return None
        failing = self.failing.pop(name, None)
        if failing is not None:
            self.incident("policy-recovered", policy=name, failures=failing.failures)
        return fut.result()

    def _timed_out(self, name: str) -> None:
        ctl = self.control
        ctl.policy_errors += 1
        ctl.policy_error_counts[name] += 1
        ctl.errors[name] = f"timed out after {self.policy_timeout}s (quarantined until it returns)"
        self.incident("policy-timeout", policy=name, error=ctl.errors[name])

    def _policy_failed(self, name: str, exc: BaseException) -> None:
        """``name`` raised: count and report it, and skip it for the next 1, 2, 4... passes
        (up to ``POLICY_BACKOFF_MAX``) while it keeps raising. The traceback is logged for the
        first failure of a streak, then one line with the count every ``ERROR_LOG_INTERVAL``."""
        ctl = self.control
        ctl.policy_errors += 1
        ctl.policy_error_counts[name] += 1
        ctl.errors[name] = f"{type(exc).__name__}: {exc}"
        f = self.failing.setdefault(name, Failing())
        f.failures += 1
        f.skip = min(2 ** min(f.failures - 1, 30), self.POLICY_BACKOFF_MAX)
        now = time.monotonic()
        if f.failures == 1:
            logger.error("dask-agents: policy %s raised (skipped for the next pass, then twice as many "
                         "while it keeps raising, up to %d)", name, self.POLICY_BACKOFF_MAX, exc_info=exc)
            f.logged, f.unlogged = now, 0
        else:
            f.unlogged += 1
            if now - f.logged >= self.ERROR_LOG_INTERVAL:
                logger.error("dask-agents: policy %s still raising: %d times in a row (%d since the last "
                             "report), last %s; skipped for the next %d passes", name, f.failures, f.unlogged,
                             ctl.errors[name], f.skip)
                f.logged, f.unlogged = now, 0
        # one event per run, so at most one per backoff period: a broken policy cannot push the
        # real decisions out of the topic
        self.incident("policy-error", quiet=True, policy=name, error=ctl.errors[name], failures=f.failures,
                      skip_passes=f.skip)

    def stats(self) -> dict:
        """What ``da.control(client).stats()`` shows of the loop's health."""
        alive = self.task is not None and not self.task.done()
        restart_in = None if self._restart_at is None else max(0.0, self._restart_at - time.monotonic())
        failing = {n: {"failures": f.failures, "skip_passes": f.skip} for n, f in self.failing.items()}
        return {"loop_alive": alive, "restarts": self.restarts, "hung_policies": sorted(self.hung),
                "failing_policies": failing, "restart_in": restart_in, "incidents": list(self.incidents)[-20:]}
