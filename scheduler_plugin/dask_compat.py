"""Every Dask *scheduler* internal that dask-agents relies on, in one place.

Each function is exercised by ``tests/test_dask_compat.py`` or ``tests/test_dask_compat_more.py``
against the pinned distributed
range (setup.cfg). Nothing else in ``scheduler_plugin`` touches ``TaskState``/``WorkerState``
attributes or scheduler dictionaries directly.
"""

from __future__ import annotations

import heapq
import logging
import time
from typing import Any, Callable, Iterable

from distributed import Scheduler


def task(scheduler: Scheduler, key: Any) -> Any:
    """The scheduler's TaskState for ``key`` (None if unknown)."""
    return scheduler.tasks.get(key)


def dependency_keys(ts: Any) -> list:
    """Keys this task depends on."""
    return [d.key for d in ts.dependencies]


def annotations(ts: Any) -> dict:
    """The task's annotations (``{"agents": {...}}`` for dask-agents calls)."""
    return ts.annotations or {}


def worker_addresses(scheduler: Scheduler) -> list[str]:
    """Addresses of the workers that are running (accepting tasks)."""
    return [ws.address for ws in scheduler.running]


def worker_name(scheduler: Scheduler, address: str) -> Any:
    """The worker's name (what cluster managers index their specs by)."""
    ws = scheduler.workers.get(address)
    return ws.name if ws is not None else address


def has_worker(scheduler: Scheduler, address: str) -> bool:
    """True if ``address`` is a connected, running worker."""
    ws = scheduler.workers.get(address)
    return ws is not None and ws in scheduler.running


def priority(ts: Any) -> tuple:
    """The task's scheduling priority (smaller runs first)."""
    return ts.priority


def set_priority(ts: Any, value: tuple) -> None:
    """Set the priority of a task that is not queued or placed yet (call in ``update_graph``,
    which Dask runs after its own ``_set_priorities``)."""
    ts.priority = value


def processing_on(ts: Any) -> str | None:
    """Address of the worker a task is assigned to, if any."""
    ws = ts.processing_on
    return ws.address if ws is not None else None


def restrict_to_worker(ts: Any, address: str) -> None:
    """Pin a not-yet-placed task to one worker (strict: no fallback elsewhere).

    Must be called in ``update_graph`` (tasks still ``released``) so placement honours it.
    """
    ts.worker_restrictions = {address}
    ts.loose_restrictions = False


PIN_ANNOTATION = "agents_pin"
"""The task annotation naming the worker the scheduler plugin pinned a call to; workers run a
stateful call only with it naming them (``dask_agents.runtime.PIN_ANNOTATION``)."""


def mark_pinned(ts: Any, address: str) -> None:
    """Record on the task (its annotations travel with it to the worker) that the plugin
    pinned it to ``address``: a stateful call without the mark was not pinned (a fault in the
    plugin's ``update_graph``) and its worker refuses to run it on a possibly fresh instance."""
    ts.annotations = {**(ts.annotations or {}), PIN_ANNOTATION: address}


def restrictions(ts: Any) -> tuple:
    """A task's worker restrictions as :func:`set_restrictions` takes them back."""
    return (set(ts.worker_restrictions) if ts.worker_restrictions else None, ts.loose_restrictions)


def set_restrictions(ts: Any, saved: tuple) -> None:
    """Put back restrictions read by :func:`restrictions`."""
    ts.worker_restrictions, ts.loose_restrictions = saved


def add_stream_handler(scheduler: Scheduler, op: str, handler: Callable) -> None:
    """Register a worker -> scheduler stream op (must precede any worker sending it)."""
    scheduler.stream_handlers[op] = handler


def add_rpc_handler(scheduler: Scheduler, name: str, handler: Callable) -> None:
    """Register an RPC handler (``client.scheduler.<name>(...)``)."""
    scheduler.handlers[name] = handler


def add_periodic(server: Any, name: str, callback: Callable, seconds: float) -> None:
    """Run ``callback`` every ``seconds`` on a scheduler's or worker's event loop (keep it short).

    Replaces a callback of the same name (re-installing a plugin must not double it)."""
    from tornado.ioloop import PeriodicCallback

    remove_periodic(server, name)
    pc = PeriodicCallback(callback, seconds * 1000)
    server.periodic_callbacks[name] = pc
    pc.start()


def remove_periodic(server: Any, name: str) -> None:
    """Stop and forget a periodic callback."""
    pc = server.periodic_callbacks.pop(name, None)
    if pc is not None:
        pc.stop()


def set_worker_stream_interval(scheduler: Scheduler, addresses: Iterable[str], seconds: float) -> None:
    """Shorten scheduler -> worker batching windows (``BatchedSend.interval``)."""
    for addr in addresses:
        bs = scheduler.stream_comms.get(addr)
        if bs is not None and hasattr(bs, "interval"):
            bs.interval = seconds


