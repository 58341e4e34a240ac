"""The global control loop: a pass every ``agents.control.interval`` on the scheduler, off the
critical path, run and supervised by :mod:`dask_agents.scheduler_plugin.watchdog` (policies in threads,
restart of a dead or stalled loop). ``tick`` is the same pass run inline, for tests and tools.

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

import logging
import time
from collections import Counter, deque
from typing import Any, Callable, Iterable

from distributed.utils import import_term

import dask_agents.config as agents_config
from dask_agents.scheduler_plugin.actions import Action
from dask_agents.scheduler_plugin.enforce import Enforcer
from dask_agents.scheduler_plugin.view import ClusterView
from dask_agents.scheduler_plugin.view_index import scan_view
from dask_agents.scheduler_plugin.watchdog import Watchdog

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

    def __init__(self, plugin: Any, policies: dict[str, Policy] | None = None):
        self.plugin = plugin
        self.policies = load_policies() if policies is None else policies
        self.enforcer = Enforcer(plugin)
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
        # runs the loop as a supervised task, policies off the event loop (scheduler_plugin/watchdog.py)
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
    def tick(self) -> dict:
        """One pass inline on the calling thread: build the view, call the policies, enforce.

        The same pass as the running loop's (:meth:`Watchdog.run_inline`, sharing its error
        reporting, quarantine and timings), with the policies called here instead of in
        threads; a policy quarantined by the loop or running in one of its threads is skipped.
        Returns the pass's summary (``seconds`` is the whole pass: it all ran on this thread)."""
        return self.watchdog.run_inline()

    def build_view(self) -> ClusterView:
        """A snapshot for the policies; at most :attr:`window` waiting calls.

        Assembled from the plugin's incremental index (scheduler_plugin/view_index.py):
        O(workers + sessions changed + window) per tick, whole worker queues rotating
        across ticks. With ``incremental`` off (or a plugin without an index) it is rebuilt
        from scheduler state, the original O(live futures) scan."""
        now = time.time()
        draining = self.enforcer.drainer.drains
        index = getattr(self.plugin, "view_index", None)
        if self.incremental and index is not None:
            return index.build(now, self.window, draining)
        return scan_view(self.plugin, now, self.window, self._idle_since, draining)

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
