"""Every Dask *worker* internal that dask-agents relies on, in one place.

Each function here is exercised by ``tests/test_dask_compat.py`` against the pinned
distributed range (setup.cfg), so an upgrade that breaks one fails loudly there.
"""

from __future__ import annotations

import math
import threading
from contextlib import contextmanager
from typing import Any, Iterator

from distributed import Worker
from distributed.threadpoolexecutor import thread_state as pool_state
from distributed.worker import thread_state as task_state

# Workers and schedulers are both distributed Servers: one implementation serves both sides.
from dask_agents.scheduler_plugin.dask_compat import add_periodic, remove_periodic  # noqa: F401


def in_task_thread() -> bool:
    """True inside a task running on a worker's thread pool (and not yet seceded).

    Two thread-locals: distributed's ``thread_state`` (the running task's key) and the
    thread pool's own (``executor``, and ``proceed`` which secede sets to False).
    """
    return (
        getattr(task_state, "key", None) is not None
        and getattr(pool_state, "executor", None) is not None
        and getattr(pool_state, "proceed", False)
    )


def secede_if_in_task() -> bool:
    """Secede the current task from the worker's pool once; returns True if it seceded.

    The thread then finishes its task outside the pool and exits (Dask's secede semantics),
    so a call that waits on other calls never holds a worker slot. We never rejoin: a
    second secede of the same task is not a valid worker transition.
    """
    if not in_task_thread():
        return False
    from distributed import secede

    secede()
    return True


@contextmanager
def unprofiled() -> Iterator[None]:
    """While a task thread waits (on a call's future, on an engine) it leaves the worker's
    ``active_threads``, the map Dask's statistical profiler walks every
    ``distributed.worker.profile.interval`` (and the call-stack view reads): a thread parked in
    a wait adds only "waiting" frames to the profile, and walking the stacks of dozens of
    seceded waiters on the event loop every 10 ms took the GIL from the engines' stepping
    threads (a fan-out of 12 requests: 5 of the workers' 15 event-loop CPU-seconds). It is put
    back before the task goes on, so Dask's own bookkeeping (``apply_function`` deletes it at the
    end, ``get_current_task``) sees it as before. Anywhere else (the driver, a thread no task
    runs in) it does nothing."""
    worker = getattr(task_state, "execution_state", {}).get("worker") if in_any_task_thread() else None
    ident = threading.get_ident()
    key = None
    if worker is not None:
        with worker.active_threads_lock:
            key = worker.active_threads.pop(ident, None)
    try:
        yield
    finally:
        if key is not None:
            with worker.active_threads_lock:
                worker.active_threads[ident] = key


def on_event_loop(owner: Any) -> bool:
    """True in the thread running the event loop of ``owner`` (a worker or a client: its
    handlers, callbacks, comms). Dask's loop is tornado's wrapper of an asyncio loop
    (``IOLoop.asyncio_loop``)."""
    import asyncio

    try:
        running = asyncio.get_running_loop()
    except RuntimeError:  # no loop runs in this thread
        return False
    return running is getattr(getattr(owner, "loop", None), "asyncio_loop", None)


@contextmanager
def lock_released(lock: Any) -> Iterator[None]:
    """Let go of ``lock`` (a ``threading.RLock``, e.g. a Dask ``Client._refcount_lock``) for
    the block if this thread holds it, however deeply, and take it back after, as
    ``threading.Condition.wait`` does with its lock (``_release_save``/``_acquire_restore``);
    anything else (None, a lock this thread does not hold): the block runs as it is."""
    owned = getattr(lock, "_is_owned", None)
    if owned is None or not owned():
        yield
        return
    state = lock._release_save()
    try:
        yield
    finally:
        lock._acquire_restore(state)


def in_any_task_thread() -> bool:
    """True in a thread that runs a task of a worker, seceded or not."""
    return getattr(task_state, "key", None) is not None


def secede_async_task(key: Any) -> bool:
    """Mark the coroutine task ``key`` running on this worker's event loop as long-running, as
    ``distributed.secede`` does for a thread: it stops counting against the worker's slots.
    Returns False (and does nothing) outside a worker or for a key that is not executing."""
    from time import time

    from distributed import get_worker
    from distributed.worker_state_machine import SecedeEvent

    try:
        worker = get_worker()
    except ValueError:
        return False
    ts = worker.state.tasks.get(key)
    if ts is None or ts.state != "executing":
        return False
    start = getattr(ts, "start_time", None) or time()
    worker.handle_stimulus(SecedeEvent(key=key, compute_duration=time() - start, stimulus_id=f"agents-secede-{time()}"))
    return True


