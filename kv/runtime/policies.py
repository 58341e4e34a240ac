"""KV policies behind one interface: LRU, WA-LRU (SAGA), Nalar's idle-time policy, and ours.

A policy answers two questions about a read-only :class:`~dask_agents.kv.runtime.view.KVView`:

``order(view, tier)``
    When ``tier`` must make room, whose blocks go first: an iterable of session ids (the blocks
    of their latest prompt go tail first; a block several sessions hold goes once all its live
    holders came up) or of block ids. The enforcer takes from the front until it has enough, and falls back to LRU
    if the order runs out. All but ``lru`` start with the *stale* blocks (in no session's latest
    prompt: context left behind by compaction or a branch, finished sessions' blocks), least
    recently used first: at session granularity a session's KV is its latest context.
``tick(view)``
    Proactive actions (:class:`~dask_agents.kv.runtime.view.Evict`, :class:`~dask_agents.kv.runtime.view.Prefetch`,
    :class:`~dask_agents.kv.runtime.view.Drop`), asked at every step arrival, step end and every ``agents.kv.tick``
    seconds (only of policies with ``ticks = True``).

Both are pure: no state is kept between calls, everything comes from the view (the AEG's
predictions included). Parameters come from ``agents.kv.*`` (:meth:`Params.from_config`).

- ``lru``: what vLLM's prefix cache does: least recently used block first (a chain's tail
  before its head); no proactive action, no knowledge of tools or session ends.
- ``wa_lru``: SAGA. Score ``alpha*R + beta*(1 - P_reuse) + gamma*S`` (normalized recency, reuse
  probability from the AEG's successors x prefix overlap, normalized size), highest evicted
  first. Tool-aware TTL: a paused session is protected for ``min(P95 of its tool, ttl-max)``;
  sessions past it (and finished ones) go before protected ones. Thresholds: below
  ``theta-low`` nothing is evicted proactively; above it, stale blocks and expired sessions are
  evicted down to ``theta-low``; above ``theta-high`` protected ones too, down to ``theta-high``. Speculative
  prefetch once P(resume within restore time + margin) reaches ``prefetch-probability``.
- ``nalar``: Nalar's Alg. 3. A finished session's KV is dropped at once. A paused session's
  predicted idle time is the mean duration of what it waits on minus the time waited;
  while less than ``nalar-reserve`` of the accelerator is free, sessions are offloaded (longest
  predicted idle first) if that idle time exceeds offload + restore time; a session is
  prefetched when its predicted time to runnable is below restore time + margin. Under demand,
  the longest predicted idle goes first.
- ``ours``: drops finished sessions at once (Nalar); orders by the *expected time to next use*
  divided by the reuse probability, where the time is the mean residual pause
  E[L - elapsed | L > elapsed] of the AEG's latency model (a session past its tool's P95 is
  expected to wait long, one just paused on a fast tool is not); prefetches like SAGA (by the
  conditional CDF) or Nalar (by the residual), making room from sessions expected later; with a
  lower tier, above ``theta-high`` it offloads ahead of demand, but only sessions expected idle
  for ``offload_idle_ratio`` (50) round trips.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping

from dask_agents.kv.runtime.view import FINISHED, PAUSED, RUNNING, Action, Drop, Evict, KVView, Prefetch, SessionView, Trim

__all__ = ["Params", "Policy", "LRU", "WALRU", "Nalar", "Ours", "POLICIES", "get_policy", "swap_in"]


@dataclass(frozen=True)
class Params:
    """Policy parameters (``agents.kv.*``; see agents.yaml for what each means)."""

    theta_low: float = 0.70
    theta_high: float = 0.90
    ttl_max: float = 60.0
    alpha: float = 0.5
    beta: float = 0.3
    gamma: float = 0.2
    prefetch_margin: float = 0.05
    prefetch_probability: float = 0.5
    nalar_reserve: float = 0.10

    def __post_init__(self) -> None:
        if not 0 <= self.theta_low <= self.theta_high <= 1:
            raise ValueError(f"need 0 <= theta-low <= theta-high <= 1, got {self.theta_low}, {self.theta_high}")

    @classmethod
    def from_config(cls) -> "Params":
        """From ``agents.kv`` (times parsed as Dask timedeltas)."""
        import dask_agents.config as c

        w = c.get("kv.wa-lru") or {}
        return cls(float(c.get("kv.theta-low")), float(c.get("kv.theta-high")), c.seconds("kv.ttl-max"),
                   float(w.get("alpha", 0.5)), float(w.get("beta", 0.3)), float(w.get("gamma", 0.2)),
                   c.seconds("kv.prefetch-margin"), float(c.get("kv.prefetch-probability")),
                   float(c.get("kv.nalar-reserve")))


class Policy:
    """Base policy: evict by LRU, suggest nothing. Subclasses override ``order``/``tick``."""

    name = "base"
    ticks = False  # whether tick() has anything to say

    def __init__(self, params: Params | None = None):
        self.params = params or Params()

    def order(self, view: KVView, tier: str) -> Iterable[str | int]:
        """Eviction order for ``tier`` (see the module docstring)."""
        return view.lru_blocks(tier)

    def tick(self, view: KVView) -> tuple[Action, ...]:
        """Proactive actions (none by default)."""
        return ()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


def _later(rank: Callable[[], list[str]]) -> Iterator[str]:
    """The sessions ``rank()`` lists, ranked only when the first is asked for: an order's
    consumer (a simulator, the KV manager) often takes all it needs from the stale blocks
    before it, and ranking every session holding the tier costs more than the rest."""
    yield from rank()


def _holding(view: KVView, tier: str) -> list[SessionView]:
    """Sessions with blocks in ``tier``."""
    return [s for s in view.sessions.values() if getattr(s, tier) > 0]


def _drop_finished(view: KVView) -> list[Action]:
    """Nalar's rule: a finished session's KV goes at once."""
    return [Drop(s.id) for s in view.sessions.values() if s.state == FINISHED]


def _paused_holding(view: KVView) -> list[SessionView]:
    """Paused sessions that hold blocks in some tier (the others have nothing to decide about)."""
    return [s for s in view.sessions.values() if s.state == PAUSED and (s.accelerator or s.host or s.disk)]


def _drop_finished_then_paused(view: KVView) -> tuple[list[Action], list[SessionView] | None]:
    """Drops of finished sessions, and the paused sessions holding blocks, or None without a
    lower tier (then there is nothing to offload or prefetch): how Nalar's and our ticks start."""
    return _drop_finished(view), (_paused_holding(view) if view.offload_tier is not None else None)


