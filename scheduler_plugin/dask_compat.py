"""Every Dask *scheduler* internal that dask-agents relies on, in one place.

Each function is exercised by ``tests/test_dask_compat.py`` against the pinned distributed
range (setup.cfg). Nothing else in ``scheduler_plugin`` touches ``TaskState``/``WorkerState``
attributes or scheduler dictionaries directly.
"""

from __future__ import annotations

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
    """Shorten a client's client -> scheduler batching window."""
    bs = getattr(client, "scheduler_comm", None)
    if bs is not None and hasattr(bs, "interval"):
        bs.interval = seconds


# -- control plane: reading load, moving and re-prioritizing work -----------------------------

def workers(scheduler: Scheduler) -> list[Any]:
    """WorkerState objects of running workers."""
    return list(scheduler.running)


def worker_summary(ws: Any) -> tuple[str, int, int, int]:
    """(address, nthreads, tasks assigned, tasks running: executing or seceded)."""
    return ws.address, ws.nthreads, len(ws.processing), len(ws.executing) + len(ws.long_running)


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

    HeapSet cannot demote an entry in place (its stale heap entry would still be popped at
    the old priority): take the task out, change it, and put it back."""
    scheduler.queued.discard(ts)
    ts.priority = priority
    scheduler.queued.add(ts)


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


async def stop_builtin_balancing(scheduler: Scheduler) -> bool:
    """Stop Dask's own stealing loop (ours replaces it); returns True if it was running."""
    ext = scheduler.extensions.get("stealing")
    if ext is None or "stealing" not in scheduler.periodic_callbacks:
        return False
    await ext.stop()
    return True


async def start_builtin_balancing(scheduler: Scheduler) -> None:
    """Give Dask its stealing loop back."""
    ext = scheduler.extensions.get("stealing")
    if ext is not None:
        await ext.start()


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

def task_key(ts: Any) -> Any:
    """The task's key."""
    return ts.key


def running_on_worker(ws: Any) -> list[Any]:
    """Tasks executing (or seceded) on ``ws`` as far as the scheduler knows (a heartbeat late)."""
    out = list(ws.executing)
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


def remove_http_application(scheduler: Scheduler, app: Any) -> None:
    """Stop serving an application added with :func:`add_http_application`."""
    apps = scheduler.http_application.applications
    if app in apps:
        apps.remove(app)


# -- fault handling: calls stranded by a lost worker -----------------------------------------

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


def is_wanted(scheduler: Scheduler, key: Any) -> bool:
    """True if a client or a waiting dependent still needs the task: when Dask releases it
    (its worker was lost) it will run again rather than be forgotten."""
    ts = scheduler.tasks.get(key)
    return ts is not None and bool(ts.who_wants or ts.waiters)


async def call_worker(scheduler: Scheduler, address: str, op: str, **kwargs: Any) -> Any:
    """Call the RPC handler ``op`` of the worker at ``address`` (the scheduler's connection pool)."""
    return await getattr(scheduler.rpc(address), op)(**kwargs)