def task_running(worker: Worker, key: Any) -> bool:
    """Whether ``key`` runs on this worker as far as its state machine knows (``executing`` or
    ``long-running``): false once the scheduler cancelled or released it, although its thread
    may run on. Read from a task thread (a dict lookup and an attribute: no loop needed)."""
    ts = worker.state.tasks.get(key)
    return ts is not None and ts.state in ("executing", "long-running")


def task_annotations(worker: Worker, key: Any) -> dict:
    """Annotations of a task the worker knows (empty if unknown)."""
    ts = worker.state.tasks.get(key)
    return (ts.annotations or {}) if ts is not None else {}


def task_priority(worker: Worker, key: Any) -> tuple:
    """The scheduler's priority of a task on this worker, without the worker's own arrival suffix."""
    ts = worker.state.tasks.get(key)
    return tuple(ts.priority[:-1]) if ts is not None and ts.priority else ()


def set_batched_send_interval(worker: Worker, seconds: float) -> None:
    """Shorten the worker -> scheduler batching window (``BatchedSend.interval``)."""
    bs = getattr(worker, "batched_stream", None)
    if bs is not None and hasattr(bs, "interval"):
        bs.interval = seconds


async def scheduler_has_handler(worker: Worker, op: str) -> bool:
    """True if the scheduler serves RPC ``op``.

    Asked through the scheduler's ``run_function`` handler (what ``Client.run_on_scheduler``
    uses): a scheduler answers nothing to an unknown RPC, so we must not send one blindly."""
    from distributed.protocol.pickle import dumps

    def check(op: str, dask_scheduler: Any = None) -> bool:  # dask passes the scheduler by keyword
        return op in dask_scheduler.handlers

    response = await worker.scheduler.run_function(
        function=dumps(check), args=dumps((op,)), kwargs=dumps({}), wait=True
    )
    return response.get("status") == "OK" and bool(response.get("result"))


def send_to_scheduler(worker: Worker, msg: dict) -> None:
    """Send a stream message to the scheduler (only ops the scheduler registered)."""
    worker.batched_send(msg)


def add_rpc_handler(worker: Worker, name: str, handler: Any) -> None:
    """Register an RPC handler (``await rpc(worker).name(...)``) on the worker."""
    worker.handlers[name] = handler



def reprioritize(worker: Worker, priorities: dict) -> int:
    """Give tasks waiting on this worker new priorities; returns how many changed.

    The worker's ready/constrained queues are HeapSets keyed by ``ts.priority``, and the worker
    appends its own arrival counter to the scheduler's priority. A HeapSet cannot demote in
    place, so each touched queue is rebuilt (small: tasks waiting on one worker)."""
    st = worker.state
    clean = {}
    for key, prio in priorities.items():  # checked before any queue is touched: a bad one changes nothing
        if not isinstance(prio, (tuple, list)) or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in prio):
            raise TypeError(f"priority of {key!r} must be a tuple of finite numbers, got {prio!r}")
        clean[key] = tuple(prio)
    priorities = clean
    changed = 0
    for heap in (st.ready, st.constrained):
        members = [ts for ts in heap if ts.key in priorities]
        if not members:
            continue
        everything = list(heap)
        heap.clear()
        for ts in members:
            ts.priority = tuple(priorities[ts.key]) + (ts.priority[-1],)
            changed += 1
        for ts in everything:
            heap.add(ts)
    return changed


def add_stream_handler(worker: Worker, op: str, handler: Any) -> None:
    """Register a scheduler -> worker stream op (before the scheduler may send it)."""
    worker.stream_handlers[op] = handler


def registered(worker: Worker) -> bool:
    """True once the worker has registered with its scheduler (False while a preload's
    ``dask_setup`` runs: preloads run before registration)."""
    from distributed.core import Status

    return worker.status == Status.running


# -- the fast path (worker_plugin/local.py) ---------------------------------------------------