def _trim(view: KVView, order: Iterable[SessionView], target: float) -> list[Action]:
    """Down to ``target`` accelerator blocks: stale blocks first, then ``order``'s sessions."""
    if view.used["accelerator"] <= target:
        return []
    return [Trim(math.floor(target), tuple(s.id for s in order if s.state != RUNNING))]


def _prefetch_into_room(view: KVView, wanted: list[SessionView], limit: float) -> list[Action]:
    """Prefetch ``wanted`` (in order) while accelerator use stays at most ``limit`` blocks."""
    used = view.used["accelerator"]
    out: list[Action] = []
    for s in wanted:
        if used + s.restorable > limit:
            continue
        out.append(Prefetch(s.id))
        used += s.restorable
    return out


class LRU(Policy):
    """vLLM's prefix cache: least recently used block first; nothing proactive."""

    name = "lru"


class WALRU(Policy):
    """SAGA's workflow-aware LRU with tool-aware TTL, thresholds and speculative prefetch."""

    name = "wa_lru"
    ticks = True

    def ttl(self, view: KVView, s: SessionView) -> float:
        """Protection of a paused session: min(P95 of what it waits on, ttl-max)."""
        return min(view.graph.latency(s.wait_key).quantile(0.95), self.params.ttl_max)

    def expired(self, view: KVView, s: SessionView) -> bool:
        """Finished, or paused past its TTL."""
        return s.state == FINISHED or (s.state == PAUSED and view.elapsed(s) > self.ttl(view, s))

    def scores(self, view: KVView, sessions: list[SessionView],
               among: list[SessionView] | None = None) -> dict[str, float]:
        """SAGA's score per session (higher: evict sooner); age and size are normalized over
        ``among`` (default: ``sessions`` themselves)."""
        p = self.params
        among = sessions if among is None else among
        max_age = max((view.now - s.last_access for s in among), default=0.0) or 1.0
        max_size = max((s.accelerator for s in among), default=0) or 1
        reuse: dict[str, float] = {}  # per node: one estimate per pass, not one per session
        out = {}
        for s in sessions:
            if s.state == FINISHED:
                r = 0.0
            else:
                r = reuse.get(s.node)
                if r is None:
                    r = reuse[s.node] = view.graph.reuse_probability(s.node)
            out[s.id] = p.alpha * (view.now - s.last_access) / max_age + p.beta * (1 - r) + p.gamma * s.accelerator / max_size
        return out

    def _ranked(self, view: KVView, tier: str, expired_only: bool = False) -> tuple[list[SessionView], set[str]]:
        """Idle sessions holding ``tier`` (expired first, each group by score), then running ones;
        and the ids of the expired ones. ``expired_only``: the expired ones alone (scored as
        among every idle one), what a trim down to the low threshold takes."""
        held = _holding(view, tier)
        idle = [s for s in held if s.state != RUNNING]
        ttl: dict[str, float] = {}  # per wait key: one quantile per pass, not one per session
        gone: set[str] = set()  # finished, or paused past its TTL (:meth:`expired`, inlined)
        now = view.now
        for s in idle:
            if s.state == FINISHED:
                gone.add(s.id)
            elif s.state == PAUSED:
                t = ttl.get(s.wait_key)
                if t is None:
                    t = ttl[s.wait_key] = self.ttl(view, s)
                if (now - s.paused_since if s.paused_since is not None else 0.0) > t:
                    gone.add(s.id)
        if expired_only:
            expired = [s for s in idle if s.id in gone]
            score = self.scores(view, expired, idle)
            return sorted(expired, key=lambda s: -score[s.id]), gone
        score = self.scores(view, idle)
        expired = sorted((s for s in idle if s.id in gone), key=lambda s: -score[s.id])
        kept = sorted((s for s in idle if s.id not in gone), key=lambda s: -score[s.id])
        running = sorted((s for s in held if s.state == RUNNING), key=lambda s: s.last_access)
        return expired + kept + running, gone

    def order(self, view: KVView, tier: str) -> Iterable[str | int]:
        """Stale blocks, then expired sessions by score, then protected ones by score, then running ones."""
        return itertools.chain(view.stale_blocks(tier), _later(lambda: [s.id for s in self._ranked(view, tier)[0]]))

    def tick(self, view: KVView) -> tuple[Action, ...]:
        """Threshold evictions and speculative prefetch."""
        p = self.params
        cap = view.capacity["accelerator"]
        used = view.used["accelerator"]
        out: list[Action] = []
        if used > p.theta_high * cap:
            out = _trim(view, self._ranked(view, "accelerator")[0], p.theta_high * cap)
        elif used > p.theta_low * cap:  # (below both thresholds nothing is ranked)
            out = _trim(view, self._ranked(view, "accelerator", expired_only=True)[0], p.theta_low * cap)
        if view.offload_tier is not None:
            soon = [s for s in view.sessions.values() if s.state == PAUSED and s.restorable
                    and view.graph.latency(s.wait_key).resume_within(
                        view.elapsed(s), view.move_s(s.restorable) + p.prefetch_margin) >= p.prefetch_probability]
            out += _prefetch_into_room(view, soon, p.theta_high * cap)
        return tuple(out)


