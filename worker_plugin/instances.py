"""Component instances hosted on a worker.

Stateless class components: one shared instance per worker (threads may call it at once).
Stateful ones: one instance per (component, session); its calls run one at a time in the
order the worker started them (tickets taken in the worker's ``ready -> executing``
transition, which follows the scheduler's priority order, i.e. submission order).
"""

from __future__ import annotations

import threading
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator


@dataclass
class StatefulSlot:
    """One stateful instance, its FIFO of call keys, and the condition calls wait on."""

    instance: Any = None
    queue: deque = field(default_factory=deque)
    cond: threading.Condition = field(default_factory=threading.Condition)
    calls: int = 0


class Instances:
    """The instances this worker hosts."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._shared: dict[str, Any] = {}
        self._stateful: dict[tuple[str, str | None], StatefulSlot] = {}

    def shared(self, component: str, cls: type) -> Any:
        """The worker's instance of a stateless class component (created on first use)."""
        inst = self._shared.get(component)
        if inst is None:
            with self._lock:
                inst = self._shared.get(component)
                if inst is None:
                    inst = self._shared[component] = cls()
        return inst

    def _slot(self, component: str, session: str | None) -> StatefulSlot:
        with self._lock:
            slot = self._stateful.get((component, session))
            if slot is None:
                slot = self._stateful[(component, session)] = StatefulSlot()
            return slot

    def ticket(self, component: str, session: str | None, key: str) -> None:
        """Queue ``key`` for its stateful instance (called as the task starts executing)."""
        slot = self._slot(component, session)
        with slot.cond:
            if key not in slot.queue:
                slot.queue.append(key)

    def done(self, component: str, session: str | None, key: str) -> None:
        """Drop ``key`` from its instance's queue (idempotent) and wake the next call."""
        slot = self._stateful.get((component, session))
        if slot is None:
            return
        with slot.cond:
            try:
                slot.queue.remove(key)
            except ValueError:
                return
            slot.cond.notify_all()

    @contextmanager
    def turn(self, component: str, session: str | None, key: str, cls: type) -> Iterator[Any]:
        """Wait for ``key``'s turn on the session's instance, then yield the instance."""
        slot = self._slot(component, session)
        with slot.cond:
            if key not in slot.queue:
                slot.queue.append(key)
            if slot.queue[0] != key:
                from worker_plugin.dask_compat import secede_if_in_task

                secede_if_in_task()  # waiting for our turn must not hold a worker thread
                slot.cond.wait_for(lambda: key not in slot.queue or slot.queue[0] == key)
            if slot.instance is None:
                slot.instance = cls()
            slot.calls += 1
        try:
            yield slot.instance
        finally:
            self.done(component, session, key)

    def end_session(self, session: str) -> int:
        """Release the session's stateful instances (calling ``close()`` if they have one)."""
        with self._lock:
            gone = [k for k in self._stateful if k[1] == session]
            slots = [self._stateful.pop(k) for k in gone]
        for slot in slots:
            close = getattr(slot.instance, "close", None)
            if callable(close):
                try:
                    close()
                except Exception:  # a failing close must not break the worker
                    pass
        return len(slots)

    def stateful_count(self) -> int:
        """How many stateful instances (sessions x components) live here."""
        return len(self._stateful)
