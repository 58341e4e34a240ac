"""Calls that run where their caller runs: the worker's half of two-level control.

Nalar's component-level controller. A call made inside a running component (a tool, or a
stateless agent method) that can run right here is *deferred* instead of submitted: its
``AgentFuture`` exists at once and nothing is sent. When its caller waits for it (``value()``,
``result()``, any materialization) it runs in the caller's own thread, which already holds
this worker's slot: no update-graph, compute-task, task-finished or key-in-memory, no thread
hop. Anything else sends it down the scheduler path with the same key, so the future never
notices which path it took:

- its caller waits for another call: the deferred siblings are submitted first (they run in
  parallel, as they would have);
- its caller submits other Dask work (any graph: a plain ``client.submit``, ``delayed``), or
  its future is pickled (part of an object another call or a result carries): submitted
  before that work is sent;
- its caller asked for a timeout, or nobody waited for it within
  ``agents.worker.fast-path.max-wait``, or its caller ended without waiting for it.

A call that ran here leaves its value in this worker's memory and tells the scheduler so,
after the caller has it (Dask's ``update-data``, as ``scatter`` does): from then on its key is
an ordinary one (an argument of any later work, ``client.gather``, released when its futures
are), though, like scattered data, not recomputed if this worker is lost. Its record
(annotation, times, outcome) reaches the scheduler plugin in this worker's report batches
(``agents-report``'s ``calls``), and a caller's records go before its own end, on the same
stream, so its session never completes ahead of them. Session graphs, telemetry and the
Agents page see both paths alike.

An LLM call takes the fast path only under the scheduler's **admission lease** (Nalar's
two-level control: the global controller decides, the worker acts on its own within that):
the scheduler admitted its session to this worker's engine of the model and nothing of the
model is short (``scheduler_plugin/admission.py``: ``Admission.short``; the lease is pushed on
change, ``agents-lease``). It then goes straight to the engine here, in its caller's thread;
its token counts reach the scheduler as a scheduler-path call's do (admission's working sets,
KV hints). When the model runs short the lease is withdrawn and its calls wait in the scheduler
again, where policies order them.

The fast path nests: a call that runs here makes its own calls as its caller would, and they
may run here too (the chain of callers up to the task that made the first must still run).

What never takes the fast path: LLM calls without a lease, stateful calls (their instance and
order belong to the scheduler), batched or resource-constrained calls, calls with a dependency
that is not a finished local call, calls of a component the control plane routed to other
workers, a call whose caller the scheduler cancelled or released, and anything outside a
worker's component thread.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from distributed import Future

from dask_agents.models import CallReport

SCHEDULER = object()
"""What :meth:`LocalCalls.result` returns for a call that took the scheduler path."""

DEFERRED, RUNNING, FINISHED, ERRED, CANCELLED, SUBMITTED = (
    "deferred", "running", "finished", "erred", "cancelled", "submitted")
_DONE = (FINISHED, ERRED, CANCELLED)


@dataclass(eq=False)
class LocalCall:
    """One call that may run in its caller's thread, or go down the scheduler path."""

    key: str
    creator: str
    ann: dict
    run: Callable[[], Any]  # the call's body with its arguments bound (values of local futures substituted)
    submit: Callable[[], Any]  # the scheduler path, same key
    submit_error: Callable[[], Any]  # a task of this key raising ``error`` (an erred call escaping)
    client: Any
    controller: "LocalCalls"
    owner: str | None = None  # a driver's direct call: the driver's client (worker_plugin/direct.py)
    state: str = DEFERRED
    value: Any = None
    error: BaseException | None = None
    started: float | None = None
    finished: float | None = None
    error_sent: bool = False  # an erred call escaped: its error task was submitted
    metrics: dict | None = None  # an LLM call's token counts (the engine's), sent with its record
    thread: int | None = None  # the thread that runs it (set when it starts)
    claimed: bool = False  # its caller waits for it: it runs here unless its future escapes first
    done: threading.Event = field(default_factory=threading.Event)

    def __repr__(self) -> str:
        return f"<LocalCall {self.key} {self.state}>"


