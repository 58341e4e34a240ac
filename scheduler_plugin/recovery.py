"""What happens to calls pinned to a worker that died or left (the global controller's part).

The scheduler plugin pins some calls to one worker (stateful calls to their session's
instance, LLM calls to an engine holding the session's KV, calls of a component the control
plane routed). Dask reschedules the calls of a lost worker, but a call pinned *strictly* to it
has nowhere to go: it would sit in ``no-worker`` forever and its future would hang. Here,
right after Dask has released the lost worker's tasks (``remove_worker``), and whenever one
of our calls becomes ``no-worker`` later (a lost result recomputed, a dependency finishing):

- LLM calls and routed stateless calls are placed again (on another host of the model, or
  anywhere when none is left): they run elsewhere; an engine recomputes the session's KV
  from the prompt;
- stateful calls fail with :class:`~dask_agents.errors.InstanceLostError` naming the session,
  component, worker and cause: the instance's state went with the worker, and running the
  call on a fresh instance would silently give another answer. Their dependents fail with
  the same cause, as for a call that raised. This is Nalar's rule: pending invocations of a
  lost instance fail with the error propagated to the workflow; later calls of the session
  go to a fresh instance elsewhere.

Nothing here runs inside a Dask transition (the hook only notes the key); recovery runs from
``remove_worker`` or a callback on the event loop right after.

Recovery never leaves a call behind: each call is recovered on its own, and a call whose
recovery raises (a bug, a Dask internal that changed) is failed with that error, or, where
failing it fails too or it is stateless, released from its pin so that Dask places it. Its
future raises or completes; it does not hang.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from typing import Any

from dask_agents.annotation import ANNOTATION, sanitize_annotation
from dask_agents.errors import InstanceLostError, where
from dask_agents.scheduler_plugin import dask_compat
from dask_agents.scheduler_plugin.admission import HELD
from dask_agents.scheduler_plugin.placement import AWAITING, LOST, Placement
from dask_agents.scheduler_plugin.roster import Roster
from dask_agents.scheduler_plugin.state import WorkflowState

logger = logging.getLogger(__name__)

TOPIC = "agents-faults"
"""Event topic of fault incidents (``client.get_events("agents-faults")``)."""


class Recovery:
    """Re-places or fails calls stranded by a lost worker, for the scheduler plugin.

    Recovery and placement need each other (placement hands recovery the calls it cannot run;
    recovery places calls again): ``placement`` is set once both exist (the plugin does it)."""

    def __init__(self, roster: Roster, state: WorkflowState, history: int = 200):
        self.roster = roster
        self.state = state
        self.placement: Placement | None = None
        self.stranded: set[str] = set()
        self._scheduled = False
        self.counts: Counter[str] = Counter()  # rerouted, failed, workers_lost
        self.incidents: deque[dict] = deque(maxlen=history)
        # worker -> why it left (for the error message of calls found stranded later)
        self.gone: dict[str, str] = {}

    @property
    def scheduler(self) -> Any:
        """The scheduler the plugin runs in."""
        return self.roster.scheduler

    @property
    def _placement(self) -> Placement:
        if self.placement is None:
            raise RuntimeError("recovery has no placement (the plugin sets it)")
        return self.placement

    def cause(self, worker: str, stimulus_id: str | None = None) -> str:
        """Why ``worker`` is gone, in words (for errors and the session's lost instances)."""
        return self.gone.get(worker) or f"worker {worker} died or left the cluster ({stimulus_id or 'remove-worker'})"

    def note_cause(self, worker: str, cause: str) -> None:
        """Why ``worker`` will be gone, known before it goes (a retirement that drained too
        long): the errors of what it held say this instead of "died or left"."""
        self.gone[worker] = cause

    def strand(self, key: Any) -> None:
        """Recover ``key`` soon (a call the plugin pinned where it cannot run)."""
        self.stranded.add(key)
        if not self._scheduled:
            self._scheduled = True
            self.scheduler.loop.add_callback(self._recover_scheduled)

    # -- hooks -------------------------------------------------------------------------------
    def on_no_worker(self, key: Any) -> None:
        """A call became ``no-worker`` (from the transition hook): recover it soon if it is pinned
        to a worker that is gone. Cheap: one lookup; the work runs in a callback."""
        ts = dask_compat.task(self.scheduler, key)
        if ts is None or not self._pinned_to_dead(ts):
            return
        self.strand(key)

    def on_worker_removed(self, worker: str, stimulus_id: str | None = None) -> None:
        """``worker`` is gone (Dask already released its tasks): recover every call placed on it."""
        cause = self.cause(worker, stimulus_id)
        self.gone[worker] = cause
        while len(self.gone) > 1000:  # bounded: only recent causes matter
            self.gone.pop(next(iter(self.gone)))
        self.counts["workers_lost"] += 1
        # O(calls placed there): placement indexes its pins by worker
        keys = list(self._placement.placed.by_worker.get(worker, ()))
        # plus calls the transition hook saw become unrunnable while Dask released the
        # worker's tasks (finished calls whose result was lost and that Dask recomputes)
        self.stranded.update(keys)
        summary = self.recover()
        incident = {"action": "worker-lost", "worker": worker, "time": time.time(), "cause": cause, **summary}
        self.incidents.append(incident)
        dask_compat.add_event(self.scheduler, TOPIC, incident)
        if summary["rerouted"] or summary["failed"]:
            logger.warning("dask-agents: %s: rerouted %d pinned calls, failed %d calls of lost stateful instances",
                           cause, summary["rerouted"], summary["failed"])

    # -- recovery ------------------------------------------------------------------------------
    def _recover_scheduled(self) -> None:
        self._scheduled = False
        summary = self.recover()
        if summary["rerouted"] or summary["failed"]:
            incident = {"action": "stranded-calls", "time": time.time(), **summary}
            self.incidents.append(incident)
            dask_compat.add_event(self.scheduler, TOPIC, incident)

    def _pinned_to_dead(self, ts: Any) -> bool:
        pins = dask_compat.worker_restrictions(ts)
        if pins == {AWAITING} or pins == {HELD}:
            return False  # waiting on purpose: for a first worker, or for an engine with room
        return bool(pins) and not any(dask_compat.has_worker(self.scheduler, w) for w in pins)

    def recover(self) -> dict:
        """Re-place or fail every stranded call; returns counts (and the failed keys).

        Each call is handled on its own: one that raises is failed or unpinned
        (:meth:`_fallback`) and the others are still recovered."""
        s = self.scheduler
        stimulus = f"dask-agents-recover-{time.time()}"
        keys, self.stranded = self.stranded, set()
        reschedule: list[Any] = []
        rerouted = failed = 0
        failed_keys: list[str] = []
        for key in keys:
            try:
                outcome = self._recover_one(key, stimulus)
            except Exception as e:  # never leave the call, nor the rest, behind
                logger.exception("dask-agents: recovering call %s failed", key)
                outcome = self._fallback(key, e, stimulus)
            if outcome == "failed":
                failed += 1
                failed_keys.append(key)
            elif outcome == "rerouted":
                rerouted += 1
                reschedule.append(key)
        if reschedule:
            try:
                dask_compat.reschedule(s, reschedule, stimulus)
            except Exception:
                # each call alone: one Dask refuses must not keep the others in no-worker
                logger.exception("dask-agents: rescheduling %d recovered calls together failed", len(reschedule))
                for key in reschedule:
                    try:
                        dask_compat.reschedule(s, [key], stimulus)
                    except Exception:  # it stays no-worker until a worker joins
                        logger.exception("dask-agents: rescheduling recovered call %s failed", key)
        self.counts["rerouted"] += rerouted
        self.counts["failed"] += failed
        return {"rerouted": rerouted, "failed": failed, "failed_keys": failed_keys[:50]}

    def _recover_one(self, key: Any, stimulus: str) -> str | None:
        """Recover one stranded call: ``"failed"``, ``"rerouted"`` (to reschedule) or None
        (nothing to do: running elsewhere, done, forgotten, or pinned by the user)."""
        s = self.scheduler
        ts = dask_compat.task(s, key)
        if ts is None or dask_compat.state(ts) not in ("waiting", "no-worker", "queued", "released"):
            return None  # already running elsewhere, done, or forgotten
        if not self._pinned_to_dead(ts):
            return None
        info = self._call_info(key, ts)
        if not (info["stateful"] or info["kind"] == "llm" or key in self._placement.placed):
            return None  # pinned by the user, not by us: Dask's behaviour (it waits for that worker)
        pins = dask_compat.worker_restrictions(ts)
        if info["stateful"]:
            return "failed" if dask_compat.fail_task(s, key, self._lost_error(key, info, pins), stimulus) else None
        self._replace(ts, info)
        return "rerouted"

    def _call_info(self, key: Any, ts: Any) -> dict:
        """What recovery needs to know of a call: from its record, else from its annotation
        read through :func:`~dask_agents.calls.sanitize_annotation` (any client can set
        ``dask.annotate(agents=...)``: an unchecked value must not break recovery)."""
        rec = self.state.calls.get(key)
        if rec is not None:
            return {"kind": rec.kind, "stateful": rec.stateful, "session": rec.session, "llm_model": rec.model,
                    "component": rec.component, "method": rec.method}
        ann = sanitize_annotation(dask_compat.annotations(ts).get(ANNOTATION)) or {}
        return {"kind": ann.get("kind"), "stateful": ann.get("stateful") is True, "session": ann.get("session"),
                "llm_model": ann.get("llm_model"), "component": ann.get("component"), "method": ann.get("method")}

    def _fallback(self, key: Any, error: BaseException, stimulus: str) -> str | None:
        """Recovering ``key`` raised ``error``: never leave it pinned to a dead worker.

        A stateful call (or one we cannot tell) fails with an error naming ``error``: its
        instance is gone, so running it elsewhere could silently give another answer. A
        stateless call, or one that failing raises for too, is unpinned so that Dask places
        it on any worker (now, or on the next one that joins)."""
        s = self.scheduler
        try:
            ts = dask_compat.task(s, key)
            if ts is None or dask_compat.state(ts) not in ("waiting", "no-worker", "queued", "released"):
                return None
            try:
                info: dict | None = self._call_info(key, ts)
            except Exception:  # noqa: BLE001 (treated as stateful: failing is the safe side)
                info = None
            if info is None or info["stateful"]:
                info = info or {}
                worker = next(iter(dask_compat.worker_restrictions(ts)), None)
                component = info.get("component") or str(key)
                # the error's text, not the error: it travels pickled, and may not pickle
                exc = InstanceLostError(
                    f"{where(component, info.get('method'), info.get('session'))}: dask-agents could not "
                    f"recover call {key} after worker {worker} was lost ({type(error).__name__}: {error}); "
                    f"it is not re-run.",
                    session=info.get("session"), component=info.get("component"), worker=worker)
                if dask_compat.fail_task(s, key, exc, stimulus):
                    return "failed"
        except Exception:  # last resort below
            logger.exception("dask-agents: failing unrecoverable call %s failed; unpinning it", key)
        try:
            ts = dask_compat.task(s, key)
            if ts is None:
                return None
            self._placement.unplace(key)
            dask_compat.clear_worker_restriction(ts)
            return "rerouted"
        except Exception:  # nothing more can be done here (logged)
            logger.exception("dask-agents: unpinning call %s failed", key)
            return None

    def _replace(self, ts: Any, ann: dict) -> None:
        """Place a stateless pinned call again: LLM calls on another host of their model (the
        session's binding moves with it), routed calls on the component's routes. ``ann``:
        the call's :meth:`_call_info`."""
        placement = self._placement
        key = dask_compat.task_key(ts)
        placement.unplace(key)
        component = ann.get("component") or str(key).rsplit("-", 1)[0]
        model = ann.get("llm_model") if ann.get("kind") == "llm" else None
        candidates = placement.candidates(model, component)
        if candidates:
            if model is not None:
                placement.place(ts, ann.get("session"), f"llm:{model}", candidates)
            else:
                placement.place(ts, None, component, candidates)
        else:  # no worker left at all: let Dask place it on the next one that joins
            dask_compat.clear_worker_restriction(ts)

    def _lost_error(self, key: Any, ann: dict, pins: set) -> InstanceLostError:
        worker = next(iter(pins), None)
        session, component = ann.get("session"), ann.get("component")
        s = self.state.sessions.get(session) if session is not None else None
        cause = (s.lost.get(component) if s is not None else None) or self.gone.get(worker) \
            or f"worker {worker} died or left the cluster"
        if worker == LOST:  # pinned nowhere by the plugin: name the worker it had
            worker = _worker_in(cause)
        rec = self.state.calls.get(key)
        done = rec is not None and rec.state == "finished"
        what = ("its result was lost with the worker, and re-running it on a fresh instance could give "
                "another answer" if done else "the call is not run on a fresh instance, which would silently "
                "give another answer")
        msg = (f"{where(component, ann.get('method'), session)}: its stateful instance was lost: {cause}; "
               f"{what} (call {key}). Later calls of this session and component fail the same way: "
               "start a new session.")
        return InstanceLostError(msg, session=session, component=component, worker=worker)

    def stats(self) -> dict:
        """Counters and recent incidents."""
        return {**self.counts, "incidents": list(self.incidents)[-20:]}


def _worker_in(cause: str) -> str | None:
    """The worker address a cause text names (``worker ADDR ...``), else None."""
    parts = cause.split()
    return parts[parts.index("worker") + 1] if "worker" in parts[:-1] else None
