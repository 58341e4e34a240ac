"""Fault tolerance of the global control loop: the loop as a supervised task, policies off the
event loop, incidents in telemetry and logs.

Nalar's rule: if the global controller fails, components keep serving on their last installed
policies while a replacement rebuilds its view. Here:

- **The loop** runs as an asyncio task on the scheduler's event loop (one pass every
  ``agents.control.interval``). A *watchdog* (a periodic callback every
  ``agents.control.watchdog-interval``) restarts it when the task died (an exception escaped
  a pass) or made no progress for ``agents.control.stall-timeout``. On restart the loop forgets
  what it derived (:meth:`ControlLoop.rebuild`) and asks the workers what they host, so its
  next view is rebuilt from scheduler and worker state. Detection plus restart stays under 1 s
  with the defaults (100 ms + 750 ms).
- **Policies** run in threads, never on the event loop: a policy that sleeps or waits on I/O
  cannot block heartbeats, transitions or client traffic. Views are frozen and policies are
  pure functions of them, so running them in a thread is safe; their actions are validated
  and applied back on the event loop (the enforcer). A policy still running after
  ``agents.control.policy-timeout`` is skipped for the pass and quarantined (not called again)
  until its thread returns; its late result is dropped. A CPU-bound endless loop in a policy
  still takes its share of the GIL: that slows the scheduler, it does not stop it.
- **Serving never depends on the loop**: placement, priorities at creation and the routes the
  enforcer installed stay as they were while the loop is down (the last decisions stand).
- **Incidents** (``policy-error``, ``policy-timeout``, ``policy-recovered``, ``loop-died``,
  ``loop-stalled``, ``loop-restarted``) go to the log, to the ``agents-control`` event topic,
  and to ``da.control(client).stats()`` (``incidents``, ``restarts``, ``hung_policies``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import dask_agents.config as agents_config
from scheduler_plugin import dask_compat

if TYPE_CHECKING:
    from scheduler_plugin.control import ControlLoop

logger = logging.getLogger(__name__)

TOPIC = "agents-control"
WATCHDOG = "dask-agents-control-watchdog"


def _run_policy(policy: Any, view: Any, max_actions: int) -> tuple[list, float]:
    """In a policy thread: the policy's actions (bounded) and how long it took."""
    t0 = time.perf_counter()
    actions = []
    for a in policy(view):
        actions.append(a)
        if len(actions) >= max_actions:
            break
    return actions, time.perf_counter() - t0


