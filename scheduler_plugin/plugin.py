"""The global controller: a SchedulerPlugin that routes Dask's events and the workers' reports to
typed collaborators, and serves the client API.

It records every call (:class:`~dask_agents.scheduler_plugin.state.WorkflowState`: per-session live
graphs, the flattened workflow graph, per-component durations) and hands each event to those
that act on it, in one order:

- :class:`~dask_agents.scheduler_plugin.placement.Placement` pins the calls that must go to one
  worker while they are still ``released`` in ``update_graph`` (stateful calls to their
  session's instance, LLM calls to an engine of the model, preferring the session's: its KV is
  there);
- :class:`~dask_agents.scheduler_plugin.admission.Admission` holds LLM calls until an engine has room;
- :class:`~dask_agents.scheduler_plugin.sessions.Sessions` owns, closes and ends sessions;
- :class:`~dask_agents.scheduler_plugin.recovery.Recovery` re-places or fails the calls of lost workers;
- :class:`~dask_agents.scheduler_plugin.view_index.ViewIndex` keeps the control loop's view current;
- :class:`~dask_agents.scheduler_plugin.control.ControlLoop` runs the policies, off the critical path.

They share the :class:`~dask_agents.scheduler_plugin.roster.Roster` (the workers) and the workflow
state, never the plugin (``tests/test_plugin_shape.py``). Everything on the event loop is O(1)
per task; housekeeping (retention) runs periodically.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import OrderedDict, defaultdict, deque
from typing import Any

from distributed import Scheduler, SchedulerPlugin

import dask_agents.config as agents_config
from dask_agents.annotation import ANNOTATION, sanitize_annotation
from dask_agents.direct import ROUTE_OP  # client -> scheduler: where a session's calls of a model go
from dask_agents.models import DRIVER, CallReport
from dask_agents.scheduler_plugin import dask_compat, engine_health, metrics, validate
from dask_agents.scheduler_plugin.actions import Kill, Provision
from dask_agents.scheduler_plugin.admission import HELD, Admission
from dask_agents.scheduler_plugin.control import ControlLoop
from dask_agents.scheduler_plugin.kv_hints import KVHints
from dask_agents.scheduler_plugin.placement import AWAITING, LOST, Placement
from dask_agents.scheduler_plugin.policies import prioritize
from dask_agents.scheduler_plugin.recovery import Recovery
from dask_agents.scheduler_plugin.roster import Roster, model_bounds
from dask_agents.scheduler_plugin.sessions import Sessions
from dask_agents.scheduler_plugin.deadlines import Deadlines
from dask_agents.scheduler_plugin.direct import DirectRoutes
from dask_agents.scheduler_plugin.state import TERMINAL, WorkflowState
from dask_agents.scheduler_plugin.timeseries import TimeSeries
from dask_agents.scheduler_plugin.view_index import BindingMap, PlacedMap, Tally, ViewIndex, ViewSources

logger = logging.getLogger(__name__)

NAME = "dask-agents"
REPORT_OP = "agents-report"
ROUTES_OP = "agents-routes"  # dask_agents.worker_plugin.plugin.ROUTES_OP
MAX_UNLINKED = 10_000  # calls parked until the record of their fast-path creator arrives
SESSION_END_OP = "agents-session-end"  # client -> scheduler, on the client's stream (ordered with its submits)
SESSION_OPEN_OP = "agents-session-open"  # client -> scheduler, on entering a da.session block
REATTACH_OP = "agents-reattach"  # client -> scheduler: a reconnected driver asks for its calls again
SETTLE_S = 2.0  # how long a session's graph asked for by its owner after its end waits for the end and records
REFUSED = "inproc://dask-agents-refused-call"
"""Where a call past a limit waits (it never runs) until it is failed, outside update_graph."""
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
        self.roster = Roster()  # the scheduler, the ready workers and each model's hosts
        self.state = WorkflowState()
        # calls pinned to a worker that died or left: re-placed or failed (scheduler_plugin/recovery.py)
        self.recovery = Recovery(self.roster, self.state)
        # bindings of sessions to workers and the calls pinned by them (scheduler_plugin/placement.py)
        self.placement = Placement(self.roster, self.state, self.recovery, self._routes)
        self.recovery.placement = self.placement
        # creator key -> calls it made that arrived before its own (fast-path) record
        self.unlinked: "OrderedDict[str, list[str]]" = OrderedDict()
        self.kv_hints = KVHints(self._send_kv_hint)  # what engines holding a session's KV should know
        self._cancelling: dict[str, str | None] = {}  # call -> client to cancel it for (its creator ended)
        self._orphaned: dict[str, tuple] = {}  # such a call -> its restrictions, while pinned to ORPHANED
        self.local_running: dict[str, set[str]] = defaultdict(set)  # worker -> fast-path calls running there
        self.arrivals = itertools.count()
        self.control: ControlLoop | None = None
        self.prioritizing = False
        self._unkeep_stealing: Any = None  # undoes keeping our calls out of Dask's stealing
        self._unkeep_calls: Any = None  # undoes holding a disconnected driver's calls
        self._undrain: Any = None  # undoes waiting for sessions before a graceful retirement
        self._reconcile_queue: list[str] = []  # open sessions whose calls are still to compare with Dask's
        self._reconcile_keys: Any = None  # the calls of the session being compared (an iterator)
        self.reconciled = 0  # calls ended from Dask's states (missed transitions)
        self.deadlines = Deadlines()  # open calls' own deadlines (timeout hint, agents.scheduler.call-timeout)
        self._call_timeout = agents_config.seconds("scheduler.call-timeout") or None  # 0: none
        self.timed_out = 0  # calls failed past their timeout
        self._max_calls = int(agents_config.get("scheduler.max-calls-per-session") or 0)  # 0: no limit
        self._max_live = int(agents_config.get("scheduler.max-live-calls-per-client") or 0)  # 0: no limit
        self._refusing: dict[str, BaseException] = {}  # calls past a limit -> their error (failed soon)
        self._gone_since: dict[str, float] = {}  # open call whose task is gone -> when first seen so
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
        # LLM calls the scheduler holds until an engine has room (scheduler_plugin/admission.py)
        self.admission = Admission(self.roster, self.state, self.placement, pauses=self.kv_hints)
        self.placement.bind_early = self.admission.bind_early
        # the control loop's view, updated by the hooks below (scheduler_plugin/view_index.py)
        self.view_sources = ViewSources(self.roster, self.state, self.placement.bindings, self.admission.is_held,
                                        self._all_routes)
        self.view_index = ViewIndex(self.view_sources)
        # sessions from open to end: owners, grace, closing, releasing (scheduler_plugin/sessions.py)
        self.sessions = Sessions(self.roster, self.state, self.placement, self._session_completed)
        # where drivers' direct calls go, told to the drivers (scheduler_plugin/direct.py)
        self.direct = DirectRoutes(lambda: self.roster.scheduler, lambda: self.roster.secret,
                                   self._routable_models, self._called_models)
        self.placement.on_bound = self.direct.bound

    # -- what the collaborators own, as the plugin's readers (view, dashboard, metrics) see it --
    @property
    def scheduler(self) -> Any:
        """The scheduler this plugin runs in (None before ``start``)."""
        return self.roster.scheduler

    @scheduler.setter
    def scheduler(self, scheduler: Any) -> None:
        self.roster.scheduler = scheduler

    @property
    def ready_workers(self) -> dict[str, dict]:
        """address -> hello info of the workers whose plugin is ready (the roster's)."""
        return self.roster.ready

    @property
    def model_workers(self) -> defaultdict[str, set[str]]:
        """model -> the workers hosting it (the roster's)."""
        return self.roster.hosts

    @property
    def bindings(self) -> BindingMap:
        """(session, component or ``llm:model``) -> worker (placement's)."""
        return self.placement.bindings

    @property
    def session_bindings(self) -> defaultdict[str, list[tuple[str, str]]]:
        """session -> its binding keys (placement's)."""
        return self.placement.session_bindings

    @property
    def session_workers(self) -> defaultdict[str, set[str]]:
        """session -> workers holding its instances or KV (placement's)."""
        return self.placement.session_workers

    @property
    def bound(self) -> defaultdict[str, int]:
        """worker -> live sessions bound to it (placement's)."""
        return self.placement.bound

    @property
    def assigned(self) -> defaultdict[str, int]:
        """worker -> sessions ever bound to it (placement's)."""
        return self.placement.assigned

    @property
    def placed(self) -> PlacedMap:
        """key -> (worker, what) of the calls placement pinned."""
        return self.placement.placed

    @property
    def placed_by_worker(self) -> dict[str, dict[Any, str]]:
        """worker -> {key: what} of the calls pinned there."""
        return self.placement.placed.by_worker

    @property
    def open_placed(self) -> Tally:
        """(worker, what) -> open calls pinned there."""
        return self.placement.open_placed

    @property
    def migrating(self) -> dict[str, tuple[str, str, str]]:
        """LLM call -> (binding, source, target) while a migration is unconfirmed (placement's)."""
        return self.placement.migrating

    @property
    def client_sessions(self) -> defaultdict[str, set[str]]:
        """owner client -> its sessions (the sessions collaborator's)."""
        return self.sessions.client_sessions

    @property
    def orphans(self) -> dict[str, float]:
        """session -> when its grace ends, its owner having disconnected (the sessions collaborator's)."""
        return self.sessions.orphans

    def _routes(self, component: str) -> Any:
        """The workers the control plane routed ``component`` to (None: not routed)."""
        return self._all_routes().get(component)

    def _all_routes(self) -> dict[str, tuple[str, ...]]:
        """component -> the workers the control plane routed it to (every routed component)."""
        return self.control.enforcer.routes if self.control is not None else {}

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()

    # -- lifecycle ----------------------------------------------------------------------
    async def start(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        dask_compat.add_worker_stream_handler(scheduler, REPORT_OP, self._on_reports,
                                              on_refused=self.aggregates.rejected.stream_refused)
        # a session's owner is the client stream the message came on, never a field of it
        for op, handler in ((SESSION_END_OP, self.sessions.on_end_msg), (SESSION_OPEN_OP, self._on_session_open),
                            (REATTACH_OP, self.sessions.on_reattach_msg), (ROUTE_OP, self._on_route)):
            dask_compat.add_client_stream_handler(scheduler, op, handler,
                                                  on_refused=self.aggregates.rejected.client_stream_refused)
        for name, handler in {
            "agents_worker_hello": self._hello,
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
        # a driver's blip: its calls are held before Dask releases them (Sessions.before_client_left)
        self._unkeep_calls = dask_compat.before_remove_client(scheduler, self.sessions.before_client_left)
        # graceful scale-down waits for the stateful sessions of the workers it retires
        self._undrain = dask_compat.before_retire_workers(scheduler, self.drain_for_retirement)
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
            if self._unkeep_calls is not None:
                self._unkeep_calls()
                self._unkeep_calls = None
            if self._undrain is not None:
                self._undrain()
                self._undrain = None

    def _is_call_task(self, ts: Any) -> bool:
        """Whether ``ts`` is a component, tool or LLM call we recorded (O(1))."""
        return dask_compat.task_key(ts) in self.state.calls

    def add_worker(self, scheduler: Scheduler, worker: str) -> None:
        dask_compat.set_worker_stream_interval(scheduler, [worker], agents_config.seconds("scheduler.batched-send-interval"))
        if self.placement.awaiting:
            scheduler.loop.add_callback(self.placement.place_awaiting)

    def valid_workers_downscaling(self, scheduler: Scheduler, workers: list) -> list:
        """Dask's choice of workers to retire (adaptive scaling, ``retire_workers`` without a
        list): only those holding no stateful instance of a live session; none if all do (the
        cluster waits for sessions to end rather than fail them)."""
        return [ws for ws in workers if not self.placement.live_stateful(dask_compat.worker_state_address(ws))]

    async def drain_for_retirement(self, workers: list[str]) -> None:
        """Before Dask retires ``workers`` gracefully: they take no new sessions (placement and
        admission skip them; engine sessions bound there rebind elsewhere on their next call,
        their KV recomputed there), and the retirement waits until the live sessions holding
        stateful instances on them have ended, at most ``agents.scheduler.drain-timeout``; past
        it they lose those instances (their next calls fail with InstanceLostError naming the
        retirement). Polls: sessions end on many paths, none of which knows a drain waits."""
        import asyncio

        timeout = agents_config.seconds("scheduler.drain-timeout")
        deadline = time.time() + timeout
        for w in workers:
            self.roster.retiring[w] = deadline
        waiting = [w for w in workers if self.placement.live_stateful(w)]
        if waiting:
            logger.info("dask-agents: retiring %s waits for %d live stateful sessions (at most %s)", waiting,
                        sum(len(self.placement.live_stateful(w)) for w in waiting),
                        agents_config.get("scheduler.drain-timeout"))
        while waiting and time.time() < deadline:
            await asyncio.sleep(0.1)
            waiting = [w for w in waiting if self.roster.alive(w) and self.placement.live_stateful(w)]
        for w in waiting:
            left = self.placement.live_stateful(w)
            cause = (f"worker {w} was retired with {len(left)} live stateful session(s) after "
                     f"agents.scheduler.drain-timeout ({agents_config.get('scheduler.drain-timeout')})")
            self.recovery.note_cause(w, cause)
            logger.warning("dask-agents: %s", cause)

    def remove_worker(self, scheduler: Scheduler, worker: str, **kwargs: Any) -> None:
        """``worker`` left: drop what it held, then recover the calls pinned to it.

        O(the worker's bindings and placed calls + models): the by-worker indexes of
        ``bindings`` and ``placed`` find them without scanning every session's."""
        self.ready_workers.pop(worker, None)
        self.roster.retiring.pop(worker, None)
        for ws in self.model_workers.values():
            ws.discard(worker)
        cause = self.recovery.cause(worker, kwargs.get("stimulus_id"))
        dropped_llm = self.placement.worker_removed(worker, cause)
        self._lost_local_calls(worker, cause)
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
            if rec.creator == DRIVER:  # a driver's direct call: its driver sends it again (same key)
                self._drop_direct(rec, worker)
                continue
            error = (f"{where(rec.component, rec.method, rec.session)}: {cause} while it ran there in its caller's "
                     f"thread; the caller runs again elsewhere (call {key})")
            self._call_event(rec, "erred", worker, None, error)

    def remove_client(self, scheduler: Scheduler, client: str) -> None:
        """The owner of some sessions disconnected: they wait ``session-grace`` for it."""
        self.sessions.client_left(client)

    def add_client(self, scheduler: Scheduler, client: str) -> None:
        self.sessions.client_back(client)

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
            if self._past_limits(ts, key, ann, client):
                continue
            old = self.state.calls.get(key)
            if old is not None and old.local and old.creator == DRIVER and old.state not in TERMINAL:
                # a driver's direct call whose worker was lost, sent again by its driver: the
                # record of the lost run goes (its worker's removal may not be seen yet)
                self._drop_direct(old, old.worker)
            rec = self.state.add_call(key, ann, dask_compat.dependency_keys(ts), now, client)
            if rec is None:
                continue
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
                self.sessions.on_call(rec, client, ann.get("opened_on"))
            if ann.get("stateful"):
                self.placement.place_stateful(ts, rec)
            elif rec.kind == "llm":
                if not self.admission.on_call(ts, rec, ann):  # session-less, or admission off
                    model = ann.get("llm_model")
                    self.placement.place(ts, rec.session, f"llm:{model}", None, model, rec.component)
            elif rec.component in self._all_routes():
                self.placement.place_routed(ts, rec.component, rec.session, self._agent_model(rec, ann))
            elif rec.session is not None and (model := self._agent_model(rec, ann)) is not None:
                # beside its session's engine of that model: its LLM calls then take the
                # worker's fast path (under the lease) instead of a hop through here
                self.placement.near_engine(ts, rec.session, model)
            if orphaned:  # and must not start before its cancel lands (measured: it did)
                self._orphaned[key] = dask_compat.restrictions(ts)
                dask_compat.restrict_to_worker(ts, ORPHANED)

    def _agent_model(self, rec: Any, ann: dict) -> str | None:
        """The model whose engine a call should run beside: its ``model=`` hint; for an agent
        without one, the model its component's LLM calls mostly used (learnt from the call
        graph), else the one model its session is bound to; None for anything else."""
        if ann.get("model"):
            return ann["model"]
        if rec.kind != "agent" or rec.session is None:
            return None
        return self.state.called_model(rec.component) or self.placement.session_model(rec.session)

    def _drop_direct(self, rec: Any, worker: str | None) -> None:
        """A driver's direct call lost with its worker: the observers hear it released, and its
        record goes (its driver sends it again under its key, down the scheduler path)."""
        for running in self.local_running.values():
            running.discard(rec.key)
        self._call_event(rec, "released", worker, None, None, rerun=True)
        self.state.drop_open(rec.key)

    def _past_limits(self, ts: Any, key: str, ann: dict, client: str) -> bool:
        """A call its session may not make any more (``agents.scheduler.max-calls-per-session``)
        or its client may not have open besides the others (``max-live-calls-per-client``):
        not recorded, held where it cannot run, and failed soon with LimitError naming the
        setting (failing it inside update_graph would race Dask's own handling of the graph).
        Bounds what one runaway session or client costs the scheduler. True if refused."""
        sid = ann.get("session")
        why = None
        if sid is not None and self._max_calls:
            s = self.state.sessions.get(sid)
            if s is not None and len(s.calls) >= self._max_calls:
                why = (f"the session made {len(s.calls)} calls, agents.scheduler.max-calls-per-session "
                       f"({self._max_calls})")
        if why is None and self._max_live and self.state.open_per_client.get(client, 0) >= self._max_live:
            why = (f"its client {client} has {self.state.open_per_client[client]} calls open, "
                   f"agents.scheduler.max-live-calls-per-client ({self._max_live}); wait for some to finish")
        if why is None:
            return False
        from dask_agents.errors import LimitError, where

        dask_compat.restrict_to_worker(ts, REFUSED)
        if not self._refusing:
            self.scheduler.loop.add_callback(self._flush_refused)
        self._refusing[key] = LimitError(
            f"{where(ann.get('component'), ann.get('method'), sid)}: {why}: this one is refused (call {key})")
        return True

    def _flush_refused(self) -> None:
        pending, self._refusing = self._refusing, {}
        stimulus = f"dask-agents-limit-{time.time()}"
        for key, exc in pending.items():
            try:
                dask_compat.fail_task(self.scheduler, key, exc, stimulus)
            except Exception:  # never leave it waiting silently: cancel it instead
                logger.exception("dask-agents: failing refused call %s failed", key)
                dask_compat.cancel_tasks(self.scheduler, [key], str(exc))

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

    def _forget_unrecorded(self, key: Any, finish: str) -> None:
        """A task without a call record changed state: if it is a call the workflow state
        dropped while it was open (session-less calls past ``max_loose_calls``, calls of an
        expired session), drop what the view index, the KV hints and the placement
        bookkeeping still hold for it. O(1): a few dict lookups for any other task."""
        self.view_index.forget(key)
        self.kv_hints.forget(key)
        if finish in ("memory", "erred", "released", "forgotten"):
            self.admission.on_transition(key, finish)  # its slot and open-call count (O(1) if not ours)
        self.placement.migrating.pop(key, None)
        if key in self.placement.placed and (finish != "released" or not dask_compat.is_wanted(self.scheduler, key)):
            self.placement.unplace(key)  # over (released and not wanted: cancelled); wanted: it runs again

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
            timeout = rec.timeout or self._call_timeout
            if timeout:
                self.deadlines.start(key, time.time() + timeout)
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
            self.placement.session_workers[rec.session].add(worker)  # its KV is there: dropped at session end
        self.kv_hints.on_transition(rec, finish, worker, now)
        self.view_index.on_transition(rec, finish, worker, ts)
        if rec.kind == "llm":
            self.admission.on_transition(key, finish)
            if finish == "no-worker" and self.admission.is_held(key):  # waiting here: policies see it
                self.view_index.on_held(rec)
        if rerun:
            return
        if not self.state.on_transition(key, finish, now if now is not None else time.time(), worker, error):
            return
        self.deadlines.discard(key)
        self._gone_since.pop(key, None)
        self.placement.unplace(key)
        if rec.children and rec.state in ("erred", "cancelled"):
            self._cancel_children(rec)
        if rec.session is not None:
            s = self.state.sessions.get(rec.session)
            if s is not None and s.state == "completed":
                self.sessions.completed(rec.session)

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
                if rec is not None and r["state"] is not None:
                    rec.ran_to = r["state"]
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

    def _local_call(self, worker: str, r: CallReport) -> None:
        """A call that ran on ``worker``'s fast path (``worker_plugin/local.py``; checked by
        ``validate.local_call``): recorded, and its events replayed through every observer as
        if the scheduler had run it there (processing, then its end)."""
        key, now = r["key"], time.time()
        rec = self.state.calls.get(key)
        if rec is None:
            ann = r["ann"]
            client = r.get("client")  # a driver's direct call (worker_plugin/direct.py): its driver's
            rec = self.state.add_call(key, ann, (), ann.get("created") or now, client)
            if rec is None:
                return
            rec.local = True
            self._link_to_creator(rec)
            for k in self.unlinked.pop(key, ()):
                child = self.state.calls.get(k)
                if child is not None:
                    self.state.link(rec, child)
            if rec.session is not None:
                self.sessions.on_call(rec, client)
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
        s = self.state.sessions.get(rec.session)
        live = s is not None and s.state != "completed"
        tell = self.placement.llm_ran(rec.key, rec.session, worker, live)
        if tell is not None:
            self.sessions.tell_ended(tell, [rec.session])  # the target never heard of it before
        if live:
            self.kv_hints.holders[rec.session].add(worker)

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
        self.placement.migrated(key, rec.session if rec is not None else None, source, target)

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
            hosted = await self.roster.call_worker(worker, "agents_swap_model", remove=None, add=model)
        except Exception as e:
            logger.warning("dask-agents: giving %s to new worker %s failed: %s", model, worker, e)
            return
        self.set_worker_models(worker, list(hosted))

    # -- sessions -------------------------------------------------------------------------
    def _session_completed(self, sid: str, s: Any) -> None:
        """``sid`` completed (once; ``s`` its record, if kept): every observer hears it."""
        if s is not None:
            self.aggregates.on_session_completed(s)
            self.timeseries.on_session_completed(s)
        self.kv_hints.on_session_end(sid)
        self.admission.on_session_ended(sid)
        self.direct.ended(sid)

    def _on_session_open(self, client: Any = None, direct: Any = False, **msg: Any) -> None:
        """A driver entered its ``da.session`` block; one that takes routes for its direct calls
        (``direct``) is told them, if it owns the session."""
        self.sessions.on_open_msg(client=client, **msg)
        sid = msg.get("session")
        s = self.state.sessions.get(sid) if direct is True and isinstance(sid, str) else None
        if s is not None and s.owner == client:
            self.direct.opened(sid, client)

    def _on_route(self, client: Any = None, session: Any = None, model: Any = None, **_: Any) -> None:
        """A driver's first call of ``model`` in its ``session`` has no route (several engines,
        no binding yet): bind the session now, as that call's own arrival would
        (``Admission.bind_early``), and tell the driver where, or that it has no route (None:
        nothing to choose now, admission holding the model's calls, a session not its own);
        the calls then go straight there, or down the scheduler path."""
        worker = None
        if isinstance(session, str) and isinstance(model, str) and self.direct.owners.get(session) == client:
            s = self.state.sessions.get(session)
            if s is not None and s.owner == client:
                worker = self.admission.bind_early(session, model)
                if worker not in self.model_workers.get(model, ()) or worker in self.roster.retiring:
                    worker = None  # (as _routable_models, without building it per request)
        self.direct.routed(client, session, model, worker)

    def _routable_models(self) -> dict[str, list[str]]:
        """model -> the workers of its engines a direct call may go to (not retiring ones)."""
        retiring = self.roster.retiring
        return {m: [w for w in ws if w not in retiring] for m, ws in self.model_workers.items()}

    def _called_models(self) -> dict[str, str]:
        """component -> the model its LLM calls use (learnt: ``WorkflowState.called_model``)."""
        return {c: m for c in self.state.llm_calls_of if (m := self.state.called_model(c)) is not None}

    def _send_kv_hint(self, worker: str, msg: dict) -> None:
        # Only to workers that said hello: they registered the op (an unknown op drops the comm).
        if worker in self.ready_workers and dask_compat.has_worker(self.scheduler, worker):
            dask_compat.send_to_worker(self.scheduler, worker, {**msg, "at": time.time()})

    def housekeeping(self) -> None:
        """Drop completed sessions past retention (bounded memory); close the sessions whose
        driver did not come back within the grace, and idle ones; fold tick times into metrics."""
        self.sessions.housekeeping(time.time())
        self.reconcile()
        self.expire_calls(time.time())
        self.aggregates.fold_ticks(self.control)
        # per-call reports are only read over the dashboard's window: keep two
        self.aggregates.forget_before(time.time() - 2 * agents_config.seconds("dashboard.window"))
        self.view_index.sync_sessions()  # keeps the touched-session set small with the loop stopped
        dropped = self.state.expire(
            time.time(), agents_config.seconds("scheduler.session-retention"),
            int(agents_config.get("scheduler.max-retained-sessions")),
        )
        self.sessions.forget(dropped)

    def expire_calls(self, now: float) -> int:
        """Fail the calls whose own time is up (``scheduler_plugin/deadlines.py``) with
        CallTimeoutError naming the call, its session and the timeout. Returns how many."""
        from dask_agents.errors import CallTimeoutError, where

        n = 0
        for key in self.deadlines.due(now):
            rec = self.state.calls.get(key)
            if rec is None or rec.state in TERMINAL or rec.local:
                continue
            timeout = rec.timeout or self._call_timeout
            why = "its timeout hint" if rec.timeout else "agents.scheduler.call-timeout"
            exc = CallTimeoutError(
                f"{where(rec.component, rec.method, rec.session)} did not finish within {timeout:g}s of being sent to "
                f"worker {rec.worker} ({why}): it was failed (a thread still running it goes on to its end: Python "
                f"cannot stop a thread) (call {key})")
            stimulus = f"dask-agents-call-timeout-{now}"
            try:
                if dask_compat.fail_running_task(self.scheduler, key, exc, stimulus) or \
                        dask_compat.fail_task(self.scheduler, key, exc, stimulus):
                    n += 1
            except Exception:  # one call's failure must not stop the others'
                logger.exception("dask-agents: failing call %s past its timeout failed", key)
        if n:
            self.timed_out += n
        return n

    RECONCILE_BATCH = 4096  # open calls compared with Dask's task states per housekeeping
    REPORT_WAIT = 1.0  # s a gone call waits for its worker's report of how it ran

    def reconcile(self) -> int:
        """Apply the transitions this plugin missed (its ``transition`` raised: a bug, a fault)
        from Dask's own task states: an open call whose task ended (in memory, erred) or is
        gone (released and wanted by nobody, forgotten) is ended here as Dask ended it, so its
        session completes and its slots, KV and instances are released. Dask calls the
        transition hook synchronously, so a state that differs here was missed, not in flight.
        Bounded: at most :attr:`RECONCILE_BATCH` calls a run, going through the open sessions'
        calls from a snapshot of each session's keys, resuming where the last run stopped (a
        session of n calls is gone through in n / batch runs). Returns the calls ended."""
        looked = ended = 0
        now = time.time()
        rebuilt = False
        while looked < self.RECONCILE_BATCH:
            if self._reconcile_keys is None:
                if not self._reconcile_queue:
                    if rebuilt:
                        break
                    rebuilt = True
                    self._reconcile_queue = [sid for sid, s in self.state.sessions.items()
                                             if s.state != "completed" and s.open_calls > 0]
                    if not self._reconcile_queue:
                        break
                s = self.state.sessions.get(self._reconcile_queue.pop())
                if s is None or s.state == "completed" or s.open_calls == 0:
                    continue
                self._reconcile_keys = iter(list(s.calls))
            key = next(self._reconcile_keys, None)
            if key is None:
                self._reconcile_keys = None
                continue
            looked += 1
            rec = self.state.calls.get(key)
            if rec is None or rec.state in TERMINAL or rec.local:
                continue
            finish = dask_compat.task_state_on(self.scheduler, key) or "forgotten"
            if finish not in ("memory", "erred", "forgotten") and not (
                    finish == "released" and not dask_compat.is_wanted(self.scheduler, key)):
                continue
            if finish in ("forgotten", "released"):  # gone: how it ran, as its worker reports
                if rec.ran_to is None and now - self._gone_since.setdefault(key, now) < self.REPORT_WAIT:
                    continue  # its worker's report (sent in batches) may still be on its way
                finish = {"memory": "memory", "error": "erred"}.get(rec.ran_to or "", finish)
            ts = dask_compat.task(self.scheduler, key)
            error = dask_compat.task_error(ts) if finish == "erred" and ts is not None else None
            self._call_event(rec, finish, None, ts, error)
            ended += 1
        if ended:
            self.reconciled += ended
            logger.warning("dask-agents: %d call(s) ended from Dask's task states (their transitions were missed)",
                           ended)
        return ended

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
        if new and self._all_routes():
            self.push_routes([worker])
        if new and self.provision_for:  # a worker we asked for: give it its model
            self.scheduler.loop.add_callback(self._assign_model, worker, self.provision_for.popleft())

    def push_routes(self, workers: list[str] | None = None) -> None:
        """Send the control plane's routes to ``workers`` (default: every ready one): calls
        made on a worker's fast path go only where their component is routed."""
        routes = self._all_routes()
        msg = {"op": ROUTES_OP, "routes": {c: list(w) for c, w in routes.items()}}
        for w in workers if workers is not None else list(self.ready_workers):
            if dask_compat.has_worker(self.scheduler, w):
                dask_compat.send_to_worker(self.scheduler, w, msg)

    def set_worker_models(self, worker: str, models: list[str]) -> None:
        """The models ``worker`` hosts now (from its hello or after a swap)."""
        engine_health.note_models(self.placement, worker, models)
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

    @staticmethod
    def model_bounds() -> dict[str, tuple[int, int | None]]:
        """model -> (min replicas, max replicas) from agents.llm.models."""
        return model_bounds()

    async def _session_graph(self, session: str, settle: Any = False) -> dict | None:
        session = validate.session_id(session, "agents_session_graph: session")
        if settle is True:
            await self._settled(session)
        if session not in self.state.sessions:
            return None
        return self.state.session_graph(session).model_dump(mode="json")

    async def _settled(self, sid: str) -> None:
        """The owner asks after leaving ``sid``'s block: its end (on its own stream) and the
        records of its direct calls (on their workers' streams) may still be on their way, so
        wait, at most :data:`SETTLE_S`, until the end has come and no record is awaited."""
        deadline = time.monotonic() + SETTLE_S
        while time.monotonic() < deadline:
            s = self.state.sessions.get(sid)
            if s is None or s.state == "completed" or (s.state == "closing" and not s.awaiting):
                return
            await asyncio.sleep(0.005)

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
        """The control loop's stats, or (``agents.control.client-actions``) start, stop or one
        pass of it asked by a client: cluster-wide changes are the scheduler's configuration
        unless it lets clients make them."""
        loop = self.control
        if loop is None:
            return {"error": "the control loop is not initialised"}
        if action in ("start", "stop", "run_once") and not agents_config.get("control.client-actions"):
            return {"refused": True,
                    "error": f"control action {action!r} refused: clients may not change the control loop "
                             "unless the scheduler's agents.control.client-actions is true"}
        if action == "start":
            loop.start()
        elif action == "stop":
            loop.stop()
        elif action == "run_once":  # policies off the event loop, as in the running loop
            return {"pass": await loop.run_pass(), **loop.stats(), "faults": self.recovery.stats()}
        elif action != "stats":
            return {"error": f"unknown control action {action!r} (start, stop, run_once, stats)"}
        # workers lost, calls rerouted/failed; LLM calls held and sessions admitted
        return {**loop.stats(), "faults": self.recovery.stats(), "admission": self.admission.snapshot()}

    def _ping(self) -> dict:
        return {"ok": True, "workers": sorted(self.ready_workers)}
