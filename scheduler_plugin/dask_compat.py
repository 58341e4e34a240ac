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


def has_worker(scheduler: Scheduler, address: str) -> bool:
    """True if ``address`` is a connected, running worker."""
    ws = scheduler.workers.get(address)
    return ws is not None and ws in scheduler.running


def load(scheduler: Scheduler, address: str) -> int:
    """Tasks assigned to a worker and not finished (its processing set)."""
    ws = scheduler.workers.get(address)
    return len(ws.processing) if ws is not None else 1 << 30


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