def _consume(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


class Watchdog:
    """Runs and supervises one :class:`~scheduler_plugin.control.ControlLoop`."""

    def __init__(self, control: "ControlLoop", history: int = 200):
        self.control = control
        self.policy_timeout = agents_config.seconds("control.policy-timeout")
        self.check_interval = agents_config.seconds("control.watchdog-interval")
        self.stall_timeout = agents_config.seconds("control.stall-timeout")
        self.task: asyncio.Task | None = None
        self.beat = time.monotonic()  # last progress of the loop task
        self.restarts = 0
        self.incidents: deque[dict] = deque(maxlen=history)
        self.hung: dict[str, concurrent.futures.Future] = {}  # policy -> its thread, past the deadline
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.enabled = False

    @property
    def scheduler(self) -> Any:
        """The scheduler the loop runs in."""
        return self.control.plugin.scheduler

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the loop task and the watchdog (on the scheduler's event loop)."""
        self.enabled = True
        self._spawn()
        dask_compat.add_periodic(self.scheduler, WATCHDOG, self.check, self.check_interval)

    def stop(self) -> None:
        """Stop the loop and the watchdog; decisions already applied stand."""
        self.enabled = False
        dask_compat.remove_periodic(self.scheduler, WATCHDOG)
        if self.task is not None:
            self.task.cancel()
            self.task = None

    def close(self) -> None:
        """Stop and release the policy threads (a hung one is abandoned, not joined)."""
        self.stop()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def _spawn(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()
        self.beat = time.monotonic()
        self.task = asyncio.get_running_loop().create_task(self._run(), name="dask-agents-control-loop")

    async def _run(self) -> None:
        while True:
            self.beat = time.monotonic()
            await self.run_pass()
            self.beat = time.monotonic()
            await asyncio.sleep(self.control.interval)

    # -- supervision -------------------------------------------------------------------------------
    def check(self) -> None:
        """Restart the loop if its task died or stalled (a periodic callback)."""
        if not self.enabled:
            return
        task = self.task
        if task is None:
            self._restart("loop-died", "no loop task")
            return
        if task.done():
            exc = None if task.cancelled() else task.exception()
            why = "cancelled" if exc is None else f"{type(exc).__name__}: {exc}"
            if exc is not None:
                logger.error("dask-agents: the control loop died", exc_info=exc)
            self._restart("loop-died", why)
        elif time.monotonic() - self.beat > self.stall_timeout:
            self._restart("loop-stalled", f"no progress for {time.monotonic() - self.beat:.2f}s")

    def _restart(self, kind: str, why: str) -> None:
        t0 = time.monotonic()
        self.incident(kind, error=why)
        self.restarts += 1
        self.control.rebuild()
        self._spawn()
        self.incident("loop-restarted", restarts=self.restarts, seconds=time.monotonic() - t0)
        # the hosted models as the workers see them now (a swap may have finished while the loop
        # was down); in the background, bounded, so the restart itself is immediate
        asyncio.get_running_loop().create_task(self._refresh_workers())

    async def _refresh_workers(self, timeout: float = 2.0) -> None:
        plugin = self.control.plugin

        async def one(addr: str) -> None:
            try:
                info = await asyncio.wait_for(self.scheduler.rpc(addr).agents_worker_info(), timeout)
            except Exception as e:  # gone or slow: the next hello or removal updates it
                logger.debug("dask-agents: worker info of %s unavailable: %s", addr, e)
                return
            if addr in plugin.ready_workers and addr not in self.control.enforcer.drainer.drains:
                plugin.set_worker_models(addr, list(info.get("models") or []))

        await asyncio.gather(*(one(a) for a in list(plugin.ready_workers)))

    def incident(self, kind: str, **details: Any) -> None:
        """Record an incident: log, ``agents-control`` event, ``stats()["incidents"]``."""
        record = {"action": kind, "time": time.time(), **details}
        self.incidents.append(record)
        dask_compat.add_event(self.scheduler, TOPIC, record)
        log = logger.info if kind in ("loop-restarted", "policy-recovered") else logger.warning
        log("dask-agents control loop: %s %s", kind, details)

    # -- one pass ---------------------------------------------------------------------------------
    async def run_pass(self) -> dict:
        """One pass: view on the event loop, policies in threads (bounded wait), enforcement on
        the event loop. Returns the same summary as :meth:`ControlLoop.tick`."""
        ctl = self.control
        t0 = time.perf_counter()
        ctl.enforcer.drainer.progress()
        view = ctl.build_view()
        on_loop = time.perf_counter() - t0
        view_seconds = getattr(ctl, "view_seconds", None)
        if view_seconds is not None:
            view_seconds.append(on_loop)
        for name, fut in list(self.hung.items()):
            if fut.done():  # its thread came back: call it again from the next pass
                del self.hung[name]
                self.incident("policy-recovered", policy=name)
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=len(ctl.policies) + 2, thread_name_prefix="dask-agents-policy")
        running = {name: self._pool.submit(_run_policy, policy, view, ctl.max_actions)
                   for name, policy in ctl.policies.items() if name not in self.hung}
        if running:
            waits = [asyncio.wrap_future(f) for f in running.values()]
            for w in waits:  # the outcome is read from the thread's future below, not from these
                w.add_done_callback(_consume)
            await asyncio.wait(waits, timeout=self.policy_timeout)
        self.beat = time.monotonic()
        applied: dict[str, int] = {}
        in_policies = 0.0
        for name, fut in running.items():
            if not fut.done():
                self.hung[name] = fut
                ctl.policy_errors += 1
                ctl.errors[name] = f"timed out after {self.policy_timeout}s (quarantined until it returns)"
                self.incident("policy-timeout", policy=name, error=ctl.errors[name])
                continue
            exc = fut.exception()
            if exc is not None:  # keep serving: log, report, let earlier decisions stand
                ctl.policy_errors += 1
                ctl.errors[name] = f"{type(exc).__name__}: {exc}"
                logger.error("dask-agents: policy %s raised", name, exc_info=exc)
                self.incident("policy-error", policy=name, error=ctl.errors[name])
                continue
            actions, seconds = fut.result()
            in_policies += seconds
            t1 = time.perf_counter()
            applied[name] = ctl.enforcer.apply(actions, name)
            on_loop += time.perf_counter() - t1
        dt = on_loop + in_policies  # the pass's work, not the time spent waiting between threads
        ctl.ticks += 1
        ctl.tick_seconds.append(dt)
        return {"tick": ctl.ticks, "seconds": dt, "applied": applied, "calls_in_view": len(view.calls),
                "truncated": view.truncated, "view_seconds": view_seconds[-1] if view_seconds else None,
                "on_loop_seconds": on_loop}

    def stats(self) -> dict:
        """What ``da.control(client).stats()`` shows of the loop's health."""
        alive = self.task is not None and not self.task.done()
        return {"loop_alive": alive, "restarts": self.restarts, "hung_policies": sorted(self.hung),
                "incidents": list(self.incidents)[-20:]}
