"""The workers the scheduler plugin knows: the one small object its collaborators share.

Placement, admission, recovery and the view index each need to know which workers said hello
(their plugin is ready), which host which model, and whether a worker is still running; none
of them needs the plugin for that. The plugin fills the roster from hellos, swaps and
``remove_worker``; everyone else only reads it.
"""

from __future__ import annotations

import secrets
from collections import defaultdict
from typing import Any

from distributed import Scheduler

from dask_agents.scheduler_plugin import dask_compat

SECRET_OP = "agents-secret"  # scheduler -> worker: dask_agents.worker_plugin.plugin.SECRET_OP


class Roster:
    """The scheduler (set when the plugin starts), the ready workers and each model's hosts."""

    def __init__(self) -> None:
        self.scheduler: Scheduler | None = None
        self.ready: dict[str, dict[str, Any]] = {}  # address -> its hello (since, pid, models)
        self.hosts: defaultdict[str, set[str]] = defaultdict(set)  # model -> workers hosting it now
        # Proves to a worker that an RPC to its mutating handlers (end sessions, swap engines,
        # KV directives) comes from this scheduler: sent on each worker's own stream, where
        # only the scheduler writes, and passed with every such call (:meth:`call_worker`).
        self.secret = secrets.token_urlsafe(32)
        # workers being retired gracefully -> when their drain ends: no new sessions go there
        self.retiring: dict[str, float] = {}

    def alive(self, worker: str) -> bool:
        """Whether ``worker`` is a connected, running worker of the scheduler (O(1))."""
        return self.scheduler is not None and dask_compat.has_worker(self.scheduler, worker)

    def running(self) -> list[str]:
        """Every running worker's address (O(workers))."""
        return dask_compat.worker_addresses(self.scheduler) if self.scheduler is not None else []

    def tell_secret(self, worker: str) -> None:
        """Send ``worker`` the secret on its own stream, where only it reads (once its plugin
        answered the hello's confirmation: it registered the op)."""
        if self.alive(worker):
            dask_compat.send_to_worker(self.scheduler, worker, {"op": SECRET_OP, "secret": self.secret})

    async def call_worker(self, worker: str, op: str, **kwargs: Any) -> Any:
        """Call one of ``worker``'s handlers that only the scheduler may call."""
        return await dask_compat.call_worker(self.scheduler, worker, op, secret=self.secret, **kwargs)

    def soon(self, fn: Any, *args: Any) -> None:
        """Run ``fn(*args)`` on the scheduler's event loop soon (outside the current handler)."""
        if self.scheduler is not None:
            self.scheduler.loop.add_callback(fn, *args)


def model_bounds() -> dict[str, tuple[int, int | None]]:
    """model -> (min replicas, max replicas) from ``agents.llm.models`` (empty if the models'
    configuration is invalid: the workers report that)."""
    from dask_agents.worker_plugin.engines import registry

    try:
        return {m: (s.min_replicas, s.max_replicas) for m, s in registry().items()}
    except ValueError:
        return {}
