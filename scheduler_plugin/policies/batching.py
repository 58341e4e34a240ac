"""Batching: gather waiting calls of a component with the ``batching`` hint on one worker,
up to its ``max_batch``, so the worker plugin can coalesce them (worker_plugin/batching.py).

For each batchable component whose waiting calls are spread over several workers, the
worker already holding the most of them (ties: the least loaded) is the batch's home; calls
elsewhere move there until it holds ``max_batch``. Calls already together are left alone.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterator

from dask_agents.scheduler_plugin.actions import Migrate
from dask_agents.scheduler_plugin.view import ClusterView


class Batching:
    """Suggest migrations that co-locate batchable calls."""

    def __init__(self, max_moves: int = 64):
        self.max_moves = int(max_moves)

    def __call__(self, view: ClusterView) -> Iterator[Migrate]:
        groups: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
        for c in view.calls.values():
            if c.batch_max and c.worker is not None and not c.stateful and not c.restricted and c.model is None:
                groups[c.component][c.worker].append(c)
        moves = 0
        for component, by_worker in groups.items():
            if len(by_worker) < 2:
                continue
            cap = next(iter(next(iter(by_worker.values())))).batch_max
            home = max(by_worker, key=lambda w: (len(by_worker[w]), -view.workers[w].processing
                                                 if w in view.workers else 0))
            room = cap - len(by_worker[home])
            for w, calls in sorted(by_worker.items(), key=lambda kv: len(kv[1])):
                if w == home:
                    continue
                for c in sorted(calls, key=lambda c: c.priority):
                    if room <= 0 or moves >= self.max_moves:
                        return
                    yield Migrate(c.key, w, home, reason=f"batch {component} on {home}")
                    room -= 1
                    moves += 1
