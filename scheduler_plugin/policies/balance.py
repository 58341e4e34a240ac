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
  only if the victim's load stays at least ``r_max`` times the thief's after the move (SAGA):
  recomputing the prefix elsewhere must be worth it. That recompute is also priced into C_mig: the session's
  context tokens on the victim (``view.kv_tokens``) / ``prefill_rate``. The KV is not shipped;
  the session's later calls follow the call to the thief (the scheduler plugin rebinds it),
  where the recomputed prefix then lives.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import Iterator

from dask.utils import parse_bytes, parse_timedelta

from dask_agents.scheduler_plugin.actions import Migrate
from dask_agents.scheduler_plugin.view import CallView, ClusterView, WorkerView


class LateBindingBalance:
    """Suggest migrations of waiting calls from overloaded to underloaded workers."""

    def __init__(self, alpha: float = 0.2, beta: float = 0.02, bandwidth: str | float = "100 MB/s",
                 move_overhead: str | float = "5ms", t_idle: str | float = "100ms", r_max: float = 2.0,
                 max_moves: int = 64, prefill_rate: float = 8000.0):
        self.alpha = float(alpha)
        self.beta = float(parse_timedelta(beta, default="s"))
        bw = bandwidth.split("/")[0] if isinstance(bandwidth, str) else bandwidth
        self.bandwidth = float(parse_bytes(bw) if isinstance(bw, str) else bw)
        self.move_overhead = float(parse_timedelta(move_overhead, default="s"))
        self.t_idle = float(parse_timedelta(t_idle, default="s"))
        self.r_max = float(r_max)
        self.max_moves = int(max_moves)
        if float(prefill_rate) <= 0:
            raise ValueError(f"prefill_rate must be > 0 tokens/s, got {prefill_rate!r}")
        self.prefill_rate = float(prefill_rate)

    def cost(self, call: CallView, view: ClusterView | None = None, victim: str | None = None) -> float:
        """C_mig: fixed overhead plus moving the call's inputs, plus recomputing the session's
        KV prefix when it lives on ``victim`` (an LLM call leaving its session's engine)."""
        c = self.move_overhead + call.input_bytes / self.bandwidth
        if view is not None and call.model is not None and call.session is not None:
            if view.kv_affinity.get((call.session, call.model)) == victim:
                c += view.kv_tokens.get((call.session, call.model), 0) / self.prefill_rate
        return c

    def movable(self, call: CallView, thief: WorkerView) -> bool:
        """Whether ``call`` may run on ``thief`` at all."""
        if call.stateful or call.restricted or call.batch_max or not thief.agents_ready:
            return False  # batchable calls are the batching policy's to place
        return call.model is None or call.model in thief.models

    def __call__(self, view: ClusterView) -> Iterator[Migrate]:
        queue = {a: [view.calls[k] for k in w.queued if k in view.calls] for a, w in view.workers.items()}
        delay = {a: sum(view.duration(c.component) for c in q) / max(view.workers[a].nthreads, 1)
                 for a, q in queue.items()}
        # Thief candidates kept sorted by (delay, queue length, position): picking the least
        # loaded compatible worker is then O(1), not a scan of every worker per call (which
        # made a pass O(workers^2): seconds at 2,048 workers). Same choice as the scan.
        pools = _Pools(view, queue, delay) if type(self).movable is LateBindingBalance.movable else None
        moves = 0
        for victim in sorted(queue, key=lambda a: delay[a], reverse=True):
            vw = view.workers[victim]
            # lowest priority first: the call that would wait longest here
            for call in sorted(queue[victim], key=lambda c: c.priority, reverse=True):
                if moves >= self.max_moves:
                    return
                q_i = len(queue[victim])
                thief = self._thief(call, view, queue, delay, victim, pools)
                if thief is None:
                    continue
                q_j = len(queue[thief])
                if q_i == 0 or (q_i - q_j) / q_i <= self.alpha:
                    break  # queues are close enough: nothing more to gain from this victim
                gain = delay[victim] - delay[thief] - self.cost(call, view, victim)
                if gain <= self.beta:
                    break
                if not self._kv_gate(call, view, vw, view.workers[thief]):
                    continue
                yield Migrate(call.key, victim, thief, reason=f"queue {q_i}->{q_j}, gain {gain:.3f}s")
                moves += 1
                d = view.duration(call.component)
                if pools is not None:
                    pools.remove(victim, thief)
                queue[victim].remove(call)
                queue[thief].append(call)
                delay[victim] -= d / max(vw.nthreads, 1)
                delay[thief] += d / max(view.workers[thief].nthreads, 1)
                if pools is not None:
                    pools.add(victim, thief)

    def _thief(self, call: CallView, view: ClusterView, queue: dict, delay: dict, victim: str,
               pools: "_Pools | None" = None) -> str | None:
        if pools is not None:
            if call.stateful or call.restricted or call.batch_max:
                return None
            return pools.best(call.model, victim)
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
        # loads as they would be after the move: a call that is its engine's only work (queued
        # for a thread slot for a moment) never leaves its KV for an idle engine
        load_v = (victim.processing - 1) / max(victim.nthreads, 1)
        load_t = (thief.processing + 1) / max(thief.nthreads, 1)
        return load_v >= self.r_max * load_t


class _Pools:
    """Per model (None: any call), the workers that may take such a call, sorted by
    (delay, queue length, position in ``view.workers``): the linear scan's order and its
    tie-break. Entries are updated for the two workers a move changes."""

    def __init__(self, view: ClusterView, queue: dict, delay: dict):
        self.view, self.queue, self.delay = view, queue, delay
        self.rank = {a: i for i, a in enumerate(view.workers)}
        self.pools: dict[str | None, list[tuple]] = {}

    def _key(self, a: str) -> tuple:
        return (self.delay[a], len(self.queue[a]), self.rank[a], a)

    def _takes(self, model: str | None, w: WorkerView) -> bool:
        return w.agents_ready and (model is None or model in w.models)

    def _pool(self, model: str | None) -> list[tuple]:
        pool = self.pools.get(model)
        if pool is None:
            pool = self.pools[model] = sorted(self._key(a) for a, w in self.view.workers.items()
                                              if self._takes(model, w))
        return pool

    def best(self, model: str | None, victim: str) -> str | None:
        """The least loaded worker other than ``victim`` that takes a call of ``model``."""
        for entry in self._pool(model)[:2]:
            if entry[3] != victim:
                return entry[3]
        return None

    def remove(self, *workers: str) -> None:
        """Take ``workers`` out before their delay or queue changes."""
        for model, pool in self.pools.items():
            for a in workers:
                if self._takes(model, self.view.workers[a]):
                    i = bisect_left(pool, self._key(a))
                    if i < len(pool) and pool[i][3] == a:
                        del pool[i]

    def add(self, *workers: str) -> None:
        """Put ``workers`` back with their new delay and queue."""
        for model, pool in self.pools.items():
            for a in workers:
                if self._takes(model, self.view.workers[a]):
                    insort(pool, self._key(a))
