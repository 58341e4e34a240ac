"""The offline optimum the online policies are measured against (used only to measure regret).

Definitions
-----------
*Block-access sequence*: every step's full prompt blocks in chain order, steps by arrival
(:meth:`dask_agents.kv.offline.traces.Trace.accesses`), the same for every policy because replay is open loop.

*Miss-count metric, uniform blocks*: a cache of ``k`` equal blocks; a request for a block not
in it is a miss, after which the block may be kept (evicting another if full) or not. Bélády's
MIN (keep the blocks whose next uses are soonest: evict, or bypass, the one whose next use is
furthest) minimizes misses for every sequence and every ``k`` against any policy, including
ones that evict early or must keep what they read (Bélády 1966; Mattson et al. 1970; the
tests check it against exhaustive search). :func:`belady` computes it exactly.

*Prefix chains and pins*: a prefix cache can only reuse a block when its whole prefix is
reusable, so a step recomputes every block after its first missing one, even cached ones; and
a running step keeps its prompt pinned on the accelerator until it ends. Every block a policy
recomputes is either missing from the union of its tiers or follows a missing one, so each
policy's recomputed blocks >= its own misses on the flat sequence, where its union of tiers is
one cache of their total capacity that a block only enters by being computed (on a miss).
That cache also holds every running step's blocks while it runs when the accelerator can hold
all running prompts at once (``trace.peak_running()`` blocks; below that, some steps cannot
keep their prompt and the simulator recomputes them). Hence :func:`lower_bound` is
:func:`belady_pinned` (MIN that must keep running steps' blocks) in that case, else plain
:func:`belady` (no pins): the fewest misses of *any* schedule of a cache of all tiers'
capacity under a subset of the simulator's rules, a true *lower bound* on the recomputed
blocks of every policy for any tiers, bandwidths or prefix rule. It can be below what a
prefix-respecting schedule achieves (MIN may keep a child while evicting its parent), so
ratios against it overstate regret, never understate it.

*Recompute cost*: the simulator caches full blocks only (as vLLM does); every full block costs
``block_size`` tokens to recompute, and the tail of each prompt past its last full block is
recomputed by every policy. Recomputed prefill tokens = ``block_size`` x recomputed blocks +
tails, so the bound in tokens is ``block_size`` x Bélády's misses + tails, exact for the flat
relaxation because all cached blocks weigh the same.

*Cost-aware variant* (:class:`Offline`): a prefix-chain-aware offline *schedule* run inside the
simulator under the same rules as the online policies (pins, prefix rule, tiers, links). It
knows every block's next read (by arrival order, so steps that tie in time stay ordered) and
evicts the block read furthest in the future first, never-read-again ones first of all and, at
equal times, a chain's tail before its head: a lost block costs its own recompute *and* that of
every block after it, so the tail is the cheapest loss. It prefetches a session's blocks just
before the step that reads them, making room from sessions needed later. It is a heuristic:
feasible, hence an *upper* bound on the best schedule under the simulator's rules, and the true
constrained optimum lies between :func:`lower_bound` and it. Where the two meet, the bound is
exactly the optimum: in ``benchmarks/kv_policies.py`` they are equal at every accelerator size on
all three trace families. With an accelerator smaller than the running steps' pins it can be
beaten (it does not foresee that a kept block cannot be brought back while everything is
pinned); the tests check that no online policy beats it once the running steps fit. Summaries
report ratios against :func:`lower_bound`.
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass
from typing import Iterator, Sequence

from dask_agents.kv.runtime.blocks import CostModel, Tiers
from dask_agents.kv.runtime.policies import Params, Policy, swap_in
from dask_agents.kv.offline.traces import Trace
from dask_agents.kv.runtime.view import FINISHED, PAUSED, Action, KVView, SessionView

_NEVER = math.inf


@dataclass(frozen=True)
class OptimalResult:
    """Bélády's MIN on a block-access sequence with ``capacity`` blocks."""

    capacity: int
    accesses: int
    misses: int
    compulsory: int  # distinct blocks: misses no cache size avoids

    @property
    def hits(self) -> int:
        """Accesses that found their block."""
        return self.accesses - self.misses


def belady(accesses: Sequence[int], capacity: int) -> OptimalResult:
    """Exact MIN: fewest misses of any cache of ``capacity`` equal blocks on ``accesses``."""
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    n = len(accesses)
    nxt = [0.0] * n
    last: dict[int, float] = {}
    for i in range(n - 1, -1, -1):
        b = accesses[i]
        nxt[i] = last.get(b, _NEVER)
        last[b] = i
    cache: dict[int, float] = {}  # block -> its next use
    heap: list[tuple[float, int]] = []  # (-next use, block); stale entries skipped
    misses = 0
    for i, b in enumerate(accesses):
        nu = nxt[i]
        if b in cache:
            cache[b] = nu
            heapq.heappush(heap, (-nu, b))
            continue
        misses += 1
        if capacity == 0 or nu == _NEVER:
            continue  # never used again: keeping it cannot help (MIN would evict it first)
        if len(cache) >= capacity:
            while True:
                neg, v = heapq.heappop(heap)
                if cache.get(v) == -neg:
                    break
            if -neg <= nu:
                # Every cached block is needed before this one: bypass it (same miss count as
                # bringing it in and evicting it first at the next miss).
                heapq.heappush(heap, (neg, v))
                continue
            del cache[v]
        cache[b] = nu
        heapq.heappush(heap, (-nu, b))
    return OptimalResult(capacity, n, misses, len(last))