class LocalCalls:
    """The fast path of one worker (owned by :class:`~dask_agents.worker_plugin.plugin.AgentsWorkerPlugin`).

    Thread-safe: callers defer and run calls from component threads; the timer and the report
    flush run on the worker's event loop."""

    def __init__(self, worker: Any, max_wait: float):
        self.worker = worker
        self.max_wait = max_wait
        self.routes: dict[str, tuple[str, ...]] = {}  # component -> workers the control plane routed it to
        self.leases: dict[str, frozenset[str]] = {}  # model -> sessions whose LLM calls may run on its engine here
        # the metrics a call's run recorded (LLM tokens): the worker plugin's, set by it
        self.take_metrics: Callable[[str], dict | None] = lambda key: None
        self._lock = threading.Lock()
        self._deferred: dict[str, LocalCall] = {}
        self._by_creator: dict[str, dict[str, None]] = {}
        self._records: dict[str, CallReport] = {}  # key -> its newest record, not sent yet
        self._running: dict[str, LocalCall] = {}  # key -> a call running on this fast path now
        self.counts: Counter[str] = Counter()  # ran, submitted:<why>, cancelled
        # driver's calls running here straight from their driver (worker_plugin/direct.py): the
        # roots of chains of local calls, as a running task is for the calls it makes
        self.direct: set[str] = set()

    def routed_away(self, component: str) -> bool:
        """True if the control plane routed ``component`` to workers other than this one."""
        workers = self.routes.get(component)
        return bool(workers) and self.worker.address not in workers

    def set_leases(self, leases: dict[str, frozenset[str]]) -> None:
        """The scheduler's newest admission lease (replaces the last one whole)."""
        self.leases = leases

    def admit_here(self, model: str, session: str) -> bool:
        """Admit ``session`` to this worker's engine of ``model`` on its own, while the
        scheduler's lease of the model is out (nothing of it is short): Nalar's local controller
        deciding within the global one's grant. The scheduler binds the session when the
        record of its first LLM call here arrives; its next lease replaces this one whole.
        False: the lease is not out (the scheduler admits the session, as before)."""
        lease = self.leases.get(model)
        if lease is None:
            return False
        if session not in lease:
            self.leases = {**self.leases, model: lease | {session}}
        return True

    def leased(self, model: str, session: str | None) -> bool:
        """Whether an LLM call of ``session`` on ``model`` may run on this worker's engine
        without the scheduler: the session is admitted here and nothing of the model is short."""
        return session is not None and session in self.leases.get(model, ())

    def runs_here(self, key: str, task_running: Callable[[str], bool]) -> bool:
        """Whether ``key`` is a call running on this fast path whose chain of callers still runs
        up to the task that made the first of them (``task_running``: the worker's state
        machine's view): the calls it makes may take the fast path too. False once that task
        was cancelled or released (its thread runs on, and so do the calls it runs here)."""
        for _ in range(10_000):  # a chain of local calls, each made by the one before
            if key in self.direct:
                return True
            call = self._running.get(key)
            if call is None:
                return False
            key = call.creator
            if task_running(key):
                return True
        return False

    # -- creation ---------------------------------------------------------------------------
    def defer(self, call: LocalCall) -> None:
        """Hold ``call`` until its caller waits for it (or :attr:`max_wait` passes)."""
        with self._lock:
            self._deferred[call.key] = call
            self._by_creator.setdefault(call.creator, {})[call.key] = None
        loop = self.worker.loop
        loop.add_callback(loop.call_later, self.max_wait, self._expire, call.key)

    def _take(self, call: LocalCall, state: str) -> bool:
        """Move a deferred call to ``state`` (under the lock); False if it was not deferred."""
        if call.state != DEFERRED:
            return False
        call.state = state
        self._deferred.pop(call.key, None)
        siblings = self._by_creator.get(call.creator)
        if siblings is not None:
            siblings.pop(call.key, None)
            if not siblings:
                del self._by_creator[call.creator]
        return True

    def _take_all(self, creator: str) -> list[LocalCall]:
        """Take every deferred call of ``creator`` (under the lock) for the scheduler path, but
        the one its caller is about to run here (``claimed``)."""
        out = []
        for k in list(self._by_creator.get(creator, ())):
            c = self._deferred.get(k)
            if c is not None and not c.claimed and self._take(c, SUBMITTED):
                out.append(c)
        return out

    # -- the caller waits -------------------------------------------------------------------
    def result(self, call: LocalCall, timeout: float | None) -> Any:
        """``call``'s value for a caller waiting on it: run here if it is still deferred;
        :data:`SCHEDULER` if it took the scheduler path (the caller reads it from there)."""
        run = False
        if timeout is None and call.state == DEFERRED:
            # Its siblings go first, while it is still deferred: they run meanwhile, on the
            # scheduler path, while this one runs here; and one whose arguments carry this
            # call's future (inside an object, pickled with it) sends this one too. Taken to
            # run first, this call could only be waited for, in the thread that was to run it.
            with self._lock:
                call.claimed = True  # not for max-wait or the siblings' submission (only its own escape)
                siblings = self._take_all(call.creator)
            try:
                for s in siblings:
                    self._submit(s, "sibling")
            except BaseException:  # left deferred, unclaimed: its caller's end sends it on
                call.claimed = False
                raise
            with self._lock:
                run = self._take(call, RUNNING)
        if run:
            self._run(call)
        elif call.state == DEFERRED:  # a timeout: only the scheduler path can honour one
            self.submit_deferred(call, "timeout")
            return SCHEDULER
        elif call.state == RUNNING and not _wait(call, timeout):
            from dask_agents.errors import CallTimeoutError, where

            a = call.ann
            raise CallTimeoutError(f"{where(a['component'], a.get('method'), a.get('session'))} did not finish "
                                   f"within {timeout}s (status: running, key: {call.key})")
        return self.outcome(call)

    @staticmethod
    def outcome(call: LocalCall) -> Any:
        """The value of a call that ended here, or its error raised; :data:`SCHEDULER` otherwise."""
        if call.state == FINISHED:
            return call.value
        if call.state == ERRED:
            raise call.error  # type: ignore[misc]
        if call.state == CANCELLED:
            from distributed.client import FutureCancelledError

            raise FutureCancelledError(call.key, "cancelled", "cancelled before it ran")
        return SCHEDULER

    def waiting_elsewhere(self, creator: str | None) -> None:
        """The call ``creator`` waits for, or submits, other work: what it deferred goes to the
        scheduler first (so it runs meanwhile, and exists before anything can depend on it)."""
        if creator is None or creator not in self._by_creator:  # unlocked peek: usually nothing
            return
        with self._lock:
            calls = self._take_all(creator)
        for c in calls:
            self._submit(c, "sibling")

    def run_direct(self, call: LocalCall) -> None:
        """Run a driver's call sent straight here (``worker_plugin/direct.py``), in this
        thread: recorded as a local call; the caller (its driver) gets the outcome from
        ``call`` itself, not from a future of this worker's client."""
        self.direct.add(call.key)
        try:
            self._run(call, resolve=False)
        finally:
            self.direct.discard(call.key)

    def _run(self, call: LocalCall, resolve: bool = True) -> None:
        call.started, call.thread = time.time(), threading.get_ident()
        self._record(call)
        self._running[call.key] = call
        try:
            call.value = call.run()
            state = FINISHED
        except BaseException as e:  # the runner raised the CallFailedError naming the call
            call.error = e
            state = ERRED
        finally:
            self._running.pop(call.key, None)
        if call.key in self._by_creator:  # what it deferred and never waited for goes on now
            self.caller_ended(call.key)
        call.finished = time.time()
        call.metrics = self.take_metrics(call.key)
        call.state = state
        self.counts["ran"] += 1
        self._record(call)
        if resolve:
            self.worker.loop.add_callback(self._resolve, call)
        call.done.set()

    def _resolve(self, call: LocalCall) -> None:
        """On the loop, after the caller has its value: the value into this worker's memory
        and the key made known to the scheduler (``update-data`` on the caller's client
        stream, ahead of anything later sent there), the shared future state resolved."""
        from dask_agents.worker_plugin import dask_compat

        try:
            if call.state == FINISHED:
                dask_compat.publish_local(self.worker, call.client, call.key, call.value)
                dask_compat.finish_future(call.client, call.key, type(call.value))
            elif call.state == ERRED:
                dask_compat.fail_future(call.client, call.key, call.error)
        except Exception as e:  # a closing client: the caller has its value already
            import logging

            logging.getLogger(__name__).debug("dask-agents: local call %s not published: %s", call.key, e)

    # -- everything else: the scheduler path -------------------------------------------------
    def submit_deferred(self, call: LocalCall, why: str) -> None:
        """Send a still-deferred call down the scheduler path."""
        with self._lock:
            took = self._take(call, SUBMITTED)
        if took:
            self._submit(call, why)

    def escape(self, call: LocalCall) -> None:
        """``call``'s future is about to be sent elsewhere (pickled, or a dependency of a call):
        make its key one the scheduler knows first. A finished call is known already (its
        ``update-data`` is queued ahead); an erred one becomes a task raising its error, so what
        depends on it fails with that error, as on the scheduler path."""
        with self._lock:
            took = self._take(call, SUBMITTED)
        if took:
            self._submit(call, "escaped")
            return
        if call.state == RUNNING:
            self._wait_to_escape(call)
        with self._lock:
            raise_error = call.state == ERRED and not call.error_sent
            call.error_sent = call.error_sent or raise_error
        if raise_error:
            self.counts["submitted:error"] += 1
            call.submit_error()

    def _wait_to_escape(self, call: LocalCall) -> None:
        """Wait for a running ``call`` whose future is being sent: its key exists once it ended.
        Never where the wait could not end: in the thread running it, or on the event loop (the
        call may need the loop; so does every other worker duty); a clear error there. Elsewhere
        the client's own lock is let go meanwhile: the sender may be serializing a graph under
        it, and the running call takes it to make any future."""
        from dask_agents.errors import escape_error
        from dask_agents.worker_plugin import dask_compat

        if call.thread == threading.get_ident() or dask_compat.on_event_loop(self.worker):
            a = call.ann
            place = "the thread running it" if call.thread == threading.get_ident() else "the worker's event loop"
            raise escape_error(a.get("component", "?"), a.get("method"), a.get("session"), call.key, place)
        with dask_compat.unprofiled(), dask_compat.lock_released(getattr(call.client, "_refcount_lock", None)):
            call.done.wait()

    def escape_keys(self, keys: list) -> None:
        """Something outside this worker will want ``keys`` (``fire_and_forget``): the
        deferred calls among them go to the scheduler first."""
        if not self._deferred:
            return
        for k in keys:
            call = self._deferred.get(k)
            if call is not None:
                self.escape(call)

    def cancel(self, call: LocalCall) -> bool:
        """The caller cancelled ``call``: True if it was still deferred (it never runs)."""
        with self._lock:
            took = self._take(call, CANCELLED)
        if not took:
            return False
        self.counts["cancelled"] += 1
        self._record(call)
        call.done.set()
        return True

    def _submit(self, call: LocalCall, why: str) -> None:
        self.counts[f"submitted:{why}"] += 1
        try:
            call.submit()
        except BaseException as e:  # the caller's future must not wait forever for a call never sent
            from dask_agents.worker_plugin import dask_compat

            call.error, call.state = e, ERRED
            call.done.set()
            self.worker.loop.add_callback(dask_compat.fail_future, call.client, call.key, e)

    def _expire(self, key: str) -> None:
        """On the loop, ``max_wait`` after creation: nobody waited for it here."""
        call = self._deferred.get(key)
        if call is None or call.claimed:  # (claimed: its caller is about to run it)
            return
        if call.client.refcount.get(key, 0) <= 0 and self.cancel(call):
            return  # its future was dropped unwaited: Dask would have released the task
        self.submit_deferred(call, "max-wait")

    def caller_ended(self, creator: str) -> None:
        """The call ``creator`` ended: what it deferred and never waited for goes to the
        scheduler (fire and forget), or is dropped if its future is gone."""
        with self._lock:
            calls = self._take_all(creator)
        for c in calls:
            if c.client.refcount.get(c.key, 0) <= 0:
                c.state = CANCELLED
                self.counts["cancelled"] += 1
                self._record(c)
                c.done.set()
            else:
                self._submit(c, "caller-ended")

    # -- records --------------------------------------------------------------------------
    def _record(self, call: LocalCall) -> None:
        r: CallReport = {"key": call.key, "ann": call.ann, "state": _RECORD_STATE[call.state],
                         "started": call.started, "finished": call.finished}
        if call.state == ERRED:
            r["error"] = _error_text(call.error)
        if call.metrics:
            r["metrics"] = call.metrics
        if call.owner is not None:
            r["client"] = call.owner
        with self._lock:
            self._records[call.key] = r

    def pending_records(self) -> list[CallReport]:
        """The records not sent yet, oldest call first; each is sent once."""
        if not self._records:
            return []
        with self._lock:
            out, self._records = list(self._records.values()), {}
        return out

    def has_deferred(self, creator: str) -> bool:
        """True if the call ``creator`` has calls waiting for it here (an unlocked peek)."""
        return creator in self._by_creator

    def has_records(self) -> bool:
        """True if records wait to be sent."""
        return bool(self._records)

    def snapshot(self) -> dict:
        """Counters and sizes (tests, debugging)."""
        with self._lock:
            return {"deferred": len(self._deferred), "records": len(self._records), **self.counts}