def set_client_stream_interval(client: Any, seconds: float) -> None:
    """Shorten a client's client -> scheduler batching window, also for the stream the client
    makes when it reconnects (Dask builds that one with its own 10 ms window)."""
    client._agents_stream_interval = seconds
    bs = getattr(client, "scheduler_comm", None)
    if bs is not None and hasattr(bs, "interval"):
        bs.interval = seconds
    if getattr(client, "_agents_keeps_interval", False):
        return
    original = client._ensure_connected

    async def ensure_connected(*args: Any, **kwargs: Any) -> Any:
        out = await original(*args, **kwargs)
        bs = getattr(client, "scheduler_comm", None)
        if bs is not None and hasattr(bs, "interval"):
            bs.interval = client._agents_stream_interval
        return out

    client._ensure_connected = ensure_connected
    client._agents_keeps_interval = True


# -- control plane: reading load, moving and re-prioritizing work -----------------------------

def workers(scheduler: Scheduler) -> list[Any]:
    """WorkerState objects of running workers."""
    return list(scheduler.running)


def worker_summary(ws: Any) -> tuple[str, int, int, int]:
    """(address, nthreads, tasks assigned, tasks running: executing or seceded)."""
    return ws.address, ws.nthreads, len(ws.processing), len(ws.executing) + len(ws.long_running) - _seceded_listed(ws)


def _seceded_listed(ws: Any) -> int:
    """Seceded tasks a worker's heartbeat also listed in ``executing`` (it reports every active
    task): counted once (this runs per worker every control tick)."""
    seceded = ws.long_running
    if not seceded:
        return 0
    # ``set.intersection`` walks its argument in C (no Python per task)
    return len(seceded.intersection(ws.executing))


def executing(ws: Any) -> list[tuple[Any, float]]:
    """(task, seconds it has executed) of the tasks executing on ``ws``, as of the worker's
    last heartbeat (seceded tasks hold no thread and are not listed; tasks that finished or
    left since that heartbeat are not either)."""
    seceded = ws.long_running  # (a heartbeat lists them in ``executing`` too)
    return [(ts, float(d or 0.0)) for ts, d in ws.executing.items() if ts.processing_on is ws and ts not in seceded]


def prefer_worker(ts: Any, address: str) -> None:
    """Place a not-yet-placed task on ``address`` if that worker is running, else anywhere (a
    loose restriction: Dask falls back to any worker). Call in ``update_graph``."""
    ts.worker_restrictions = {address}
    ts.loose_restrictions = True


def free_threads(scheduler: Scheduler, address: str) -> int:
    """Threads of worker ``address`` not running a task now (seceded tasks do not hold one);
    0 for an unknown or not-running worker."""
    ws = scheduler.workers.get(address)
    if ws is None or ws not in scheduler.running:
        return 0
    return ws.nthreads - (len(ws.executing) - _seceded_listed(ws))  # seceded tasks hold no thread


def waiting_on_worker(ws: Any) -> list[Any]:
    """Tasks assigned to ``ws`` that have not started there (as far as the scheduler knows)."""
    running = ws.executing.keys() | ws.long_running
    return [ts for ts in ws.processing if ts not in running]


def started_on_worker(ws: Any, ts: Any) -> bool:
    """True if ``ts`` executes (or has seceded) on ``ws`` as far as the scheduler knows (O(1))."""
    return ts in ws.executing or ts in ws.long_running


def queued_on_scheduler(scheduler: Scheduler, limit: int) -> list[Any]:
    """Up to ``limit`` root-ish tasks the scheduler holds back (best priority first)."""
    return list(scheduler.queued.peekn(limit)) if limit > 0 else []


def input_bytes(ts: Any) -> int:
    """Bytes of the task's dependencies' results (what moving it may transfer)."""
    return sum(dts.nbytes for dts in ts.dependencies if dts.nbytes and dts.nbytes > 0)


def has_foreign_restrictions(ts: Any) -> bool:
    """Resource or host restrictions: moving those would corrupt Dask's resource accounting."""
    return bool(ts.resource_restrictions or ts.host_restrictions)


def has_strict_worker_restriction(ts: Any) -> bool:
    """Pinned to specific workers with no fallback (``workers=`` without ``allow_other_workers``)."""
    return bool(ts.worker_restrictions) and not ts.loose_restrictions


def state(ts: Any) -> str:
    """The task's scheduler state."""
    return ts.state


def is_queued_on_scheduler(scheduler: Scheduler, ts: Any) -> bool:
    """True if the scheduler holds the task in its root-ish queue."""
    return ts in scheduler.queued


def requeue_with_priority(scheduler: Scheduler, ts: Any, priority: tuple) -> None:
    """Change the priority of a task held in the scheduler's queue.

    HeapSet cannot change an entry in place, and taking the task out and back is not enough to
    demote it: ``discard`` leaves its heap entry, which ``peek``/``pop`` skip only for tasks no
    longer in the set, so the task would still come first at its old priority. Its old entries
    are dropped first (O(queued), for a demotion only: a promotion's new entry sorts first)."""
    queued = scheduler.queued
    demoted = ts.priority is not None and tuple(priority) > tuple(ts.priority)
    queued.discard(ts)
    ts.priority = priority
    if demoted and queued._heap:
        queued._heap = [e for e in queued._heap if e[2]() is not ts]
        heapq.heapify(queued._heap)
        queued._sorted = False
    queued.add(ts)


