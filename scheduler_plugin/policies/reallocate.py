"""Dynamic resource reallocation (Nalar Alg. 2): engine workers between models, and workers
between the routes of bounded CPU components.

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

CPU components run on any worker's threads: every worker is already their replica, and there
is nothing to move, unless their hints bound them (``max_replicas``, e.g. a test runner that
must not take every thread from the agents). A bounded component's replicas are the workers
the control plane routes it to (a ``Route``: its new calls go only there, on the scheduler
and on the workers' fast paths; calls already placed finish where they are): workers hosting
its ``model=`` hint's engine first (its calls go beside it), else workers without an engine
first (a heavy tool beside an engine slows it). It starts on ``min_replicas``
workers (at least one), the least covered by other bounded components' routes, and the same
rule moves workers toward the bottleneck:
    x_c = (threads of its replicas / mean call duration) / max(lam_c, delta)
(a worker with T threads completes T / duration calls a second while busy: measured from
every completed call, so a tool of minutes has a service rate before its window holds
``min_completions`` of them). Only an overloaded component (x_c < 1, below its
``max_replicas``) gains workers: one that keeps up with its arrivals has nothing to gain
from more. The most overloaded first takes workers no bounded route holds, as many as its
arrivals need; else one worker moves from the donor that stays above it (the rule above),
which is how a component gives workers back when another becomes the bottleneck; if neither
exists, the next overloaded one is tried. The enforcer refuses a route outside the
component's bounds.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Iterator

from dask.utils import parse_timedelta

from dask_agents.scheduler_plugin.actions import Provision, Reassign, Route
from dask_agents.scheduler_plugin.view import ClusterView, ComponentView


class _Rates:
    """Arrival rate and per-replica service rate of each pool (a model, a component) over a
    sliding window of ticks."""

    def __init__(self, window: float, min_completions: int):
        self.window = window
        self.min_completions = min_completions
        self.mu: dict[str, float] = {}
        self.lam: dict[str, float] = {}
        self._prev: dict[str, tuple[int, int, int]] = {}  # pool -> (created, completed, open)
        # pool -> ticks (time, dt, arrivals, completions, replica-seconds while work existed)
        self._ticks: dict[str, deque] = {}

    def observe(self, name: str, now: float, dt: float | None, counters: tuple[int, int, int],
                replicas: int) -> None:
        """Add one tick of ``name``'s cumulative ``counters`` (created, completed, open)."""
        prev = self._prev.get(name)
        self._prev[name] = counters
        if prev is None or not dt or dt <= 0:
            return
        worked = replicas > 0 and (prev[2] > 0 or counters[2] > 0)  # runnable work existed
        ticks = self._ticks.setdefault(name, deque())
        ticks.append((now, dt, counters[0] - prev[0], counters[1] - prev[1] if worked else 0,
                      replicas * dt if worked else 0.0))
        while ticks and now - ticks[0][0] > self.window:
            ticks.popleft()
        span = sum(t[1] for t in ticks)
        self.lam[name] = sum(t[2] for t in ticks) / span if span > 0 else 0.0
        done = sum(t[3] for t in ticks)
        busy = sum(t[4] for t in ticks)
        if busy > 0 and done >= self.min_completions:
            self.mu[name] = done / busy