def _wait(call: LocalCall, timeout: float | None) -> bool:
    """Wait for a call another thread runs (out of Dask's profiler meanwhile)."""
    from dask_agents.worker_plugin import dask_compat

    with dask_compat.unprofiled():
        return call.done.wait(timeout)


_RECORD_STATE = {RUNNING: "processing", FINISHED: "memory", ERRED: "erred", CANCELLED: "cancelled"}


def substitute(x: Any) -> Any:
    """``x`` with finished local futures replaced by their values, as Dask substitutes the
    values of dependencies (``dask._task_spec.parse_input``): in dicts' values, lists, sets
    and tuples, which come back as plain ones (a namedtuple stays one) when something inside
    was replaced; anything else as it is."""
    if isinstance(x, Future):
        call = x.__dict__.get("_agents_local")
        return call.value if call is not None and call.state == FINISHED else x
    if isinstance(x, dict):
        items = {k: substitute(v) for k, v in x.items()}
        return items if any(items[k] is not v for k, v in x.items()) else x
    if isinstance(x, (list, set, tuple)):
        items = [substitute(y) for y in x]
        if all(a is b for a, b in zip(items, x)):
            return x
        if isinstance(x, tuple) and hasattr(x, "_fields"):
            return type(x)(*items)
        return list(items) if isinstance(x, list) else set(items) if isinstance(x, set) else tuple(items)
    return x


def _error_text(e: BaseException | None) -> str:
    try:
        return f"{type(e).__name__}: {e}"[:2000]
    except Exception:
        return type(e).__name__
