"""The global controller, first part: a SchedulerPlugin that records every call and keeps the
workflow view (per-session live graphs, flattened workflow graph, per-component durations).

It also places the calls that must go to a particular worker, while they are still
``released`` in ``update_graph``:

- stateful components: every call of a (session, component) goes to one worker, where the
  worker plugin keeps the session's instance;
- LLM calls: to a worker hosting the model, preferring the one that already served the
  session (its KV is there: session affinity).

Everything on the event loop is O(1) per task; housekeeping (retention) runs periodically.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict, defaultdict, deque
from typing import Any

from distributed import Scheduler, SchedulerPlugin

import dask_agents.config as agents_config
from dask_agents.annotation import ANNOTATION, MAX_LABEL, sanitize_annotation
from dask_agents.models import DRIVER
from dask_agents.scheduler_plugin import dask_compat, engine_health, metrics, validate
from dask_agents.scheduler_plugin.actions import Kill, Provision
from dask_agents.scheduler_plugin.admission import HELD, Admission
from dask_agents.scheduler_plugin.control import ControlLoop
from dask_agents.scheduler_plugin.kv_hints import KVHints
from dask_agents.scheduler_plugin.policies import prioritize
from dask_agents.scheduler_plugin.recovery import Recovery
from dask_agents.scheduler_plugin.state import TERMINAL, WorkflowState
from dask_agents.scheduler_plugin.timeseries import TimeSeries
from dask_agents.scheduler_plugin.view_index import BindingMap, PlacedMap, Tally, ViewIndex

logger = logging.getLogger(__name__)

NAME = "dask-agents"
REPORT_OP = "agents-report"
ROUTES_OP = "agents-routes"  # dask_agents.worker_plugin.plugin.ROUTES_OP
MAX_UNLINKED = 10_000  # calls parked until the record of their fast-path creator arrives
SESSION_END_OP = "agents-session-end"  # client -> scheduler, on the client's stream (ordered with its submits)
SESSION_OPEN_OP = "agents-session-open"  # client -> scheduler, on entering a da.session block
LOST = "inproc://dask-agents-lost-instance"
"""Where a stateful call whose instance is gone is pinned: no worker has this address, so the
call cannot run anywhere (never on a fresh instance); recovery fails it with InstanceLostError."""
AWAITING = "inproc://dask-agents-awaiting-worker"
"""Where a stateful call waits while the cluster has no worker to bind its instance to: placed
for real when one joins (so every call of the instance goes to the same one)."""
ORPHANED = "inproc://dask-agents-orphaned-call"
"""Where a call whose creator ended before it arrived waits until its cancel lands (it must not
start meanwhile); one another client also wants is placed again then."""


class AgentsSchedulerPlugin(SchedulerPlugin):
    """Records calls and sessions; routes stateful and LLM calls; serves the client API."""

    name = NAME
    idempotent = True
    LOST = LOST
    AWAITING = AWAITING
    HELD = HELD

    def __init__(self) -> None:
        self.scheduler: Scheduler | None = None
        self.state = WorkflowState()
        self.ready_workers: dict[str, dict] = {}  # address -> hello info
        self.model_workers: dict[str, set[str]] = defaultdict(set)
        # (session, component or llm:model) -> worker; a dict that also indexes the LLM part
        # (the control view's KV affinity) so a tick does not scan every binding
        self.bindings: dict[tuple[str, str], str] = BindingMap()
        self.session_bindings: dict[str, list[tuple[str, str]]] = defaultdict(list)  # index by session
        self.session_workers: dict[str, set[str]] = defaultdict(set)  # stateful hosts, LLM KV holders
        self.migrating: dict[str, tuple[str, str, str]] = {}  # LLM call -> (binding, source, target)
        # creator key -> calls it made that arrived before its own (fast-path) record
        self.unlinked: "OrderedDict[str, list[str]]" = OrderedDict()
        self.kv_hints = KVHints(self._send_kv_hint)  # what engines holding a session's KV should know
        self.bound: dict[str, int] = defaultdict(int)  # worker -> live sessions bound to it (KV/instances held)
        self.assigned: dict[str, int] = defaultdict(int)  # worker -> sessions ever bound (round-robin tie-break)
        # key -> (worker, what) of the calls we pinned; also indexed by worker (``placed.by_worker``)
        # so a lost worker's calls are found without scanning every placed call
        self.placed: PlacedMap = PlacedMap()
        self.placed_by_worker: dict[str, dict[Any, str]] = self.placed.by_worker  # worker -> {key: what}
        # open calls placed per (worker, what): the load that matters when choosing an engine
        # (a worker busy with agent tasks may have an idle engine). A read of a missing pair
        # gives 0 without inserting it and an entry goes at zero: a lost worker's are few.
        self.open_placed: Tally = Tally()
        self.client_sessions: dict[str, set[str]] = defaultdict(set)  # owner client -> its sessions
        self.orphans: dict[str, float] = {}  # session -> when its grace ends (its owner disconnected)
        self._lingering: dict[str, Any] = {}  # completed session -> timer releasing its instances
        self._cancelling: dict[str, str | None] = {}  # call -> client to cancel it for (its creator ended)
        self._orphaned: dict[str, tuple] = {}  # such a call -> its restrictions, while pinned to ORPHANED
        self.local_running: dict[str, set[str]] = defaultdict(set)  # worker -> fast-path calls running there
        self.awaiting: set[str] = set()  # stateful calls pinned to AWAITING (no worker yet)
        self.arrivals = itertools.count()
        self.control: ControlLoop | None = None
        self.view_index = ViewIndex(self)  # the control loop's view, updated by the hooks below
        self.prioritizing = False
        self._unkeep_stealing: Any = None  # undoes keeping our calls out of Dask's stealing
        # scale requests for the client-side cluster link (dask_agents.scaling)
        self.link_seen: float | None = None
        self.link_interval = 0.5
        self.pending_add = 0
        self.pending_remove: list[str] = []
        self.provision_for: deque[str] = deque()  # models new workers should host
        # what the dashboard and /metrics show (scheduler_plugin/metrics.py, dashboard.py)
        self.aggregates = metrics.Aggregates()
        self.timeseries = TimeSeries(self, agents_config.seconds("dashboard.timeseries-interval"),
                                     agents_config.seconds("dashboard.timeseries-window"),
                                     agents_config.seconds("dashboard.window"))
        self.dashboard: Any = None
        # calls pinned to a worker that died or left: re-placed or failed (scheduler_plugin/recovery.py)
        self.recovery = Recovery(self)
        # LLM calls the scheduler holds until an engine has room (scheduler_plugin/admission.py)
        self.admission = Admission(self)
        # sessions that ended, per worker holding their instances or KV, not yet told (batched)
        self._ending: dict[str, list[str]] = defaultdict(list)
        self._flushing_ends = False

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()

    # -- lifecycle ----------------------------------------------------------------------
    async def start(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        dask_compat.add_worker_stream_handler(scheduler, REPORT_OP, self._on_reports,
                                              on_refused=self.aggregates.rejected.stream_refused)
        dask_compat.add_stream_handler(scheduler, SESSION_END_OP, self._on_session_end_msg)
        dask_compat.add_stream_handler(scheduler, SESSION_OPEN_OP, self._on_session_open_msg)
        for name, handler in {
            "agents_worker_hello": self._hello,
            "agents_session_end": self._session_end,
            "agents_session_graph": self._session_graph,
            "agents_telemetry": self._telemetry,
            "agents_workflow_graph": self._workflow_graph,
            "agents_models": self._models,
            "agents_ping": self._ping,
            "agents_control": self._control,
            "agents_scale_requests": self._scale_requests,
            "agents_progress": self._progress,
        }.items():
            dask_compat.add_rpc_handler(scheduler, name, handler)
        dask_compat.set_worker_stream_interval(
            scheduler, dask_compat.worker_addresses(scheduler), agents_config.seconds("scheduler.batched-send-interval")
        )
        dask_compat.add_periodic(
            scheduler, "dask-agents-housekeeping", self.housekeeping, agents_config.seconds("scheduler.housekeeping-interval")
        )
        if self.admission.enabled:
            dask_compat.add_periodic(scheduler, "dask-agents-admission", self.admission.tick,
                                     agents_config.seconds("scheduler.admission.interval"))
        # A bad policy configuration fails here, loudly (register_plugin / scheduler start-up).
        self.control = ControlLoop(self)
        self.prioritizing = any(isinstance(p, prioritize.Prioritize) for p in self.control.policies.values())
        if agents_config.get("control.replace-stealing"):
            # Dask's stealing keeps balancing plain tasks; agent calls are the balance policy's
            # alone (Dask's would move them without knowing sessions, KV or instances)
            self._unkeep_stealing = dask_compat.keep_from_builtin_stealing(scheduler, self._is_call_task)
        if agents_config.get("control.enabled"):
            self.control.start()
        metrics.register(self)
        # sampled whether or not a page is open: a page opened late shows the last minutes
        dask_compat.add_periodic(scheduler, "dask-agents-timeseries", self.timeseries.sample,
                                 self.timeseries.interval_s)
        dask_compat.acyclic_task_group_layout()  # agent workflows make cycles of task groups
        if agents_config.get("dashboard.enabled"):
            from dask_agents.scheduler_plugin import dashboard

            self.dashboard = dashboard.install(self)

    async def close(self) -> None:
        metrics.unregister(self)
        if self.dashboard is not None:
            self.dashboard.uninstall()
            self.dashboard = None
        if self.scheduler is not None:
            dask_compat.remove_periodic(self.scheduler, "dask-agents-housekeeping")
            dask_compat.remove_periodic(self.scheduler, "dask-agents-admission")
            dask_compat.remove_periodic(self.scheduler, "dask-agents-timeseries")
            if self.control is not None:
                self.control.close()
            if self._unkeep_stealing is not None:
                self._unkeep_stealing()
                self._unkeep_stealing = None

    def _is_call_task(self, ts: Any) -> bool:
        """Whether ``ts`` is a component, tool or LLM call we recorded (O(1))."""
        return dask_compat.task_key(ts) in self.state.calls

    def add_worker(self, scheduler: Scheduler, worker: str) -> None:
        dask_compat.set_worker_stream_interval(scheduler, [worker], agents_config.seconds("scheduler.batched-send-interval"))
        if self.awaiting:
            scheduler.loop.add_callback(self._place_awaiting)

    def _place_awaiting(self) -> None:
        """A worker joined: bind the stateful calls that waited for one (all calls of one
        instance to one worker) and let Dask run them."""
        keys, self.awaiting = self.awaiting, set()
        stimulus = f"dask-agents-awaiting-{time.time()}"
        for key in keys:
            ts, rec = dask_compat.task(self.scheduler, key), self.state.calls.get(key)
            if ts is None or rec is None or dask_compat.worker_restrictions(ts) != {AWAITING}:
                continue
            self._place_stateful(ts, rec)
            if dask_compat.worker_restrictions(ts) != {AWAITING}:
                try:
                    dask_compat.reschedule(self.scheduler, [key], stimulus)
                except Exception:  # it stays no-worker: the next worker that joins tries again
                    logger.exception("dask-agents: placing stateful call %s failed", key)

    def remove_worker(self, scheduler: Scheduler, worker: str, **kwargs: Any) -> None:
        """``worker`` left: drop what it held, then recover the calls pinned to it.

        O(the worker's bindings and placed calls + models): the by-worker indexes of
        ``bindings`` and ``placed`` find them without scanning every session's."""
        self.ready_workers.pop(worker, None)
        for ws in self.model_workers.values():
            ws.discard(worker)
        # moves to or from it are moot (O(calls moved and not yet reported): a handful)
        for key in [k for k, (_w, src, dst) in self.migrating.items() if worker in (src, dst)]:
            del self.migrating[key]
        dropped_llm: list[tuple[str, str]] = []
        cause = self.recovery.cause(worker, kwargs.get("stimulus_id"))
        for k in self.bindings.keys_on(worker):
            del self.bindings[k]
            if k[1].startswith("llm:"):
                self.state.forget_kv(k[0], k[1][4:])  # its KV died with the engine
                dropped_llm.append((k[0], k[1][4:]))
            else:  # a stateful instance: its state went with the worker, for every later call too
                s = self.state.sessions.get(k[0])
                if s is not None:
                    s.lost[k[1]] = cause
        self.bound.pop(worker, None)
        self._lost_local_calls(worker, cause)
        # the open-call counters of the worker: one per kind of call placed there (the calls
        # themselves stay in ``placed`` until recovery re-places them or they end)
        for what in set(self.placed_by_worker.get(worker, {}).values()):
            self.open_placed.pop((worker, what), None)
        self.assigned.pop(worker, None)
        self.aggregates.forget_worker(worker)
        self.admission.on_worker_removed(worker)
        self.view_index.on_worker_removed(worker, dropped_llm)  # drops those sessions' KV token entries
        # after the bindings are gone, so re-placed calls and their sessions go elsewhere
        self.recovery.on_worker_removed(worker, kwargs.get("stimulus_id"))

    def _lost_local_calls(self, worker: str, cause: Any) -> None:
        """The fast-path calls that were running on ``worker`` when it left end erred, naming
        why: they ran in their caller's thread, so they died with it; Dask runs the caller
        again (it is a task), which makes its calls anew. Open, they would keep their session
        from ever completing."""
        from dask_agents.errors import where

        for key in self.local_running.pop(worker, ()):
            rec = self.state.calls.get(key)
            if rec is None or rec.state in TERMINAL:
                continue
            error = (f"{where(rec.component, rec.method, rec.session)}: {cause} while it ran there in its caller's "
                     f"thread; the caller runs again elsewhere (call {key})")
            self._call_event(rec, "erred", worker, None, error)

    def remove_client(self, scheduler: Scheduler, client: str) -> None:
        """The owner of some sessions disconnected: they wait ``session-grace`` for it to come
        back (a reconnecting ``Client`` keeps its id) before they are closed. Clients that own
        nothing (workers' own clients, which only submit nested calls) change nothing."""
        sids = self.client_sessions.get(client)
        if sids:  # completed ones need nothing from their owner any more
            sids.difference_update([sid for sid in sids if (s := self.state.sessions.get(sid)) is None
                                    or s.state == "completed"])
        if not sids:
            self.client_sessions.pop(client, None)
            return
        deadline = time.time() + agents_config.seconds("scheduler.session-grace")
        for sid in sids:
            s = self.state.sessions.get(sid)
            if s is not None and s.state == "active":  # one the driver already left goes on by itself
                self.orphans[sid] = deadline
        logger.info("dask-agents: client %s disconnected; its %d open sessions wait %s for it to reconnect",
                    client, len(sids), agents_config.get("scheduler.session-grace"))

    def add_client(self, scheduler: Scheduler, client: str) -> None:
        for sid in self.client_sessions.get(client, ()):
            self.orphans.pop(sid, None)  # reconnected within the grace: everything is kept

    # -- fast path ------------------------------------------------------------------------
    def update_graph(self, scheduler: Scheduler, *, client: str, keys: Any, tasks: Any,
                     annotations: dict, **kwargs: Any) -> None:
        ann_by_key = annotations.get(ANNOTATION)
        if not ann_by_key:
            return
        now = time.time()
        for key, raw in ann_by_key.items():
            # any client can annotate (dask.annotate(agents=...)): read it typed, or not at all,
            # so no value from outside can break a later handler (and cost a worker its stream)
            ann = sanitize_annotation(raw)
            if ann is None or ann.get("call") != key or not ann.get("component"):
                continue  # not a component, tool or LLM call: plain Dask work, left as Dask runs it
            ts = dask_compat.task(scheduler, key)
            if ts is None:
                continue
            rec = self.state.add_call(key, ann, dask_compat.dependency_keys(ts), now)
            if rec is None:
                continue
            rec.client = client
            parent = self._link_to_creator(rec)
            orphaned = parent is not None and parent.state in ("erred", "cancelled")
            if orphaned:  # it ended before its call arrived (its thread ran on)
                self._cancel_soon([key], client)
            # Priority at creation: session progress first (when prioritizing), then arrival.
            # Arrival gives FIFO among equals: Dask gives graphs submitted within its
            # fifo_timeout (100 ms) the same priority, and workers run equal priorities LIFO.
            user = dask_compat.priority(ts)[0]
            if self.prioritizing and rec.session is not None:
                progress = self.state.sessions[rec.session].progress
                dask_compat.set_priority(ts, prioritize.priority(user, progress, next(self.arrivals)))
            else:
                dask_compat.set_priority(ts, prioritize.fifo(user, next(self.arrivals)))
            if rec.session is not None:
                self._session_call(rec, client)
            if ann.get("stateful"):
                self._place_stateful(ts, rec)
            elif rec.kind == "llm":
                if not self.admission.on_call(ts, rec, ann):  # session-less, or admission off
                    model = ann.get("llm_model")
                    self._place(ts, rec.session, f"llm:{model}", None, model, rec.component)
            elif self.control is not None and rec.component in self.control.enforcer.routes:
                self._place(ts, None, rec.component, self._candidates(None, rec.component))
            elif ann.get("model") and rec.session is not None:
                self._near_engine(ts, rec.session, ann["model"])
            elif rec.kind == "agent" and rec.session is not None:
                model = self._session_model(rec.session)
                if model is not None:  # its LLM calls then run beside their engine (under its lease)
                    self._near_engine(ts, rec.session, model)
            if orphaned:  # and must not start before its cancel lands (measured: it did)
                self._orphaned[key] = dask_compat.restrictions(ts)
                dask_compat.restrict_to_worker(ts, ORPHANED)

    def _link_to_creator(self, rec: Any) -> Any:
        """Add ``rec`` to its creator's children and return the creator's record; a creator not
        recorded yet (a fast-path call, whose record comes later) finds it parked then."""
        parent = self.state.calls.get(rec.creator)
        if parent is not None:
            parent.children.append(rec.key)
        elif rec.creator != DRIVER:
            self.unlinked.setdefault(rec.creator, []).append(rec.key)
            while len(self.unlinked) > MAX_UNLINKED:
                self.unlinked.popitem(last=False)
        return parent

    def _session_call(self, rec: Any, client: str | None) -> None:
        """A call of ``rec.session`` arrived from ``client``. The first call made from outside
        the session (by its driver, not by one of its own calls) makes that client the owner.
        A call into a completed session whose instances are still kept (``instance-linger``)
        keeps them."""
        sid = rec.session
        s = self.state.sessions[sid]
        if s.owner is None and rec.creator not in s.calls and client is not None:
            self._own(s, client)
        timer = self._lingering.pop(sid, None)
        if timer is not None:
            self.scheduler.loop.remove_timeout(timer)

    def _own(self, s: Any, client: str) -> None:
        s.owner = client
        self.client_sessions[client].add(s.id)

    def _on_session_open_msg(self, session: Any = None, tenant: Any = None, client: Any = None, **kw: Any) -> None:
        """A driver entered its ``da.session`` block (on its client stream, before any of its
        calls): it owns the session, whoever submits into it first."""
        try:
            if not isinstance(client, str):
                raise ValueError("a session open from no client")
            session = validate.session_id(session, "agents-session-open: session")
            if tenant is not None and (not isinstance(tenant, str) or len(tenant) > MAX_LABEL):
                tenant = None
            s = self.state.session(session, tenant, time.time())
            if s.owner is None:
                self._own(s, client)
        except Exception as e:  # raising here would close the client's stream
            logger.warning("dask-agents: session open ignored: %s", e)

    def _place_stateful(self, ts: Any, rec: Any) -> None:
        """Pin a stateful call to its session's instance. Once an instance exists its calls go
        there and nowhere else, whatever routes or readiness say (elsewhere would be a fresh
        instance); if it is gone, the call fails (:meth:`_strand_lost`)."""
        sid, component = rec.session, rec.component
        if sid is None:  # outside any session: one instance per worker, anywhere
            self._place(ts, None, component, None, None, component)
            return
        s = self.state.sessions[sid]
        bound = self.bindings.get((sid, component))
        if bound is not None and component not in s.lost and not dask_compat.has_worker(self.scheduler, bound):
            s.lost[component] = self.recovery.cause(bound)  # gone without remove_worker having run yet
        if component in s.lost:
            self._strand_lost(ts)
        elif bound is not None:
            dask_compat.restrict_to_worker(ts, bound)
            self.placed[dask_compat.task_key(ts)] = (bound, component)
            self.open_placed[(bound, component)] += 1
        elif candidates := self._candidates(None, component):
            self._place(ts, sid, component, candidates)
        else:  # no worker at all yet: wait for one rather than let Dask scatter the instance
            dask_compat.restrict_to_worker(ts, AWAITING)
            self.awaiting.add(dask_compat.task_key(ts))

    def _near_engine(self, ts: Any, sid: str, model: str) -> None:
        """An agent call with the ``model=`` hint goes to the worker of the engine its session
        is bound to, when that worker has a free thread: the call and its LLM calls then stay in
        one process (no hop to the engine and back). Loosely: if that worker leaves, Dask places
        it anywhere. Without a binding yet, or a busy worker, Dask places it as usual."""
        bound = self.bindings.get((sid, f"llm:{model}"))
        if bound is not None and dask_compat.free_threads(self.scheduler, bound) > 0:
            dask_compat.prefer_worker(ts, bound)

    def _session_model(self, sid: str) -> str | None:
        """The one model whose engine session ``sid`` is bound to (None: none yet, or several:
        an agent without a ``model=`` hint then goes where Dask puts it). O(its bindings)."""
        models = [w[4:] for _s, w in self.session_bindings.get(sid, ()) if w.startswith("llm:")]
        return models[0] if len(models) == 1 else None

    def _strand_lost(self, ts: Any) -> None:
        """``ts`` is a call of a stateful instance that is gone: pin it where it cannot run and
        let recovery fail it with InstanceLostError (with the session's recorded cause)."""
        dask_compat.restrict_to_worker(ts, LOST)
        self.recovery.strand(dask_compat.task_key(ts))

    def _candidates(self, model: str | None, component: str) -> list[str]:
        pool = self.model_workers.get(model) if model is not None else None
        if not pool:
            pool = self.ready_workers.keys() or dask_compat.worker_addresses(self.scheduler)
        routed = self.control.enforcer.routes.get(component) if self.control is not None else None
        if routed:
            pool = [w for w in pool if w in routed] or pool
        return engine_health.exclude_dropped(self, model, [w for w in pool if dask_compat.has_worker(self.scheduler, w)])

    def _bound_ok(self, bound: str, model: str | None, component: str) -> bool:
        """Whether ``bound`` is still among ``_candidates(model, component)``, in O(1) (the
        candidates are O(workers) to list: not per call on the critical path)."""
        if self.control is not None and self.control.enforcer.routes.get(component):
            return bound in self._candidates(model, component)  # routed: rare, the slow way
        pool = self.model_workers.get(model) if model is not None else None
        if pool:
            if bound not in pool:
                return False
        elif self.ready_workers and bound not in self.ready_workers:
            return False
        return dask_compat.has_worker(self.scheduler, bound)

    def _place(self, ts: Any, session: str | None, what: str, candidates: list[str] | None,
               model: str | None = None, component: str | None = None) -> None:
        """Pin ``ts`` to the worker bound to (session, what), binding one first if needed.
        ``candidates`` None: those of (model, component), listed only when a binding is made."""
        bound = self.bindings.get((session, what)) if session is not None else None
        if candidates is None:
            keep = bound is not None and self._bound_ok(bound, model, component or what)
            if not keep:
                candidates = self._candidates(model, component or what)
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
                old = self.bindings.get((session, what))
                if old is None:
                    self.session_bindings[session].append((session, what))
                else:
                    if self.bound.get(old, 0) > 0:
                        self.bound[old] -= 1
                    if what.startswith("llm:") and old != bound:
                        # the new engine never held the session's KV: its next call recomputes
                        # the prefix there (what balance prices), until that call reports
                        self.state.forget_kv(session, what[4:])
                self.bindings[(session, what)] = bound
                self.bound[bound] += 1
                self.assigned[bound] += 1
                if not what.startswith("llm:"):
                    self.session_workers[session].add(bound)
        dask_compat.restrict_to_worker(ts, bound)
        self.placed[dask_compat.task_key(ts)] = (bound, what)
        self.open_placed[(bound, what)] += 1

    def _unplace(self, key: str) -> None:
        """The call is no longer pinned by us (it ended, or is being placed again)."""
        where = self.placed.pop(key, None)
        if where is not None:
            self.open_placed.decrement(where)

    def _move_placed(self, key: str, target: str) -> tuple[str, str] | None:
        """A placed call moved to ``target`` (a migration): move its placement bookkeeping
        (``placed``, its by-worker index, the open-call counters) in O(1). Returns its former
        (worker, what), or None if we had not placed it."""
        where = self.placed.get(key)
        if where is not None and where[0] != target:
            self.open_placed.decrement(where)
            self.placed[key] = (target, where[1])
            self.open_placed[(target, where[1])] += 1
        return where

    def _forget_unrecorded(self, key: Any, finish: str) -> None:
        """A task without a call record changed state: if it is a call the workflow state
        dropped while it was open (session-less calls past ``max_loose_calls``, calls of an
        expired session), drop what the view index, the KV hints and the placement
        bookkeeping still hold for it. O(1): a few dict lookups for any other task."""
        self.view_index.forget(key)
        self.kv_hints.forget(key)
        self.migrating.pop(key, None)
        if key in self.placed and (finish != "released" or not dask_compat.is_wanted(self.scheduler, key)):
            self._unplace(key)  # over (released and not wanted: cancelled); wanted: it runs again

    def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        if finish == "no-worker":  # pinned to a lost worker? (also calls past retention)
            self.recovery.on_no_worker(key)
        rec = self.state.calls.get(key)
        if rec is None:
            if finish != "processing":  # left a worker or the queue: nothing of it may stay behind
                self._forget_unrecorded(key, finish)
            return
        if rec.local:  # ran on a worker's fast path: its record says how it went; Dask's task of
            return  # its key only holds the published value (released when its futures are)
        worker = None
        ts = None
        if finish == "processing":
            ts = dask_compat.task(self.scheduler, key)
            worker = dask_compat.processing_on(ts) if ts is not None else None
        if finish == "released" and dask_compat.is_wanted(self.scheduler, key):
            self._call_event(rec, finish, worker, ts, None, rerun=True)
            return  # released to run again (its worker was lost), not cancelled: the call goes on
        error = None
        if finish == "erred":
            error = kwargs.get("exception_text")
            if not error:
                ts = ts if ts is not None else dask_compat.task(self.scheduler, key)
                error = dask_compat.task_error(ts) if ts is not None else None
        self._call_event(rec, finish, worker, ts, error)

    def _call_event(self, rec: Any, finish: str, worker: str | None, ts: Any, error: str | None,
                    rerun: bool = False, now: float | None = None) -> None:
        """A call changed state (``finish``: Dask's task state) on the scheduler path or, from a
        worker's report, on its fast path (``ts`` None): every observer hears it in one order."""
        key = rec.key
        if finish == "processing" and worker is not None and rec.kind == "llm" and rec.session is not None:
            self.session_workers[rec.session].add(worker)  # its KV is there: dropped at session end
        self.kv_hints.on_transition(rec, finish, worker)
        self.view_index.on_transition(rec, finish, worker, ts)
        if rec.kind == "llm":
            self.admission.on_transition(key, finish)
            if finish == "no-worker" and self.admission.is_held(key):  # waiting here: policies see it
                self.view_index.on_held(rec)
        if rerun:
            return
        if not self.state.on_transition(key, finish, now if now is not None else time.time(), worker, error):
            return
        self._unplace(key)
        if rec.children and rec.state in ("erred", "cancelled"):
            self._cancel_children(rec)
        if rec.session is not None:
            s = self.state.sessions.get(rec.session)
            if s is not None and s.state == "completed":
                self._on_session_completed(rec.session)

    def _on_reports(self, worker: str, reports: Any = None, engines: Any = None, calls: Any = None,
                    **kw: Any) -> None:
        """A worker's timing reports, its fast-path calls' records and engine stats, on its own
        stream (``worker`` is the stream's, never the message's); each record is checked before
        it is stored."""
        rejected = self.aggregates.rejected
        for r in validate.local_calls(self, worker, calls, rejected):
            try:
                self._local_call(worker, r)
            except Exception:  # one bad record is dropped; raising here would close the worker's stream
                logger.exception("dask-agents: a fast-path record from %s was dropped", worker)
        for r in validate.reports(self, worker, reports, rejected):
            try:
                self.state.on_report(r["key"], r["started"], r["finished"], worker, r["metrics"])
                rec = self.state.calls.get(r["key"])
                self.aggregates.on_report(rec)
                if rec is not None and rec.kind == "llm" and rec.session is not None:
                    self.admission.on_llm_report(rec)
                    self._llm_ran(rec, worker)
            except Exception:  # one bad report is dropped; raising here would close the worker's stream
                logger.exception("dask-agents: a report from %s was dropped", worker)
        if engines is not None:
            stats = validate.engine_stats(engines, validate.known_models(self), rejected, worker)
            if stats is not None:
                self.aggregates.on_engine_stats(worker, stats, time.time())
                self.admission.on_engine_stats(worker, stats)

    def _local_call(self, worker: str, r: dict) -> None:
        """A call that ran on ``worker``'s fast path (``worker_plugin/local.py``; checked by
        ``validate.local_call``): recorded, and its events replayed through every observer as
        if the scheduler had run it there (processing, then its end)."""
        key, now = r["key"], time.time()
        rec = self.state.calls.get(key)
        if rec is None:
            ann = r["ann"]
            rec = self.state.add_call(key, ann, (), ann.get("created") or now)
            if rec is None:
                return
            rec.local = True
            self._link_to_creator(rec)
            for k in self.unlinked.pop(key, ()):
                child = self.state.calls.get(k)
                if child is not None:
                    self.state.link(rec, child)
            if rec.session is not None:
                self._session_call(rec, None)
            if r["started"] is not None:
                self._call_event(rec, "processing", worker, None, None, now=r["started"])
                if rec.kind == "llm":
                    self.admission.on_local_llm(key, worker, r["ann"].get("llm_model"))
        state = r["state"]
        if state == "processing":
            self.local_running[worker].add(key)
            return
        running = self.local_running.get(worker)
        if running is not None:
            running.discard(key)
        if r["started"] is not None and rec.state not in TERMINAL:
            self.state.on_report(key, r["started"], r["finished"], worker, r.get("metrics"))
            self.aggregates.on_report(rec)
            if rec.kind == "llm" and rec.session is not None and r.get("metrics"):
                self.admission.on_llm_report(rec)  # its tokens: working sets, as a scheduler-path call's
                self._llm_ran(rec, worker)
        self._call_event(rec, "released" if state == "cancelled" else state, worker, None, r["error"],
                         now=r["finished"] if r["finished"] is not None else now)

    def _llm_ran(self, rec: Any, worker: str) -> None:
        """An LLM call of a session finished on ``worker``: its KV is there (dropped at session
        end); a migration it was part of either happened (binding stays on the target) or the
        source refused it, the call having started (the binding goes back: the KV is there)."""
        moved = self.migrating.pop(rec.key, None)
        s = self.state.sessions.get(rec.session)
        if s is None or s.state == "completed":  # reports trail the transitions: it already ended
            if moved is not None and worker == moved[2] and dask_compat.has_worker(self.scheduler, worker):
                self._end_sessions(worker, [rec.session])  # the target never heard of it before
            return
        self.session_workers[rec.session].add(worker)
        self.kv_hints.holders[rec.session].add(worker)
        if moved is not None:
            what, source, target = moved
            if worker == source and self.bindings.get((rec.session, what)) == target:
                self.bindings[(rec.session, what)] = source
                if self.bound.get(target, 0) > 0:
                    self.bound[target] -= 1
                self.bound[source] += 1

    def _cancel_children(self, rec: Any) -> None:
        """``rec`` failed or was cancelled: the calls it created and that are still open can no
        longer matter (only it held their futures), so they are cancelled (soon, outside the
        transition); their own children follow when they end."""
        open_children = [c for k in rec.children if (c := self.state.calls.get(k)) is not None
                         and c.state not in ("finished", "erred", "cancelled")]
        for c in open_children:
            self._cancel_soon([c.key], c.client)

    def _cancel_soon(self, keys: list[str], client: str | None) -> None:
        """Cancel ``keys`` for ``client`` (the one that submitted them) soon, outside the
        transition: as ``client.cancel`` would, so a call someone else also wants (handed to
        ``fire_and_forget``, to another client) goes on."""
        if not self._cancelling:
            self.scheduler.loop.add_callback(self._flush_cancels)
        for k in keys:
            self._cancelling[k] = client

    def _flush_cancels(self) -> None:
        pending, self._cancelling = self._cancelling, {}
        by_client: dict[str | None, list[str]] = defaultdict(list)
        for k, client in pending.items():
            by_client[client].append(k)
        for client, keys in by_client.items():
            try:
                dask_compat.cancel_tasks(self.scheduler, keys, "dask-agents: the call that created it failed or was "
                                                               "cancelled", client=client)
            except Exception:  # a Dask internal that changed: the calls run on to their end
                logger.exception("dask-agents: cancelling %d orphaned nested calls failed", len(keys))
        # one another client also wants (fire_and_forget, a second client) goes on where it was placed
        orphaned, self._orphaned = self._orphaned, {}
        placed = []
        for k, saved in orphaned.items():
            ts = dask_compat.task(self.scheduler, k)
            if ts is not None and dask_compat.worker_restrictions(ts) == {ORPHANED}:
                dask_compat.set_restrictions(ts, saved)
                placed.append(k)
        if placed:
            dask_compat.reschedule(self.scheduler, placed, f"dask-agents-orphans-kept-{time.time()}")

    # -- called by the enforcement layer ---------------------------------------------------
    def on_migrated(self, key: str, source: str, target: str) -> None:
        """A call moved to ``target`` (the enforcement layer calls this once Dask confirmed the
        steal): record it. An LLM call that leaves the engine holding its
        session's KV takes the session with it (the balance policy priced the recompute): the
        session's later calls go where its prefix now lives; other bindings stay."""
        self.state.on_migrated(key, target)
        rec = self.state.calls.get(key)
        if rec is not None:
            self.view_index.on_migrated(rec, target)
        where = self.placed.get(key)
        if where is not None:
            self._unplace(key)
            self.placed[key] = (target, where[1])
            self.open_placed[(target, where[1])] += 1
            rec = self.state.calls.get(key)
            what = where[1]
            if (rec is not None and rec.session is not None and what.startswith("llm:")
                    and self.bindings.get((rec.session, what)) == source):
                self.bindings[(rec.session, what)] = target
                self.state.forget_kv(rec.session, what[4:])  # rebuilt on the target by this call
                # Dask's steal may still be refused (the call started): the report decides
                self.migrating[key] = (what, source, target)
                if self.bound.get(source, 0) > 0:
                    self.bound[source] -= 1
                self.bound[target] += 1

    def linked(self) -> bool:
        """A cluster link (``da.attach_cluster``) polled recently."""
        return self.link_seen is not None and time.time() - self.link_seen < max(5 * self.link_interval, 2.0)

    def scale(self, action: Provision | Kill) -> str | None:
        """Provision/kill workers; returns why not (None when done).

        With a cluster link, both go through the cluster manager; without one, a kill
        retires the worker on the scheduler and provisioning is impossible."""
        if isinstance(action, Kill):
            if not dask_compat.has_worker(self.scheduler, action.worker):
                return "unknown worker"
            if self.linked():
                self.pending_remove.append(dask_compat.worker_name(self.scheduler, action.worker))
            else:
                self.scheduler.loop.add_callback(self.scheduler.retire_workers, workers=[action.worker])
            return None
        if not self.linked():
            return "no cluster manager attached (da.attach_cluster(client, cluster))"
        if action.n < 1:
            return "n must be >= 1"
        self.pending_add += action.n
        if action.component is not None:
            self.provision_for.extend([action.component] * action.n)
        return None

    def _scale_requests(self, interval: float = 0.5) -> dict:
        interval = validate.interval(interval, "agents_scale_requests: interval")
        self.link_seen = time.time()
        self.link_interval = interval
        out = {"add": self.pending_add, "remove": list(self.pending_remove)}
        self.pending_add = 0
        self.pending_remove.clear()
        return out

    async def _assign_model(self, worker: str, model: str) -> None:
        try:
            hosted = await self.scheduler.rpc(worker).agents_swap_model(remove=None, add=model)
        except Exception as e:
            logger.warning("dask-agents: giving %s to new worker %s failed: %s", model, worker, e)
            return
        self.set_worker_models(worker, list(hosted))

    # -- sessions -------------------------------------------------------------------------
    def _close(self, sid: str, now: float, reason: str | None = None, abort: bool = False) -> None:
        """Close ``sid`` (the driver is done, or ``reason``: the scheduler closes it). With
        ``abort``, its open calls fail with SessionClosedError (``reason``) or, running, are
        cancelled: nobody is left to use their results."""
        self.orphans.pop(sid, None)
        known = self.state.sessions.get(sid)
        if known is not None and known.state == "completed":
            return  # already over: nothing to close
        s = self.state.close_session(sid, now)
        if reason is not None:
            s.closed_reason = reason
            logger.info("dask-agents: session %s closed: %s", sid, reason)
        if abort and s.open_calls > 0:
            self._abort(s, reason or "the session was closed")
        if s.state == "completed":
            self._on_session_completed(sid)

    def _abort(self, s: Any, reason: str) -> None:
        """Fail the session's open calls that have not started (SessionClosedError naming the
        call, session and ``reason``) and cancel the ones that are running."""
        from dask_agents.errors import SessionClosedError, where

        stimulus = f"dask-agents-session-closed-{time.time()}"
        running = []
        for rec in [r for r in s.calls.values() if r.state not in ("finished", "erred", "cancelled")
                    and not self._needed_elsewhere(r.key, s)]:
            exc = SessionClosedError(f"{where(rec.component, rec.method, s.id)}: the session was closed before the "
                                     f"call ran: {reason} (call {rec.key})", session=s.id)
            try:
                if not dask_compat.fail_task(self.scheduler, rec.key, exc, stimulus):
                    running.append(rec.key)
            except Exception:  # never leave it open: cancel it instead
                logger.exception("dask-agents: failing call %s of closed session %s failed", rec.key, s.id)
                running.append(rec.key)
        if running:
            try:
                dask_compat.cancel_tasks(self.scheduler, running, f"dask-agents: session {s.id} was closed: {reason}")
            except Exception:
                logger.exception("dask-agents: cancelling %d calls of closed session %s failed", len(running), s.id)

    def _needed_elsewhere(self, key: str, s: Any) -> bool:
        """Whether a task outside session ``s`` (another session's call, plain work) depends on
        call ``key``: giving up ``s`` must not break it."""
        ts = dask_compat.task(self.scheduler, key)
        return ts is not None and any(d not in s.calls for d in dask_compat.dependent_keys(ts))

    def _on_session_completed(self, sid: str) -> None:
        """``sid`` completed: its KV goes at once; its stateful instances (if any) after
        ``instance-linger``, unless a late call reopens the session first. Once per completion."""
        s = self.state.sessions.get(sid)
        if s is not None:
            if s.ended:
                return
            s.ended = True
            self.aggregates.on_session_completed(s)
            self.timeseries.on_session_completed(s)
        self.orphans.pop(sid, None)
        self.kv_hints.on_session_end(sid)
        self.admission.on_session_ended(sid)
        linger = agents_config.seconds("scheduler.instance-linger")
        if linger > 0 and any(not w.startswith("llm:") for _s, w in self.session_bindings.get(sid, ())):
            if sid not in self._lingering:
                self._lingering[sid] = self.scheduler.loop.call_later(linger, self._release_session, sid)
            return
        self._release_session(sid)

    def _release_session(self, sid: str) -> None:
        """Drop ``sid``'s bindings and tell the workers holding its instances or KV."""
        self._lingering.pop(sid, None)
        s = self.state.sessions.get(sid)
        if s is not None and s.state != "completed":
            return  # reopened meanwhile
        released = f"its instance was released when the session completed at " \
                   f"{time.strftime('%H:%M:%S', time.localtime((s.completed_at if s else None) or time.time()))}"
        for key in self.session_bindings.pop(sid, ()):
            w = self.bindings.pop(key, None)
            if w is None:
                continue
            if self.bound.get(w, 0) > 0:
                self.bound[w] -= 1
            if s is not None and not key[1].startswith("llm:"):  # a later call of it must not start afresh
                s.lost.setdefault(key[1], released)
        for key in [k for k, m in self.migrating.items() if m is not None and k in s.calls] if s is not None else ():
            _what, _source, target = self.migrating.pop(key)
            self.session_workers[sid].add(target)  # a moved call that has not reported yet
        for addr in self.session_workers.pop(sid, ()):
            if dask_compat.has_worker(self.scheduler, addr):
                self._end_sessions(addr, [sid])

    def _end_sessions(self, addr: str, sids: list[str]) -> None:
        """Tell ``addr`` (soon, batched) that ``sids`` ended: their KV and instances go."""
        self._ending[addr].extend(sids)
        if not self._flushing_ends:
            self._flushing_ends = True
            self.scheduler.loop.add_callback(self._flush_ends)

    def _send_kv_hint(self, worker: str, msg: dict) -> None:
        # Only to workers that said hello: they registered the op (an unknown op drops the comm).
        if worker in self.ready_workers and dask_compat.has_worker(self.scheduler, worker):
            dask_compat.send_to_worker(self.scheduler, worker, {**msg, "at": time.time()})

    async def _flush_ends(self) -> None:
        """Tell workers which sessions ended: one RPC per worker at a time, carrying every
        session that ended meanwhile. (One RPC per session opened hundreds of connections when
        thousands of sessions ended together, and the pool kept them.)"""
        import asyncio

        try:
            while self._ending:
                ending, self._ending = self._ending, defaultdict(list)
                await asyncio.gather(*(self._end_on_worker(a, sids) for a, sids in ending.items()))
        finally:
            self._flushing_ends = False

    async def _end_on_worker(self, addr: str, sids: list[str]) -> None:
        try:
            await self.scheduler.rpc(addr).agents_end_session(sessions=sids)
        except Exception as e:  # the worker left: its instances went with it
            logger.debug("dask-agents: end_session on %s failed: %s", addr, e)

    def housekeeping(self) -> None:
        """Drop completed sessions past retention (bounded memory); close the sessions whose
        driver did not come back within the grace, and idle ones; fold tick times into metrics."""
        now = time.time()
        for sid in [sid for sid, t in self.orphans.items() if t <= now]:
            s = self.state.sessions.get(sid)
            owner = s.owner if s is not None else None
            self.client_sessions.get(owner, set()).discard(sid)
            if owner in self.client_sessions and not self.client_sessions[owner]:
                del self.client_sessions[owner]
            self._close(sid, now, f"its driver (client {owner}) disconnected and did not reconnect within "
                                  f"{agents_config.get('scheduler.session-grace')}", abort=True)
        idle = agents_config.seconds("scheduler.session-idle-timeout")
        for sid in self.state.idle(now, idle):
            s = self.state.sessions.get(sid)
            if s is None:
                self.state.activity.pop(sid, None)
            elif s.open_calls > 0:  # calls still run: not idle
                self.state.active(s, now)
            else:
                self._close(sid, now, f"no activity for {agents_config.get('scheduler.session-idle-timeout')} "
                                      "(agents.scheduler.session-idle-timeout)")
        self.aggregates.fold_ticks(self.control)
        # per-call reports are only read over the dashboard's window: keep two
        self.aggregates.forget_before(time.time() - 2 * agents_config.seconds("dashboard.window"))
        self.view_index.sync_sessions()  # keeps the touched-session set small with the loop stopped
        dropped = self.state.expire(
            time.time(), agents_config.seconds("scheduler.session-retention"),
            int(agents_config.get("scheduler.max-retained-sessions")),
        )
        if dropped:  # a long-lived client's session index would otherwise grow without end
            for client in list(self.client_sessions):
                self.client_sessions[client].difference_update(dropped)
                if not self.client_sessions[client]:
                    del self.client_sessions[client]
            for sid in dropped:
                self.orphans.pop(sid, None)

    # -- RPC handlers (client API) ---------------------------------------------------------
    async def _hello(self, comm: Any, worker: Any = None, models: Any = None, pid: Any = None) -> dict:
        """A worker's plugin is ready (checked: it comes from that worker, which confirms what
        it hosts: ``validate.hello``)."""
        worker, models, pid = await validate.hello(self, comm, worker, models, pid)
        self.register_worker(worker, models, pid)
        return {"ok": True}

    def register_worker(self, worker: str, models: list[str], pid: int | None = None) -> None:
        """``worker``'s plugin is ready and hosts ``models`` (its hello, checked)."""
        new = worker not in self.ready_workers
        info = self.ready_workers.setdefault(worker, {"since": time.time()})
        info["pid"] = pid
        if new:  # its first hello: what it hosts from the start (a later one announces lazy engines)
            self.admission.on_hello(models)
        self.set_worker_models(worker, models)
        if new and self.control is not None and self.control.enforcer.routes:
            self.push_routes([worker])
        if new and self.provision_for:  # a worker we asked for: give it its model
            self.scheduler.loop.add_callback(self._assign_model, worker, self.provision_for.popleft())

    def push_routes(self, workers: list[str] | None = None) -> None:
        """Send the control plane's routes to ``workers`` (default: every ready one): calls
        made on a worker's fast path go only where their component is routed."""
        routes = self.control.enforcer.routes if self.control is not None else {}
        msg = {"op": ROUTES_OP, "routes": {c: list(w) for c, w in routes.items()}}
        for w in workers if workers is not None else list(self.ready_workers):
            if dask_compat.has_worker(self.scheduler, w):
                dask_compat.send_to_worker(self.scheduler, w, msg)

    def set_worker_models(self, worker: str, models: list[str]) -> None:
        """The models ``worker`` hosts now (from its hello or after a swap)."""
        engine_health.note_models(self, worker, models)
        info = self.ready_workers.setdefault(worker, {"since": time.time()})
        info["models"] = list(models)
        draining = self.control.enforcer.drainer.drains if self.control is not None else {}
        for m, hosts in self.model_workers.items():
            if m not in models:
                hosts.discard(worker)
        for m in models:
            d = draining.get(worker)
            if d is None or d.phase != "draining" or d.source != m:
                self.model_workers[m].add(worker)
        self.admission.on_models()

    @staticmethod
    def component_of(model: str) -> str:
        """The component name of a model's calls."""
        from dask_agents.annotation import component_name

        return component_name(model)

    def model_bounds(self) -> dict[str, tuple[int, int | None]]:
        """model -> (min replicas, max replicas) from agents.llm.models."""
        from dask_agents.worker_plugin.engines import registry

        try:
            return {m: (s.min_replicas, s.max_replicas) for m, s in registry().items()}
        except ValueError:
            return {}

    def _session_end(self, session: str, cancel: bool = False, client: str | None = None) -> dict:
        """The driver left its ``da.session`` block (``cancel``: with an exception, so its open
        calls can no longer matter). An unknown session is not created: it made no call. Only
        the owner's end counts (``client``, when known): another client that joined the session
        leaving its own block ends nothing."""
        session = validate.session_id(session, "agents_session_end: session")
        rec = self.state.sessions.get(session)
        if rec is None:
            return {"state": "unknown"}
        if client is not None and rec.owner is not None and client != rec.owner:
            return {"state": rec.state}
        reason = "its driver left the da.session block with an exception" if cancel is True else None
        self._close(session, time.time(), reason, abort=cancel is True)
        return {"state": self.state.sessions[session].state}

    def _on_session_end_msg(self, session: Any = None, cancel: Any = False, client: Any = None, **kw: Any) -> None:
        """The client-stream form of :meth:`_session_end`: it arrives after the client's earlier
        submits (same stream), so a session cannot complete before its last calls are seen."""
        try:
            self._session_end(session, cancel, client if isinstance(client, str) else None)
        except Exception as e:  # raising here would close the client's stream
            logger.warning("dask-agents: session end ignored: %s", e)

    def _session_graph(self, session: str) -> dict | None:
        session = validate.session_id(session, "agents_session_graph: session")
        if session not in self.state.sessions:
            return None
        return self.state.session_graph(session).model_dump(mode="json")

    def _telemetry(self, session: str | None = None, table: str = "calls") -> list[dict] | dict:
        if session is not None:
            session = validate.session_id(session, "agents_telemetry: session")
        if table == "calls":
            return self.state.rows(session)
        if table == "sessions":
            now = time.time()
            if session is not None:
                row = self.state.session_summary(session, now)
                return [row] if row is not None else []
            return self.state.session_rows(now)
        if table == "kv":
            return self.aggregates.kv_rows()
        return {"error": f"unknown telemetry table {table!r} (calls, sessions, kv)"}

    def _progress(self, sessions: list[str] | None = None) -> dict:
        sessions = validate.sessions(sessions, "agents_progress: sessions")
        now = time.time()
        expected = self.state.expected_calls()
        out = {}
        for sid in sessions or ():
            d = self.state.session_summary(sid, now)
            out[sid] = None if d is None else {**d, "expected": expected}
        return out

    def _workflow_graph(self) -> dict:
        return self.state.workflow_graph().model_dump(mode="json")

    def _models(self) -> dict:
        return {m: sorted(ws) for m, ws in self.model_workers.items() if ws}

    async def _control(self, action: str = "stats") -> dict:
        loop = self.control
        if loop is None:
            return {"error": "the control loop is not initialised"}
        if action == "start":
            loop.start()
        elif action == "stop":
            loop.stop()
        elif action == "run_once":  # policies off the event loop, as in the running loop
            return {"pass": await loop.watchdog.run_pass(), **loop.stats(), "faults": self.recovery.stats()}
        elif action != "stats":
            return {"error": f"unknown control action {action!r} (start, stop, run_once, stats)"}
        # workers lost, calls rerouted/failed; LLM calls held and sessions admitted
        return {**loop.stats(), "faults": self.recovery.stats(), "admission": self.admission.snapshot()}

    def _ping(self) -> dict:
        return {"ok": True, "workers": sorted(self.ready_workers)}
