"""The enforcement layer: validate each suggested action, apply it through Dask, record it.

Policies only suggest. Here every action is checked against the scheduler's *current* state
(the view may be a tick old): the call still exists and waits, workers are running and
valid for it, the call is not already moving. Invalid actions are dropped and counted, never
applied half-way.

Custom policies (``agents.control.policies.<name>.class``) are a documented extension point,
and this layer is what keeps them safe: whatever a policy suggests, an action that would break
one of the invariants below is refused (counted in ``rejected``, its reason in
``rejected_reasons`` and in the ``rejections`` history) and never applied:

- a stateful call never moves: its instance and the session's bindings stay on its worker;
- an LLM call moves only to a worker hosting its model (the plugin's ``model_workers``);
- a call moves only to a worker that supplies its resource restrictions (Dask worker
  resources), and not at all when it is restricted to hosts;
- a move's target is a running worker (not paused, closing, closed or retiring);
- a call the scheduler knows has started does not move (nothing runs twice).

A move is Dask's steal protocol: the victim gives the call up only if it has not started. Until
the victim answers, a move is *requested* (``requested``, ``moves_pending``); it counts as
*applied* (``applied``, the call's telemetry ``migrations``, the plugin's ``on_migrated``
bookkeeping, the ``agents-control`` event) only once Dask confirms it, and as *refused*
(``refused``) when the victim refused it or the request lapsed. Moves of the drain protocol
(:mod:`dask_agents.scheduler_plugin.drain`) go through the same checks and confirmation.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Protocol

from dask_agents.scheduler_plugin import dask_compat
from dask_agents.scheduler_plugin.actions import Action, ActionError, Kill, Migrate, Provision, Reassign, Route, SetPriority, kind
from dask_agents.scheduler_plugin.drain import Drainer

if TYPE_CHECKING:
    from dask_agents.scheduler_plugin.admission import Admission
    from dask_agents.scheduler_plugin.placement import Placement
    from dask_agents.scheduler_plugin.roster import Roster
    from dask_agents.scheduler_plugin.state import WorkflowState
    from dask_agents.scheduler_plugin.view_index import ViewIndex, ViewSources

logger = logging.getLogger(__name__)

TOPIC = "agents-control"
REPRIORITIZE_OP = "agents-reprioritize"
MAX_PROVISION = 256
"""Most workers one ``Provision`` may ask for (a runaway policy cannot request a fleet)."""
MAX_REASONS = 64
"""Distinct ``rejected_reasons`` kept (reasons may name workers or errors: the counter stays
bounded, the rest is counted under ``<kind>: other``)."""
STEAL_WATCH = "dask-agents-steal-answers"
"""The scheduler plugin (:func:`dask_compat.watch_steal_answers`) that hears Dask's answers."""

# why a move is refused: one text per invariant (stable, so they can be counted)
STATEFUL = "stateful call: its instance and the session's bindings stay on its worker"
LACKS_RESOURCES = "target lacks the call's resources"
HOST_RESTRICTED = "host restricted"
STARTED = "already started"


@dataclass
class PendingMove:
    """A move Dask was asked for and whose victim has not answered yet."""

    key: Any
    source: str
    target: str
    record: dict | None  # the policy's decision; None for a move of the drain protocol


class ControlHost(Protocol):
    """What the control loop and its enforcement need of the scheduler plugin: the shared state
    views are built from and actions are checked against, and the plugin's operations that
    actions turn into (it is their event router: each also tells the observers)."""

    roster: "Roster"
    state: "WorkflowState"
    placement: "Placement"
    admission: "Admission"
    view_index: "ViewIndex"
    view_sources: "ViewSources"

    def push_routes(self, workers: list[str] | None = None) -> None: ...

    def scale(self, action: Provision | Kill) -> str | None: ...

    def on_migrated(self, key: str, source: str, target: str) -> None: ...

    def set_worker_models(self, worker: str, models: list[str]) -> None: ...