def send_to_client(scheduler: Scheduler, client: str, msg: dict) -> None:
    """Stream a message to a client (ops it registered; an unknown one is logged there)."""
    scheduler.client_send(client, msg)


def send_to_worker(scheduler: Scheduler, address: str, msg: dict) -> None:
    """Stream a message to a worker. Only ops the worker registered: an unknown op closes the
    comm and the scheduler loses the worker."""
    scheduler.worker_send(address, msg)


def stealing(scheduler: Scheduler) -> Any:
    """Dask's work-stealing extension used as a move engine (created if absent, never started)."""
    ext = scheduler.extensions.get("stealing")
    if ext is None:
        from distributed.stealing import WorkStealing

        ext = WorkStealing(scheduler)
        scheduler.extensions["stealing"] = ext
    return ext


def keep_from_builtin_stealing(scheduler: Scheduler, skip: Callable[[Any], bool]) -> Callable[[], None] | None:
    """Let Dask's own work stealing go on balancing every task except those ``skip(ts)`` says
    are ours: they never enter its stealable sets (``WorkStealing.put_key_in_stealable``, the
    one place a task becomes stealable), so only the control plane moves them. Returns a
    function that undoes it, or None when the scheduler has no stealing extension."""
    ext = scheduler.extensions.get("stealing")
    if ext is None:
        return None
    original = ext.put_key_in_stealable

    def put_key_in_stealable(ts: Any) -> None:
        if not skip(ts):
            original(ts)

    ext.put_key_in_stealable = put_key_in_stealable
    for ts in [ts for level in ext.stealable.values() for tasks in level for ts in tasks if skip(ts)]:
        ext.remove_key_from_stealable(ts)  # ours that were already stealable

    def undo() -> None:
        if ext.put_key_in_stealable is put_key_in_stealable:
            del ext.put_key_in_stealable  # the class's method again

    return undo


def move_task(scheduler: Scheduler, ts: Any, victim: str, thief: str) -> str:
    """Ask ``victim`` to give up ``ts`` (if it has not started) and send it to ``thief``.

    Returns Dask's request id, ``"in-flight"`` or ``"comm-closed"``. The victim refuses if the
    task already runs, so a call never runs twice. Dask's confirm ignores restrictions, so a
    task pinned by us is re-pinned to the thief first."""
    if ts.worker_restrictions:
        ts.worker_restrictions = {thief}
    return stealing(scheduler).move_task_request(ts, scheduler.workers[victim], scheduler.workers[thief])


def add_event(scheduler: Scheduler, topic: str, msg: dict) -> None:
    """Record ``msg`` on a scheduler event topic (``client.get_events(topic)``)."""
    scheduler.log_event(topic, msg)


# -- dashboard and metrics ---------------------------------------------------------------------

def task_error(ts: Any) -> str | None:
    """The text of the exception a task erred with (its own, or the dependency's it erred
    through: ``exception_blame``), as Dask's task page shows it; None if it has none."""
    blame = getattr(ts, "exception_blame", None) or ts
    text = getattr(blame, "exception_text", None)
    return str(text) if text else None


def task_key(ts: Any) -> Any:
    """The task's key."""
    return ts.key


def running_on_worker(ws: Any) -> list[Any]:
    """Tasks executing (or seceded) on ``ws`` as far as the scheduler knows (a heartbeat late)."""
    # ws.executing is refreshed by heartbeats only (never on a task's finish): it may still
    # list tasks that finished since, or moved; only those still processing there count
    out = [ts for ts in ws.executing if ts.processing_on is ws]
    out.extend(ts for ts in ws.long_running if ts not in ws.executing)
    return out


def _dask_bokeh_app(scheduler: Scheduler) -> Any:
    for app in getattr(getattr(scheduler, "http_application", None), "applications", ()):
        paths = getattr(app, "app_paths", None)
        if paths and "/status" in paths:
            return app
    return None


def dashboard_prefix(scheduler: Scheduler) -> str | None:
    """The URL prefix of Dask's dashboard (``""`` at the root); None when it is off."""
    app = _dask_bokeh_app(scheduler)
    return None if app is None else app.prefix


def dashboard_template_variables(scheduler: Scheduler) -> dict:
    """The variables Dask's dashboard pages render their navigation bar with (shared, mutable)."""
    from distributed.dashboard.scheduler import template_variables

    return template_variables(scheduler)


def add_dashboard_page_link(scheduler: Scheduler, page: str) -> None:
    """Link ``page`` from the navigation bar of Dask's dashboard pages (rendered after this)."""
    pages = dashboard_template_variables(scheduler).get("pages")
    if isinstance(pages, list) and page not in pages:
        pages.append(page)


def remove_dashboard_page_link(scheduler: Scheduler, page: str) -> None:
    """Undo :func:`add_dashboard_page_link`."""
    pages = dashboard_template_variables(scheduler).get("pages")
    if isinstance(pages, list) and page in pages:
        pages.remove(page)


def add_http_application(scheduler: Scheduler, app: Any) -> None:
    """Serve a tornado application (a Bokeh server) from the scheduler's HTTP server."""
    scheduler.http_application.add_application(app)