class Nalar(Policy):
    """Nalar's workflow-aware KV management (Alg. 3)."""

    name = "nalar"
    ticks = True

    @staticmethod
    def idle(view: KVView, s: SessionView, memo: dict | None = None) -> float:
        """Predicted time until the session is runnable again (inf once finished). ``memo``:
        a dict shared by one pass's calls (one mean per wait key, not one per session)."""
        if s.state == FINISHED:
            return math.inf
        if s.state == RUNNING:
            return 0.0
        if memo is None:
            return max(0.0, view.graph.latency(s.wait_key).mean() - view.elapsed(s))
        mean = memo.get(s.wait_key)
        if mean is None:
            mean = memo[s.wait_key] = view.graph.latency(s.wait_key).mean()
        return max(0.0, mean - view.elapsed(s))

    def order(self, view: KVView, tier: str) -> Iterable[str | int]:
        """Stale blocks, then the longest predicted idle first; running sessions last."""
        def ranked() -> list[str]:
            held = _holding(view, tier)
            memo: dict = {}
            idle = {s.id: self.idle(view, s, memo) for s in held}
            return [s.id for s in sorted(held, key=lambda s: (s.state == RUNNING, -idle[s.id], s.last_access))]

        return itertools.chain(view.stale_blocks(tier), _later(ranked))

    def tick(self, view: KVView) -> tuple[Action, ...]:
        """Drop finished sessions; offload idle ones to restore the reserve; prefetch soon-runnable ones."""
        p = self.params
        out, paused = _drop_finished_then_paused(view)
        if paused is None:
            return tuple(out)
        cap = view.capacity["accelerator"]
        memo: dict = {}
        idle = {s.id: self.idle(view, s, memo) for s in paused}
        if view.used["accelerator"] > (1 - p.nalar_reserve) * cap:
            worth = [s for s in sorted(paused, key=lambda s: -idle[s.id])
                     if idle[s.id] > 2 * view.move_s(s.accelerator)]  # offload + restore
            out += _trim(view, worth, (1 - p.nalar_reserve) * cap)
        soon = sorted((s for s in paused
                       if s.restorable and idle[s.id] < view.move_s(s.restorable) + p.prefetch_margin),
                      key=lambda s: idle[s.id])
        out += _prefetch_into_room(view, soon, cap)
        return tuple(out)


