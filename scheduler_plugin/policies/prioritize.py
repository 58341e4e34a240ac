"""Workflow-aware prioritization (Nalar) with Agent Fair Share (SAGA).

Priority of a waiting call, as a Dask priority tuple (smaller runs first)::

    (user priority, -starved, -progress, -kv_resident, arrival)

- progress: completed calls of its session; more progress runs first, so a retry of a nearly
  finished request overtakes newly arrived work.
- kv_resident: an LLM call waiting on the worker that holds its session's KV, or held by the
  scheduler for engine room while its session is bound to an engine, goes first among equals
  (its prefill is cheap there).
- starved (Agent Fair Share, SAGA): a session whose elapsed time exceeds ``fair_share_slowdown``
  times its own fair completion time runs ahead of progress order, so short interactive
  requests are not stuck behind long agents and vice versa. Its fair time is its workflow's:
  the median time the latest completed sessions of the same workflow (the component of a
  session's first call: "Planner", "Router") took, once there are a few; before that, the
  expected time of a session from the flattened workflow graph (visits x mean duration per
  component). A tenant with an SLO (``fair_share_slo``: tenant -> seconds) has that as its
  sessions' budget instead. How far past its budget a session is (1x, 2x, 3x, 4x or more) is
  its deficit: the more starved run first. With ``fair_share_key: tenant`` every session of a
  tenant with a starved session is lifted by that session's deficit.
- arrival: FIFO among equals.

The same function sets the priority when a call is created (scheduler plugin's
``update_graph``) and revises it while the call waits (this policy, each tick).
"""

from __future__ import annotations

from typing import Any, Iterator

from dask_agents.scheduler_plugin.actions import SetPriority
from dask_agents.scheduler_plugin.view import CallView, ClusterView, SessionView


def priority(user: float, progress: int, arrival: int, starved: int = 0, kv_resident: bool = False) -> tuple:
    """The priority tuple of a call (see the module docstring; ``starved``: its deficit, 0 if
    none, a bool counting as 0 or 1)."""
    return (user, -int(starved), -progress, -int(kv_resident), arrival)


def fifo(user: float, arrival: int) -> tuple:
    """The same tuple shape with prioritization switched off: FIFO among equal user priority."""
    return (user, 0, 0, 0, arrival)


MAX_DEFICIT = 4  # deficits past 4x a session's budget order alike


def expected_duration(view: ClusterView) -> float:
    """Expected completion time of one session: sum over components of visits x mean duration."""
    return sum(c.visits_per_session * view.duration(c.name) for c in view.components.values())


class Prioritize:
    """Revise waiting calls' priorities from session progress, fair share and KV residency."""

    def __init__(self, fair_share_slowdown: float = 4.0, fair_share_key: str = "session",
                 fair_share_slo: dict[str, float] | None = None):
        if fair_share_key not in ("session", "tenant"):
            raise ValueError(f"fair_share_key must be 'session' or 'tenant', got {fair_share_key!r}")
        if fair_share_slowdown <= 0:
            raise ValueError("fair_share_slowdown must be positive")
        slo = dict(fair_share_slo or {})
        for tenant, seconds in slo.items():
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
                raise ValueError(f"fair_share_slo[{tenant!r}] must be a positive number of seconds, got {seconds!r}")
        self.slowdown = float(fair_share_slowdown)
        self.key = fair_share_key
        self.slo = {str(t): float(v) for t, v in slo.items()}

    def budget(self, s: SessionView, view: ClusterView, default: float | None = None) -> float:
        """How long session ``s`` may take before it is starved: its tenant's SLO, else
        ``fair_share_slowdown`` x its workflow's expected time (else the flattened graph's;
        ``default``: that, computed once by the caller)."""
        if s.tenant is not None and s.tenant in self.slo:
            return self.slo[s.tenant]
        fair = view.expected_times.get(s.workflow) if s.workflow is not None else None
        if fair is None:
            fair = expected_duration(view) if default is None else default
        return fair * self.slowdown

    def deficit(self, s: SessionView, view: ClusterView, default: float | None = None) -> int:
        """0 while ``s`` is within its budget, else how many budgets it has taken (1 to
        ``MAX_DEFICIT``): the more starved run first."""
        budget = self.budget(s, view, default)
        if budget <= 0:
            return 0
        elapsed = view.now - s.created
        return 0 if elapsed <= budget else min(MAX_DEFICIT, int(elapsed // budget))

    def starved_groups(self, view: ClusterView) -> dict:
        """Sessions (or tenants) past their fair share of waiting -> their deficit (a tenant's:
        its most starved session's)."""
        default = expected_duration(view)
        out: dict = {}
        for s in view.sessions.values():  # every live session, each tick: only for tenant keys
            d = self.deficit(s, view, default)
            if d:
                group = s.id if self.key == "session" else s.tenant
                if d > out.get(group, 0):
                    out[group] = d
        return out

    def desired(self, call: CallView, view: ClusterView, starved: Any) -> tuple:
        """The priority ``call`` should have now (``starved``: group -> deficit)."""
        s = view.sessions.get(call.session) if call.session else None
        progress = s.progress if s is not None else 0
        group = call.session if self.key == "session" else call.tenant
        # its KV is where it will run: on its worker's engine, or (a call the scheduler holds for
        # engine room, worker None) on the engine its session is bound to, where it binds first
        bound = view.kv_affinity.get((call.session, call.model)) if call.model is not None else None
        kv = bound is not None and (call.worker is None or bound == call.worker)
        return priority(call.priority[0], progress, call.priority[-1], starved.get(group, 0) if group else 0, kv)

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
    """``starved.get(sid, 0)`` exactly as ``policy.starved_groups(view).get(sid, 0)`` for
    session fair share, computed on demand (for the sessions of the calls in view only)."""

    def __init__(self, view: ClusterView, policy: Prioritize):
        self.view = view
        self.policy = policy
        self.default: float | None = None  # the flattened graph's expected time, once needed

    def get(self, sid: object, missing: int = 0) -> int:
        s = self.view.sessions.get(sid)
        if s is None:
            return missing
        fair = self.view.expected_times.get(s.workflow) if s.workflow is not None else None
        if fair is None and self.default is None and not (s.tenant is not None and s.tenant in self.policy.slo):
            self.default = expected_duration(self.view)
        return self.policy.deficit(s, self.view, self.default) or missing