def start_bokeh_application(scheduler: Scheduler, paths: dict[str, Callable], prefix: str) -> Any:
    """Serve Bokeh application(s) ``{path: make_document}`` from the scheduler's HTTP server
    as Dask serves its own dashboard pages (its template variables, under ``prefix``); started.

    Why not ``distributed.scheduler.http.routes`` (the documented hook): it takes modules of
    plain tornado handlers, named in the configuration before the scheduler starts; a Bokeh
    page needs Bokeh's server (sessions, the websocket), and dask-agents may be installed on a
    running scheduler (``da.install``)."""
    from distributed.dashboard.core import BokehApplication
    from tornado.ioloop import IOLoop

    app = BokehApplication(paths, scheduler, prefix=prefix, template_variables=dashboard_template_variables(scheduler))
    add_http_application(scheduler, app)
    app.initialize(IOLoop.current())
    app.start()
    return app


def dashboard_theme() -> tuple[Any, Any]:
    """Dask's dashboard look for a page of ours: (its Bokeh theme, its jinja template environment)."""
    from distributed.dashboard.components.scheduler import BOKEH_THEME, env

    return BOKEH_THEME, env


def assigned_to_worker(scheduler: Scheduler, address: str) -> tuple[list[Any], list[Any]]:
    """(not started, started) tasks the scheduler has assigned to worker ``address``, as far as
    it knows (a heartbeat late for the split); ``([], [])`` for an unknown worker."""
    ws = scheduler.workers.get(address)
    if ws is None:
        return [], []
    waiting = waiting_on_worker(ws)
    not_started = set(waiting)
    return waiting, [ts for ts in ws.processing if ts not in not_started]


def remove_http_application(scheduler: Scheduler, app: Any) -> None:
    """Stop serving an application added with :func:`add_http_application`."""
    apps = scheduler.http_application.applications
    if app in apps:
        apps.remove(app)


# -- Dask's /groups page on agent workflows ---------------------------------------------------
#
# Reported upstream (distributed 2026.8.0 with dask 2026.8): the task-group graph of /groups
# (``distributed.dashboard.components.scheduler.TaskGroupGraph.update_layout``) orders the groups
# with ``dask.order.order(dsk={name: 1, ...}, dependencies=...)`` and places each group after its
# dependencies. With literal values dask.order orders a chain backwards
# (``order(dsk={"A": 1, "B": 1}, dependencies={"B": {"A"}})`` is ``{"B": 0, "A": 1}``), so the
# layout reads a dependency not placed yet and raises ``KeyError`` (``'Developer'`` for a
# Planner -> Developer -> Tester run): /groups answers 500. Agent workflows also make cycles of
# groups (Developer -> Tester -> Developer on a retry), which no order can place. When Dask's
# own layout fails, the wrapper below lays the page out again in topological order, with the
# edges that close a cycle left out (an edge to a group created after the dependent group).

class _Group:
    """A TaskGroup seen without the dependencies that close a cycle."""

    def __init__(self, group: Any, dependencies: set):
        self._group, self.dependencies = group, dependencies

    def __getattr__(self, name: str) -> Any:
        return getattr(self._group, name)


class _Groups:
    """A scheduler seen through :class:`_Group`: what the /groups layout reads."""

    def __init__(self, scheduler: Any):
        self._scheduler = scheduler
        created = {name: i for i, name in enumerate(scheduler.task_groups)}  # creation order
        self.task_groups = {
            name: _Group(tg, {d for d in tg.dependencies
                              if created.get(d.name, -1) < created[name] and d.name != name})
            for name, tg in scheduler.task_groups.items()}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._scheduler, name)


def _topological_order(dsk: dict, dependencies: dict, **kwargs: Any) -> dict:
    """``{key: position}`` with every key after its dependencies (ties in ``dsk``'s order);
    the graph must be acyclic."""
    pending = {k: set(dependencies.get(k, ())) & dsk.keys() for k in dsk}
    out: dict = {}
    while pending:
        ready = [k for k, deps in pending.items() if deps <= out.keys()]
        if not ready:
            raise ValueError("the graph has a cycle")
        for k in ready:
            out[k] = len(out)
            del pending[k]
    return out


def acyclic_task_group_layout() -> bool:
    """Make Dask's /groups page lay out cyclic task-group graphs (see above); idempotent.
    Returns False when the dashboard component is not where this expects it (nothing done)."""
    try:
        from distributed.dashboard.components.scheduler import TaskGroupGraph
    except ImportError:  # no bokeh: no dashboard
        return False
    original = getattr(TaskGroupGraph, "update_layout", None)
    if original is None:
        return False
    if getattr(original, "_dask_agents_acyclic", False):
        return True

    def update_layout(self: Any) -> Any:
        try:
            return original(self)
        except KeyError:
            import dask.order

            scheduler, order = self.scheduler, dask.order.order
            self.scheduler = _Groups(scheduler)
            # (swapped only for this call, on the event loop: a dask.order elsewhere in this
            # process meanwhile would get a valid topological order, not dask's heuristic one)
            dask.order.order = _topological_order
            try:
                return original(self)
            finally:
                self.scheduler, dask.order.order = scheduler, order

    update_layout._dask_agents_acyclic = True  # type: ignore[attr-defined]
    update_layout._dask_agents_original = original  # type: ignore[attr-defined]
    update_layout.__doc__ = original.__doc__
    TaskGroupGraph.update_layout = update_layout
    return True


