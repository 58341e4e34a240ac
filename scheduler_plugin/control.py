"""The global control loop: a pass every ``agents.control.interval`` on the scheduler, off the
critical path (:meth:`ControlLoop.run_pass`: policies in threads), its task supervised by
:mod:`dask_agents.scheduler_plugin.watchdog` (restart of a dead or stalled loop; policy timeouts,
quarantine and backoff). ``tick`` is the same pass run inline, for tests and tools.

Each pass builds a read-only :class:`~dask_agents.scheduler_plugin.view.ClusterView` (bounded by
``agents.control.max-calls-per-tick``), runs every enabled policy, and hands their
suggestions to the enforcement layer (the pattern of Dask's Active Memory Manager), which
refuses whatever would break its invariants, whichever policy suggests it. A policy that raises
is logged and reported, and backs off while it keeps raising; the others still run and earlier
decisions stand.
Two timings are recorded per pass: ``tick_seconds``, the time the pass held the scheduler's
event loop (view, enforcement; for an inline ``tick`` also the policies), because that time
delays every other scheduler operation; and ``policy_seconds``, the policies' own run time
(in their threads for the running loop, so not on the event loop).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections import Counter, deque
from typing import Callable, Iterable

from distributed.utils import import_term

import dask_agents.config as agents_config
from dask_agents.scheduler_plugin.actions import Action
from dask_agents.scheduler_plugin.enforce import ControlHost, Enforcer
from dask_agents.scheduler_plugin.view import ClusterView
from dask_agents.scheduler_plugin.view_index import scan_view
from dask_agents.scheduler_plugin.watchdog import Watchdog, consume, run_policy

logger = logging.getLogger(__name__)
Policy = Callable[[ClusterView], Iterable[Action]]


def load_policies(spec: dict | None = None) -> dict[str, Policy]:
    """Instantiate the enabled policies of ``agents.control.policies`` (name -> policy).

    Each entry: ``{class: dotted.path.Policy, enabled: bool, options: {...}}``; option names
    may use dashes. Operators add their own the same way."""
    spec = agents_config.get("control.policies") if spec is None else spec
    out: dict[str, Policy] = {}
    for name, entry in (spec or {}).items():
        if not entry or not entry.get("enabled", True):
            continue
        try:
            cls = import_term(entry["class"])
        except Exception as e:
            path = str(entry.get("class"))
            hint = ""
            if path.split(".")[0] in ("scheduler_plugin", "worker_plugin", "kv"):  # names before 0.1's namespace
                hint = f" (dask-agents' modules are under dask_agents: 'dask_agents.{path}')"
            raise ValueError(f"agents.control.policies.{name}: cannot import {path!r}: {e}{hint}") from None
        options = {k.replace("-", "_"): v for k, v in (entry.get("options") or {}).items()}
        try:
            out[name] = cls(**options)
        except TypeError as e:
            raise ValueError(f"agents.control.policies.{name}: bad options {options}: {e}") from None
    return out


class ControlLoop:
    """Runs policies periodically for the scheduler plugin."""

    NAME = "dask-agents-control"

    def __init__(self, host: ControlHost, policies: dict[str, Policy] | None = None):
        self.host = host  # the scheduler plugin, as the loop and its enforcement see it
        self.policies = load_policies() if policies is None else policies
        self.enforcer = Enforcer(host)
        self.interval = agents_config.seconds("control.interval")
        self.max_calls = int(agents_config.get("control.max-calls-per-tick"))
        # Pass budget: a pass that ran longer than this takes fewer waiting calls next time
        # (the window), down to MIN_WINDOW; a fast one takes more again, up to max_calls. 0: off.
        self.pass_budget = agents_config.seconds("control.pass-budget")
        self._window: int | None = None  # None: not cut, the window is max_calls
        self.max_actions = int(agents_config.get("control.max-actions-per-tick"))
        self.running = False
        self.ticks = 0
        # per pass: time on the scheduler's event loop (what delays the scheduler) ...
        self.tick_seconds: deque[float] = deque(maxlen=1000)
        # ... and the policies' own run time (in their threads for the running loop)
        self.policy_seconds: deque[float] = deque(maxlen=1000)
        self.errors: dict[str, str] = {}
        self.policy_errors = 0
        self.policy_error_counts: Counter[str] = Counter()  # policy -> errors (raised or timed out)
        self._idle_since: dict[str, float] = {}
        self.incremental = True  # build views from the plugin's ViewIndex (False: full rescan)
        self.view_seconds: deque[float] = deque(maxlen=1000)  # the view-building part of each pass
        self._lock = asyncio.Lock()  # one pass at a time: the loop's, run_once's
        # runs the loop as a supervised task and watches the policies (scheduler_plugin/watchdog.py)
        self.watchdog = Watchdog(self)

    MIN_WINDOW = 256  # the window is never cut below this many calls

    # -- the window -----------------------------------------------------------------------
    @property
    def window(self) -> int:
        """Waiting calls the next pass takes: ``max_calls``, or less after passes over
        ``pass_budget`` (see :meth:`adapt_window`)."""
        return self.max_calls if self._window is None else min(self._window, self.max_calls)

    def adapt_window(self, seconds: float, calls_in_view: int) -> None:
        """Size the next pass's window from this pass's ``seconds`` (view, policies and
        enforcement: the policies' threads hold the GIL the scheduler needs too).

        A pass's cost is a fixed part (every worker, the sessions touched since the last pass)
        plus a part per call in view; at 2^18 live futures on 2,048 workers a 5,000-call window
        made 60-70 ms passes. Over budget, with the window the binding limit, it is cut by a
        fifth; under 80% of the budget it grows by an eighth. Calls left out are not lost: whole
        worker queues rotate through the window across passes, so a smaller window means a
        slower rotation (more passes to see every waiting call), not calls never seen. If the
        fixed part alone exceeds the budget the window stays at ``MIN_WINDOW``."""
        if self.pass_budget <= 0:
            self._window = None
            return
        window = self.window
        if seconds > self.pass_budget and calls_in_view >= window // 2:
            self._window = max(min(self.MIN_WINDOW, self.max_calls), int(window * 0.8))
        elif self._window is not None and seconds < 0.8 * self.pass_budget:
            grown = window + max(window // 8, 16)
            self._window = None if grown >= self.max_calls else grown

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        """Start a pass every ``agents.control.interval``, supervised by the watchdog (call on
        the scheduler's event loop)."""
        self.watchdog.start()
        self.running = True

    def stop(self) -> None:
        """Stop the loop (decisions already applied stand)."""
        self.watchdog.stop()
        self.running = False

    def close(self) -> None:
        """Stop for good: also release the policy threads and stop hearing Dask's answers to moves."""
        self.watchdog.close()
        self.enforcer.close()
        self.running = False

    def rebuild(self) -> None:
        """Forget what earlier passes derived, so the next view is rebuilt from the scheduler's
        state (the watchdog calls this when it restarts the loop). The plugin's view index is
        kept by the plugin's own hooks, not by the loop, so it stays valid."""
        self._idle_since.clear()

    # -- one pass -------------------------------------------------------------------------
    def in_pass(self) -> bool:
        """Whether a threaded pass is running now (the loop's or ``run_once``'s)."""
        return self._lock.locked()

    async def run_pass(self) -> dict:
        """One pass: view on the event loop, policies in threads (bounded wait), enforcement on
        the event loop. Passes are serialised (the loop's and ``run_once``'s). Returns the
        summary described in :meth:`_finish`."""
        if self.watchdog.closed:
            raise RuntimeError("dask-agents: the control loop was closed")
        async with self._lock:
            return await self._threaded_pass()

    async def _threaded_pass(self) -> dict:
        wd = self.watchdog
        t0 = time.perf_counter()
        view, eligible, skipped = self._prepare()
        on_loop = time.perf_counter() - t0
        if wd.closed:
            raise RuntimeError("dask-agents: the control loop was closed")
        submitted = time.monotonic()
        mine = {name: wd.launch(name, policy, view, self.max_actions) for name, policy in eligible.items()}
        # the view is built (however long that took): from now on the clock is the policies'
        wd.expect(wd.policy_timeout + wd.stall_timeout, "policies")
        try:
            if mine:
                waits = [asyncio.wrap_future(f) for f in mine.values()]
                for w in waits:
                    w.add_done_callback(consume)
                await asyncio.wait(waits, timeout=wd.policy_timeout)
        except BaseException:
            wd.abandon(mine, submitted)
            raise
        wd.collected(mine)
        wd.expect(wd.stall_timeout, "enforce")
        return self._finish(view, mine, skipped, on_loop, in_thread=True)

    def tick(self) -> dict:
        """One pass inline on the calling thread: build the view, call the policies, enforce.

        The same pass as the running loop's (sharing its error reporting, quarantine and
        timings), with the policies called here instead of in threads; a policy quarantined by
        the loop or running in one of its threads is skipped. Returns the pass's summary
        (``seconds`` is the whole pass: it all ran on this thread). For tests and tools."""
        t0 = time.perf_counter()
        view, eligible, skipped = self._prepare()
        outcomes: dict[str, concurrent.futures.Future] = {}
        for name, policy in eligible.items():
            fut: concurrent.futures.Future = concurrent.futures.Future()
            try:
                fut.set_result(run_policy(policy, view, self.max_actions))
            except Exception as e:  # reported by _finish, as for a policy thread
                fut.set_exception(e)
            outcomes[name] = fut
        # all of it ran on this thread: the caller's loop was blocked for the whole pass
        return self._finish(view, outcomes, skipped, time.perf_counter() - t0, in_thread=False)

    def _prepare(self) -> tuple[ClusterView, dict[str, Policy], list[str]]:
        """Start of a pass: drains, the view; the policies to call now (the watchdog's say)."""
        t0 = time.perf_counter()
        self.enforcer.settle()
        self.enforcer.drainer.progress()
        view = self.build_view()
        self.view_seconds.append(time.perf_counter() - t0)
        eligible, skipped = self.watchdog.eligible(self.policies)
        return view, eligible, skipped

    def _finish(self, view: ClusterView, outcomes: dict[str, concurrent.futures.Future], skipped: list[str],
                on_loop: float, in_thread: bool) -> dict:
        """End of a pass: report errors and timeouts, apply the actions, record the timings.

        The summary: ``tick``, ``seconds`` (= ``on_loop_seconds``: the time the pass held the
        event loop, which is what delays the scheduler; also recorded in ``tick_seconds``),
        ``policy_seconds`` (the policies' own run time, in their threads for the running loop;
        recorded in ``policy_seconds``), ``view_seconds``, ``applied`` (policy -> actions that
        were accepted), ``skipped`` (quarantined, still running or backing off), ``calls_in_view``,
        ``truncated``."""
        applied: dict[str, int] = {}
        in_policies = 0.0
        for name, fut in outcomes.items():
            result = self.watchdog.outcome(name, fut)
            if result is None:  # timed out or raised: reported; earlier decisions stand
                continue
            actions, seconds = result
            in_policies += seconds
            t1 = time.perf_counter()
            applied[name] = self.enforcer.apply(actions, name)
            if in_thread:  # inline, on_loop already covers the whole pass
                on_loop += time.perf_counter() - t1
        self.ticks += 1
        self.tick_seconds.append(on_loop)
        # inline, on_loop already covers the policies
        self.adapt_window(on_loop + in_policies if in_thread else on_loop, len(view.calls))
        self.policy_seconds.append(in_policies)
        return {"tick": self.ticks, "seconds": on_loop, "on_loop_seconds": on_loop, "policy_seconds": in_policies,
                "view_seconds": self.view_seconds[-1] if self.view_seconds else None, "applied": applied,
                "skipped": skipped, "calls_in_view": len(view.calls), "truncated": view.truncated}

    def build_view(self) -> ClusterView:
        """A snapshot for the policies; at most :attr:`window` waiting calls.

        Assembled from the plugin's incremental index (scheduler_plugin/view_index.py):
        O(workers + sessions changed + window) per tick, whole worker queues rotating
        across ticks. With ``incremental`` off it is rebuilt
        from scheduler state, the original O(live futures) scan."""
        now = time.time()
        draining = self.enforcer.drainer.drains
        if self.incremental:
            return self.host.view_index.build(now, self.window, draining)
        return scan_view(self.host.view_sources, now, self.window, self._idle_since, draining)

    def stats(self) -> dict:
        """Pass timings (``tick_seconds_*``: on the event loop; ``policy_seconds_*``: the
        policies' run time), action counters and the last error of each failing policy."""
        ts = sorted(self.tick_seconds)
        ps = sorted(self.policy_seconds)
        pct = (lambda xs, q: xs[min(int(q * len(xs)), len(xs) - 1)] if xs else None)
        return {
            "running": self.running, "interval": self.interval, "ticks": self.ticks,
            "window": self.window, "max_calls": self.max_calls, "pass_budget": self.pass_budget,
            "policies": list(self.policies), "tick_seconds_last": self.tick_seconds[-1] if ts else None,
            "tick_seconds_p50": pct(ts, 0.5), "tick_seconds_p99": pct(ts, 0.99),
            "tick_seconds_max": ts[-1] if ts else None,
            "policy_seconds_p50": pct(ps, 0.5), "policy_seconds_p99": pct(ps, 0.99),
            "policy_seconds_max": ps[-1] if ps else None,
            "policy_errors": self.policy_errors, "errors": dict(self.errors), **self.enforcer.stats(),
            "recent": list(self.enforcer.recent)[-20:], **self.watchdog.stats(),
        }
