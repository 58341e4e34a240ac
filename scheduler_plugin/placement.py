"""Where the calls that must go to one worker go: the scheduler plugin's placement collaborator.

Most calls go where Dask puts them. These are pinned while they are still ``released`` in
``update_graph`` (or when admission binds them):

- stateful calls: every call of a (session, component) goes to the worker holding the
  session's instance, and nowhere else once it exists (elsewhere would be a fresh instance);
- LLM calls: to a worker hosting the model, preferring the one that already served the
  session (its KV is there: session affinity);
- calls of a component the control plane routed: to its routes.

This object owns the bindings ((session, component or ``llm:model``) -> worker) and the
bookkeeping of the calls it pinned (``placed``, indexed by worker, and the open calls per
(worker, what)). It reads the workers from the :class:`~dask_agents.scheduler_plugin.roster.Roster`,
the sessions from the :class:`~dask_agents.scheduler_plugin.state.WorkflowState`, and the routes through
``routes``; a call that cannot run any more (its instance is gone) it hands to recovery
(``faults``: :meth:`cause` and :meth:`strand` of :class:`~dask_agents.scheduler_plugin.recovery.Recovery`).
Everything here is O(1) per call on the scheduler's event loop, except listing candidates
(O(workers)), done only when a binding is made.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from typing import Any, Callable, Collection, Protocol

from dask_agents.scheduler_plugin import dask_compat, engine_health
from dask_agents.scheduler_plugin.roster import Roster
from dask_agents.scheduler_plugin.state import WorkflowState
from dask_agents.scheduler_plugin.view_index import BindingMap, PlacedMap, Tally

logger = logging.getLogger(__name__)

LOST = "inproc://dask-agents-lost-instance"
"""Where a stateful call whose instance is gone is pinned: no worker has this address, so the
call cannot run anywhere (never on a fresh instance); recovery fails it with InstanceLostError."""
AWAITING = "inproc://dask-agents-awaiting-worker"
"""Where a stateful call waits while the cluster has no worker to bind its instance to: placed
for real when one joins (so every call of the instance goes to the same one)."""


class Faults(Protocol):
    """What placement needs of recovery (:class:`~dask_agents.scheduler_plugin.recovery.Recovery`)."""

    def cause(self, worker: str, stimulus_id: str | None = None) -> str: ...

    def strand(self, key: Any) -> None: ...


class Placement:
    """Bindings of sessions to workers and the calls pinned by them (see the module docstring)."""

    def __init__(self, roster: Roster, state: WorkflowState, faults: Faults,
                 routes: Callable[[str], Collection[str] | None]):
        self.roster = roster
        self.state = state
        self.faults = faults
        self.routes = routes  # component -> the workers the control plane routed it to (None: not routed)
        # (session, model) -> the engine worker a session's first agent call binds it to (admission's
        # bind_early; the plugin sets it): None, or it returns None, leaves the agent to Dask
        self.bind_early: Callable[[str, str], str | None] | None = None
        # told (session, "llm:<model>", worker or None) whenever a session's engine binding
        # changes: the plugin passes it on to the session's driver (scheduler_plugin/direct.py)
        self.on_bound: Callable[[str, str, str | None], None] | None = None
        # (session, component or llm:model) -> worker; a dict that also indexes the LLM part
        # (the control view's KV affinity) so a tick does not scan every binding
        self.bindings: BindingMap = BindingMap()
        self.session_bindings: defaultdict[str, list[tuple[str, str]]] = defaultdict(list)  # index by session
        self.session_workers: defaultdict[str, set[str]] = defaultdict(set)  # stateful hosts, LLM KV holders
        self.migrating: dict[str, tuple[str, str, str]] = {}  # LLM call -> (binding, source, target)
        self.bound: defaultdict[str, int] = defaultdict(int)  # worker -> live sessions bound to it
        self.assigned: defaultdict[str, int] = defaultdict(int)  # worker -> sessions ever bound (tie-break)
        # key -> (worker, what) of the calls we pinned; also indexed by worker (``placed.by_worker``)
        # so a lost worker's calls are found without scanning every placed call
        self.placed: PlacedMap = PlacedMap()
        # open calls placed per (worker, what): the load that matters when choosing an engine
        # (a worker busy with agent tasks may have an idle engine). A read of a missing pair
        # gives 0 without inserting it and an entry goes at zero: a lost worker's are few.
        self.open_placed: Tally = Tally()
        self.awaiting: set[str] = set()  # stateful calls pinned to AWAITING (no worker yet)

    @property
    def scheduler(self) -> Any:
        """The scheduler (from the roster)."""
        return self.roster.scheduler

    # -- choosing ----------------------------------------------------------------------------
    def candidates(self, model: str | None, component: str) -> list[str]:
        """The workers a call of ``component`` (an LLM call: of ``model``) may be bound to:
        the model's hosts, else every ready worker, within the component's routes; never one
        whose engine for ``model`` gave up while another can take it. O(workers)."""
        pool: Collection[str] | None = self.roster.hosts.get(model) if model is not None else None
        if not pool:
            pool = self.roster.ready.keys() or self.roster.running()
        routed = self.routes(component)
        if routed:
            pool = [w for w in pool if w in routed] or pool
        if self.roster.retiring:  # draining for a graceful retirement: no new sessions there
            pool = [w for w in pool if w not in self.roster.retiring] or pool
        return engine_health.exclude_dropped(self, model, [w for w in pool if self.roster.alive(w)])

    def bound_ok(self, bound: str, model: str | None, component: str) -> bool:
        """Whether ``bound`` is still among ``candidates(model, component)``, in O(1) (the
        candidates are O(workers) to list: not per call on the critical path)."""
        if self.roster.retiring and bound in self.roster.retiring:
            return bound in self.candidates(model, component)  # retiring: elsewhere if anywhere else
        if self.routes(component):
            return bound in self.candidates(model, component)  # routed: rare, the slow way
        pool = self.roster.hosts.get(model) if model is not None else None
        if pool:
            if bound not in pool:
                return False
        elif self.roster.ready and bound not in self.roster.ready:
            return False
        return self.roster.alive(bound)

    def session_model(self, sid: str) -> str | None:
        """The one model whose engine session ``sid`` is bound to (None: none yet, or several:
        an agent without a ``model=`` hint then goes where Dask puts it). O(its bindings)."""
        models = [w[4:] for _s, w in self.session_bindings.get(sid, ()) if w.startswith("llm:")]
        return models[0] if len(models) == 1 else None

    # -- pinning -----------------------------------------------------------------------------
    def place(self, ts: Any, session: str | None, what: str, candidates: list[str] | None,
              model: str | None = None, component: str | None = None) -> None:
        """Pin ``ts`` to the worker bound to (session, what), binding one first if needed.
        ``candidates`` None: those of (model, component), listed only when a binding is made."""
        bound = self.bindings.get((session, what)) if session is not None else None
        if candidates is None:
            keep = bound is not None and self.bound_ok(bound, model, component or what)
            if not keep:
                candidates = self.candidates(model, component or what)
        else:
            keep = bound is not None and bound in candidates
        if not keep:
            if not candidates:
                return  # nothing to choose from yet: let Dask place it (lazy engine start there)
            # A new session goes where the fewest live sessions are bound: all its later calls
            # (and, for an engine, its KV) follow it there, so sessions are the load that lasts;
            # the open calls of this kind at this instant are a noisy tie-breaker (measured: open
            # calls first left one of two engines with 61% of the decode work, sessions first 5x%).
            bound = min(candidates, key=lambda w: (self.bound.get(w, 0), self.open_placed[(w, what)],
                                                   self.assigned.get(w, 0)))
            if session is not None:
                self._bind(session, what, bound)
        self._pin(ts, bound, what)

    def bind(self, session: str, what: str, worker: str) -> None:
        """Bind (session, what) to ``worker`` before any call of it is placed (admission's
        placement from the start); its calls are then pinned there as any bound session's."""
        self._bind(session, what, worker)

    def _bind(self, session: str, what: str, worker: str) -> None:
        old = self.bindings.get((session, what))
        if old is None:
            self.session_bindings[session].append((session, what))
        else:
            if self.bound.get(old, 0) > 0:
                self.bound[old] -= 1
            if what.startswith("llm:") and old != worker:
                # the new engine never held the session's KV: its next call recomputes
                # the prefix there (what balance prices), until that call reports
                self.state.forget_kv(session, what[4:])
        self.bindings[(session, what)] = worker
        self.told(session, what, worker)
        self.bound[worker] += 1
        self.assigned[worker] += 1
        if not what.startswith("llm:"):
            self.session_workers[session].add(worker)

    def told(self, session: str, what: str, worker: str | None) -> None:
        """A session's binding ``what`` changed to ``worker`` (None: gone): tell ``on_bound``."""
        if self.on_bound is not None and what.startswith("llm:"):
            self.on_bound(session, what, worker)

    def _pin(self, ts: Any, worker: str, what: str) -> None:
        dask_compat.restrict_to_worker(ts, worker)
        dask_compat.mark_pinned(ts, worker)
        self.placed[dask_compat.task_key(ts)] = (worker, what)
        self.open_placed[(worker, what)] += 1

    def place_stateful(self, ts: Any, rec: Any) -> None:
        """Pin a stateful call to its session's instance. Once an instance exists its calls go
        there and nowhere else, whatever routes or readiness say (elsewhere would be a fresh
        instance); if it is gone, the call fails (recovery, with the session's recorded cause)."""
        sid, component = rec.session, rec.component
        if sid is None:  # outside any session: one instance per worker, anywhere
            self.place(ts, None, component, None, None, component)
            return
        s = self.state.sessions[sid]
        if s.outlived is not None and component not in s.lost:
            s.lost[component] = s.outlived
        bound = self.bindings.get((sid, component))
        if bound is not None and component not in s.lost and not self.roster.alive(bound):
            s.lost[component] = self.faults.cause(bound)  # gone without remove_worker having run yet
        if component in s.lost:
            dask_compat.restrict_to_worker(ts, LOST)
            self.faults.strand(dask_compat.task_key(ts))
        elif bound is not None:
            self._pin(ts, bound, component)
        elif candidates := self.candidates(None, component):
            self.place(ts, sid, component, candidates)
        else:  # no worker at all yet: wait for one rather than let Dask scatter the instance
            dask_compat.restrict_to_worker(ts, AWAITING)
            self.awaiting.add(dask_compat.task_key(ts))

    def place_awaiting(self) -> None:
        """A worker joined: bind the stateful calls that waited for one (all calls of one
        instance to one worker) and let Dask run them."""
        keys, self.awaiting = self.awaiting, set()
        stimulus = f"dask-agents-awaiting-{time.time()}"
        for key in keys:
            ts, rec = dask_compat.task(self.scheduler, key), self.state.calls.get(key)
            if ts is None or rec is None or dask_compat.worker_restrictions(ts) != {AWAITING}:
                continue
            self.place_stateful(ts, rec)
            if dask_compat.worker_restrictions(ts) != {AWAITING}:
                try:
                    dask_compat.reschedule(self.scheduler, [key], stimulus)
                except Exception:  # it stays no-worker: the next worker that joins tries again
                    logger.exception("dask-agents: placing stateful call %s failed", key)

    def near_engine(self, ts: Any, sid: str, model: str) -> None:
        """An agent call with the ``model=`` hint goes to the worker of the engine its session
        is bound to, when that worker has a free thread: the call and its LLM calls then stay in
        one process (no hop to the engine and back). Loosely: if that worker leaves, Dask places
        it anywhere. Without a binding yet the session is bound now (``bind_early``), so its
        first agent call runs beside its engine too; with a busy worker Dask places it as usual."""
        bound = self.bindings.get((sid, f"llm:{model}"))
        if bound is None and self.bind_early is not None:  # its first call: its engine chosen now
            bound = self.bind_early(sid, model)
        if bound is not None and dask_compat.free_threads(self.scheduler, bound) > 0:
            dask_compat.prefer_worker(ts, bound)

    def place_routed(self, ts: Any, component: str, session: str | None, model: str | None) -> None:
        """A call of a component the control plane routed: pinned within its route, beside its
        session's engine of ``model`` (its ``model=`` hint, or the model its session calls)
        when that worker is in the route with a free thread, else on the route's least loaded
        worker."""
        candidates = self.candidates(None, component)
        if model is not None and session is not None:
            bound = self.bindings.get((session, f"llm:{model}"))
            if (bound is not None and bound in candidates
                    and dask_compat.free_threads(self.scheduler, bound) > 0):
                self._pin(ts, bound, component)
                return
        self.place(ts, None, component, candidates)

    def unplace(self, key: str) -> None:
        """The call is no longer pinned by us (it ended, or is being placed again)."""
        where = self.placed.pop(key, None)
        if where is not None:
            self.open_placed.decrement(where)

    def move_placed(self, key: str, target: str) -> tuple[str, str] | None:
        """A placed call moved to ``target`` (a migration): move its placement bookkeeping
        (``placed``, its by-worker index, the open-call counters) in O(1). Returns its former
        (worker, what), or None if we had not placed it."""
        where = self.placed.get(key)
        if where is not None and where[0] != target:
            self.open_placed.decrement(where)
            self.placed[key] = (target, where[1])
            self.open_placed[(target, where[1])] += 1
        return where

    # -- what happened -----------------------------------------------------------------------
    def migrated(self, key: str, session: str | None, source: str, target: str) -> None:
        """A call moved to ``target`` (Dask confirmed the steal). An LLM call that leaves the
        engine holding its session's KV takes the session with it (the balance policy priced
        the recompute): the session's later calls go where its prefix now lives."""
        where = self.placed.get(key)
        if where is None:
            return
        self.unplace(key)
        self.placed[key] = (target, where[1])
        self.open_placed[(target, where[1])] += 1
        what = where[1]
        if session is not None and what.startswith("llm:") and self.bindings.get((session, what)) == source:
            self.bindings[(session, what)] = target
            self.told(session, what, target)
            self.state.forget_kv(session, what[4:])  # rebuilt on the target by this call
            # Dask's steal may still be refused (the call started): the report decides
            self.migrating[key] = (what, source, target)
            if self.bound.get(source, 0) > 0:
                self.bound[source] -= 1
            self.bound[target] += 1

    def llm_ran(self, key: str, session: str, worker: str, live: bool) -> str | None:
        """An LLM call of ``session`` finished on ``worker`` (``live``: the session is still
        open): its KV is there. A migration it was part of either happened (the binding stays
        on the target) or the source refused it, the call having started (the binding goes
        back: the KV is there). Returns a worker that must be told the session ended (a
        target that never heard of a session that ended meanwhile), else None."""
        moved = self.migrating.pop(key, None)
        if not live:  # reports trail the transitions: it already ended
            if moved is not None and worker == moved[2] and self.roster.alive(worker):
                return worker
            return None
        self.session_workers[session].add(worker)
        if moved is not None:
            what, source, target = moved
            if worker == source and self.bindings.get((session, what)) == target:
                self.bindings[(session, what)] = source
                self.told(session, what, source)
                if self.bound.get(target, 0) > 0:
                    self.bound[target] -= 1
                self.bound[source] += 1
        return None

    def worker_removed(self, worker: str, cause: str) -> list[tuple[str, str]]:
        """``worker`` left: drop its bindings (a stateful instance's loss is recorded on its
        session, with ``cause``, for every later call of it) and its counters. Returns the
        (session, model) pairs whose KV died with it. O(its bindings + placed kinds)."""
        for key in [k for k, (_w, src, dst) in self.migrating.items() if worker in (src, dst)]:
            del self.migrating[key]  # moves to or from it are moot (a handful)
        dropped_llm: list[tuple[str, str]] = []
        for k in self.bindings.keys_on(worker):
            del self.bindings[k]
            self.told(k[0], k[1], None)
            if k[1].startswith("llm:"):
                self.state.forget_kv(k[0], k[1][4:])  # its KV died with the engine
                dropped_llm.append((k[0], k[1][4:]))
            else:  # a stateful instance: its state went with the worker, for every later call too
                s = self.state.sessions.get(k[0])
                if s is not None:
                    s.lost[k[1]] = cause
        self.bound.pop(worker, None)
        # the open-call counters of the worker: one per kind of call placed there (the calls
        # themselves stay in ``placed`` until recovery re-places them or they end)
        for what in set(self.placed.by_worker.get(worker, {}).values()):
            self.open_placed.pop((worker, what), None)
        self.assigned.pop(worker, None)
        return dropped_llm

    def live_stateful(self, worker: str) -> list[tuple[str, str]]:
        """The (session, component) stateful instances on ``worker`` whose session is not over:
        what a graceful retirement of it must wait for. O(its bindings)."""
        out = []
        for sid, what in self.bindings.keys_on(worker):
            if not what.startswith("llm:"):
                s = self.state.sessions.get(sid)
                if s is not None and s.state != "completed":
                    out.append((sid, what))
        return out

    def has_instances(self, sid: str) -> bool:
        """Whether session ``sid`` is bound to a stateful instance somewhere."""
        return any(not w.startswith("llm:") for _s, w in self.session_bindings.get(sid, ()))

    def release_session(self, sid: str, s: Any, released: str) -> set[str]:
        """Drop ``sid``'s bindings (``s``: its record, if kept); a stateful component's later
        call must not start afresh (``released`` says why). Returns the workers holding its
        instances or KV (to be told it ended)."""
        for key in self.session_bindings.pop(sid, ()):
            w = self.bindings.pop(key, None)
            if w is None:
                continue
            if self.bound.get(w, 0) > 0:
                self.bound[w] -= 1
            if s is not None and not key[1].startswith("llm:"):
                s.lost.setdefault(key[1], released)
        workers = self.session_workers.pop(sid, set())
        if s is not None:
            for key in [k for k in self.migrating if k in s.calls]:
                workers.add(self.migrating.pop(key)[2])  # a moved call that has not reported yet
        return workers