# -- fault handling: calls stranded by a lost worker -----------------------------------------

def dependencies_in_memory(ts: Any) -> bool:
    """Whether every dependency of ``ts`` has its result (it can run as soon as it is placed)."""
    return all(dts.state == "memory" for dts in ts.dependencies)


def worker_restrictions(ts: Any) -> set:
    """The workers a task is pinned to (empty: anywhere)."""
    return set(ts.worker_restrictions or ())


def clear_worker_restriction(ts: Any) -> None:
    """Let a task run on any worker again (its pinned worker is gone and no other fits)."""
    ts.worker_restrictions = None
    ts.loose_restrictions = False


def task_state_on(scheduler: Scheduler, key: Any) -> str | None:
    """The scheduler state of ``key`` (None if unknown)."""
    ts = scheduler.tasks.get(key)
    return ts.state if ts is not None else None


def reschedule(scheduler: Scheduler, keys: Iterable[Any], stimulus_id: str) -> None:
    """Ask Dask to place ``no-worker`` tasks again (after their restrictions changed).

    Dask re-examines unrunnable tasks only when a worker joins; a task re-pinned to a live
    worker would otherwise wait for that."""
    recs = {k: "processing" for k in keys if task_state_on(scheduler, k) == "no-worker"}
    if recs:
        scheduler.transitions(recs, stimulus_id=stimulus_id)


def fail_task(scheduler: Scheduler, key: Any, exc: BaseException, stimulus_id: str) -> bool:
    """Err a task that is not running anywhere (waiting, queued, no-worker) with ``exc``.

    The client's future raises ``exc``; dependents err with it as their cause, as for a
    task that raised. The exception travels pickled, as Dask sends its own ``KilledWorker``.
    Returns False (nothing done) for tasks in other states."""
    from distributed.protocol import pickle

    ts = scheduler.tasks.get(key)
    if ts is None or ts.state not in ("waiting", "queued", "no-worker", "released"):
        return False
    if ts.state in ("no-worker", "queued"):  # these transitions take the exception directly
        recs = scheduler.transition(
            key, "erred", stimulus_id, exception=pickle.dumps(exc), cause=key,
            exception_text=str(exc), traceback=None,
        )
        scheduler.transitions(recs, stimulus_id=stimulus_id)
        return True
    # waiting/released go through released -> erred, which reports the exception of the task
    # to blame (as for a failed dependency): blame the task itself
    ts.exception = pickle.dumps(exc)
    ts.exception_text = str(exc)
    ts.traceback = None
    ts.exception_blame = ts
    scheduler.transitions({key: "erred"}, stimulus_id=stimulus_id)
    return True


def fail_running_task(scheduler: Scheduler, key: Any, exc: BaseException, stimulus_id: str) -> bool:
    """Err a task that a worker is processing with ``exc``, as if the worker had reported it,
    and tell that worker to let it go (its thread may run on: Python cannot stop it; an LLM
    call's engine request is aborted by the worker plugin on the release). The client's future
    raises ``exc``; dependents err with it. False (nothing done) for tasks in other states."""
    from distributed.protocol import pickle

    ts = scheduler.tasks.get(key)
    if ts is None or ts.state != "processing" or ts.processing_on is None:
        return False
    worker = ts.processing_on.address
    recs = scheduler.transition(key, "erred", stimulus_id, worker=worker, cause=key, exception=pickle.dumps(exc),
                                traceback=None, exception_text=str(exc))
    scheduler.transitions(recs, stimulus_id=stimulus_id)
    if worker in scheduler.workers:
        scheduler.worker_send(worker, {"op": "free-keys", "keys": [key], "stimulus_id": stimulus_id})
    return True


def cancel_tasks(scheduler: Scheduler, keys: Iterable[Any], reason: str, client: str | None = None) -> int:
    """Cancel ``keys``, their dependents too; futures raise ``CancelledError`` with ``reason``.

    With ``client``: as that client's ``client.cancel(keys)`` would: a key another client also
    wants is only released by this one (it goes on). Without: for every client that wants
    them (``client.cancel(force=True)``). A task still running on a worker is released there
    (its thread runs on to its end; Dask drops its result). Tasks no client wants (only needed
    by dependents) go with those dependents. Returns how many keys were asked to cancel."""
    wanted = [k for k in keys if (ts := scheduler.tasks.get(k)) is not None and ts.who_wants]
    if client is not None:
        wanted = [k for k in wanted if any(cs.client_key == client for cs in scheduler.tasks[k].who_wants)]
    if not wanted:
        return 0
    if client is None:
        # any registered client may force it (stimulus_cancel looks it up): Dask's own one always exists
        scheduler.stimulus_cancel(wanted, "fire-and-forget", force=True, reason=reason, msg=reason)
        return len(wanted)
    # Dask's unforced cancel releases a key only when no other client wants it (the other half
    # of client.cancel, cancelling the caller's own future, runs in that client): a shared key
    # is released for this client here, and its future told it was cancelled.
    shared = [k for k in wanted if len(scheduler.tasks[k].who_wants) > 1]
    alone = [k for k in wanted if k not in shared]
    if alone:
        scheduler.stimulus_cancel(alone, client, force=False, reason=reason, msg=reason)
    if shared:
        scheduler.client_releases_keys(keys=shared, client=client, stimulus_id=f"agents-cancel-{time.time()}")
        scheduler.report({"op": "cancelled-keys", "keys": shared, "reason": reason, "msg": reason}, client=client)
    return len(wanted)