class Reallocate:
    """Suggest moving engine workers between models, and workers between bounded CPU
    components' routes, toward the bottleneck."""

    def __init__(self, persistence: int = 4, epsilon: float = 0.1, delta: float = 1e-3, window: str | float = "2s",
                 min_completions: int = 4, provision: bool = False, provision_cooldown: str | float = "30s"):
        self.persistence = int(persistence)
        self.epsilon = float(epsilon)
        self.delta = float(delta)
        # Rates over a sliding window, not per tick: a 100 ms tick sees 0 or 1 completions, and
        # a per-tick estimate swings the bottleneck back and forth.
        self.window = float(parse_timedelta(window, default="s"))
        self.min_completions = int(min_completions)
        self._models = _Rates(self.window, self.min_completions)
        self._components = _Rates(self.window, self.min_completions)
        self.mu = self._models.mu  # model -> service rate per replica
        self.lam = self._models.lam  # model -> arrival rate
        self._prev_time: float | None = None
        self.streak: tuple[str | None, int] = (None, 0)
        self.cpu_streak: tuple[str | None, int] = (None, 0)
        self.provision = bool(provision)
        self.provision_cooldown = float(parse_timedelta(provision_cooldown, default="s"))
        self._last_provision: float | None = None

    def observe(self, view: ClusterView) -> None:
        """Update service and arrival rates from the counters in ``view`` (sliding window)."""
        dt = None if self._prev_time is None else view.now - self._prev_time
        self._prev_time = view.now
        for m in view.models.values():
            c = view.components.get(m.component)
            counters = (c.calls, c.completed, c.open) if c is not None else (0, 0, 0)
            self._models.observe(m.name, view.now, dt, counters, len(m.replicas))
        for c in view.components.values():
            if c.max_replicas is not None:
                self._components.observe(c.name, view.now, dt, (c.calls, c.completed, c.open), len(c.replicas))

    def capacity(self, model: str, replicas: int) -> float:
        """Normalized capacity x of ``model`` with ``replicas`` replicas."""
        known = [v for v in self.mu.values() if v > 0]
        mu = self.mu.get(model) or (sum(known) / len(known) if known else 0.0)
        return replicas * mu / max(self.lam.get(model, 0.0), self.delta)

    def __call__(self, view: ClusterView) -> Iterator[Reassign | Provision | Route]:
        self.observe(view)
        yield from self._cpu(view)
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

    # -- bounded CPU components ---------------------------------------------------------------
    def cpu_capacity(self, view: ClusterView, c: ComponentView, workers: tuple[str, ...] | list[str]) -> float | None:
        """Normalized capacity x of component ``c`` on ``workers``: their threads over its mean
        call duration, over its arrival rate (None before any call of it completed; infinite
        while none arrives). Not its backlog: a route places new calls only, the calls already
        placed finish where they are, so more workers would not clear it."""
        demand = self._components.lam.get(c.name, 0.0)
        if not c.mean_duration:
            return None if demand > 0 else math.inf
        threads = sum(view.workers[w].nthreads for w in workers if w in view.workers)
        return threads / c.mean_duration / max(demand, self.delta)

    def _cpu(self, view: ClusterView) -> Iterator[Route]:
        """Routes for bounded components: set up (and topped up to ``min_replicas``), then one
        move per ``persistence`` ticks toward the bottleneck."""
        bounded = {n: c for n, c in view.components.items() if c.max_replicas is not None}
        if not bounded:
            return
        pool = sorted(w for w, v in view.workers.items() if v.agents_ready and w not in view.draining)
        if not pool:
            return

        def rank(c: ComponentView, w: str) -> int:
            """0 for the workers a component should get first: those hosting its ``model=``
            hint's engine (its calls go beside it), else those without an engine (a heavy tool
            beside an engine slows it)."""
            models = view.workers[w].models
            return int(c.model not in models) if c.model is not None else int(bool(models))

        routes = {n: [w for w in c.replicas if w in pool] for n, c in bounded.items()}
        cover = dict.fromkeys(pool, 0)  # bounded routes holding each worker
        for r in routes.values():
            for w in r:
                cover[w] += 1
        changed = False
        for n, c in sorted(bounded.items()):  # set up, or top up after workers left
            want = min(max(c.min_replicas, 1), c.max_replicas, len(pool))
            if len(routes[n]) < want:
                spare = sorted((w for w in pool if w not in routes[n]), key=lambda w: (rank(c, w), cover[w], w))
                for w in spare[:want - len(routes[n])]:
                    routes[n].append(w)
                    cover[w] += 1
                changed = True
                yield Route(n, tuple(routes[n]), reason=f"{n}: {len(routes[n])} of min {c.min_replicas}, "
                                                        f"max {c.max_replicas} replicas")
        if changed:
            return  # measure on the routes first
        x = {n: self.cpu_capacity(view, c, routes[n]) for n, c in bounded.items()}
        # overloaded (its threads do not keep up with its arrivals: a component that keeps up
        # gains nothing from more) and below its max_replicas: one at its max cannot gain, and
        # must not keep another overloaded one from gaining
        short = [n for n, c in bounded.items()
                 if c.open > 0 and x[n] is not None and x[n] < 1 and len(routes[n]) < c.max_replicas]
        if not short:
            self.cpu_streak = (None, 0)
            return
        bottleneck = min(short, key=lambda n: x[n])
        streak = self.cpu_streak
        self.cpu_streak = (bottleneck, streak[1] + 1 if streak[0] == bottleneck else 1)
        if self.cpu_streak[1] < self.persistence:
            return
        for n in sorted(short, key=lambda n: x[n]):  # the bottleneck first; the next if it can take nothing
            free = sorted((w for w in pool if not cover[w]),
                          key=lambda w: (rank(bounded[n], w), view.workers[w].processing))
            moves = self._cpu_move(view, bounded, routes, x, n, free)
            if moves:
                self.cpu_streak = (None, 0)
                yield from moves
                return

    def _cpu_move(self, view: ClusterView, bounded: dict[str, ComponentView], routes: dict[str, list[str]],
                  x: dict[str, float | None], bottleneck: str, free: list[str]) -> list[Route]:
        """The routes that give the overloaded ``bottleneck`` capacity: free workers (those no
        bounded route holds) as its arrivals need, else one worker of the donor that stays
        above it; none if neither exists."""
        b, xb = bounded[bottleneck], x[bottleneck]
        if free:
            need = max(1, math.ceil(len(routes[bottleneck]) * ((1 + self.epsilon) / max(xb, 1e-9) - 1)))
            take = free[:min(need, b.max_replicas - len(routes[bottleneck]))]
            return [Route(bottleneck, tuple(routes[bottleneck] + take),
                          reason=f"x[{bottleneck}]={xb:.2f} < 1: {len(take)} free worker(s)")]
        best = None
        for name, d in bounded.items():
            mine = [w for w in routes[name] if w not in routes[bottleneck]]
            floor = max(d.min_replicas, 1)  # never an empty route: that is "anywhere"
            if name == bottleneck or not mine or len(routes[name]) <= floor or x[name] is None:
                continue
            w = min(mine, key=lambda w: view.workers[w].processing)
            gained = self.cpu_capacity(view, b, routes[bottleneck] + [w])
            after = self.cpu_capacity(view, d, [v for v in routes[name] if v != w])
            if after <= gained:
                continue  # the donor would become the new bottleneck
            new_min = min([gained, after] + [v for m, v in x.items() if m not in (name, bottleneck) and v is not None])
            if new_min <= (1 + self.epsilon) * xb:
                continue  # not worth the disruption
            if best is None or after > best[1]:
                best = (name, after, w)
        if best is None:
            return []
        donor, _, w = best
        reason = f"x[{bottleneck}]={xb:.2f} < x[{donor}]={x[donor]:.2f}: {w} moves"
        return [Route(donor, tuple(v for v in routes[donor] if v != w), reason=reason),
                Route(bottleneck, tuple(routes[bottleneck] + [w]), reason=reason)]
