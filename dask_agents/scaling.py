"""Carrying the control plane's ``Provision``/``Kill`` to the cluster manager.

The scheduler cannot reach a cluster manager (LocalCluster, dask-jobqueue's clusters, any
SpecCluster): it lives in the client's process. ``attach_cluster(client, cluster)`` starts a
small loop there that collects the scheduler plugin's scale requests and applies them the
way Dask's Adaptive does: ``cluster.scale(n)`` to add workers, and for removals a clean
``retire_workers`` followed by ``cluster.scale_down(names)``. New workers announce themselves
and the controller gives them the model they were provisioned for.
"""

from __future__ import annotations

import logging
import math
from inspect import isawaitable
from typing import Any

from dask.utils import parse_timedelta
from distributed import Client

logger = logging.getLogger(__name__)


class ClusterLink:
    """A client-side loop applying scale requests to ``cluster``."""

    def __init__(self, client: Client, cluster: Any, interval: str | float = "500ms",
                 max_workers: int | None = None):
        if not hasattr(cluster, "scale"):
            raise TypeError(f"attach_cluster needs a cluster manager with scale(), got {type(cluster).__name__}")
        try:
            seconds = float(parse_timedelta(interval, default="s"))
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError, IndexError):
            seconds = math.nan
        if not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"attach_cluster(interval=...) must be a positive duration such as '500ms', got {interval!r}")
        if max_workers is not None and (isinstance(max_workers, bool) or not isinstance(max_workers, int)
                                        or max_workers < 0):
            raise ValueError(f"attach_cluster(max_workers=...) must be None or an int >= 0, got {max_workers!r}")
        self.client = client
        self.cluster = cluster
        self.interval = seconds
        self.max_workers = max_workers
        self.added = 0
        self.removed: list[str] = []
        self._pc: Any = None

    def start(self) -> "ClusterLink":
        """Start polling (on the client's event loop)."""
        from tornado.ioloop import PeriodicCallback

        self._pc = PeriodicCallback(self.poll, self.interval * 1000)
        self.client.loop.add_callback(self._pc.start)
        return self

    def stop(self) -> None:
        """Stop polling."""
        if self._pc is not None:
            self.client.loop.add_callback(self._pc.stop)

    async def poll(self) -> None:
        """Fetch pending requests and apply them."""
        try:
            req = await self.client.scheduler.agents_scale_requests(interval=self.interval)
        except Exception as e:  # scheduler gone or busy: try again next time
            logger.debug("dask-agents: scale requests unavailable: %s", e)
            return
        if req.get("remove"):
            names = list(req["remove"])
            await self.client.scheduler.retire_workers(names=names, remove=True, close_workers=True)
            f = self.cluster.scale_down(names) if hasattr(self.cluster, "scale_down") else None
            if isawaitable(f):
                await f
            self.removed += names
        if req.get("add"):
            current = len(getattr(self.cluster, "worker_spec", None) or self.cluster.workers)
            target = current + int(req["add"])
            if self.max_workers is not None:
                target = min(target, self.max_workers)
            if target > current:
                f = self.cluster.scale(target)
                if isawaitable(f):
                    await f
                self.added += target - current


def attach_cluster(client: Client, cluster: Any, *, interval: str | float = "500ms",
                   max_workers: int | None = None) -> ClusterLink:
    """Let the control plane add and remove workers of ``cluster`` (returns the running link)."""
    return ClusterLink(client, cluster, interval, max_workers).start()