def dependent_keys(ts: Any) -> list:
    """Keys of the tasks that depend on this one."""
    return [d.key for d in ts.dependents]


def is_wanted(scheduler: Scheduler, key: Any) -> bool:
    """True if a client or a waiting dependent still needs the task: when Dask releases it
    (its worker was lost) it will run again rather than be forgotten."""
    ts = scheduler.tasks.get(key)
    return ts is not None and bool(ts.who_wants or ts.waiters)


async def call_worker(scheduler: Scheduler, address: str, op: str, **kwargs: Any) -> Any:
    """Call the RPC handler ``op`` of the worker at ``address`` (the scheduler's connection pool)."""
    return await getattr(scheduler.rpc(address), op)(**kwargs)


# -- trust at the plugin's endpoints (scheduler_plugin/validate.py) ----------------------------

def _stream_origin(code: Any) -> dict | None:
    """The ``extra`` of the ``Server.handle_stream`` loop two frames up (the one that called
    the handler wrapper): ``{"worker": address}`` on a worker's stream, ``{"client": id}`` on
    a client's. None when the wrapper was not called by that loop."""
    import sys

    frame = sys._getframe(2)  # 0: here, 1: the wrapper, 2: its caller
    if frame.f_code is not code:
        return None
    extra = frame.f_locals.get("extra")
    return dict(extra) if isinstance(extra, dict) else None


def add_worker_stream_handler(scheduler: Scheduler, op: str, handler: Callable,
                              on_refused: Callable[[str, dict], None] | None = None) -> None:
    """Register a stream op that only *worker* streams may use.

    Dask keeps one ``stream_handlers`` table for worker and client streams (its
    ``worker_handlers``/``client_handlers`` are merged in ``Scheduler.__init__`` and not kept),
    and calls a handler with ``**merge(extra, msg)``: the message's own fields win over the
    stream's identity (``extra``), so a message can claim any ``worker``. The wrapper reads
    ``extra`` from the ``handle_stream`` frame that called it instead, calls
    ``handler(worker=<the stream's worker>, **other fields)`` for worker streams, and drops the
    message (``on_refused(op, origin)``) for anything else. Called from elsewhere (never by
    Dask 2026.8), it falls back to the merged fields: a client stream always carries a
    ``client`` field there (a message can change its value, not remove it)."""
    code = type(scheduler).handle_stream.__code__

    def worker_only(**msg: Any) -> Any:
        origin = _stream_origin(code)
        if origin is None:
            origin = {k: msg[k] for k in ("worker", "client") if k in msg}
        msg.pop("worker", None)
        msg.pop("client", None)
        worker = origin.get("worker")
        if "client" in origin or not isinstance(worker, str):
            if on_refused is not None:
                on_refused(op, origin)
            return None
        return handler(worker=worker, **msg)

    worker_only.__name__ = f"worker_only_{getattr(handler, '__name__', 'handler')}"
    scheduler.stream_handlers[op] = worker_only


def add_client_stream_handler(scheduler: Scheduler, op: str, handler: Callable,
                              on_refused: Callable[[str, dict], None] | None = None) -> None:
    """Register a stream op that only *client* streams may use, with the stream's own client.

    The counterpart of :func:`add_worker_stream_handler`: the wrapper reads the stream's
    identity from ``handle_stream``'s ``extra`` and calls ``handler(client=<the stream's
    client id>, **other fields)``; a message's own ``client`` (or ``worker``) field is dropped,
    never trusted. A message on a worker's stream, or one not delivered by Dask's stream loop
    (no stream identity to read: a test, or a Dask whose loop changed, which
    ``tests/test_dask_compat.py`` would show), is refused (``on_refused(op, origin)``): an
    operation on a session is never done for a client we cannot name."""
    code = type(scheduler).handle_stream.__code__

    def client_only(**msg: Any) -> Any:
        origin = _stream_origin(code)
        msg.pop("worker", None)
        msg.pop("client", None)
        client = (origin or {}).get("client")
        if origin is None or "worker" in origin or not isinstance(client, str):
            if on_refused is not None:
                on_refused(op, origin or {})
            return None
        return handler(client=client, **msg)

    client_only.__name__ = f"client_only_{getattr(handler, '__name__', 'handler')}"
    scheduler.stream_handlers[op] = client_only


