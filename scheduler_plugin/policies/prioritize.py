"""Workflow-aware prioritization (Nalar) with Agent Fair Share (SAGA).

Priority of a waiting call, as a Dask priority tuple (smaller runs first)::

    (user priority, -starved, -progress, -kv_resident, arrival)

- progress: completed calls of its session; more progress runs first, so a retry of a nearly
  finished request overtakes newly arrived work.
- kv_resident: an LLM call waiting on the worker that holds its session's KV, or held by the
  scheduler for engine room while its session is bound to an engine, goes first among equals
  (its prefill is cheap there).
- starved (Agent Fair Share): a session (or tenant) whose elapsed time exceeds
  ``fair_share_slowdown`` times its expected completion time (from the flattened workflow
  graph: visits x mean duration per component) runs ahead of progress order, so short
  interactive requests are not stuck behind long agents and vice versa.
- arrival: FIFO among equals.

The same function sets the priority when a call is created (scheduler plugin's
``update_graph``) and revises it while the call waits (this policy, each tick).
"""

from __future__ import annotations

from typing import Iterator

from dask_agents.scheduler_plugin.actions import SetPriority
from dask_agents.scheduler_plugin.view import CallView, ClusterView


def priority(user: float, progress: int, arrival: int, starved: bool = False, kv_resident: bool = False) -> tuple:
    """The priority tuple of a call (see the module docstring)."""
    return (user, -int(starved), -progress, -int(kv_resident), arrival)


def fifo(user: float, arrival: int) -> tuple:
    """The same tuple shape with prioritization switched off: FIFO among equal user priority."""
    return (user, 0, 0, 0, arrival)


def expected_duration(view: ClusterView) -> float:
    """Expected completion time of one session: sum over components of visits x mean duration."""
    return sum(c.visits_per_session * view.duration(c.name) for c in view.components.values())


class Prioritize:
    """Revise waiting calls' priorities from session progress, fair share and KV residency."""

    def __init__(self, fair_share_slowdown: float = 4.0, fair_share_key: str = "session"):
        if fair_share_key not in ("session", "tenant"):
            raise ValueError(f"fair_share_key must be 'session' or 'tenant', got {fair_share_key!r}")
        if fair_share_slowdown <= 0:
            raise ValueError("fair_share_slowdown must be positive")
        self.slowdown = float(fair_share_slowdown)
        self.key = fair_share_key

    def starved_groups(self, view: ClusterView) -> set:
        """Sessions (or tenants) past their fair share of waiting."""
        budget = expected_duration(view) * self.slowdown
        if budget <= 0:
            return set()
        now = view.now  # one comprehension: this runs over every live session each tick
        if self.key == "session":
            return {s.id for s in view.sessions.values() if now - s.created > budget}
        return {s.tenant for s in view.sessions.values() if now - s.created > budget}

    def desired(self, call: CallView, view: ClusterView, starved: set) -> tuple:
        """The priority ``call`` should have now."""
        s = view.sessions.get(call.session) if call.session else None
        progress = s.progress if s is not None else 0
        group = call.session if self.key == "session" else call.tenant
        # its KV is where it will run: on its worker's engine, or (a call the scheduler holds for
        # engine room, worker None) on the engine its session is bound to, where it binds first
        bound = view.kv_affinity.get((call.session, call.model)) if call.model is not None else None
        kv = bound is not None and (call.worker is None or bound == call.worker)
        return priority(call.priority[0], progress, call.priority[-1], group in starved if group else False, kv)

    def __call__(self, view: ClusterView) -> Iterator[SetPriority]:
        # Per session, only the sessions of the calls in view are asked (O(calls in view), not
        # a scan of every live session each tick); per tenant, any session of it counts: a scan.
        starved = _StarvedSessions(view, self) if self.key == "session" else self.starved_groups(view)
        for call in view.calls.values():
            if len(call.priority) != 5:
                continue  # not created by dask-agents' priority scheme
            want = self.desired(call, view, starved)
            if want != tuple(call.priority):
                yield SetPriority(call.key, want, reason="progress" if want[1] == 0 else "fair-share")


class _StarvedSessions:
    """``sid in starved`` exactly as ``sid in policy.starved_groups(view)`` for session fair
    share, computed on demand."""

    def __init__(self, view: ClusterView, policy: Prioritize):
        self.view = view
        self.budget = expected_duration(view) * policy.slowdown

    def __contains__(self, sid: object) -> bool:
        if self.budget <= 0:
            return False
        s = self.view.sessions.get(sid)
        return s is not None and self.view.now - s.created > self.budget
