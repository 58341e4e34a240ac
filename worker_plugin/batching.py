"""Coalescing calls of a component with the ``batching`` hint on one worker.

Calls of the same (component, method) that start on a worker within ``max_wait`` of each
other, up to ``max_batch``, run as one batch: the first becomes the leader, waits for the
batch to fill (or the wait to end), runs it, and hands each follower its own result or
exception. A component runs the batch in one go when it provides a batch form:

- a function component: an attribute ``__dask_agents_batch__(calls)``;
- a class component: a method ``<method>_batch(self, calls)``;

where ``calls`` is a list of ``(args, kwargs)`` and the return value a list of results in
the same order. Without one, the leader runs the calls one after another (still one thread
instead of many). Followers secede while they wait, so waiting holds no worker thread.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class _Batch:
    opened: float
    calls: list = field(default_factory=list)  # (args, kwargs, Future)
    closed: bool = False
    full: threading.Event = field(default_factory=threading.Event)


class Batcher:
    """Per-worker coalescing of batchable calls."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[tuple[str, str | None], _Batch] = {}
        self.batches = 0
        self.batched_calls = 0

    def run(self, key: tuple[str, str | None], max_batch: int, max_wait: float,
            single: Callable[[tuple, dict], Any], batch: Callable[[list], list] | None,
            args: tuple, kwargs: dict) -> Any:
        """Run one call as part of a batch; returns its result (or raises its exception)."""
        fut: Future = Future()
        with self._lock:
            b = self._open.get(key)
            leader = b is None
            if leader:
                b = self._open[key] = _Batch(time.monotonic())
            b.calls.append((args, kwargs, fut))
            if len(b.calls) >= max_batch:
                self._close(key, b)
        if not leader:
            from dask_agents.worker_plugin.dask_compat import secede_if_in_task

            if not fut.done():
                secede_if_in_task()
            return fut.result()
        b.full.wait(max_wait)
        with self._lock:
            self._close(key, b)
        self._execute(b.calls, single, batch)
        return fut.result()

    def _close(self, key: tuple, b: _Batch) -> None:
        if not b.closed:
            b.closed = True
            b.full.set()
            if self._open.get(key) is b:
                del self._open[key]

    def _execute(self, calls: list, single: Callable, batch: Callable | None) -> None:
        self.batches += 1
        self.batched_calls += len(calls)
        if batch is not None and len(calls) > 1:
            try:
                results = batch([(a, k) for a, k, _ in calls])
                if len(results) != len(calls):
                    raise ValueError(f"batch form returned {len(results)} results for {len(calls)} calls")
            except Exception as e:
                for _, _, f in calls:
                    f.set_exception(e)
                return
            for (_, _, f), r in zip(calls, results):
                f.set_result(r)
            return
        for a, k, f in calls:
            try:
                f.set_result(single(a, k))
            except Exception as e:  # each call gets its own exception
                f.set_exception(e)