def before_remove_client(scheduler: Scheduler, hook: Callable[[str], None]) -> Callable[[], None]:
    """Call ``hook(client)`` when a client's connection ends, *before* Dask releases the keys
    the client wanted; returns the undo.

    Why: Dask's ``remove_client`` releases every key the client wanted and only then calls
    the plugins' ``remove_client``: a call still running is released (its worker drops the
    result when it ends) although the client may reconnect within a second. The hook can make
    another wanter (``desire_keys``) hold them first. Dask calls ``self.remove_client`` when a
    client's stream closes; an attribute on the instance shadows the method."""
    original = scheduler.remove_client

    def remove_client(client: str, stimulus_id: str | None = None) -> None:
        try:
            hook(client)
        except Exception:  # never keep Dask from removing the client
            logging.getLogger(__name__).exception("dask-agents: before remove_client(%s)", client)
        return original(client=client, stimulus_id=stimulus_id)

    scheduler.remove_client = remove_client  # type: ignore[method-assign]

    def undo() -> None:
        if scheduler.__dict__.get("remove_client") is remove_client:
            del scheduler.remove_client

    return undo


def before_retire_workers(scheduler: Scheduler, hook: Callable[[list[str]], Any]) -> Callable[[], None]:
    """Await ``hook(addresses)`` before Dask's ``retire_workers`` starts retiring them; returns
    the undo.

    Why: a graceful retirement (``client.retire_workers``, ``cluster.adapt`` scaling down, a
    worker's ``--lifetime``) only waits for Dask's data to be replicated; a stateful instance is
    no Dask data, and Dask has no hook to wait for it. Every path reaches the scheduler's
    ``retire_workers`` handler (an RPC; the handler table holds the bound method, so the table
    entry is replaced along with the attribute). Without a list of workers, Dask's own choice
    (``workers_to_close``, which asks the plugins' ``valid_workers_downscaling``) is made here
    first, so the hook sees the workers it will retire."""
    original = scheduler.retire_workers
    choose = ("memory_ratio", "n", "key", "minimum", "target", "attribute")

    async def retire_workers(workers: Any = None, *, names: Any = None, **kwargs: Any) -> Any:
        if workers is None and names is None:
            workers = scheduler.workers_to_close(**{k: kwargs.pop(k) for k in choose if k in kwargs})
            if not workers:
                return {}
        else:
            for k in choose:
                kwargs.pop(k, None)
        if names is not None:
            wanted = {str(n) for n in names}
            targets = [a for a, ws in scheduler.workers.items() if str(ws.name) in wanted]
        else:
            targets = [w for w in workers if w in scheduler.workers]
        if targets:
            await hook(targets)
        return await original(workers=workers, names=names, **kwargs)

    scheduler.retire_workers = retire_workers  # type: ignore[method-assign]
    scheduler.handlers["retire_workers"] = retire_workers

    def undo() -> None:
        if scheduler.__dict__.get("retire_workers") is retire_workers:
            del scheduler.retire_workers
        if scheduler.handlers.get("retire_workers") is retire_workers:
            scheduler.handlers["retire_workers"] = original

    return undo


def worker_state_address(ws: Any) -> str:
    """A WorkerState's address (what ``valid_workers_downscaling`` is given)."""
    return ws.address


def wanted_by(scheduler: Scheduler, client: str) -> list:
    """The keys ``client`` wants (holds futures of), as the scheduler knows."""
    cs = scheduler.clients.get(client)
    return [ts.key for ts in cs.wants_what] if cs is not None else []


def desire_keys(scheduler: Scheduler, keys: Iterable[Any], client: str) -> list:
    """Make ``client`` (a real client or a name of ours, as Dask's ``fire-and-forget``) want
    the known ``keys``: they are kept while it does. A real client is told at once of those
    already finished or erred. Returns the keys that were known."""
    known = [k for k in keys if k in scheduler.tasks]
    if known:
        scheduler.client_desires_keys(keys=known, client=client)
    return known


def release_keys(scheduler: Scheduler, keys: Iterable[Any], client: str, stimulus_id: str) -> None:
    """``client`` no longer wants ``keys`` (released if nobody else does)."""
    keys = [k for k in keys if k in scheduler.tasks]
    if keys and client in scheduler.clients:
        scheduler.client_releases_keys(keys=keys, client=client, stimulus_id=stimulus_id)


def tell_cancelled(scheduler: Scheduler, client: str, keys: list, reason: str, msg: str) -> None:
    """Tell ``client`` that its futures of ``keys`` are cancelled (``reason``, ``msg``): what
    Dask sends when a key is cancelled; the client's futures raise ``FutureCancelledError``."""
    scheduler.report({"op": "cancelled-keys", "keys": list(keys), "reason": reason, "msg": msg}, client=client)


def task_holders(ts: Any) -> set[str]:
    """Addresses of the workers holding the task's result (empty when none)."""
    return {ws.address for ws in (ts.who_has or ())}


def task_erred_on(ts: Any) -> set[str]:
    """Addresses of the workers the task erred on (empty when none)."""
    return set(ts.erred_on or ())


def comm_peer(comm: Any) -> str | None:
    """The peer address of an RPC's comm (an ephemeral address for outgoing connections:
    not the caller's listening address)."""
    return getattr(comm, "peer_address", None)


def worker_stream_peer(scheduler: Scheduler, address: str) -> str | None:
    """The peer address of the scheduler's stream comm with the worker at ``address``: where
    that worker's own outgoing connections come from (None if it has no stream)."""
    bs = scheduler.stream_comms.get(address)
    comm = getattr(bs, "comm", None)
    return getattr(comm, "peer_address", None)


