"""The global control loop: a pass every ``agents.control.interval`` on the scheduler, off the
critical path, run and supervised by :mod:`scheduler_plugin.watchdog` (policies in threads,
restart of a dead or stalled loop). ``tick`` is the same pass run inline, for tests and tools.

Each tick builds a read-only :class:`~scheduler_plugin.view.ClusterView` (bounded by
``agents.control.max-calls-per-tick``), runs every enabled policy, and hands their
suggestions to the enforcement layer (the pattern of Dask's Active Memory Manager). A policy
that raises is logged and reported; the others still run and earlier decisions stand.
Tick time is measured and exposed, because a slow tick blocks the whole scheduler.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any, Callable, Iterable

from distributed.utils import import_term

import dask_agents.config as agents_config
from scheduler_plugin import dask_compat
from scheduler_plugin.actions import Action
from scheduler_plugin.enforce import Enforcer
from scheduler_plugin.view import ClusterView
from scheduler_plugin.view_index import scan_view
from scheduler_plugin.watchdog import Watchdog

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
            raise ValueError(f"agents.control.policies.{name}: cannot import {entry.get('class')!r}: {e}") from None
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
        self.max_actions = int(agents_config.get("control.max-actions-per-tick"))
        self.running = False
        self.ticks = 0
        self.tick_seconds: deque[float] = deque(maxlen=1000)
        self.errors: dict[str, str] = {}
        self.policy_errors = 0
        self._idle_since: dict[str, float] = {}
        self.incremental = True  # build views from the plugin's ViewIndex (False: full rescan)
        self.view_seconds: deque[float] = deque(maxlen=1000)  # the view-building part of each pass
        # runs the loop as a supervised task, policies off the event loop (scheduler_plugin/watchdog.py)
        self.watchdog = Watchdog(self)

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
        """Stop for good: also release the policy threads."""
        self.watchdog.close()
        self.running = False

    def rebuild(self) -> None:
        """Forget what earlier passes derived, so the next view is rebuilt from the scheduler's
        state (the watchdog calls this when it restarts the loop). The plugin's view index is
        kept by the plugin's own hooks, not by the loop, so it stays valid."""
        self._idle_since.clear()

    # -- one pass -------------------------------------------------------------------------
    def tick(self) -> dict:
        """Build the view, run the policies, enforce; returns a summary of this pass."""
        t0 = time.perf_counter()
        self.enforcer.drainer.progress()
        view = self.build_view()
        self.view_seconds.append(time.perf_counter() - t0)
        applied: dict[str, int] = {}
        for name, policy in self.policies.items():
            try:
                actions = []
                for a in policy(view):
                    actions.append(a)
                    if len(actions) >= self.max_actions:
                        break
            except Exception as e:  # keep serving: log, report, let earlier decisions stand
                self.policy_errors += 1
                self.errors[name] = f"{type(e).__name__}: {e}"
                logger.exception("dask-agents: policy %s raised", name)
                dask_compat.add_event(self.plugin.scheduler, "agents-control",
                                      {"action": "policy-error", "policy": name, "error": self.errors[name]})
                continue
            applied[name] = self.enforcer.apply(actions, name)
        dt = time.perf_counter() - t0
        self.ticks += 1
        self.tick_seconds.append(dt)
        return {"tick": self.ticks, "seconds": dt, "view_seconds": self.view_seconds[-1], "applied": applied,
                "calls_in_view": len(view.calls),
                "truncated": view.truncated}

    def build_view(self) -> ClusterView:
        """A snapshot for the policies; at most ``max_calls`` waiting calls.

        Assembled from the plugin's incremental index (scheduler_plugin/view_index.py):
        O(workers + sessions changed + ``max_calls``) per tick, whole worker queues rotating
        across ticks. With ``incremental`` off (or a plugin without an index) it is rebuilt
        from scheduler state, the original O(live futures) scan."""
        now = time.time()
        draining = self.enforcer.drainer.drains
        index = getattr(self.plugin, "view_index", None)
        if self.incremental and index is not None:
            return index.build(now, self.max_calls, draining)
        return scan_view(self.plugin, now, self.max_calls, self._idle_since, draining)

    def stats(self) -> dict:
        """Tick timing, action counters and the last error of each failing policy."""
        ts = sorted(self.tick_seconds)
        pct = (lambda q: ts[min(int(q * len(ts)), len(ts) - 1)] if ts else None)
        return {
            "running": self.running, "interval": self.interval, "ticks": self.ticks,
            "policies": list(self.policies), "tick_seconds_last": self.tick_seconds[-1] if ts else None,
            "tick_seconds_p50": pct(0.5), "tick_seconds_p99": pct(0.99), "tick_seconds_max": ts[-1] if ts else None,
            "policy_errors": self.policy_errors, "errors": dict(self.errors), **self.enforcer.stats(),
            "recent": list(self.enforcer.recent)[-20:], **self.watchdog.stats(),
        }