def publish_local(worker: Worker, client: Any, key: Any, value: Any) -> None:
    """On the worker's loop: ``value`` into this worker's memory as ``key`` (the worker half of
    ``scatter``: a released -> memory transition that sends nothing), then the scheduler told
    on ``client``'s stream (``update-data``, the other half), so the key is an ordinary one."""
    from time import time

    from dask.sizeof import sizeof

    worker.update_data({key: value}, stimulus_id=f"agents-local-{time()}")
    # sent now, not queued behind callbacks already on the loop: a graph depending on the key,
    # submitted after the call ended, is queued there (Client._send_to_scheduler)
    client._send_to_scheduler_safe({"op": "update-data", "who_has": {key: [worker.address]},
                               "nbytes": {key: sizeof(value)}, "client": client.id})


def _future_state(client: Any, key: Any) -> Any:
    st = client.futures.get(key)
    return st if st is not None and st.status == "pending" else None


def finish_future(client: Any, key: Any, typ: type | None) -> None:
    """On the client's loop: the pending state every Future of ``key`` shares becomes finished
    (what Dask's key-in-memory does)."""
    st = _future_state(client, key)
    if st is not None:
        st.finish(typ)


def fail_future(client: Any, key: Any, exc: BaseException) -> None:
    """On the client's loop: the pending shared state of ``key`` becomes an error (task-erred)."""
    st = _future_state(client, key)
    if st is not None:
        st.set_error(exc, exc.__traceback__)


def lost_with_connection(exc: BaseException) -> bool:
    """Whether ``exc`` is Dask cancelling a future because its client lost the scheduler
    connection (``Client._reconnect`` cancels and forgets every future's state)."""
    from distributed.client import FutureCancelledError

    return isinstance(exc, FutureCancelledError) and exc.reason == "scheduler-connection-lost"


def scheduler_id(client: Any) -> str | None:
    """The id of the scheduler ``client`` is connected to (``Scheduler-<uuid>``, new on every
    scheduler start), as its last ``identity`` answer gave it; None before it connected. A
    reconnecting client asks again before it is ``running`` (``Client._ensure_connected``)."""
    info = getattr(client, "_scheduler_identity", None)
    sid = info.get("id") if isinstance(info, dict) else None
    return sid if isinstance(sid, str) else None


def rebind_future(fut: Any) -> None:
    """On the client's loop, after it reconnected: give ``fut`` a live state of its key again
    (the one the client's other futures of the key will share). The client's reference count
    for the key outlived the reconnect, so releasing ``fut`` later releases the key as usual."""
    from distributed.client import FutureState

    client = fut.client
    st = client.futures.get(fut.key)
    if st is None:
        st = client.futures[fut.key] = FutureState(fut.key)
    fut._state = st


def cancel_future(client: Any, key: Any, msg: str) -> None:
    """On the client's loop: the pending shared state of ``key`` becomes cancelled."""
    st = _future_state(client, key)
    if st is not None:
        st.cancel(reason="cancelled", msg=msg)


def before_graph_submission(client: Any, before: Any, before_desired: Any = None) -> None:
    """Call ``before()`` ahead of every graph this client sends (``submit``, ``map``,
    ``compute``, ``delayed``: all go through ``Client._graph_to_futures``) and, if given,
    ``before_desired(keys)`` ahead of every ``client-desires-keys`` it sends
    (``fire_and_forget``). Once per client; instance attributes, so other clients are untouched."""
    if getattr(client._graph_to_futures, "_agents_before", None) is not None:
        return
    original = client._graph_to_futures

    def _graph_to_futures(*args: Any, **kwargs: Any) -> Any:
        before()
        return original(*args, **kwargs)

    _graph_to_futures._agents_before = before  # type: ignore[attr-defined]
    client._graph_to_futures = _graph_to_futures
    if before_desired is not None:
        send = client._send_to_scheduler

        def _send_to_scheduler(msg: dict) -> Any:
            if msg.get("op") == "client-desires-keys":
                before_desired(list(msg.get("keys") or ()))
            return send(msg)

        client._send_to_scheduler = _send_to_scheduler


def hold_value(worker: Worker, key: Any, value: Any) -> None:
    """On the worker's loop: ``value`` into this worker's memory as ``key`` (the worker half of
    ``scatter``); whoever called for it names it to the scheduler."""
    from time import time

    worker.update_data({key: value}, stimulus_id=f"agents-direct-{time()}")