class Ours(Policy):
    """Combined policy (see the module docstring)."""

    name = "ours"
    ticks = True
    # Offload ahead of demand only sessions expected to stay idle this many round trips (the
    # transfer is then <= 2% of the idle time). Measured on the generated traces with a host tier:
    # offloading whatever pays for one round trip (Nalar's rule) doubled the bytes offloaded and
    # raised restore stall from 56 s to 81 s, for no change in recomputed tokens.
    offload_idle_ratio = 50.0
    # A session paused longer than this quantile of the pauses seen to end at its wait key is
    # taken for gone (ranked with finished ones). Without an end signal (conversation traces,
    # a client that never closes its session) nothing else separates sessions that return
    # from those that do not: the learned pauses are those of sessions that came back.
    gone_quantile = 0.99

    @classmethod
    def next_use(cls, view: KVView, s: SessionView, open_pauses: Mapping[str, list[float]] | None = None,
                 memo: dict | None = None) -> float:
        """Expected seconds until the session reads its KV again, over the probability that it
        does (inf: finished, or paused past every pause seen to end there but 1%).

        That probability is the workflow's reuse probability times, once pauses were seen to
        end at its wait key, the share of pauses that got as far as this one and then ended:
        pauses seen to end after ``elapsed`` against those open now past ``elapsed``
        (``open_pauses``: the elapsed times of the paused sessions per wait key, sorted). Without
        an end signal, sessions that never return pile up among the open ones, so the share
        falls where they sit; with one, it only ranks long waits below short ones.

        ``memo``: a dict shared by the calls of one pass over one view (what depends only on a
        node or a wait key is then estimated once per pass, not once per session)."""
        if s.state == FINISHED:
            return math.inf
        if memo is None:
            memo = {}
        node = s.node
        reuse = memo.get(("reuse", node))
        if reuse is None:
            reuse = memo[("reuse", node)] = max(view.graph.reuse_probability(node), 0.05)
        if s.state == RUNNING:
            # Its step is still running: at least the pause that follows it.
            out = memo.get(("running", node))
            if out is None:
                out = memo[("running", node)] = view.graph.expected_pause(node) / reuse
            return out
        got = memo.get(("wait", s.wait_key))
        if got is None:
            lat = view.graph.latency(s.wait_key)
            got = memo[("wait", s.wait_key)] = (lat, lat.quantile(cls.gone_quantile) if lat.empirical else None)
        lat, gone_after = got
        elapsed = view.elapsed(s)
        if gone_after is not None and elapsed > gone_after:
            return math.inf
        if open_pauses is not None:
            ended = lat.longer_than(elapsed)
            waiting = open_pauses.get(s.wait_key, ())
            still = len(waiting) - bisect.bisect_left(waiting, elapsed)
            if ended + still:
                reuse *= max(ended / (ended + still), 1e-3)
        return lat.residual(elapsed) / reuse

    @staticmethod
    def open_pauses(view: KVView) -> dict[str, list[float]]:
        """The elapsed times of the paused sessions, per wait key, sorted (for :meth:`next_use`)."""
        out: dict[str, list[float]] = {}
        for s in view.sessions.values():
            if s.state == PAUSED:
                out.setdefault(s.wait_key, []).append(view.elapsed(s))
        for xs in out.values():
            xs.sort()
        return out

    def order(self, view: KVView, tier: str) -> Iterable[str | int]:
        """Stale blocks, then the furthest expected next use first (finished sessions first of all)."""
        def ranked() -> list[str]:
            held = _holding(view, tier)
            pauses, memo = self.open_pauses(view), {}
            nxt = {s.id: self.next_use(view, s, pauses, memo) for s in held}
            return [s.id for s in sorted(held, key=lambda s: (-nxt[s.id], s.last_access))]

        return itertools.chain(view.stale_blocks(tier), _later(ranked))

    def tick(self, view: KVView) -> tuple[Action, ...]:
        """Drop finished sessions; with a lower tier, keep headroom and prefetch before the resume."""
        p = self.params
        out, paused = _drop_finished_then_paused(view)
        if paused is None:
            return tuple(out)
        cap = view.capacity["accelerator"]
        pauses, memo = self.open_pauses(view), {}
        nxt = {s.id: self.next_use(view, s, pauses, memo) for s in paused}
        used = view.used["accelerator"]
        if used > p.theta_high * cap:
            worth = [s for s in sorted(paused, key=lambda s: -nxt[s.id])
                     if nxt[s.id] > self.offload_idle_ratio * view.move_s(s.accelerator)]
            out += _trim(view, worth, p.theta_high * cap)  # (prefetch below counts the use before it)
        # Prefetch sessions about to resume, soonest first; room comes from free space, then from
        # paused sessions expected back later than the one prefetched (tail blocks first).
        soon = []
        for s in paused:
            if not s.restorable:
                continue
            lead = view.move_s(s.restorable) + p.prefetch_margin
            m = view.graph.latency(s.wait_key)
            e = view.elapsed(s)
            if m.resume_within(e, lead) >= p.prefetch_probability or m.residual(e) < lead:
                soon.append(s)
        soon.sort(key=lambda s: nxt[s.id])
        out += swap_in(view, soon, paused, nxt, used)
        return tuple(out)


