"""Dynamic resource reallocation (Nalar Alg. 2) for engine workers.

Per model v, each tick measures
    mu_v   per-replica service rate: completions / (replicas x seconds), only over ticks in
           which v had runnable work (an idle replica says nothing about its capacity), over a
           sliding ``window`` and only once it holds ``min_completions``
    lam_v  arrival rate of v's calls over the same window. lam_v = p_v x (request rate), with p_v the
           visits per request of the flattened graph: the request rate is common to every v,
           so comparing mu_v R_v / lam_v ranks models exactly as Nalar's x_v = mu_v R_v / p_v.
    x_v    = R_v mu_v / max(lam_v, delta)   (normalized capacity)
The smallest x_v with open calls is the bottleneck. After it stays the bottleneck for
``persistence`` (K) consecutive ticks, one replica moves to it from the donor that stays
above it after the move (and above its ``min_replicas``), if the predicted throughput
(min over v of x_v) improves by more than ``epsilon``. The move itself (drain the worker,
swap its engine, kick both sides) is the enforcement layer's job.

With ``provision`` on and no donor to take from, the policy asks the cluster manager for a
new worker for the bottleneck instead (at most once per ``provision_cooldown``); this needs
a cluster link (``da.attach_cluster``) and costs money on real clusters, so it is opt-in.
"""

from __future__ import annotations

from typing import Iterator

from collections import deque

from dask.utils import parse_timedelta

from dask_agents.scheduler_plugin.actions import Provision, Reassign
from dask_agents.scheduler_plugin.view import ClusterView


class Reallocate:
    """Suggest moving engine workers between models toward the bottleneck."""

    def __init__(self, persistence: int = 4, epsilon: float = 0.1, delta: float = 1e-3, window: str | float = "2s",
                 min_completions: int = 4, provision: bool = False, provision_cooldown: str | float = "30s"):
        self.persistence = int(persistence)
        self.epsilon = float(epsilon)
        self.delta = float(delta)
        # Rates over a sliding window, not per tick: a 100 ms tick sees 0 or 1 completions, and
        # a per-tick estimate swings the bottleneck back and forth.
        self.window = float(parse_timedelta(window, default="s"))
        self.min_completions = int(min_completions)
        self.mu: dict[str, float] = {}
        self.lam: dict[str, float] = {}
        self._prev: dict[str, tuple[int, int, int]] = {}  # model -> (created, completed, open)
        self._prev_time: float | None = None
        # model -> ticks (time, dt, arrivals, completions, replica-seconds while work existed)
        self._ticks: dict[str, deque] = {}
        self.streak: tuple[str | None, int] = (None, 0)
        self.provision = bool(provision)
        self.provision_cooldown = float(parse_timedelta(provision_cooldown, default="s"))
        self._last_provision: float | None = None

    def observe(self, view: ClusterView) -> None:
        """Update service and arrival rates from the counters in ``view`` (sliding window)."""
        dt = None if self._prev_time is None else view.now - self._prev_time
        self._prev_time = view.now
        for m in view.models.values():
            c = view.components.get(m.component)
            now = (c.calls, c.completed, c.open) if c is not None else (0, 0, 0)
            prev = self._prev.get(m.name)
            self._prev[m.name] = now
            if prev is None or not dt or dt <= 0:
                continue
            worked = bool(m.replicas) and (prev[2] > 0 or now[2] > 0)  # runnable work existed
            ticks = self._ticks.setdefault(m.name, deque())
            ticks.append((view.now, dt, now[0] - prev[0], now[1] - prev[1] if worked else 0,
                          len(m.replicas) * dt if worked else 0.0))
            while ticks and view.now - ticks[0][0] > self.window:
                ticks.popleft()
            span = sum(t[1] for t in ticks)
            self.lam[m.name] = sum(t[2] for t in ticks) / span if span > 0 else 0.0
            done = sum(t[3] for t in ticks)
            busy = sum(t[4] for t in ticks)
            if busy > 0 and done >= self.min_completions:
                self.mu[m.name] = done / busy

    def capacity(self, model: str, replicas: int) -> float:
        """Normalized capacity x of ``model`` with ``replicas`` replicas."""
        known = [v for v in self.mu.values() if v > 0]
        mu = self.mu.get(model) or (sum(known) / len(known) if known else 0.0)
        return replicas * mu / max(self.lam.get(model, 0.0), self.delta)

    def __call__(self, view: ClusterView) -> Iterator[Reassign | Provision]:
        self.observe(view)
        if not self.mu or len(view.models) < 2:
            return
        x = {m: self.capacity(m, len(v.replicas)) for m, v in view.models.items()}
        busy = [m for m, v in view.models.items()
                if (c := view.components.get(v.component)) is not None and c.open > 0]
        if not busy:
            self.streak = (None, 0)
            return
        bottleneck = min(busy, key=lambda m: x[m])
        self.streak = (bottleneck, self.streak[1] + 1 if self.streak[0] == bottleneck else 1)
        if self.streak[1] < self.persistence:
            return
        b = view.models[bottleneck]
        if b.max_replicas is not None and len(b.replicas) >= b.max_replicas:
            return
        gained = self.capacity(bottleneck, len(b.replicas) + 1)
        best = None
        for name, d in view.models.items():
            if name == bottleneck or len(d.replicas) <= max(d.min_replicas, 0) or not d.replicas:
                continue
            after = self.capacity(name, len(d.replicas) - 1)
            if after <= gained:
                continue  # the donor would become the new bottleneck
            new_min = min([gained, after] + [x[m] for m in x if m not in (name, bottleneck)])
            if new_min <= (1 + self.epsilon) * min(x.values()):
                continue  # not worth the disruption
            if best is None or after > best[1]:
                best = (name, after)
        if best is None:
            if self.provision and (self._last_provision is None
                                   or view.now - self._last_provision >= self.provision_cooldown):
                self._last_provision = view.now
                self.streak = (None, 0)
                yield Provision(1, bottleneck, reason=f"x[{bottleneck}]={x[bottleneck]:.2f}, no donor")
            return
        donor = view.models[best[0]]
        worker = min(donor.replicas, key=lambda w: view.workers[w].processing if w in view.workers else 0)
        self.streak = (None, 0)
        yield Reassign(worker, donor.name, bottleneck,
                       reason=f"x[{bottleneck}]={x[bottleneck]:.2f} < x[{donor.name}]={x[donor.name]:.2f}")