def drop_value(worker: Worker, key: Any) -> None:
    """On the worker's loop: forget ``key`` held by :func:`hold_value` that nobody named to
    the scheduler (its caller dropped it)."""
    from time import time

    from distributed.worker_state_machine import FreeKeysEvent

    if key in worker.state.tasks:
        worker.handle_stimulus(FreeKeysEvent(keys=[key], stimulus_id=f"agents-direct-forget-{time()}"))


def nbytes(value: Any) -> int:
    """Dask's size estimate of ``value``."""
    from dask.sizeof import sizeof

    return int(sizeof(value))


@contextmanager
def as_worker(worker: Worker) -> Iterator[None]:
    """In a thread of our own: ``get_worker()`` (and so ``get_client()``) answer ``worker``, as
    in one of its task threads (``distributed.worker._worker_cvar``)."""
    from distributed.worker import _worker_cvar

    token = _worker_cvar.set(worker)
    try:
        yield
    finally:
        _worker_cvar.reset(token)


def add_client_stream_handler(client: Any, op: str, handler: Any) -> None:
    """Handle ``op`` on ``client``'s stream from the scheduler (``Client._stream_handlers``,
    which the client's report loop reads for every message)."""
    client._stream_handlers[op] = handler


def register_key(client: Any, key: Any, worker: str, nbytes: int) -> None:
    """On the client's loop: tell the scheduler that ``worker`` holds ``key`` for ``client``
    (``update-data`` on the client's own stream, as ``scatter`` does), so that it is an
    ordinary key: an argument of later work, released when the client's futures are."""
    client._send_to_scheduler({"op": "update-data", "who_has": {key: [worker]}, "nbytes": {key: int(nbytes)},
                               "client": client.id})


def graph_dependencies(expr: Any) -> set:
    """The keys a graph about to be sent depends on from outside itself (its futures)."""
    graph = dict(expr.__dask_graph__())
    deps: set = set()
    for node in graph.values():
        deps.update(getattr(node, "dependencies", ()) or ())
    return deps - set(graph)


def on_graph_dependencies(client: Any, wanted: Any, hook: Any) -> None:
    """Call ``hook(keys)`` with the outside dependencies of every graph ``client`` sends, ahead
    of it, while ``wanted()`` (a cheap check: the graph is read only then). Once per client."""
    if getattr(client._graph_to_futures, "_agents_deps", None) is not None:
        return
    original = client._graph_to_futures

    def _graph_to_futures(*args: Any, **kwargs: Any) -> Any:
        if wanted():
            hook(graph_dependencies(args[0] if args else kwargs["expr"]))
        return original(*args, **kwargs)

    _graph_to_futures._agents_deps = hook  # type: ignore[attr-defined]
    client._graph_to_futures = _graph_to_futures


def submit_key(client: Any, func: Any, *args: Any, key: str, resources: dict | None = None,
               workers: list[str] | None = None) -> Any:
    """``client.submit(func, *args, key=key, pure=False, resources=resources)`` for a key the
    client already holds a future of (a fast-path call's, created before it was sent):
    ``Client.submit`` returns the existing future for such a key and sends nothing."""
    import uuid

    from dask._expr import LLGExpr
    from dask._task_spec import Task, parse_input
    from distributed.spans import SpanMetadata

    expr = LLGExpr({key: Task(key, func, *(parse_input(a) for a in args))}, _determ_token=uuid.uuid4().hex)
    return client._graph_to_futures(expr, [key], workers=workers, internal_priority={key: 0}, resources=resources,
                                    span_metadata=SpanMetadata(collections=[{"type": "Future"}]))[key]


def leave_sigint_to_nanny(worker: Worker) -> bool:
    """In a worker process a Nanny started, ignore SIGINT: Ctrl-C in a terminal reaches the whole
    process group, and the nanny (in the driver's process, for a ``LocalCluster``; a process of
    its own for ``dask worker``) is the one that stops its worker. A worker that died on it under
    a driver's ``LocalCluster`` printed tracebacks, failed the calls in flight, and left the
    driver's cluster close waiting for workers that were gone. Returns whether it was set
    (only from the main thread, and only under a nanny: a worker without one keeps Ctrl-C)."""
    import signal
    import threading

    if getattr(worker, "nanny", None) is None or threading.current_thread() is not threading.main_thread():
        return False
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return True