class Enforcer:
    """Applies actions for the scheduler plugin; keeps counters and recent decisions."""

    def __init__(self, host: ControlHost, history: int = 1000):
        self.host = host
        self.applied: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter()
        self.rejected_reasons: Counter[str] = Counter()  # "<kind>: <why>" (bounded: MAX_REASONS)
        self.requested: Counter[str] = Counter()  # moves asked of Dask (applied or refused once answered)
        self.refused: Counter[str] = Counter()  # moves the victim refused (it had started) or that lapsed
        # applied decisions, one record per ``applied`` count (the dashboard reads them by that count)
        self.recent: deque[dict] = deque(maxlen=history)
        self.rejections: deque[dict] = deque(maxlen=history)  # rejected and refused decisions, with why
        self.routes: dict[str, tuple[str, ...]] = {}
        self.moves: dict[str, PendingMove] = {}  # Dask's request id -> the move it awaits an answer to
        self._watching = False
        self.drainer = Drainer(host.roster, host.state, host.placement, host.set_worker_models, move=self.move)

    @property
    def scheduler(self) -> Any:
        """The scheduler the plugin runs in."""
        return self.host.roster.scheduler

    def apply(self, actions: Iterable[Action], policy: str) -> int:
        """Validate and apply ``actions`` from ``policy``; returns how many were accepted: applied,
        or (moves) requested from Dask, which confirms or refuses them later."""
        worker_priorities: dict[str, dict] = {}
        n = 0
        for action in actions:
            try:
                k = kind(action)
            except ActionError as e:  # a policy returned something else: count it, go on
                logger.warning("dask-agents: policy %s returned %s", policy, e)
                self.rejected["invalid"] += 1
                continue
            record = {"action": k, "policy": policy, "time": time.time(),
                      **{f: getattr(action, f) for f in action.__slots__}}
            try:
                why = self._apply(action, worker_priorities, record)
            except Exception as e:  # a bad action never breaks the loop
                logger.exception("dask-agents: applying %r failed", action)
                why = f"error: {e}"
            if why:
                self.rejected[k] += 1
                self._history(record, "rejected", why)
                continue
            n += 1
            if isinstance(action, Migrate):  # counted as applied when Dask confirms it (_answered)
                self.requested[k] += 1
                continue
            self._applied(record)
        for address, prios in worker_priorities.items():
            dask_compat.send_to_worker(self.scheduler, address, {"op": REPRIORITIZE_OP, "priorities": prios})
        self.settle()
        return n

    def _applied(self, record: dict) -> None:
        self.applied[record["action"]] += 1
        self.recent.append(record)
        dask_compat.add_event(self.scheduler, TOPIC, record)

    def _history(self, record: dict, outcome: str, why: str) -> None:
        """A rejected or refused decision: in ``rejections`` and ``rejected_reasons`` (not on
        the event topic: a policy suggesting the same invalid move every pass would push the
        real decisions out of it)."""
        self.rejections.append({**record, "outcome": outcome, "why": why})
        reason = f"{record['action']}: {why}"
        if reason not in self.rejected_reasons and len(self.rejected_reasons) >= MAX_REASONS:
            reason = f"{record['action']}: other"
        self.rejected_reasons[reason] += 1

    def _apply(self, a: Action, worker_priorities: dict, record: dict) -> str | None:
        """Apply one action; return why it was rejected (None when applied or, a move, requested)."""
        s = self.scheduler
        if isinstance(a, SetPriority):
            ts = dask_compat.task(s, a.key)
            if ts is None or a.key not in self.host.state.calls:
                return "unknown call"
            st = dask_compat.state(ts)
            if dask_compat.is_queued_on_scheduler(s, ts):
                dask_compat.requeue_with_priority(s, ts, a.priority)
            elif st == "processing":
                addr = dask_compat.processing_on(ts)
                if addr not in self.host.roster.ready:
                    return "worker cannot take directives"
                dask_compat.set_priority(ts, a.priority)
                worker_priorities.setdefault(addr, {})[a.key] = list(a.priority)
            elif st in ("waiting", "no-worker", "released"):
                dask_compat.set_priority(ts, a.priority)  # used when it becomes runnable
            else:
                return f"call is {st}"
            self.host.state.on_priority(a.key, a.priority)
            return None
        if isinstance(a, Migrate):
            if self.host.admission.is_held(a.key):  # waiting for an engine: bind it to the target
                return self.host.admission.prefer(a.key, a.target)
            ts = dask_compat.task(s, a.key)
            if ts is None or dask_compat.state(ts) != "processing":
                return "not queued on a worker"
            if dask_compat.processing_on(ts) != a.source:
                return "not on the source worker"
            return self.move(ts, a.source, a.target, record)
        if isinstance(a, Route):
            bad = [w for w in a.workers if not dask_compat.has_worker(s, w)]
            if bad:
                return f"unknown workers {bad}"
            bounds = self.host.state.component_bounds.get(a.component)
            if bounds is not None:  # a bounded component: its route is its replicas
                lo, hi = bounds
                n = len(set(a.workers))
                if not n or n > hi:
                    return f"{n or 'every'} workers, past max_replicas={hi}"
                available = sum(1 for w in self.host.roster.ready if w not in self.drainer.drains)
                if n < min(lo, available):
                    return f"{n} workers, below min_replicas={lo}"
            if a.workers:
                self.routes[a.component] = tuple(a.workers)
            else:
                self.routes.pop(a.component, None)
            self.host.push_routes()  # the workers' fast paths honour them too
            return None
        if isinstance(a, Reassign):
            return self.drainer.begin(a)
        if isinstance(a, Provision) and a.n > MAX_PROVISION:
            return f"n={a.n} exceeds {MAX_PROVISION} workers per action"
        if isinstance(a, (Provision, Kill)):
            return self.host.scale(a)
        return f"unknown action {type(a).__name__}"

    # -- moves ------------------------------------------------------------------------------
    def why_not_move(self, ts: Any, source: str, target: str) -> str | None:
        """Why moving ``ts`` (processing on ``source``) to ``target`` would break an invariant
        (module docstring); None if it may move."""
        s = self.scheduler
        rec = self.host.state.calls.get(dask_compat.task_key(ts))
        if rec is None:
            return "unknown call"
        if rec.stateful:
            return STATEFUL
        if target == source:
            return "target is the source"
        if not dask_compat.has_worker(s, target):
            status = dask_compat.worker_status(s, target)
            return "unknown target" if status is None else f"target is {status}"
        if rec.kind == "llm" and target not in self.host.roster.hosts.get(rec.model, ()):
            return f"target does not host model {rec.model}"
        if dask_compat.has_host_restrictions(ts):
            return HOST_RESTRICTED
        if not dask_compat.worker_has_resources(s, ts, target):
            return LACKS_RESOURCES
        if dask_compat.task_started(ts):
            return STARTED
        return None

    def move(self, ts: Any, source: str, target: str, record: dict | None = None) -> str | None:
        """Ask Dask to move ``ts`` from ``source`` to ``target`` if that breaks no invariant;
        returns why not (None: requested). Confirmed, it is recorded (:meth:`_answered`);
        ``record`` is the policy's decision it carries out (None: a drain's move)."""
        why = self.why_not_move(ts, source, target)
        if why:
            return why
        self._watch()
        result = str(dask_compat.move_task(self.scheduler, ts, source, target))
        if not result.startswith("steal-"):
            return "already moving" if result == "in-flight" else result
        self.moves[result] = PendingMove(dask_compat.task_key(ts), source, target, record)
        return None

    def _watch(self) -> None:
        """Hear Dask's answers to move requests (installed with the first move)."""
        if self._watching:
            return
        self._watching = True
        # a stand-in scheduler without a plugin registry (benchmarks/control_scale.py) applies
        # moves at once: settle() finds them done
        if hasattr(self.scheduler, "add_plugin"):
            dask_compat.watch_steal_answers(self.scheduler, STEAL_WATCH, self._answered)

    def _answered(self, stimulus_id: str, answer: str) -> None:
        """Dask's answer to a move request (called inside its confirmation)."""
        m = self.moves.pop(stimulus_id, None)
        if m is None:
            return  # not ours (Dask's own balancing), or already settled
        try:
            if answer == "confirm":
                self._moved(m)
            else:
                ts = dask_compat.task(self.scheduler, m.key)
                if ts is not None and answer in ("already-computing", "reschedule"):
                    dask_compat.undo_move_pin(ts, m.source, m.target)  # it stays (or is placed) as before
                self._refused(m, {"already-computing": "the call had started on the source",
                                  "reschedule": "Dask placed the call anew (the target left)",
                                  "already-aborted": "the call left the source before it answered",
                                  "stale-response": "superseded by a newer request"}.get(answer, answer))
        except Exception:  # never break Dask's confirmation
            logger.exception("dask-agents: recording the answer %r to moving %s failed", answer, m.key)

    def _moved(self, m: PendingMove) -> None:
        ts = dask_compat.task(self.scheduler, m.key)
        if ts is not None:
            dask_compat.move_resource_accounting(self.scheduler, ts, m.source, m.target)
        self.host.on_migrated(m.key, m.source, m.target)
        if m.record is not None:
            self._applied(m.record)

    def _refused(self, m: PendingMove, why: str) -> None:
        if m.record is not None:
            self.refused[m.record["action"]] += 1
            self._history(m.record, "refused", why)

    def settle(self) -> None:
        """Resolve the requested moves Dask will not answer with an event: the call left the
        source meanwhile (finished, released, its worker gone), or a move engine that applies
        moves at once. Called after each batch of actions and at the start of each pass."""
        s = self.scheduler
        for sid, m in list(self.moves.items()):
            ts = dask_compat.task(s, m.key)
            if ts is not None and dask_compat.move_in_flight(s, ts) == sid:
                continue  # the victim has not answered yet
            del self.moves[sid]
            if ts is not None and dask_compat.state(ts) == "processing" and dask_compat.processing_on(ts) == m.target:
                self._moved(m)
            else:
                self._refused(m, "the request lapsed (the call left the source)")

    def close(self) -> None:
        """Stop hearing Dask's answers (the control loop is closed)."""
        if self._watching and hasattr(self.scheduler, "add_plugin"):
            dask_compat.unwatch_steal_answers(self.scheduler, STEAL_WATCH)
        self._watching = False

    def stats(self) -> dict:
        """Counters: applied, rejected (and why), requested and refused actions by kind; moves
        awaiting Dask's answer; the last rejected or refused decisions."""
        return {"applied": dict(self.applied), "rejected": dict(self.rejected),
                "rejected_reasons": dict(self.rejected_reasons), "requested": dict(self.requested),
                "refused": dict(self.refused), "moves_pending": len(self.moves),
                "rejections": list(self.rejections)[-20:], "drains": self.drainer.stats()}
