"""Incremental index behind the control loop's :class:`~dask_agents.scheduler_plugin.view.ClusterView`.

Rebuilding the view from scheduler state each tick walks the workers' assigned tasks until
the call budget is spent, every live session and every binding, and builds every object anew:
70-100 ms of Python on the scheduler's event loop at a quarter-million live futures
(benchmarks/control_scale.py), always on the same first workers. This module keeps what the
view needs up to date as events happen, at O(1) per event, so a tick only assembles it:

- which waiting calls sit on which worker (``on_worker``: an index per replica) and which
  the scheduler holds back (``sched_queued``), maintained from the plugin's ``transition``
  hook and from migrations;
- open calls per component and worker (``per_replica``);
- one frozen :class:`SessionView` per live session, redone only for the sessions
  :class:`~dask_agents.scheduler_plugin.state.WorkflowState` marked as touched since the last tick;
- one :class:`CallView` per waiting call, built the first time a tick needs it and dropped
  when the call changes state (re-checked against the task's current priority and worker);
- the LLM session affinity map, kept beside the plugin's bindings (:class:`BindingMap`).

**Bounded work with carry-over.** A tick takes at most ``max_calls`` waiting calls. It takes
*whole* worker queues, starting where the previous tick stopped (workers rotate through a
ring), plus a rotating slice of the calls the scheduler holds back. Over successive ticks
every waiting call is seen. Within one view the worker set is consistent: a worker appears
only if its ``queued`` tuple is complete (its queue is in this tick's slice, or it has no
waiting task at all), so a policy never mistakes an unvisited, loaded worker for an idle
one. ``view.truncated`` says that some loaded workers or held-back calls were left for
later ticks.

:func:`scan_view` is the from-scratch build (the control loop's original algorithm). Tests
check that the incremental view equals it on random event sequences; ``ControlLoop`` can
use either (``incremental``), and ``benchmarks/control_scale.py`` compares them.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import immutables

from dask_agents.annotation import component_name
from dask_agents.scheduler_plugin import dask_compat
from dask_agents.scheduler_plugin.roster import Roster, model_bounds
from dask_agents.scheduler_plugin.state import WorkflowState
from dask_agents.scheduler_plugin.view import (
    CallView,
    ClusterView,
    ComponentView,
    ModelView,
    SessionView,
    WorkerView,
    make_call_view,
    make_session_view,
    make_worker_view,
)

# Scheduler states in which a call sits in a worker's or the scheduler's queue.
_ON_WORKER = "processing"
_HELD = "queued"


_ABSENT = object()


class _IndexedDict(dict):
    """A dict whose subclasses keep side indexes: every removal goes through ``_drop`` (and
    ``clear`` through ``_clear_indexes``), so the dict methods below keep them in step."""

    __slots__ = ()

    def _drop(self, key: Any, value: Any) -> None:
        raise NotImplementedError

    def _clear_indexes(self) -> None:
        raise NotImplementedError

    def __delitem__(self, key: Any) -> None:
        value = dict.__getitem__(self, key)
        dict.__delitem__(self, key)
        self._drop(key, value)

    def pop(self, key: Any, *default: Any) -> Any:
        """``dict.pop``, keeping the side indexes in step."""
        had = key in self
        value = dict.pop(self, key, *default)
        if had:
            self._drop(key, value)
        return value

    def popitem(self) -> tuple:
        """``dict.popitem``, keeping the side indexes in step."""
        key, value = dict.popitem(self)
        self._drop(key, value)
        return key, value

    def setdefault(self, key: Any, default: Any = None) -> Any:
        """``dict.setdefault``, keeping the side indexes in step."""
        if key not in self:
            self[key] = default
        return dict.__getitem__(self, key)

    def update(self, *args: Any, **kwargs: Any) -> None:
        """``dict.update``, keeping the side indexes in step."""
        for k, v in dict(*args, **kwargs).items():
            self[k] = v

    def clear(self) -> None:
        """``dict.clear``, keeping the side indexes in step."""
        dict.clear(self)
        self._clear_indexes()


class BindingMap(_IndexedDict):
    """Placement's ``bindings`` ((session, component or ``llm:model``) -> worker) that also keeps
    two side indexes: ``llm``, the LLM part as (session, model) -> worker (the view's
    ``kv_affinity``; an ``immutables.Map``, replaced on each change), and ``by_worker``,
    worker -> its binding keys (what a lost worker takes with it, found without scanning
    every binding).

    A dict subclass so that placement's code, and anything reading its bindings, is
    unchanged; every mutating method keeps the side indexes in step (O(1) each, O(log n) for
    ``llm``)."""

    __slots__ = ("by_worker", "llm")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        # an immutable map (O(log n) per update): the control loop's views hold it as it is
        self.llm: immutables.Map = immutables.Map()
        self.by_worker: dict[str, dict[tuple, None]] = {}
        self.update(*args, **kwargs)

    @staticmethod
    def _llm_key(key: Any) -> tuple | None:
        if isinstance(key, tuple) and len(key) == 2 and isinstance(key[1], str) and key[1].startswith("llm:"):
            return (key[0], key[1][4:])
        return None

    def _unindex(self, key: Any, worker: Any) -> None:
        keys = self.by_worker.get(worker)
        if keys is not None:
            keys.pop(key, None)
            if not keys:
                del self.by_worker[worker]

    def _drop(self, key: Any, worker: Any) -> None:
        self._unindex(key, worker)
        k = self._llm_key(key)
        if k is not None:
            if k in self.llm:
                self.llm = self.llm.delete(k)

    def _clear_indexes(self) -> None:
        self.llm = immutables.Map()
        self.by_worker.clear()

    def keys_on(self, worker: str) -> list[tuple]:
        """The binding keys pointing at ``worker`` (O(those), a copy: safe to delete while iterating)."""
        return list(self.by_worker.get(worker, ()))

    def __setitem__(self, key: Any, value: Any) -> None:
        old = dict.get(self, key, _ABSENT)
        dict.__setitem__(self, key, value)
        if old is not _ABSENT and old != value:
            self._unindex(key, old)
        self.by_worker.setdefault(value, {})[key] = None
        k = self._llm_key(key)
        if k is not None and self.llm.get(k, _ABSENT) != value:  # a rebind to the same worker: no new map
            self.llm = self.llm.set(k, value)


class Tally(dict):
    """Counts keyed by anything (placement's ``open_placed``: (worker, what) -> open placed calls).

    Reading a missing key gives 0 *without* inserting it (a ``defaultdict(int)`` inserts on
    every read: choosing among candidates would leave a zero entry per worker ever
    considered, which a lost worker's cleanup would then have to scan for)."""

    __slots__ = ()

    def __missing__(self, key: Any) -> int:
        return 0

    def decrement(self, key: Any) -> None:
        """Count one less of ``key``; the entry goes at zero (never below)."""
        n = dict.get(self, key, 0) - 1
        if n > 0:
            dict.__setitem__(self, key, n)
        else:
            self.pop(key, None)


class PlacedMap(_IndexedDict):
    """Placement's ``placed`` (call key -> (worker, what) it was pinned to) that also keeps
    ``by_worker``: worker -> {key: what} of the calls pinned there, so a lost worker's calls
    (and its open-call counters) are found in O(its calls), not by scanning every placed call.

    Every write goes through the mapping's methods, so any code that re-places a call (the
    placement's ``place``/``unplace``, a migration) keeps the index in step."""

    __slots__ = ("by_worker",)

    def __init__(self) -> None:
        super().__init__()
        self.by_worker: dict[str, dict[Any, str]] = {}

    def _drop(self, key: Any, where: tuple[str, str]) -> None:
        keys = self.by_worker.get(where[0])
        if keys is not None:
            keys.pop(key, None)
            if not keys:
                del self.by_worker[where[0]]

    def _clear_indexes(self) -> None:
        self.by_worker.clear()

    def __setitem__(self, key: Any, value: tuple[str, str]) -> None:
        old = dict.get(self, key)
        dict.__setitem__(self, key, value)
        if old is not None and old[0] != value[0]:
            self._drop(key, old)
        self.by_worker.setdefault(value[0], {})[key] = value[1]


@dataclass(frozen=True)
class ViewSources:
    """What a view is built from, and nothing more: the workers (``roster``), the calls and
    sessions (``state``), the bindings (placement's :class:`BindingMap`: the KV affinity),
    whether admission holds a call (``is_held``) and the control plane's routes
    (``routes``: component -> workers)."""

    roster: Roster
    state: WorkflowState
    bindings: dict
    is_held: Callable[[str], bool]
    routes: Callable[[], Mapping[str, tuple[str, ...]]] = dict


def session_view(rec: Any) -> SessionView:
    """The frozen view of one :class:`~dask_agents.scheduler_plugin.state.SessionRecord`."""
    return make_session_view(rec.id, rec.tenant, rec.created, rec.progress, rec.open_calls, rec.state, rec.workflow)


def call_view(src: ViewSources, ts: Any, rec: Any, worker: str | None) -> CallView:
    """The frozen view of one waiting call (``ts``: its TaskState, ``rec``: its CallRecord)."""
    state = src.state
    s = state.sessions.get(rec.session) if rec.session is not None else None
    # CallView's fields in order: key, component, kind, session, tenant, worker, priority,
    # created, ready, stateful, model, restricted, input_bytes, batch_max
    return make_call_view(
        rec.key, rec.component, rec.kind, rec.session, s.tenant if s is not None else None,
        worker, dask_compat.priority(ts), rec.created, rec.ready, rec.stateful, rec.model,
        # restricted: restrictions we did not set ourselves (LLM calls are pinned by us to a model host)
        dask_compat.has_foreign_restrictions(ts)
        or (rec.kind != "llm" and not rec.stateful and dask_compat.has_strict_worker_restriction(ts)),
        dask_compat.input_bytes(ts), rec.batch_max,
    )


def _common(src: ViewSources, draining: Iterable[str]) -> tuple[dict, dict]:
    """Components and models: small (one entry per component / model), built each tick."""
    bounded = src.state.component_bounds
    routes = src.routes() if bounded else {}
    components = {}
    for c, stats in src.state.component_stats().items():
        if c in bounded:  # its replicas: the live workers of its route
            replicas = tuple(w for w in routes.get(c, ()) if src.roster.alive(w))
            components[c] = ComponentView(c, *stats, replicas, *bounded[c], src.state.component_models.get(c))
        else:
            components[c] = ComponentView(c, *stats)
    draining = set(draining)
    bounds = model_bounds()
    models = {
        m: ModelView(m, component_name(m), tuple(sorted(w for w in hosts if w not in draining)),
                     *bounds.get(m, (1, None)))
        for m, hosts in src.roster.hosts.items()
    }
    return components, models


def _affinity(src: ViewSources) -> dict:
    b = src.bindings
    if isinstance(b, BindingMap):
        return b.llm
    return {(sid, what[4:]): w for (sid, what), w in b.items() if what.startswith("llm:")}


def scan_view(src: ViewSources, now: float, max_calls: int, idle_since: dict[str, float],
              draining: Iterable[str] = ()) -> ClusterView:
    """The view built from scratch from scheduler state (O(tasks on workers + sessions)).

    At most ``max_calls`` waiting calls, the first found (workers in the scheduler's order,
    then the scheduler's queue best priority first). The reference the incremental index is
    tested against, and the baseline of ``benchmarks/control_scale.py``."""
    s = src.roster.scheduler
    state = src.state
    budget = max_calls
    calls: dict[str, CallView] = {}
    workers: dict[str, WorkerView] = {}
    truncated = False
    for ws in dask_compat.workers(s):
        address, nthreads, processing, running = dask_compat.worker_summary(ws)
        queued = []
        if processing > running and budget > 0:
            for ts in dask_compat.waiting_on_worker(ws):
                rec = state.calls.get(dask_compat.task_key(ts))
                if rec is None:
                    continue
                if budget <= 0:
                    truncated = True
                    break
                cv = call_view(src, ts, rec, address)
                calls[cv.key] = cv
                queued.append(cv)
                budget -= 1
        queued.sort(key=lambda c: c.priority)
        workers[address] = _worker_view(src, address, nthreads, processing, running,
                                        tuple(c.key for c in queued), now, idle_since)
    for ts in dask_compat.queued_on_scheduler(s, budget):
        rec = state.calls.get(dask_compat.task_key(ts))
        if rec is not None:
            cv = call_view(src, ts, rec, None)
            calls[cv.key] = cv
    sessions = {sid: session_view(r) for sid, r in state.sessions.items() if r.state != "completed"}
    draining = set(draining)
    components, models = _common(src, draining)
    affinity = _affinity(src)
    kv_tokens = {}
    for sid, model in affinity:
        rec = state.sessions.get(sid)
        ctx = getattr(rec, "context_tokens", None) if rec is not None else None
        if ctx and model in ctx:
            kv_tokens[(sid, model)] = ctx[model]
    return ClusterView.freeze(now, workers, calls, sessions, components, affinity, truncated, models,
                              draining, kv_tokens, state.expected_times())


def _worker_view(src: ViewSources, address: str, nthreads: int, processing: int, running: int,
                 queued: tuple[str, ...], now: float, idle_since: dict[str, float],
                 cache: dict | None = None) -> WorkerView:
    """The view of one worker; with ``cache`` (address -> (signature, view)), an unchanged
    worker with an empty queue gets last tick's object back (most workers, most ticks)."""
    if processing == 0:
        idle_since.setdefault(address, now)
    else:
        idle_since.pop(address, None)
    info = src.roster.ready.get(address)
    if cache is not None and not queued:
        sig = (nthreads, processing, running, tuple(info["models"]) if info and "models" in info else (),
               idle_since.get(address), info is not None)
        hit = cache.get(address)
        if hit is not None and hit[0] == sig:
            return hit[1]
        wv = _worker_view(src, address, nthreads, processing, running, queued, now, idle_since)
        cache[address] = (sig, wv)
        return wv
    # WorkerView's fields in order: address, nthreads, processing, running, queued, models,
    # idle_since, agents_ready
    return make_worker_view(
        address, nthreads, processing, running, queued,
        tuple(info["models"]) if info and "models" in info else (),
        idle_since.get(address), info is not None,
    )


class ViewIndex:
    """The control loop's view, kept up to date by the scheduler plugin's hooks.

    Event methods (``on_*``, ``forget``) run on the scheduler's critical path and are O(1).
    ``build`` runs once per control tick. Its Python work is O(workers + sessions touched
    since the last tick + ``max_calls``), independent of the number of live futures. The
    policies read the view on other threads while these hooks keep mutating the index, so the
    view must not share a mutable mapping with it: the live-session views, the LLM bindings
    and ``kv_tokens`` are immutable maps (``immutables.Map``, a hash array mapped trie: an
    update is O(log n) and makes a new map sharing the rest), handed to the view as they are;
    copying them as dicts took 10 ms of a 26 ms view at 24k live sessions (the copy touches
    every entry)."""

    def __init__(self, src: ViewSources):
        self.src = src
        # worker -> {key: [CallRecord, TaskState or None, CallView or None]} of calls processing
        # there that had not started when last looked at (an index per replica), in arrival
        # order. The CallView is built the first time a tick needs it and kept while the call
        # stays put (re-checked against the task's current priority); an entry is new after
        # every transition or move, so a changed call never keeps a stale view.
        self.on_worker: dict[str, dict[str, list]] = {}
        # worker -> {key: component} of calls seen executing or seceded there: later ticks skip
        # them (a started task stays started until its next transition, which removes it). The
        # component is kept so the entry can be dropped, and ``per_replica`` corrected, without
        # the call's record (``forget``: the state may have evicted it).
        self.started: dict[str, dict[str, str]] = {}
        # key -> worker it is processing on; its entry is in ``on_worker[worker]`` or
        # ``started[worker]`` (both carry the component): O(1) to drop without the record
        self.where: dict[str, str] = {}
        # held back by the scheduler: key -> [CallRecord, TaskState or None, CallView or None]
        self.sched_queued: OrderedDict[str, list] = OrderedDict()
        self.per_replica: Counter[tuple[str, str]] = Counter()  # (component, worker) -> processing calls
        self.ring: OrderedDict[str, None] = OrderedDict()  # worker visiting order (carry-over)
        self.sessions: immutables.Map = immutables.Map()  # live (not completed) sessions -> SessionView
        # (session, model) -> context tokens held where the session's KV lives (kv_affinity)
        self.kv_tokens: immutables.Map = immutables.Map()
        self._token_models: dict[str, tuple[str, ...]] = {}  # session -> models it has entries for
        self.idle_since: dict[str, float] = {}
        self.stats: Counter[str] = Counter()  # call views built, index entries healed
        self._healed_into: set[str] = set()  # workers that gained calls by healing, this build
        self._idle_views: dict[str, tuple] = {}  # address -> (signature, WorkerView) of queue-less workers

    # -- events (critical path: O(1) each) ---------------------------------------------------
    def on_transition(self, rec: Any, finish: str, worker: str | None, ts: Any = None) -> None:
        """A call's scheduler state changed (``worker``: where it is processing, if it is;
        ``ts``: its TaskState when the caller has it at hand)."""
        key = rec.key
        self._leave(key, rec.component)
        if finish == _ON_WORKER and worker is not None:
            self._enter(rec, worker, ts)
        elif finish == _HELD:
            self.sched_queued[key] = [rec, ts, None]

    def on_held(self, rec: Any) -> None:
        """An LLM call waits in the scheduler for an engine with room (``dask_agents.scheduler_plugin.admission``):
        policies see it beside the calls Dask's queue holds back (worker None)."""
        self.sched_queued[rec.key] = [rec, None, None]

    def on_migrated(self, rec: Any, target: str) -> None:
        """A call moved to ``target``: Dask confirmed the steal (it moves a task without a
        transition, so the index is told here)."""
        key = rec.key
        w = self.where.get(key)
        if w is not None and w != target:
            entry = self.on_worker.get(w, {}).get(key)
            self._leave(key, rec.component)
            self._enter(rec, target, entry[1] if entry else None)

    def on_worker_removed(self, address: str, dropped_llm: Iterable[tuple[str, str]] = ()) -> None:
        """A worker left (or stopped running): its calls transition elsewhere (those events
        re-add them). ``dropped_llm``: the (session, model) LLM bindings the plugin dropped with
        it; their KV token entries go too. O(the worker's entries + ``dropped_llm``)."""
        self.ring.pop(address, None)
        self.idle_since.pop(address, None)
        self._idle_views.pop(address, None)
        for key, entry in list(self.on_worker.get(address, {}).items()):
            self._leave(key, entry[0].component)
        for key, component in list(self.started.get(address, {}).items()):
            self._leave(key, component)
        self.on_worker.pop(address, None)
        self.started.pop(address, None)
        affinity = _affinity(self.src)
        for sid, model in dropped_llm:
            if (sid, model) in affinity:
                continue  # bound again meanwhile: its entry belongs to the new binding
            if (sid, model) in self.kv_tokens:
                self.kv_tokens = self.kv_tokens.delete((sid, model))
                ms = tuple(m for m in self._token_models.get(sid, ()) if m != model)
                if ms:
                    self._token_models[sid] = ms
                else:
                    self._token_models.pop(sid, None)

    def forget(self, key: str) -> None:
        """Drop whatever the index holds for ``key`` without its call record (O(1)).

        For calls the workflow state no longer records (it evicts session-less calls past
        ``max_loose_calls`` even while they run, and drops expired sessions' calls): the
        plugin's ``transition`` hook calls this when such a call leaves ``processing``, so
        their ``where``/``started``/``per_replica`` entries do not outlive them."""
        w = self.where.get(key)
        if w is None:
            self.sched_queued.pop(key, None)
            return
        entry = self.on_worker.get(w, {}).get(key)
        component = entry[0].component if entry is not None else self.started.get(w, {}).get(key)
        self._leave(key, component)

    def _enter(self, rec: Any, worker: str, ts: Any) -> None:
        q = self.on_worker.get(worker)
        if q is None:
            q = self.on_worker[worker] = {}
        q[rec.key] = [rec, ts, None]
        self.where[rec.key] = worker
        self.per_replica[(rec.component, worker)] += 1

    def _leave(self, key: str, component: str | None) -> None:
        w = self.where.pop(key, None)
        if w is None:
            self.sched_queued.pop(key, None)
            return
        q = self.on_worker.get(w)
        if q is not None and q.pop(key, None) is None:
            st = self.started.get(w)
            if st is not None:
                st.pop(key, None)
        if component is not None:
            c = self.per_replica.get((component, w), 0) - 1
            if c > 0:
                self.per_replica[(component, w)] = c
            else:
                self.per_replica.pop((component, w), None)

    def replica_load(self, component: str) -> dict[str, int]:
        """worker -> calls of ``component`` processing there (O(entries): for reports, not ticks)."""
        return {w: n for (c, w), n in self.per_replica.items() if c == component}

    # -- sessions ------------------------------------------------------------------------
    def sync_sessions(self) -> int:
        """Redo the views of the sessions touched since the last call; returns how many.

        Also run from the plugin's housekeeping so the touched set stays small while the
        control loop is stopped."""
        state = self.src.state
        touched = getattr(state, "touched", None)
        if touched is None:  # an older WorkflowState: rebuild all
            self.sessions = immutables.Map(
                {sid: session_view(r) for sid, r in state.sessions.items() if r.state != "completed"})
            return len(self.sessions)
        n = len(touched)
        if not n:
            return 0
        # the maps a view holds stay as they were
        sessions, kv_tokens = self.sessions.mutate(), self.kv_tokens.mutate()
        affinity = _affinity(self.src)
        token_models = self._token_models
        while touched:
            sid = touched.pop()
            r = state.sessions.get(sid)
            for m in token_models.pop(sid, ()):
                kv_tokens.pop((sid, m), None)
            if r is None or r.state == "completed":
                sessions.pop(sid, None)
                continue
            sessions[sid] = session_view(r)
            ctx = getattr(r, "context_tokens", None)
            if ctx:
                ms = tuple(m for m in ctx if (sid, m) in affinity)
                for m in ms:
                    kv_tokens[(sid, m)] = ctx[m]
                if ms:
                    token_models[sid] = ms
        self.sessions, self.kv_tokens = sessions.finish(), kv_tokens.finish()
        return n

    # -- one tick ---------------------------------------------------------------------------
    def build(self, now: float, max_calls: int, draining: Iterable[str] = ()) -> ClusterView:
        """The view for one tick (see the module docstring for the window it covers)."""
        src = self.src
        s = src.roster.scheduler
        ring = self.ring
        idle_since = self.idle_since
        summaries: dict[str, tuple] = {}
        waiting_total = 0
        for ws in dask_compat.workers(s):
            address, nthreads, processing, running = dask_compat.worker_summary(ws)
            summaries[address] = (ws, nthreads, processing, running)
            if processing > running:
                waiting_total += processing - running
            if address not in ring:
                ring[address] = None
        if len(ring) != len(summaries):
            for gone in [a for a in ring if a not in summaries]:
                self.on_worker_removed(gone)

        # Budget: held-back calls get at least a quarter (their priorities matter too), the
        # rest goes to whole worker queues; what one side does not use, the other may.
        n_held = len(self.sched_queued)
        held_quota = min(n_held, max(max_calls // 4, max_calls - waiting_total))
        budget = max_calls - held_quota

        calls: dict[str, CallView] = {}
        workers: dict[str, WorkerView] = {}
        truncated = False
        visited: list[str] = []
        self._healed_into = healed = set()
        # One worker's queue is taken whole even beyond the budget (its WorkerView must be
        # complete), up to this much; a larger queue is cut and the view says truncated.
        cap = max(4 * max_calls, 256)
        for address in list(ring):
            ws, nthreads, processing, running = summaries[address]
            if processing <= running:  # nothing waits there: complete as it is
                if self.on_worker.get(address):  # calls that started, or that Dask moved away
                    self._worker_calls(s, ws, address, 0)
                workers[address] = _worker_view(src, address, nthreads, processing, running, (), now, idle_since,
                                                self._idle_views)
                continue
            if budget <= 0 or (visited and processing - running > budget):
                truncated = True  # left for a later tick (it stays ahead in the ring)
                continue
            visited.append(address)
            queued = self._worker_calls(s, ws, address, max(budget, cap) if not visited[:-1] else budget)
            truncated |= len(queued) >= cap
            budget -= len(queued)
            self._emit(src, address, summaries[address], queued, now, calls, workers)
        # Calls Dask moved without a transition were found on their old worker above; a new
        # worker already emitted is redone so that its queue is complete in this view.
        for address in healed.intersection(visited):
            old = workers[address].queued
            queued = self._worker_calls(s, summaries[address][0], address, max(budget, 0) + len(old))
            budget -= len(queued) - len(old)
            self._emit(src, address, summaries[address], queued, now, calls, workers)
        for address in visited:  # carry-over: the next tick starts with the workers not visited
            ring.move_to_end(address)
        if budget > 0:
            held_quota += budget
        truncated |= self._held_calls(s, held_quota, calls) < len(self.sched_queued)
        self.sync_sessions()
        draining = set(draining)
        components, models = _common(src, draining)
        return ClusterView.freeze(now, workers, calls, self.sessions, components, _affinity(src),
                                  truncated, models, draining, self.kv_tokens, src.state.expected_times())

    def _emit(self, src: ViewSources, address: str, summary: tuple, queued: list[CallView], now: float,
              calls: dict, workers: dict) -> None:
        _ws, nthreads, processing, running = summary
        queued.sort(key=_priority)
        for cv in queued:
            calls[cv.key] = cv
        workers[address] = _worker_view(src, address, nthreads, processing, running,
                                        tuple(c.key for c in queued), now, self.idle_since)

    def _worker_calls(self, s: Any, ws: Any, address: str, budget: int) -> list[CallView]:
        """The not-started calls processing on ``ws`` (at most ``budget``), correcting the
        index where Dask moved a task without a transition (a steal, a refused steal)."""
        out: list[CallView] = []
        q = self.on_worker.get(address)
        if not q:
            return out
        state_calls = self.src.state.calls
        task, state, processing_on = dask_compat.task, dask_compat.state, dask_compat.processing_on
        started, priority = dask_compat.started_on_worker, dask_compat.priority
        for key, entry in list(q.items()):
            rec, ts, cv = entry
            if ts is None:
                ts = entry[1] = task(s, key)
            if (ts is None or state(ts) != _ON_WORKER
                    or (rec.session is None and state_calls.get(key) is not rec)):  # loose calls are evicted
                self._leave(key, rec.component)
                continue
            actual = processing_on(ts)
            if actual != address:
                self.stats["healed"] += 1
                self._leave(key, rec.component)
                if actual is not None:
                    self._enter(rec, actual, ts)
                    self._healed_into.add(actual)
                continue
            if started(ws, ts):
                del q[key]
                st = self.started.get(address)
                if st is None:
                    st = self.started[address] = {}
                st[key] = rec.component
                continue
            if len(out) >= budget:
                if budget:
                    break
                continue  # budget 0: only correcting the index (started or moved calls)
            if cv is None or cv.priority != priority(ts):
                cv = entry[2] = call_view(self.src, ts, rec, address)
                self.stats["built"] += 1
            out.append(cv)
        return out

    def _held_calls(self, s: Any, quota: int, calls: dict) -> int:
        """Add up to ``quota`` calls the scheduler holds back, rotating through them."""
        held = self.sched_queued
        taken = 0
        state_calls = self.src.state.calls
        for key in self._first(held, quota):
            held.move_to_end(key)
            entry = held[key]
            rec, ts, cv = entry
            if ts is None:
                ts = entry[1] = dask_compat.task(s, key)
            if (ts is None or not (dask_compat.is_queued_on_scheduler(s, ts) or self.src.is_held(key))
                    or (rec.session is None and state_calls.get(key) is not rec)):
                del held[key]
                continue
            if cv is None or cv.priority != dask_compat.priority(ts):
                cv = entry[2] = call_view(self.src, ts, rec, None)
                self.stats["built"] += 1
            calls[key] = cv
            taken += 1
        return taken

    @staticmethod
    def _first(d: OrderedDict, n: int) -> list:
        out: list = []
        if n <= 0:
            return out
        for k in d:
            out.append(k)
            if len(out) >= n:
                break
        return out


def _priority(cv: CallView) -> tuple:
    return cv.priority
