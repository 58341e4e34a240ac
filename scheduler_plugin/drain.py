"""The drain protocol that moves an engine worker from one model to another.

1. stop routing: the worker leaves the source model's replicas, so no new call goes there
   (sessions bound to it re-bind to another replica on their next call);
2. move its waiting source calls to the other replicas (the enforcer's moves: Dask's steal
   protocol, so only calls that have not started move and nothing runs twice; a move counts
   once Dask confirms it);
3. wait, tick after tick, until the source calls it was running have finished;
4. swap: the worker plugin closes the source engine and loads the target (an RPC);
5. kick: the worker joins the target's replicas and calls start flowing to it.
A drain that does not finish within ``timeout`` is rolled back (the worker serves the
source again). Progress is driven by the control loop; nothing here blocks the event loop.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

from dask_agents.annotation import component_name
from dask_agents.scheduler_plugin import dask_compat
from dask_agents.scheduler_plugin.actions import Reassign
from dask_agents.scheduler_plugin.placement import Placement
from dask_agents.scheduler_plugin.roster import Roster
from dask_agents.scheduler_plugin.state import WorkflowState

logger = logging.getLogger(__name__)


@dataclass
class Drain:
    """One move in progress."""

    worker: str
    source: str
    target: str
    started: float
    phase: str = "draining"  # draining -> swapping -> done | failed


class Drainer:
    """Runs drains for the scheduler plugin."""

    def __init__(self, roster: Roster, state: WorkflowState, placement: Placement,
                 set_worker_models: Callable[[str, list[str]], None],
                 move: Callable[[Any, str, str], str | None], timeout: float = 120.0):
        self.roster = roster
        self.state = state
        self.placement = placement  # its open-call counts spread the moved calls
        self.set_worker_models = set_worker_models  # the plugin's: a swapped worker's models
        # the enforcer's move: checked against its invariants, recorded once Dask confirms it
        self.move = move
        self.timeout = timeout
        self.drains: dict[str, Drain] = {}
        self.completed = 0
        self.failed = 0

    def begin(self, a: Reassign) -> str | None:
        """Start draining ``a.worker``; returns why not (None when started)."""
        if a.worker in self.drains:
            return "already draining"
        if not self.roster.alive(a.worker) or a.worker not in self.roster.ready:
            return "unknown worker"
        hosts = self.roster.hosts.get(a.source, set())
        if a.worker not in hosts:
            return f"worker does not serve {a.source}"
        others = [w for w in hosts if w != a.worker and self.roster.alive(w)]
        if not others and self.state.open_per_component.get(component_name(a.source), 0) > 0:
            return f"last replica of {a.source} with calls open"
        hosts.discard(a.worker)  # 1. stop routing
        self.drains[a.worker] = Drain(a.worker, a.source, a.target, time.time())
        self._move_waiting(self.drains[a.worker], others)  # 2. move what has not started
        return None

    def _source_calls(self, d: Drain) -> tuple[list, list]:
        """(waiting, running) tasks of the source model on the drained worker."""
        waiting, started = dask_compat.assigned_to_worker(self.roster.scheduler, d.worker)
        return [ts for ts in waiting if self._is_source(ts, d)], [ts for ts in started if self._is_source(ts, d)]

    def _is_source(self, ts: Any, d: Drain) -> bool:
        rec = self.state.calls.get(dask_compat.task_key(ts))
        return rec is not None and rec.model == d.source

    def _move_waiting(self, d: Drain, others: list[str]) -> None:
        if not others:
            return
        # moves count on the thieves once confirmed: spread this round's requests meanwhile
        asked: Counter[str] = Counter()
        for ts in self._source_calls(d)[0]:
            thief = min(others, key=lambda w: self.placement.open_placed[(w, f"llm:{d.source}")] + asked[w])
            if self.move(ts, d.worker, thief) is None:
                asked[thief] += 1

    def progress(self) -> None:
        """Advance every drain by what is possible now (called each control tick)."""
        now = time.time()
        for d in list(self.drains.values()):
            if d.phase == "draining":
                waiting, running = self._source_calls(d)
                if waiting:  # a call slipped in (or a move was refused): try again
                    self._move_waiting(d, [w for w in self.roster.hosts.get(d.source, ())])
                elif not running:
                    d.phase = "swapping"  # 3. drained
                    self.roster.soon(self._swap, d)
                    continue
                if now - d.started > self.timeout:
                    self._rollback(d, "timed out draining")
            elif d.phase in ("done", "failed"):
                del self.drains[d.worker]

    async def _swap(self, d: Drain) -> None:
        try:
            hosted = await self.roster.call_worker(d.worker, "agents_swap_model", remove=d.source, add=d.target)  # 4.
        except Exception as e:
            logger.warning("dask-agents: swapping %s on %s failed: %s", d.target, d.worker, e)
            self._rollback(d, f"swap failed: {e}")
            return
        self.set_worker_models(d.worker, list(hosted))  # 5. kick: new calls route here
        d.phase = "done"
        self.completed += 1
        dask_compat.add_event(self.roster.scheduler, "agents-control", {
            "action": "reassign-done", "worker": d.worker, "source": d.source, "target": d.target,
            "seconds": time.time() - d.started})

    def _rollback(self, d: Drain, why: str) -> None:
        d.phase = "failed"
        self.failed += 1
        if self.roster.alive(d.worker):
            self.roster.hosts[d.source].add(d.worker)
        dask_compat.add_event(self.roster.scheduler, "agents-control", {
            "action": "reassign-failed", "worker": d.worker, "source": d.source, "target": d.target, "why": why})

    def stats(self) -> dict:
        """Drains in progress and totals."""
        return {"in_progress": {w: f"{d.source}->{d.target} ({d.phase})" for w, d in self.drains.items()},
                "completed": self.completed, "failed": self.failed}
