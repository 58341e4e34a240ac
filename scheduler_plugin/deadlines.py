"""Calls' own deadlines (issue 27, bounded cost): a call still open ``timeout`` seconds after
the scheduler sent it to a worker fails with :class:`~dask_agents.errors.CallTimeoutError`.

``timeout`` is the component's ``timeout`` hint, else ``agents.scheduler.call-timeout``. The
plugin starts a call's clock on its ``processing`` transition and checks the due ones in its
housekeeping (so the precision is ``agents.scheduler.housekeeping-interval``). A heap of
(deadline, key) with the current deadline per open call: a call that ends, or runs again (its
worker was lost), makes its old entry stale; stale entries are dropped when they surface or
when they outnumber the live ones.
"""

from __future__ import annotations

import heapq


class Deadlines:
    """When each open call's time is up."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, str]] = []
        self._current: dict[str, float] = {}  # open call -> its deadline

    def __len__(self) -> int:
        return len(self._current)

    def start(self, key: str, deadline: float) -> None:
        """``key`` was sent to a worker: it must end by ``deadline`` (a rerun restarts it)."""
        self._current[key] = deadline
        heapq.heappush(self._heap, (deadline, key))
        if len(self._heap) > 2 * len(self._current) + 1024:  # ended calls' entries: compact
            self._heap = [(d, k) for d, k in self._heap if self._current.get(k) == d]
            heapq.heapify(self._heap)

    def discard(self, key: str) -> None:
        """``key`` ended: no deadline any more."""
        self._current.pop(key, None)

    def due(self, now: float) -> list[str]:
        """The calls whose deadline passed (each once)."""
        out = []
        while self._heap and self._heap[0][0] <= now:
            deadline, key = heapq.heappop(self._heap)
            if self._current.get(key) == deadline:
                del self._current[key]
                out.append(key)
        return out
