"""Component instances hosted on a worker.

Stateless class components: one shared instance per worker (threads may call it at once).
Stateful ones: one instance per (component, session); its calls run one at a time in
submission order. Tickets are taken as each call *arrives* on the worker (all calls of a
session's stateful instance are sent to the worker that hosts it) and kept sorted by the
client's submission time, so a later call that the worker happens to start first (priorities
change while calls wait) still waits for the earlier ones.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator


@dataclass
class StatefulSlot:
    """One stateful instance, its FIFO of call keys, and the condition calls wait on."""

    instance: Any = None
    queue: deque = field(default_factory=deque)
    order: dict = field(default_factory=dict)  # key -> its sort key (submission time, arrival)
    cond: threading.Condition = field(default_factory=threading.Condition)
    calls: int = 0
    active: str | None = None  # the call using the instance now (an earlier call arriving later waits for it)


class Instances:
    """The instances this worker hosts.

    Instances released here at their session's end are remembered (the last ``remember`` of
    them): a call of one that still arrives raises :class:`~dask_agents.errors.InstanceLostError`
    instead of running on a fresh, empty instance. (The scheduler already fails such calls;
    this is the worker's own guard.) A component of that session none of whose calls came
    here is not affected."""

    def __init__(self, remember: int = 20_000) -> None:
        self._lock = threading.Lock()
        self._shared: dict[str, Any] = {}
        self._stateful: dict[tuple[str, str | None], StatefulSlot] = {}
        # (component, session) -> when its instance was released here
        self._ended: OrderedDict[tuple[str, str | None], float] = OrderedDict()
        self._remember = remember

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

    def ticket(self, component: str, session: str | None, key: str, created: float | None = None) -> None:
        """Queue ``key`` for its stateful instance, in submission order (``created``: the
        client's submission time; None sorts after every stamped call). Idempotent."""
        if (component, session) in self._ended:
            return  # its turn() fails: no slot for a released instance
        slot = self._slot(component, session)
        with slot.cond:
            if key in slot.order:
                return
            rank = (created if created is not None else float("inf"), len(slot.order) + slot.calls)
            slot.order[key] = rank
            i = len(slot.queue)
            while i > 0 and slot.order.get(slot.queue[i - 1], rank) > rank:
                i -= 1
            slot.queue.insert(i, key)
            slot.cond.notify_all()

    def done(self, component: str, session: str | None, key: str) -> None:
        """A call left the worker (finished, released, cancelled): drop its ticket unless it is
        the one using the instance, whose turn ends when its code returns. Idempotent."""
        slot = self._stateful.get((component, session))
        if slot is not None:
            self._release(slot, key, running=False)

    @staticmethod
    def _release(slot: StatefulSlot, key: str, running: bool) -> None:
        with slot.cond:
            if slot.active == key:
                if not running:
                    return  # still inside turn(): its own exit releases it
                slot.active = None
            slot.order.pop(key, None)
            try:
                slot.queue.remove(key)
            except ValueError:
                pass
            slot.cond.notify_all()

    @contextmanager
    def turn(self, component: str, session: str | None, key: str, cls: type,
             method: str | None = None) -> Iterator[Any]:
        """Wait for ``key``'s turn on the session's instance, then yield the instance.

        Raises InstanceLostError if the session ended here (its instance was released)."""
        if (component, session) in self._ended:
            self._lost(component, method, session, key)
        slot = self._slot(component, session)
        with slot.cond:
            if key not in slot.queue:
                slot.order[key] = (float("inf"), len(slot.order) + slot.calls)
                slot.queue.append(key)

            def ready() -> bool:
                return slot.active is None and (key not in slot.queue or slot.queue[0] == key)

            if not ready():
                from dask_agents.worker_plugin.dask_compat import secede_if_in_task

                secede_if_in_task()  # waiting for our turn must not hold a worker thread
                slot.cond.wait_for(ready)
            if (component, session) in self._ended:  # released while this call waited for its turn
                self._lost(component, method, session, key)
            slot.active = key
            if slot.instance is None:
                slot.instance = cls()
            slot.calls += 1
        try:
            yield slot.instance
        finally:
            self._release(slot, key, running=True)

    def end_session(self, session: str) -> int:
        """Release the session's stateful instances (calling ``close()`` if they have one)."""
        with self._lock:
            gone = [k for k in self._stateful if k[1] == session]
            slots = [self._stateful.pop(k) for k in gone]
            now = time.time()
            for k in gone:  # components whose calls came here: a late one must not start afresh
                self._ended[k] = now
            while len(self._ended) > self._remember:
                self._ended.popitem(last=False)
        for slot in slots:
            with slot.cond:  # calls still queued (late ones) must not wait on a gone slot forever
                slot.queue.clear()
                slot.order.clear()
                slot.cond.notify_all()
            close = getattr(slot.instance, "close", None)
            if callable(close):
                try:
                    close()
                except Exception:  # a failing close must not break the worker
                    pass
        return len(slots)

    def _lost(self, component: str, method: str | None, session: str | None, key: str) -> None:
        from dask_agents.errors import InstanceLostError, where

        ended = time.strftime("%H:%M:%S", time.localtime(self._ended.get((component, session), 0.0)))
        raise InstanceLostError(
            f"{where(component, method, session)}: its stateful instance was released on this worker when the "
            f"session ended at {ended}; the call is not run on a fresh instance (call {key}).",
            session=session, component=component)

    def stateful_count(self) -> int:
        """How many stateful instances (sessions x components) live here."""
        return len(self._stateful)