def belady_pinned(trace: Trace, capacity: int) -> OptimalResult:
    """Exact MIN when running steps pin their prompts: fewest misses of any cache of ``capacity``
    equal blocks that holds every running step's blocks from its arrival to its end (events in
    the simulator's order, :meth:`dask_agents.kv.offline.traces.Trace.timeline`). ValueError if the running steps
    alone ever need more than ``capacity`` blocks.

    Between two pinned periods of a block lies a *gap*; keeping the block through the gap saves
    the miss at its end. The kept gaps covering a moment may use ``capacity`` minus the blocks
    pinned then. Choosing the most gaps under that (time-varying) capacity is solved by a left
    to right sweep that, whenever the kept gaps exceed the room, drops the one that ends
    furthest in the future: an exchange argument (any solution drops one of the gaps covering
    that moment; the one reaching furthest covers a superset of the others' future) shows it is
    optimal, as for MIN, and the tests check it against exhaustive search."""
    steps = trace.steps
    events = trace.timeline()
    # Accesses are ordered by their place in the timeline, not by timestamp: steps arriving at
    # the same time are still served one after another, and with timestamps as keys two gaps
    # ending at one instant tie, so the sweep could drop the one needed first (overcounting).
    times: dict[int, list[int]] = {}
    for pos, (_, arrival, i) in enumerate(events):
        if arrival:
            for b in steps[i].blocks:
                times.setdefault(b, []).append(pos)
    ptr = dict.fromkeys(times, 0)  # index of each block's next access
    pins: dict[int, int] = {}
    kept: dict[int, int] = {}  # block -> end of its kept gap (its next access's place)
    heap: list[tuple[int, int]] = []
    misses = accesses = 0

    def fit() -> None:
        room = capacity - len(pins)
        if room < 0:
            raise ValueError(f"running steps pin {len(pins)} blocks, more than the capacity {capacity}")
        while len(kept) > room:
            neg, b = heapq.heappop(heap)
            if kept.get(b) == -neg:
                del kept[b]

    for _, arrival, i in events:
        blocks = steps[i].blocks
        if arrival:
            for b in blocks:
                accesses += 1
                ptr[b] += 1
                if b not in pins and kept.pop(b, None) is None:
                    misses += 1
                pins[b] = pins.get(b, 0) + 1
        else:
            for b in blocks:
                n = pins[b] - 1
                if n:
                    pins[b] = n
                    continue
                del pins[b]
                k = ptr[b]
                if k < len(times[b]):  # a gap until its next access
                    kept[b] = times[b][k]
                    heapq.heappush(heap, (-times[b][k], b))
        fit()
    return OptimalResult(capacity, accesses, misses, len(times))


@dataclass(frozen=True)
class Bound:
    """The lower bound on recomputed prefill tokens for one trace and tier configuration."""

    capacity_blocks: int
    recomputed_tokens: int
    prompt_tokens: int
    misses: int
    compulsory_tokens: int  # recomputed even with unlimited memory (first uses and tails)
    kind: str = "flat"      # "pinned" (belady_pinned) or "flat" (belady)

    @property
    def hit_rate(self) -> float:
        """Token-weighted hit rate of the optimum."""
        return 1 - self.recomputed_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def lower_bound(trace: Trace, tiers: Tiers, cost: CostModel) -> Bound:
    """The optimum in recomputed tokens with all tiers' blocks as one cache (module docstring):
    :func:`belady_pinned` when the accelerator holds every running step's prompt at once (then
    the simulator pins exactly those blocks), else :func:`belady` (no pins)."""
    capacity = sum(cost.blocks_in(t) for t in tiers)
    pinned = cost.blocks_in(tiers.accelerator) >= trace.peak_running()
    r = belady_pinned(trace, capacity) if pinned else belady(trace.accesses(), capacity)
    tails = trace.tail_tokens()
    bs = trace.block_size
    return Bound(capacity, r.misses * bs + tails, trace.prompt_tokens(), r.misses, r.compulsory * bs + tails,
                 "pinned" if pinned else "flat")


