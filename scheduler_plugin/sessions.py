"""Sessions from open to end: the scheduler plugin's sessions collaborator.

A session is opened by its driver (``da.session``) or by its first call; the client that opened
it owns it. It ends when its driver leaves the block (``agents_session_end``, on the client's
stream so that it follows the driver's last submits), when its owner disconnects and does not
come back within ``agents.scheduler.session-grace``, or when it idles past
``agents.scheduler.session-idle-timeout``. Closing a session with ``abort`` fails its calls that
have not started (:class:`~dask_agents.errors.SessionClosedError`) and cancels the running ones.
Once it completes, its KV is dropped at once and its stateful instances after
``agents.scheduler.instance-linger`` (a late call reopens it and keeps them); the workers holding
either are told in batches, one RPC per worker at a time.

The records live in :class:`~dask_agents.scheduler_plugin.state.WorkflowState`; this object
keeps who owns what, the grace deadlines and the pending ends, and calls ``on_completed`` once
per completion so that the plugin can tell its observers (admission, KV hints, metrics).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from typing import Any, Callable

import dask_agents.config as agents_config
from dask_agents.annotation import MAX_LABEL
from dask_agents.scheduler_plugin import dask_compat, validate
from dask_agents.scheduler_plugin.placement import Placement
from dask_agents.scheduler_plugin.roster import Roster
from dask_agents.scheduler_plugin.state import WorkflowState

logger = logging.getLogger(__name__)

KEEPER = "dask-agents-keeper"
"""The scheduler's own wanter of the calls a disconnected driver held (as Dask's
``fire-and-forget``): they run on and their results stay until the driver is back."""
LOST_REASON = "dask-agents: lost with the driver's connection"
MAX_REATTACH = 10_000  # keys in one reattach message
MAX_AWAITED = 100_000  # direct calls a session's end may name (dask_agents/direct.py)


class Sessions:
    """Ownership, closing and ending of sessions (see the module docstring)."""

    def __init__(self, roster: Roster, state: WorkflowState, placement: Placement,
                 on_completed: Callable[[str, Any], None]):
        self.roster = roster
        self.state = state
        self.placement = placement  # releases the ended sessions' bindings
        self.on_completed = on_completed  # (session id, its record or None): once per completion
        self.client_sessions: defaultdict[str, set[str]] = defaultdict(set)  # owner client -> its sessions
        self.orphans: dict[str, float] = {}  # session -> when its grace ends (its owner disconnected)
        self._lingering: dict[str, Any] = {}  # completed session -> timer releasing its instances
        # sessions that ended, per worker holding their instances or KV, not yet told (batched)
        self._ending: defaultdict[str, list[str]] = defaultdict(list)
        self._flushing_ends = False
        self.refused = 0  # ends asked by a client that does not own the session
        # a disconnected client -> (when its grace ends, the call keys held for it by KEEPER)
        self.kept: dict[str, tuple[float, set]] = {}

    # -- owners ------------------------------------------------------------------------------
    def on_call(self, rec: Any, client: str | None, opened_on: str | None = None) -> None:
        """A call of ``rec.session`` arrived from ``client``. The first call made from outside
        the session (by its driver, not by one of its own calls) makes that client the owner.
        A call into a completed session whose instances are still kept (``instance-linger``)
        keeps them. ``opened_on``: the scheduler the session's first call from that client (or
        that call's task) went to; if not this one, the session outlived its scheduler: Dask's
        workers close with their scheduler, so every instance of it is gone and its stateful
        calls fail here (never on a fresh instance)."""
        sid = rec.session
        s = self.state.sessions[sid]
        if opened_on is not None and s.outlived is None and opened_on != self.roster.scheduler.id:
            s.outlived = (f"the session started on scheduler {opened_on}, which stopped (this is "
                          f"{self.roster.scheduler.id}); its instances closed with that scheduler's workers")
            logger.warning("dask-agents: session %s outlived its scheduler %s: its stateful calls fail "
                           "(InstanceLostError)", sid, opened_on)
        if s.owner is None and rec.creator not in s.calls and client is not None:
            self._own(s, client)
        timer = self._lingering.pop(sid, None)
        if timer is not None:
            self.roster.scheduler.loop.remove_timeout(timer)

    def _own(self, s: Any, client: str) -> None:
        s.owner = client
        self.client_sessions[client].add(s.id)

    def on_open_msg(self, session: Any = None, tenant: Any = None, client: Any = None, **kw: Any) -> None:
        """A driver entered its ``da.session`` block (on its client stream, before any of its
        calls): it owns the session, whoever submits into it first."""
        try:
            if not isinstance(client, str):
                raise ValueError("a session open from no client")
            session = validate.session_id(session, "agents-session-open: session")
            if tenant is not None and (not isinstance(tenant, str) or len(tenant) > MAX_LABEL):
                tenant = None
            s = self.state.session(session, tenant, time.time())
            if s.owner is None:
                self._own(s, client)
        except Exception as e:  # raising here would close the client's stream
            logger.warning("dask-agents: session open ignored: %s", e)

    def client_left(self, client: str) -> None:
        """The owner of some sessions disconnected: they wait ``session-grace`` for it to come
        back (a reconnecting ``Client`` keeps its id) before they are closed. Clients that own
        nothing (workers' own clients, which only submit nested calls) change nothing."""
        sids = self.client_sessions.get(client)
        if sids:  # completed ones need nothing from their owner any more
            sids.difference_update([sid for sid in sids if (s := self.state.sessions.get(sid)) is None
                                    or s.state == "completed"])
        if not sids:
            self.client_sessions.pop(client, None)
            return
        deadline = time.time() + agents_config.seconds("scheduler.session-grace")
        for sid in sids:
            s = self.state.sessions.get(sid)
            if s is not None and s.state == "active":  # one the driver already left goes on by itself
                self.orphans[sid] = deadline
        logger.info("dask-agents: client %s disconnected; its %d open sessions wait %s for it to reconnect",
                    client, len(sids), agents_config.get("scheduler.session-grace"))

    def client_back(self, client: str) -> None:
        """``client`` (re)connected: its sessions in their grace are kept, everything with them,
        and it wants again the calls held for it while it was away (its futures of them come
        back to life when it asks for their results: :meth:`on_reattach_msg`)."""
        for sid in self.client_sessions.get(client, ()):
            self.orphans.pop(sid, None)
        held = self.kept.pop(client, None)
        if held is not None:
            scheduler = self.roster.scheduler
            dask_compat.desire_keys(scheduler, held[1], client)
            dask_compat.release_keys(scheduler, held[1], KEEPER, f"dask-agents-client-back-{time.time()}")

    def before_client_left(self, client: str) -> None:
        """``client``'s connection ended and Dask is about to release every key it wanted
        (``dask_compat.before_remove_client``). Its agent calls among them are held first
        (:data:`KEEPER`) for ``session-grace``: a call running goes on to its end, its result
        stays, and a driver that reconnects gets it, so nothing is cancelled under a call that
        ran and no step is re-submitted (run twice). Only for drivers owning sessions; plain
        Dask work is left to Dask."""
        if not self.client_sessions.get(client):
            # not a driver that owns sessions (a worker's own client, gone with its worker: the
            # calls it made are its caller's, which runs again elsewhere and makes them anew)
            return
        scheduler = self.roster.scheduler
        keys = [k for k in dask_compat.wanted_by(scheduler, client) if k in self.state.calls]
        if not keys:
            return
        dask_compat.desire_keys(scheduler, keys, KEEPER)
        old = self.kept.get(client)
        self.kept[client] = (time.time() + agents_config.seconds("scheduler.session-grace"),
                             (old[1] if old is not None else set()) | set(keys))

    def on_reattach_msg(self, keys: Any = None, client: Any = None, **kw: Any) -> None:
        """A reconnected driver asks again for calls whose futures Dask cancelled when its
        connection dropped (on its client stream; ``client`` is the stream's). It is told of
        each at once if finished or erred, when it ends otherwise; one no longer kept (its
        grace passed, its session was closed) is cancelled for it with a reason naming it."""
        try:
            if not isinstance(client, str):
                raise ValueError("a reattach from no client")
            if not isinstance(keys, (list, tuple)) or len(keys) > MAX_REATTACH or not all(
                    isinstance(k, str) and len(k) <= validate.MAX_KEY for k in keys):
                raise ValueError(f"keys must be a list of at most {MAX_REATTACH} call keys")
            scheduler = self.roster.scheduler
            known = set(dask_compat.desire_keys(scheduler, keys, client))
            for k in keys:
                if k not in known:
                    dask_compat.tell_cancelled(scheduler, client, [k], LOST_REASON, self._lost_text(k))
        except Exception as e:  # raising here would close the client's stream
            logger.warning("dask-agents: reattach ignored: %s", e)

    def _lost_text(self, key: str) -> str:
        from dask_agents.errors import where

        rec = self.state.calls.get(key)
        if rec is None:
            return (f"call {key}: its driver's connection dropped and the call is no longer known "
                    f"(not an agent call, or its session ended and was dropped)")
        s = self.state.sessions.get(rec.session) if rec.session else None
        why = (f"its session was closed: {s.closed_reason}" if s is not None and s.closed_reason
               else f"its driver did not ask for it within agents.scheduler.session-grace "
                    f"({agents_config.get('scheduler.session-grace')})")
        return (f"{where(rec.component, rec.method, rec.session)}: its driver's connection dropped and the call "
                f"was released ({why}) (call {key})")

    def _expire_kept(self, now: float) -> None:
        """Release what was held for clients that did not come back within their grace."""
        for client in [c for c, (deadline, _) in self.kept.items() if deadline <= now]:
            _, keys = self.kept.pop(client)
            dask_compat.release_keys(self.roster.scheduler, keys, KEEPER, f"dask-agents-grace-over-{now}")

    # -- ending ------------------------------------------------------------------------------
    def end(self, session: Any, cancel: Any = False, client: str | None = None, direct: Any = None) -> dict:
        """The driver ``client`` left its ``da.session`` block (``cancel``: with an exception,
        so its open calls can no longer matter). Only the owner's end counts, and ``client``
        is the stream the message came on (:meth:`on_end_msg`), never a field of it: another
        client (one that joined the session, or one naming someone else's session) ends
        nothing, and neither does an end from nobody we can name. An unknown session is not
        created: it made no call."""
        session = validate.session_id(session, "agents-session-end: session")
        rec = self.state.sessions.get(session)
        if rec is None:
            return {"state": "unknown"}
        if client is None or client != rec.owner:
            if client is not None and rec.owner is not None:
                self.refused += 1
                logger.warning("dask-agents: client %s may not end session %s (its owner is another client)",
                               client, session)
            return {"state": rec.state}
        reason = "its driver left the da.session block with an exception" if cancel is True else None
        if isinstance(direct, (list, tuple)):  # its direct calls' records may still be on their way
            rec.awaiting = {k for k in direct[:MAX_AWAITED] if isinstance(k, str) and k not in rec.calls}
        self.close(session, time.time(), reason, abort=cancel is True)
        return {"state": self.state.sessions[session].state}

    def on_end_msg(self, session: Any = None, cancel: Any = False, client: Any = None, direct: Any = None,
                   **kw: Any) -> None:
        """The driver's end of ``session``, on its client stream (``client``: the stream's own
        identity, ``dask_compat.add_client_stream_handler``). It arrives after the client's
        earlier submits (same stream), so a session cannot complete before its last calls are
        seen."""
        try:
            self.end(session, cancel, client if isinstance(client, str) else None, direct)
        except Exception as e:  # raising here would close the client's stream
            logger.warning("dask-agents: session end ignored: %s", e)

    def close(self, sid: str, now: float, reason: str | None = None, abort: bool = False,
              unawaited: bool = False) -> None:
        """Close ``sid`` (the driver is done, or ``reason``: the scheduler closes it). With
        ``abort``, its open calls fail with SessionClosedError (``reason``) or, running, are
        cancelled: nobody is left to use their results."""
        self.orphans.pop(sid, None)
        known = self.state.sessions.get(sid)
        if known is not None and known.state == "completed":
            return  # already over: nothing to close
        if known is not None and unawaited:
            known.awaiting.clear()  # the scheduler closes it (its driver is gone): nothing to wait for
        s = self.state.close_session(sid, now)
        if reason is not None:
            s.closed_reason = reason
            logger.info("dask-agents: session %s closed: %s", sid, reason)
        if abort and s.open_calls > 0:
            self._abort(s, reason or "the session was closed")
        if s.state == "completed":
            self.completed(sid)

    def _abort(self, s: Any, reason: str) -> None:
        """Fail the session's open calls that have not started (SessionClosedError naming the
        call, session and ``reason``) and cancel the ones that are running."""
        from dask_agents.errors import SessionClosedError, where

        scheduler = self.roster.scheduler
        stimulus = f"dask-agents-session-closed-{time.time()}"
        running = []
        for rec in [r for r in s.calls.values() if r.state not in ("finished", "erred", "cancelled")
                    and not self._needed_elsewhere(r.key, s)]:
            exc = SessionClosedError(f"{where(rec.component, rec.method, s.id)}: the session was closed before the "
                                     f"call ran: {reason} (call {rec.key})", session=s.id)
            try:
                if not dask_compat.fail_task(scheduler, rec.key, exc, stimulus):
                    running.append(rec.key)
            except Exception:  # never leave it open: cancel it instead
                logger.exception("dask-agents: failing call %s of closed session %s failed", rec.key, s.id)
                running.append(rec.key)
        if running:
            try:
                dask_compat.cancel_tasks(scheduler, running, f"dask-agents: session {s.id} was closed: {reason}")
            except Exception:
                logger.exception("dask-agents: cancelling %d calls of closed session %s failed", len(running), s.id)

    def _needed_elsewhere(self, key: str, s: Any) -> bool:
        """Whether a task outside session ``s`` (another session's call, plain work) depends on
        call ``key``: giving up ``s`` must not break it."""
        ts = dask_compat.task(self.roster.scheduler, key)
        return ts is not None and any(d not in s.calls for d in dask_compat.dependent_keys(ts))

    def completed(self, sid: str) -> None:
        """``sid`` completed: its KV goes at once; its stateful instances (if any) after
        ``instance-linger``, unless a late call reopens the session first. Once per completion."""
        s = self.state.sessions.get(sid)
        if s is not None:
            if s.ended:
                return
            s.ended = True
        self.orphans.pop(sid, None)
        self.on_completed(sid, s)
        linger = agents_config.seconds("scheduler.instance-linger")
        if linger > 0 and self.placement.has_instances(sid):
            if sid not in self._lingering:
                self._lingering[sid] = self.roster.scheduler.loop.call_later(linger, self.release, sid)
            return
        self.release(sid)

    def release(self, sid: str) -> None:
        """Drop ``sid``'s bindings and tell the workers holding its instances or KV."""
        self._lingering.pop(sid, None)
        s = self.state.sessions.get(sid)
        if s is not None and s.state != "completed":
            return  # reopened meanwhile
        released = f"its instance was released when the session completed at " \
                   f"{time.strftime('%H:%M:%S', time.localtime((s.completed_at if s else None) or time.time()))}"
        for addr in self.placement.release_session(sid, s, released):
            if self.roster.alive(addr):
                self.tell_ended(addr, [sid])

    def tell_ended(self, addr: str, sids: list[str]) -> None:
        """Tell ``addr`` (soon, batched) that ``sids`` ended: their KV and instances go."""
        self._ending[addr].extend(sids)
        if not self._flushing_ends:
            self._flushing_ends = True
            self.roster.soon(self._flush_ends)

    async def _flush_ends(self) -> None:
        """Tell workers which sessions ended: one RPC per worker at a time, carrying every
        session that ended meanwhile. (One RPC per session opened hundreds of connections when
        thousands of sessions ended together, and the pool kept them.)"""
        try:
            while self._ending:
                ending, self._ending = self._ending, defaultdict(list)
                await asyncio.gather(*(self._end_on_worker(a, sids) for a, sids in ending.items()))
        finally:
            self._flushing_ends = False

    async def _end_on_worker(self, addr: str, sids: list[str]) -> None:
        try:
            await self.roster.call_worker(addr, "agents_end_session", sessions=sids)
        except Exception as e:  # the worker left: its instances went with it
            logger.debug("dask-agents: end_session on %s failed: %s", addr, e)

    # -- periodic ----------------------------------------------------------------------------
    def housekeeping(self, now: float) -> None:
        """Close the sessions whose driver did not come back within the grace, and idle ones."""
        if self.kept:
            self._expire_kept(now)
        for sid in [sid for sid, t in self.orphans.items() if t <= now]:
            s = self.state.sessions.get(sid)
            owner = s.owner if s is not None else None
            self.client_sessions.get(owner, set()).discard(sid)
            if owner in self.client_sessions and not self.client_sessions[owner]:
                del self.client_sessions[owner]
            self.close(sid, now, f"its driver (client {owner}) disconnected and did not reconnect within "
                                 f"{agents_config.get('scheduler.session-grace')}", abort=True, unawaited=True)
        idle = agents_config.seconds("scheduler.session-idle-timeout")
        for sid in self.state.idle(now, idle):
            s = self.state.sessions.get(sid)
            if s is None:
                self.state.activity.pop(sid, None)
            elif s.open_calls > 0:  # calls still run: not idle
                self.state.active(s, now)
            else:
                self.close(sid, now, f"no activity for {agents_config.get('scheduler.session-idle-timeout')} "
                                     "(agents.scheduler.session-idle-timeout)", unawaited=True)

    def forget(self, dropped: list[str]) -> None:
        """The workflow state dropped these completed sessions (retention): so do the indexes
        (a long-lived client's session index would otherwise grow without end)."""
        if not dropped:
            return
        for client in list(self.client_sessions):
            self.client_sessions[client].difference_update(dropped)
            if not self.client_sessions[client]:
                del self.client_sessions[client]
        for sid in dropped:
            self.orphans.pop(sid, None)
