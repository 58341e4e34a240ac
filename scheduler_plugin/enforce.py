"""The enforcement layer: validate each suggested action, apply it through Dask, record it.

Policies only suggest. Here every action is checked against the scheduler's *current* state
(the view may be a tick old): the call still exists and waits, workers are running and
valid for it, the call is not already moving. Invalid actions are dropped and counted, never
applied half-way.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from typing import Any, Iterable

from scheduler_plugin import dask_compat
from scheduler_plugin.actions import Action, ActionError, Kill, Migrate, Provision, Reassign, Route, SetPriority, kind
from scheduler_plugin.drain import Drainer

logger = logging.getLogger(__name__)

TOPIC = "agents-control"
REPRIORITIZE_OP = "agents-reprioritize"
MAX_PROVISION = 256
"""Most workers one ``Provision`` may ask for (a runaway policy cannot request a fleet)."""


class Enforcer:
    """Applies actions for the scheduler plugin; keeps counters and recent decisions."""

    def __init__(self, plugin: Any, history: int = 1000):
        self.plugin = plugin
        self.applied: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter()
        self.recent: deque[dict] = deque(maxlen=history)
        self.routes: dict[str, tuple[str, ...]] = {}
        self.drainer = Drainer(plugin)

    @property
    def scheduler(self) -> Any:
        """The scheduler the plugin runs in."""
        return self.plugin.scheduler

    def apply(self, actions: Iterable[Action], policy: str) -> int:
        """Validate and apply ``actions`` from ``policy``; returns how many took effect."""
        worker_priorities: dict[str, dict] = {}
        n = 0
        for action in actions:
            try:
                k = kind(action)
            except ActionError as e:  # a policy returned something else: count it, go on
                logger.warning("dask-agents: policy %s returned %s", policy, e)
                self.rejected["invalid"] += 1
                continue
            try:
                why = self._apply(action, worker_priorities)
            except Exception as e:  # a bad action never breaks the loop
                logger.exception("dask-agents: applying %r failed", action)
                why = f"error: {e}"
            if why:
                self.rejected[k] += 1
                continue
            n += 1
            self.applied[k] += 1
            record = {"action": k, "policy": policy, "time": time.time(),
                      **{f: getattr(action, f) for f in action.__slots__}}
            self.recent.append(record)
            dask_compat.add_event(self.scheduler, TOPIC, record)
        for address, prios in worker_priorities.items():
            dask_compat.send_to_worker(self.scheduler, address, {"op": REPRIORITIZE_OP, "priorities": prios})
        return n

    def _apply(self, a: Action, worker_priorities: dict) -> str | None:
        """Apply one action; return why it was rejected (None when applied)."""
        s = self.scheduler
        if isinstance(a, SetPriority):
            ts = dask_compat.task(s, a.key)
            if ts is None or a.key not in self.plugin.state.calls:
                return "unknown call"
            st = dask_compat.state(ts)
            if dask_compat.is_queued_on_scheduler(s, ts):
                dask_compat.requeue_with_priority(s, ts, a.priority)
            elif st == "processing":
                addr = dask_compat.processing_on(ts)
                if addr not in self.plugin.ready_workers:
                    return "worker cannot take directives"
                dask_compat.set_priority(ts, a.priority)
                worker_priorities.setdefault(addr, {})[a.key] = list(a.priority)
            elif st in ("waiting", "no-worker", "released"):
                dask_compat.set_priority(ts, a.priority)  # used when it becomes runnable
            else:
                return f"call is {st}"
            self.plugin.state.on_priority(a.key, a.priority)
            return None
        if isinstance(a, Migrate):
            ts = dask_compat.task(s, a.key)
            if ts is None or dask_compat.state(ts) != "processing":
                return "not queued on a worker"
            if dask_compat.processing_on(ts) != a.source:
                return "not on the source worker"
            if not dask_compat.has_worker(s, a.target) or a.target == a.source:
                return "bad target"
            if dask_compat.has_foreign_restrictions(ts):
                return "resource/host restricted"
            rec = self.plugin.state.calls.get(a.key)
            if rec is None:
                return "unknown call"
            result = dask_compat.move_task(s, ts, a.source, a.target)
            if not str(result).startswith("steal-"):
                return result
            self.plugin.on_migrated(a.key, a.source, a.target)
            return None
        if isinstance(a, Route):
            bad = [w for w in a.workers if not dask_compat.has_worker(s, w)]
            if bad:
                return f"unknown workers {bad}"
            if a.workers:
                self.routes[a.component] = tuple(a.workers)
            else:
                self.routes.pop(a.component, None)
            return None
        if isinstance(a, Reassign):
            return self.drainer.begin(a)
        if isinstance(a, Provision) and a.n > MAX_PROVISION:
            return f"n={a.n} exceeds {MAX_PROVISION} workers per action"
        if isinstance(a, (Provision, Kill)):
            return self.plugin.scale(a)
        return f"unknown action {type(a).__name__}"

    def stats(self) -> dict:
        """Counters: applied and rejected actions by kind."""
        return {"applied": dict(self.applied), "rejected": dict(self.rejected), "drains": self.drainer.stats()}