def address_host(address: Any) -> str | None:
    """The host part of a Dask address (``tcp://10.0.0.1:1234`` -> ``10.0.0.1``); None when
    it is not one."""
    from distributed.comm.addressing import get_address_host

    if not isinstance(address, str):
        return None
    try:
        return get_address_host(address)
    except Exception:  # ValueError for junk; inproc raises for other processes' addresses
        return None


# -- the enforcement layer: answers to move requests, what a move's target must offer ----------

STEAL_ANSWERS = frozenset({"confirm", "already-computing", "reschedule", "already-aborted", "stale-response"})
"""What ``WorkStealing.move_task_confirm`` logs on the ``stealing`` topic when a victim answers."""


def watch_steal_answers(scheduler: Scheduler, name: str, callback: Callable[[str, str], None]) -> None:
    """Call ``callback(stimulus_id, answer)`` for every answer to a move request (:func:`move_task`).

    Dask's ``WorkStealing.move_task_confirm`` acts on the victim's answer, then logs it on the
    ``stealing`` event topic as a tuple ``(answer, ..., stimulus_id)``: ``confirm`` (the victim
    gave the task up: it now processes on the thief), ``already-computing`` (refused: it had
    started), ``reschedule`` (logged just before Dask places the task anew, e.g. the thief
    left), ``already-aborted`` (the task left the victim before the answer), ``stale-response``
    (an answer to a superseded request). A scheduler plugin's ``log_event`` hook sees each event
    as it is logged, so ``callback`` runs inside the confirmation. The plugin is registered
    under ``name``, replacing one of that name."""
    from distributed import SchedulerPlugin

    class StealAnswers(SchedulerPlugin):
        def log_event(self, topic: str, msg: Any) -> None:
            if (topic == "stealing" and isinstance(msg, (tuple, list)) and len(msg) > 1
                    and msg[0] in STEAL_ANSWERS and isinstance(msg[-1], str)):
                callback(msg[-1], msg[0])

    scheduler.plugins.pop(name, None)  # replace without add_plugin's overwrite warning
    scheduler.add_plugin(StealAnswers(), name=name)


def unwatch_steal_answers(scheduler: Scheduler, name: str) -> None:
    """Undo :func:`watch_steal_answers`."""
    if name in scheduler.plugins:
        scheduler.remove_plugin(name=name)


def move_in_flight(scheduler: Scheduler, ts: Any) -> str | None:
    """The stimulus id of the move request of ``ts`` awaiting the victim's answer (None: none).
    A move engine without requests in flight (the benchmarks' stand-in applies moves at once)
    has none."""
    ext = scheduler.extensions.get("stealing")
    info = (getattr(ext, "in_flight", None) or {}).get(ts) if ext is not None else None
    return info["stimulus_id"] if info else None


def task_started(ts: Any) -> bool:
    """True if ``ts`` executes (or has seceded) on the worker it is processing on, as far as the
    scheduler knows (a heartbeat late: the worker may have started it since)."""
    ws = ts.processing_on
    return ws is not None and started_on_worker(ws, ts)


def has_host_restrictions(ts: Any) -> bool:
    """Restricted to hosts (``workers=`` naming hosts, not worker addresses)."""
    return bool(ts.host_restrictions)


def worker_has_resources(scheduler: Scheduler, ts: Any, address: str) -> bool:
    """True if the worker at ``address`` supplies every resource ``ts`` needs (``resources=``)."""
    need = ts.resource_restrictions
    if not need:
        return True
    ws = scheduler.workers.get(address)
    return ws is not None and all(ws.resources.get(r, 0) >= n for r, n in need.items())


def worker_status(scheduler: Scheduler, address: str) -> str | None:
    """The worker's status (``running``, ``paused``, ``closing_gracefully``...); None if unknown."""
    ws = scheduler.workers.get(address)
    return None if ws is None else ws.status.name


def move_resource_accounting(scheduler: Scheduler, ts: Any, victim: str, thief: str) -> None:
    """After a confirmed move: carry the resources ``ts`` holds in the scheduler's books from
    ``victim`` to ``thief``. Dask's steal confirmation moves the task but not what it acquired:
    the victim would keep it acquired, and the thief's count would go negative when the task
    ends there."""
    if not ts.resource_restrictions:
        return
    ws = scheduler.workers.get(victim)
    if ws is not None:
        scheduler.release_resources(ts, ws)
    ws = scheduler.workers.get(thief)
    if ws is not None:
        scheduler.acquire_resources(ts, ws)


def undo_move_pin(ts: Any, victim: str, thief: str) -> None:
    """After a refused move: a task :func:`move_task` re-pinned to ``thief`` is pinned to
    ``victim`` again (where it stays, or is placed again)."""
    if ts.worker_restrictions == {thief}:
        ts.worker_restrictions = {victim}


def worker_pid(scheduler: Scheduler, address: str) -> int | None:
    """The process id the worker at ``address`` registered with (None if unknown)."""
    ws = scheduler.workers.get(address)
    pid = getattr(ws, "pid", None)
    return pid if isinstance(pid, int) and pid > 0 else None