class Offline(Policy):
    """The cost-aware offline schedule (a heuristic upper bound on the constrained optimum; see
    the module docstring). Built from the trace it replays: it reads the future."""

    name = "offline"
    ticks = True

    def __init__(self, trace: Trace, params: Params | None = None):
        super().__init__(params)
        # Futures by arrival ordinal (the position in the simulator's order: ties in time are
        # still ordered), and arrival times for prefetch timing.
        self._arrivals: dict[str, list[int]] = {}
        self._uses: dict[int, list[int]] = {}
        self._depths: dict[int, list[int]] = {}  # block -> its position in each read (beside _uses)
        self._at: list[float] = []
        for _, arrival, i in trace.timeline():
            if arrival:
                k = len(self._at)
                step = trace.steps[i]
                self._at.append(step.at)
                self._arrivals.setdefault(step.session, []).append(k)
                for depth, b in enumerate(step.blocks):
                    self._uses.setdefault(b, []).append(k)
                    self._depths.setdefault(b, []).append(depth)

    @staticmethod
    def _next(ordinals: list[int], view: KVView) -> float:
        i = bisect.bisect_left(ordinals, view.arrivals)  # ordinals >= arrivals are still to come
        return ordinals[i] if i < len(ordinals) else _NEVER

    def next_use(self, view: KVView, block: int) -> float:
        """Arrival ordinal of the next step that reads ``block`` (inf if none)."""
        return self._next(self._uses.get(block, []), view)

    def next_depth(self, view: KVView, block: int) -> int:
        """``block``'s position in the next step that reads it (0 if none): at equal next reads
        the deeper block goes first, since a miss recomputes every block after it."""
        uses = self._uses.get(block, [])
        i = bisect.bisect_left(uses, view.arrivals)
        return self._depths[block][i] if i < len(uses) else 0

    def next_step(self, view: KVView, sid: str) -> float:
        """Arrival ordinal of the session's next step (inf if none)."""
        return self._next(self._arrivals.get(sid, []), view)

    def next_at(self, view: KVView, sid: str) -> float:
        """When the session's next step arrives (inf if none)."""
        k = self.next_step(view, sid)
        return self._at[k] if k != _NEVER else _NEVER

    def order(self, view: KVView, tier: str) -> Iterator[int]:
        """Blocks by next read, furthest first (never-read-again ones first of all; a chain's tail
        before its head at equal times). Lazy: a k-way merge of the sessions' chains taken from
        the tail (with prefix-chained ids a block is never read before its parent, so each chain
        reversed is already in order) and of the blocks no live session holds."""
        # (-next read, -depth, seq, cursor, chain, its session: None for a stale block)
        heap: list[tuple[float, int, int, int, tuple[int, ...], SessionView | None]] = []
        seq = 0
        where, down = view.where, view.down

        def skip(s: SessionView, chain: tuple[int, ...], j: int) -> int:
            """The cursor (a position in ``chain``, moving to the head) past blocks not in
            ``tier`` (cheap; ranking them is not) and, where the view says so cheaply, those
            that may not leave it; -1 past the head."""
            if down is not None:
                return down(s.id, j, tier)
            if where is not None:
                while j >= 0 and where(chain[j]) != tier:
                    j -= 1
            return j

        for b in view.stale_blocks(tier):
            nu = self.next_use(view, b)
            if nu == _NEVER:
                yield b
            else:  # (its depth in the read that needs it: a stale block is no chain's head)
                heap.append((-nu, -self.next_depth(view, b), seq, 0, (b,), None))
                seq += 1
        for s in view.sessions.values():
            if s.state != FINISHED and s.blocks and getattr(s, tier) > 0:
                chain = s.blocks
                j = skip(s, chain, len(chain) - 1)
                if j >= 0:
                    heap.append((-self.next_use(view, chain[j]), -j, seq, j, chain, s))
                    seq += 1
        heapq.heapify(heap)
        while heap:
            _, _, n, j, chain, s = heapq.heappop(heap)
            yield chain[j]
            j = skip(s, chain, j - 1) if s is not None else -1
            if j >= 0:
                heapq.heappush(heap, (-self.next_use(view, chain[j]), -j, n, j, chain, s))

    def tick(self, view: KVView) -> tuple[Action, ...]:
        """Prefetch just in time, making room from sessions needed later. (No drops: a block a
        finished session leaves may still be read by another session; the order handles it.)"""
        out: list[Action] = []
        if view.offload_tier is None:
            return ()
        paused = [s for s in view.sessions.values() if s.state == PAUSED and (s.accelerator or s.host or s.disk)]
        nxt = {s.id: self.next_at(view, s.id) for s in paused}
        soon = []
        for s in sorted((s for s in paused if s.restorable), key=lambda s: nxt[s.id]):
            if nxt[s.id] - view.now > view.move_s(s.restorable) + self.params.prefetch_margin:
                break
            if self.next_use(view, s.blocks[0]) == self.next_step(view, s.id):  # its next step reads them
                soon.append(s)
        out += swap_in(view, soon, paused, nxt, view.used["accelerator"])
        return tuple(out)