def swap_in(view: KVView, soon: list[SessionView], paused: list[SessionView], nxt: dict[str, float],
            used: float) -> list[Action]:
    """Prefetch ``soon`` (in order) into free accelerator room, else into room made by evicting
    paused sessions expected back later (``nxt``: expected next use per paused session), as far
    as the lower tier has room for what they give up (a swap must not discard anything)."""
    cap = view.capacity["accelerator"]
    below = view.offload_tier
    spare = view.free(below.name) if below is not None else 0
    donors = sorted((s for s in paused if s.accelerator > s.in_flight), key=lambda s: -nxt[s.id])
    out: list[Action] = []
    for s in soon:
        short = used + s.restorable - cap
        freed: list[Evict] = []
        for d in donors:
            if short <= 0 or nxt[d.id] <= nxt[s.id] or spare <= 0:
                break
            k = min(d.accelerator - d.in_flight, short, spare)
            freed.append(Evict(d.id, k))
            short -= k
            spare -= k
        if short > 0:
            spare += sum(e.blocks or 0 for e in freed)
            continue
        out += freed
        used += s.restorable - sum(e.blocks or 0 for e in freed)
        donors = [d for d in donors if d.id not in {e.session for e in freed}]
        out.append(Prefetch(s.id))
    return out


POLICIES: dict[str, Callable[..., Policy]] = {"lru": LRU, "wa_lru": WALRU, "nalar": Nalar, "ours": Ours}
"""Online policies by name."""


def get_policy(name: str, params: Params | None = None, **kwargs: Any) -> Policy:
    """The policy called ``name`` (``agents.kv.*`` parameters unless ``params``); ValueError naming
    the known ones otherwise."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown KV policy {name!r} (known: {', '.join(POLICIES)})") from None
    return cls(params if params is not None else Params.from_config(), **kwargs)
