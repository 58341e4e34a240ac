"""What every engine host with per-session KV control shares: the KV manager's hooks on the
stepping thread, hints, and calls run between steps.

:class:`~dask_agents.worker_plugin.vllm_host.EngineHost` (real vLLM) and
:class:`~dask_agents.worker_plugin.emulated.EmulatedEngineHost` keep the same attributes (``kv``: an
``EngineKV``-shaped object or None, ``kv_manager``: a ``KVManager`` or None, ``_calls``: a
queue of ``(fn, future)`` the stepping thread runs between steps, ``name``) and inherit the
logic here, so a directive, a hint or a failing manager behaves the same on both.
``_kv_lock`` guards the engine state against readers on other threads: the emulated engine's
lock (its stats are read while it steps), none on the real engine (vLLM's state is touched only
by its stepping thread).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import time
from concurrent.futures import Future
from typing import Any

logger = logging.getLogger(__name__)

MANAGER_FAILURES_MAX = 5  # consecutive failed looks before a KV manager is switched off


class SessionKVHost:
    """Mixin of the engine hosts (see the module docstring)."""

    name: str
    kv: Any
    kv_manager: Any
    load_error: BaseException | None
    _calls: queue.SimpleQueue
    _inbox: queue.SimpleQueue
    _manager_failures: int = 0

    # each host says whether it stopped, what a caller of a stopped engine gets, how its KV
    # control is reached, and what to do when a call was queued after its thread ended
    def _stopped(self) -> bool:
        raise NotImplementedError

    def _stopped_error(self) -> BaseException:
        raise NotImplementedError

    def _kv_or_raise(self) -> Any:
        raise NotImplementedError

    def _fail_if_gone(self) -> None:
        raise NotImplementedError

    def _kv_lock(self) -> Any:
        return contextlib.nullcontext()

    def _take_inbox(self) -> list:
        """Empty the requests queued for the stepping thread (its wake-up ``None``s left out)."""
        out = []
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return out
            if item is not None:
                out.append(item)

    def kv_directive(self, op: str, session: str, timeout: float = 60.0, **args: Any) -> dict:
        """Apply one KV directive between engine steps (the registry checked ``op`` and
        ``args``): ``{"result": ..., "residency": {...}}`` (no residency after ``invalidate``)."""
        import dataclasses

        def apply(kv: Any) -> dict:
            result = getattr(kv, op)(session, **args)
            out: dict = {"result": dataclasses.asdict(result) if dataclasses.is_dataclass(result) else result}
            if op != "invalidate":
                out["residency"] = dataclasses.asdict(kv.inspect(session))
            return out

        return self.kv_call(apply).result(timeout)

    def kv_session_end(self, session: str) -> None:
        """The session ended: invalidate its KV between steps (nobody waits)."""
        self.kv_call(lambda kv: kv.invalidate(session))

    def kv_hint(self, session: str, state: str, node: str | None = None, wait_key: str | None = None,
                at: float | None = None) -> Future | None:
        """Tell this engine's KV manager the workflow state of ``session`` (see
        ``dask_agents.kv.runtime.manager.KVManager.hint``); ``at`` is a Unix time (``time.time()``), default now.
        Non-blocking: returns the future of the hint on the engine thread, or None when there is
        no manager or it never saw the session (nothing to do here). Raises KVDirectiveError
        for an unknown state."""
        from dask_agents.kv.runtime.engine_kv import KVDirectiveError
        from dask_agents.kv.runtime.manager import STATES

        if state not in STATES:
            raise KVDirectiveError(f"unknown session state {state!r} (known: {', '.join(STATES)})")
        manager = self.kv_manager
        if manager is None or not manager.knows(session):
            return None
        # the sender's wall clock -> this engine's monotonic clock (a skewed future is "now")
        mono = None if at is None else time.monotonic() - max(0.0, time.time() - float(at))
        return self.kv_call(lambda kv: manager.hint(session, state, node, wait_key, mono))

    def kv_call(self, fn: Any, *args: Any) -> Future:
        """Run ``fn(self.kv, *args)`` on the stepping thread between two steps (where touching the
        engine's KV is safe); the future holds its result or exception."""
        fut: Future = Future()
        if self._stopped():
            fut.set_exception(self._stopped_error())
        elif self.load_error is not None:
            fut.set_exception(RuntimeError(f"engine {self.name!r} failed to load: {self.load_error}"))
        else:
            self._calls.put((lambda: fn(self._kv_or_raise(), *args), fut))
            self._inbox.put(None)  # wake the thread if it is idle
            self._fail_if_gone()  # queued after the thread ended: nobody would answer
        return fut

    def _kv_track(self, event: str, session: str | None, request_id: str) -> None:
        """A request was admitted (``event`` "admit") or finished ("finish"): the KV manager (or,
        without one, the KV state) follows the session's blocks. Never fails the call."""
        if self.kv is None:
            return
        target = self.kv_manager if self.kv_manager is not None else self.kv
        try:
            getattr(target, f"on_{event}")(session, request_id)
        except Exception:  # KV bookkeeping must never fail a call
            logger.exception("engine %s: KV tracking of %s failed", self.name, request_id)

    def _manager_actions(self) -> dict:
        """The KV manager's directive counts by kind (empty without a manager)."""
        manager = self.kv_manager
        for _ in range(3):  # the engine thread may be counting meanwhile: retry a torn copy
            try:
                return dict(manager.stats.actions) if manager is not None else {}
            except RuntimeError:
                continue
        return {}

    def _fail_calls(self, exc: BaseException) -> None:
        """Fail the KV calls still queued (the stepping thread is ending or gone)."""
        while True:
            try:
                _fn, fut = self._calls.get_nowait()
            except queue.Empty:
                return
            if fut.done():
                continue
            try:
                fut.set_exception(exc)
            except Exception:  # InvalidStateError: settled concurrently
                pass

    def _run_calls(self) -> None:
        """Run the queued KV calls (directives, hints) between two steps; each answers its caller."""
        while True:
            try:
                fn, fut = self._calls.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                with self._kv_lock():
                    result = fn()
                fut.set_result(result)
            except BaseException as e:  # a bad directive fails its caller, not the engine
                fut.set_exception(e)

    def _kv_poll(self) -> None:
        """Between steps: the KV manager's look (it keeps pins in order itself), else the KV
        state's housekeeping. A manager that keeps failing is switched off (logged): serving
        goes on with the engine's prefix cache alone."""
        if self.kv_manager is not None:
            try:
                with self._kv_lock():
                    self.kv_manager.poll()
                self._manager_failures = 0
            except Exception:
                logger.exception("engine %s: KV manager look failed", self.name)
                self._manager_failures += 1
                if self._manager_failures >= MANAGER_FAILURES_MAX:
                    logger.error("engine %s: KV manager switched off after repeated failures", self.name)
                    self.kv_manager = None
        elif self.kv is not None:
            try:
                with self._kv_lock():
                    self.kv.maintain()
            except Exception:  # bookkeeping must not stop the engine
                logger.exception("engine %s: KV housekeeping failed", self.name)

    def _idle_wait(self) -> float:
        """How long an idle loop sleeps: a manager's paused sessions need looks while idle."""
        return min(0.5, max(0.005, self.kv_manager.tick_s)) if self.kv_manager is not None else 0.5
