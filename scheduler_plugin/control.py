"""The global control loop: one periodic callback on the scheduler, off the critical path.

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
from scheduler_plugin.view import CallView, ClusterView, ComponentView, ModelView, SessionView, WorkerView

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

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        """Start ticking every ``agents.control.interval``."""
        dask_compat.add_periodic(self.plugin.scheduler, self.NAME, self.tick, self.interval)
        self.running = True

    def stop(self) -> None:
        """Stop ticking (decisions already applied stand)."""
        dask_compat.remove_periodic(self.plugin.scheduler, self.NAME)
        self.running = False

    # -- one pass -------------------------------------------------------------------------
    def tick(self) -> dict:
        """Build the view, run the policies, enforce; returns a summary of this pass."""
        t0 = time.perf_counter()
        self.enforcer.drainer.progress()
        view = self.build_view()
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
        return {"tick": self.ticks, "seconds": dt, "applied": applied, "calls_in_view": len(view.calls),
                "truncated": view.truncated}

    def build_view(self) -> ClusterView:
        """A snapshot for the policies; at most ``max_calls`` waiting calls."""
        s = self.plugin.scheduler
        state = self.plugin.state
        now = time.time()
        budget = self.max_calls
        calls: dict[str, CallView] = {}
        workers: dict[str, WorkerView] = {}
        truncated = False

        def call_view(ts: Any, worker: str | None) -> CallView | None:
            rec = state.calls.get(ts.key)
            if rec is None:
                return None
            return CallView(
                key=rec.key, component=rec.component, kind=rec.kind, session=rec.session,
                tenant=state.sessions[rec.session].tenant if rec.session in state.sessions else None,
                worker=worker, priority=dask_compat.priority(ts), created=rec.created, ready=rec.ready,
                stateful=rec.stateful, model=rec.model,
                # restrictions we did not set ourselves (LLM calls are pinned by us to a model host)
                restricted=dask_compat.has_foreign_restrictions(ts)
                or (rec.kind != "llm" and not rec.stateful and dask_compat.has_strict_worker_restriction(ts)),
                input_bytes=dask_compat.input_bytes(ts), batch_max=rec.batch_max,
            )

        for ws in dask_compat.workers(s):
            address, nthreads, processing, running = dask_compat.worker_summary(ws)
            queued = []
            if processing > running and budget > 0:
                for ts in dask_compat.waiting_on_worker(ws):
                    cv = call_view(ts, address)
                    if cv is None:
                        continue
                    if budget <= 0:
                        truncated = True
                        break
                    calls[cv.key] = cv
                    queued.append(cv)
                    budget -= 1
            queued.sort(key=lambda c: c.priority)
            if processing == 0:
                self._idle_since.setdefault(address, now)
            else:
                self._idle_since.pop(address, None)
            info = self.plugin.ready_workers.get(address)
            workers[address] = WorkerView(
                address=address, nthreads=nthreads, processing=processing, running=running,
                queued=tuple(c.key for c in queued), models=tuple(info["models"]) if info else (),
                idle_since=self._idle_since.get(address), agents_ready=info is not None,
            )
        for ts in dask_compat.queued_on_scheduler(s, budget):
            cv = call_view(ts, None)
            if cv is not None:
                calls[cv.key] = cv
        sessions = {
            sid: SessionView(sid, r.tenant, r.created, r.progress, r.open_calls, r.state)
            for sid, r in state.sessions.items() if r.state != "completed"
        }
        wf = state.component_stats()
        components = {c: ComponentView(c, *stats) for c, stats in wf.items()}
        affinity = {(sid, what[4:]): w for (sid, what), w in self.plugin.bindings.items() if what.startswith("llm:")}
        draining = set(self.enforcer.drainer.drains)
        bounds = self.plugin.model_bounds()
        models = {
            m: ModelView(m, self.plugin.component_of(m), tuple(sorted(w for w in hosts if w not in draining)),
                         *bounds.get(m, (1, None)))
            for m, hosts in self.plugin.model_workers.items()
        }
        return ClusterView.freeze(now, workers, calls, sessions, components, affinity, truncated, models, draining)

    def stats(self) -> dict:
        """Tick timing, action counters and the last error of each failing policy."""
        ts = sorted(self.tick_seconds)
        pct = (lambda q: ts[min(int(q * len(ts)), len(ts) - 1)] if ts else None)
        return {
            "running": self.running, "interval": self.interval, "ticks": self.ticks,
            "policies": list(self.policies), "tick_seconds_last": self.tick_seconds[-1] if ts else None,
            "tick_seconds_p50": pct(0.5), "tick_seconds_p99": pct(0.99), "tick_seconds_max": ts[-1] if ts else None,
            "policy_errors": self.policy_errors, "errors": dict(self.errors), **self.enforcer.stats(),
            "recent": list(self.enforcer.recent)[-20:],
        }
