"""Late-binding load balancing (Nalar Alg. 1) with SAGA's locality-gated stealing.

Calls queue on workers (LLM and stateful calls are placed eagerly; other calls with
dependencies too). Each tick, for the most loaded worker i and the least loaded compatible
worker j, the lowest-priority waiting call moves from i to j when

    (Q_i - Q_j) / Q_i > alpha                      (queues differ enough)
    W_i - W_j - C_mig > beta                       (the wait saved beats the move's cost)

where Q is the number of waiting calls, W the expected queueing delay (mean durations of
the waiting calls / threads) and C_mig a fixed overhead plus input bytes / bandwidth.

- Stateful calls never move: they keep their session's instance. Batchable calls are left
  to the batching policy (it gathers them; this one would spread them).
- LLM calls move only to workers hosting their model. When their session's KV lives on the
  victim (session affinity), they move only to a thief idle for at least ``t_idle`` and
  only if the victim's load is at least ``r_max`` times the thief's (SAGA): recomputing the
  prefix elsewhere must be worth it.
"""

from __future__ import annotations

from typing import Iterator

from dask.utils import parse_bytes, parse_timedelta

from scheduler_plugin.actions import Migrate
from scheduler_plugin.view import CallView, ClusterView, WorkerView


class LateBindingBalance:
    """Suggest migrations of waiting calls from overloaded to underloaded workers."""

    def __init__(self, alpha: float = 0.2, beta: float = 0.02, bandwidth: str | float = "100 MB/s",
                 move_overhead: str | float = "5ms", t_idle: str | float = "100ms", r_max: float = 2.0,
                 max_moves: int = 64):
        self.alpha = float(alpha)
        self.beta = float(parse_timedelta(beta, default="s"))
        bw = bandwidth.split("/")[0] if isinstance(bandwidth, str) else bandwidth
        self.bandwidth = float(parse_bytes(bw) if isinstance(bw, str) else bw)
        self.move_overhead = float(parse_timedelta(move_overhead, default="s"))
        self.t_idle = float(parse_timedelta(t_idle, default="s"))
        self.r_max = float(r_max)
        self.max_moves = int(max_moves)

    def cost(self, call: CallView) -> float:
        """C_mig: fixed overhead plus moving the call's inputs."""
        return self.move_overhead + call.input_bytes / self.bandwidth

    def movable(self, call: CallView, thief: WorkerView) -> bool:
        """Whether ``call`` may run on ``thief`` at all."""
        if call.stateful or call.restricted or call.batch_max or not thief.agents_ready:
            return False  # batchable calls are the batching policy's to place
        return call.model is None or call.model in thief.models

    def __call__(self, view: ClusterView) -> Iterator[Migrate]:
        queue = {a: [view.calls[k] for k in w.queued if k in view.calls] for a, w in view.workers.items()}
        delay = {a: sum(view.duration(c.component) for c in q) / max(view.workers[a].nthreads, 1)
                 for a, q in queue.items()}
        moves = 0
        for victim in sorted(queue, key=lambda a: delay[a], reverse=True):
            vw = view.workers[victim]
            # lowest priority first: the call that would wait longest here
            for call in sorted(queue[victim], key=lambda c: c.priority, reverse=True):
                if moves >= self.max_moves:
                    return
                q_i = len(queue[victim])
                thief = self._thief(call, view, queue, delay, victim)
                if thief is None:
                    continue
                q_j = len(queue[thief])
                if q_i == 0 or (q_i - q_j) / q_i <= self.alpha:
                    break  # queues are close enough: nothing more to gain from this victim
                gain = delay[victim] - delay[thief] - self.cost(call)
                if gain <= self.beta:
                    break
                if not self._kv_gate(call, view, vw, view.workers[thief]):
                    continue
                yield Migrate(call.key, victim, thief, reason=f"queue {q_i}->{q_j}, gain {gain:.3f}s")
                moves += 1
                d = view.duration(call.component)
                queue[victim].remove(call)
                queue[thief].append(call)
                delay[victim] -= d / max(vw.nthreads, 1)
                delay[thief] += d / max(view.workers[thief].nthreads, 1)

    def _thief(self, call: CallView, view: ClusterView, queue: dict, delay: dict, victim: str) -> str | None:
        best = None
        for a, w in view.workers.items():
            if a == victim or not self.movable(call, w):
                continue
            if best is None or (delay[a], len(queue[a])) < (delay[best], len(queue[best])):
                best = a
        return best

    def _kv_gate(self, call: CallView, view: ClusterView, victim: WorkerView, thief: WorkerView) -> bool:
        """SAGA: a call whose KV lives on the victim moves only to an idle, much less loaded thief."""
        if call.model is None or view.kv_affinity.get((call.session, call.model)) != victim.address:
            return True
        if thief.idle_since is None or view.now - thief.idle_since < self.t_idle:
            return False
        load_v = victim.processing / max(victim.nthreads, 1)
        load_t = thief.processing / max(thief.nthreads, 1)
        return load_v >= self.r_max * load_t
