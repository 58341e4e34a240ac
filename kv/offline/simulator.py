"""Trace-driven KV simulator: replays a :class:`~dask_agents.kv.offline.traces.Trace` against tiers and a policy.

It is the enforcer of :mod:`dask_agents.kv.runtime.view`: it keeps where every block is, asks the policy for an
eviction order when a tier must make room and for proactive actions at every arrival, step end
and ``tick``, and applies them under the hard rules (capacities, pinned running steps, one tier
per block).

Time model (open loop). Steps arrive at the trace's times whatever the policy does, so every
policy and the offline optimum see the same block-access sequence; time spent waiting on a
restore is *reported* (``stall_s``) but does not delay later steps. A step reads its prompt at
arrival and keeps its blocks pinned on the accelerator until it ends (``at + duration``).

Serving a step (prefix semantics, as a prefix cache matches): the reusable prefix is the
longest run of leading blocks that are available in some tier (and for a lower tier, restoring
beats recomputing); everything after it is recomputed, even blocks still cached (a block is
useful only if its whole prefix is). Missing blocks need accelerator room; the policy's order
makes it. Evicted blocks go to the next lower tier, which makes room the same way (over its
old blocks and the newcomers alike), or are discarded when there is none. Restores queue on
their tier's link (one link per tier, ``bytes / bandwidth``); a demand eviction into a lower
tier must finish its copy-out before the room is reused, and both count as stall. Blocks that
cannot be placed even after evicting everything unpinned (running steps pin more than the
accelerator holds) are recomputed and not kept.

Simplifications: a copy to a lower tier frees its accelerator room at once for proactive
evictions (no clean copies kept in two tiers); decode-generated blocks are not cached (a
step's output reaches the cache as part of the next prompt); the AEG is learned online from
the replay itself, starting empty.

Metrics (token-weighted): ``hit_rate`` = reused prompt tokens (from any tier) / prompt tokens;
``recomputed_tokens`` = prompt tokens prefilled again, including each prompt's tail past its last
full block (never cached); bytes offloaded (accelerator -> lower tier), prefetched (proactive
restores) and restored on demand; total stall; peak accelerator bytes.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from types import MappingProxyType
from typing import Iterator

from dask_agents.kv.runtime.aeg import AgentGraph
from dask_agents.kv.runtime.blocks import TIER_NAMES, CostModel, Tiers, common_prefix
from dask_agents.kv.runtime.policies import Policy
from dask_agents.kv.offline.traces import Trace
from dask_agents.kv.runtime.view import FINISHED, PAUSED, RUNNING, Drop, Evict, KVView, Prefetch, SessionView, Trim

ACC = 0
_TIER = {name: i for i, name in enumerate(TIER_NAMES)}


@dataclass(frozen=True)
class SimResult:
    """What one replay measured (tokens, bytes, seconds)."""

    policy: str
    trace: str
    tiers: str
    accelerator_blocks: int
    total_blocks: int
    steps: int
    prompt_tokens: int
    recomputed_tokens: int
    hit_tokens: int
    accelerator_hit_tokens: int
    bytes_offloaded: int
    bytes_prefetched: int
    bytes_restored: int
    stall_s: float
    peak_accelerator_bytes: int
    discarded_blocks: int
    wall_s: float

    @property
    def hit_rate(self) -> float:
        """Reused prompt tokens / prompt tokens."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self) -> dict:
        """Plain fields plus ``hit_rate``."""
        from dataclasses import asdict

        return {**asdict(self), "hit_rate": self.hit_rate}


class _Session:
    __slots__ = ("id", "state", "node", "key", "last_access", "paused_since", "chain", "pinned", "pos", "hi")

    def __init__(self, sid: str):
        self.id = sid
        self.state = RUNNING
        self.node = ""
        self.key = ""
        self.last_access = 0.0
        self.paused_since: float | None = None
        self.chain: tuple[int, ...] = ()  # its latest prompt's blocks (a finished session: its last)
        self.pinned: tuple[int, ...] = ()  # what its running step pins
        self.pos: dict[int, int] = {}  # block -> its (last) position in ``chain``
        # per tier: 1 + the position of its last block in the tier (0: none), kept as blocks
        # move (Simulator._move): walks from the tail start there, so an evicted tail is not
        # walked again at every eviction
        self.hi = [0, 0, 0]


class Simulator:
    """One replay of ``trace`` on ``tiers`` with ``policy`` (see the module docstring).

    Ownership: a session *holds* the blocks of its latest prompt (a finished one, of its last)
    until it is dropped or forgotten; a block no live (unfinished) session holds is *stale*.
    A session's blocks are walked tail first; a block several sessions hold is only taken when
    every live holder has come up in the policy's order."""

    def __init__(self, trace: Trace, tiers: Tiers, policy: Policy, cost: CostModel, tick: float = 0.25,
                 min_samples: int = 20):
        if cost.block_size != trace.block_size:
            raise ValueError(f"cost model block size {cost.block_size} != trace block size {trace.block_size}")
        self.trace, self.tiers, self.policy, self.cost, self.tick_s = trace, tiers, policy, cost, tick
        self.graph = AgentGraph(min_samples)
        self._tiers = list(tiers)
        self.cap = [cost.blocks_in(t) for t in self._tiers]
        self.lower = [i for i in (1, 2) if self.cap[i] > 0]
        self.loc: dict[int, int] = {}
        self.lru: list[OrderedDict[int, None]] = [OrderedDict() for _ in TIER_NAMES]
        self.holders: dict[int, set[str]] = {}
        self.live: dict[int, int] = {}  # block -> live sessions holding it
        self.ready: dict[int, float] = {}  # in-flight prefetches: block -> when it lands
        self.pins: dict[int, int] = {}
        self.busy = [0.0, 0.0, 0.0]  # each tier's link is busy until
        self.sessions: dict[str, _Session] = {}
        self.views: dict[str, SessionView] = {}
        self.dirty: set[str] = set()
        self.m = dict.fromkeys(("prompt", "recomputed", "hit", "acc_hit", "offloaded", "prefetched",
                                "restored", "discarded", "peak"), 0)
        self.stall = 0.0
        self._keep: frozenset[int] = frozenset()
        # Bumped by every change a Trim's outcome depends on (a block's place, pins, ownership):
        # a Trim that freed nothing is a no-op until it moves (WA-LRU repeats one every tick).
        self._epoch = 0
        self._idle_trim: tuple | None = None
        self._leaving = [0, 0, 0]
        self.arrivals = 0
        self.restorable = [t for t in (1, 2) if cost.restore_wins(self._tiers[t])]
        # Whether the trace is prefix-closed (Trace.prefix_closed: a block always follows the
        # same parent). Then whoever holds a block holds every block before it, so a walk from a
        # chain's tail may stop at the first block another live session still needs (every
        # block before it is needed too), and an order may leave out blocks that cannot move.
        self.prefix_closed = trace.prefix_closed()

    # -- state helpers ---------------------------------------------------------------------

    def _move(self, b: int, dst: int | None) -> None:
        """Move block ``b`` to tier ``dst`` (None: discard it)."""
        self._epoch += 1
        src = self.loc.get(b)
        if src is not None:
            del self.lru[src][b]
        self.ready.pop(b, None)
        holders = self.holders.get(b, ())
        self.dirty.update(holders)
        loc = self.loc
        if dst is None:
            if loc.pop(b, None) is not None:
                self.m["discarded"] += 1
        else:
            loc[b] = dst
            self.lru[dst][b] = None
            if dst == ACC and len(self.lru[ACC]) > self.m["peak"]:
                self.m["peak"] = len(self.lru[ACC])
        if src == dst:
            return
        sessions = self.sessions
        for h in holders:  # keep each holder's hi tight: raised past b, lowered below its top
            s = sessions.get(h)
            if s is None:
                continue
            p = s.pos.get(b)
            if p is None:
                continue
            hi = s.hi
            if dst is not None and hi[dst] <= p:
                hi[dst] = p + 1
            if src is not None and hi[src] == p + 1:
                chain, j = s.chain, p - 1
                while j >= 0 and loc.get(chain[j]) != src:
                    j -= 1
                hi[src] = j + 1

    def _hold(self, s: _Session, chain: tuple[int, ...]) -> None:
        """Make ``chain`` the live session's latest prompt (releasing the previous one)."""
        self._release(s)
        holders, live = self.holders, self.live
        for b in chain:
            holders.setdefault(b, set()).add(s.id)
            live[b] = live.get(b, 0) + 1
        s.chain = chain
        s.pos = pos = {}
        s.hi = hi = [0, 0, 0]
        loc = self.loc
        for i, b in enumerate(chain):
            pos[b] = i
            t = loc.get(b)
            if t is not None:
                hi[t] = i + 1

    def _release(self, s: _Session, forget: bool = True) -> None:
        """The session stops being live for its chain's blocks (and holding them, if ``forget``)."""
        live_session = s.state != FINISHED
        holders, live = self.holders, self.live
        for b in s.chain:
            if live_session:
                n = live[b] - 1
                if n:
                    live[b] = n
                else:
                    del live[b]
            if forget:
                h = holders[b]
                h.discard(s.id)
                if not h:
                    del holders[b]
        if forget:
            s.chain = ()
            s.pos = {}
            s.hi = [0, 0, 0]

    def _where(self, b: int) -> str | None:
        """The tier block ``b`` is in (None: not cached)."""
        t = self.loc.get(b)
        return None if t is None else TIER_NAMES[t]

    def _down(self, sid: str, j: int, tier: str) -> int:
        """``KVView.down``: from position ``j`` of the session's chain to its head, the first
        block in ``tier`` that may leave it now (not pinned, not read by the arriving step); -1
        if none. Exact only for an order that keeps its merge when blocks are left out: on
        prefix-closed traces (the view offers it only then)."""
        s = self.sessions.get(sid)
        if s is None:
            return -1
        t = _TIER[tier]
        if t == ACC and s.state == RUNNING:
            v = self.views.get(sid)
            if v is not None and len(s.pinned) >= v.accelerator:
                return -1  # its step pins all of it that is on the accelerator
        chain, loc, pins, keep = s.chain, self.loc, self.pins, self._keep
        j = min(j, s.hi[t] - 1)  # (nothing past hi is in the tier)
        while j >= 0:
            b = chain[j]
            if loc.get(b) == t and b not in pins and b not in keep:
                return j
            j -= 1
        return -1

    def _stale(self, tier: int) -> Iterator[int]:
        """Blocks of ``tier`` no live session holds, least recently used first."""
        live = self.live
        return (b for b in self.lru[tier] if b not in live)

    def _free_to_take(self, b: int, processed: set[str]) -> bool:
        """Whether every live holder of ``b`` came up in the order already."""
        sessions = self.sessions
        return all(h in processed or sessions[h].state == FINISHED for h in self.holders.get(b, ()))

    def _transfer(self, tier: int, blocks: int, now: float) -> float:
        """Queue ``blocks`` on ``tier``'s link; when they are through."""
        start = max(now, self.busy[tier])
        self.busy[tier] = start + self.cost.transfer_s(blocks, self._tiers[tier])
        return self.busy[tier]

    def _demote(self, victims: list[int], src: int, now: float) -> float:
        """Move ``victims`` (least valuable first) out of tier ``src``: into the next lower tier,
        which then makes room by the policy's order over its old blocks and these alike, or away
        when there is none. Returns when the copy-out is through (``now`` if nothing was copied)."""
        below = [t for t in self.lower if t > src]
        if not below or not victims:
            for b in victims:
                self._move(b, None)
            return now
        dst = below[0]
        for b in victims:
            self._move(b, dst)
        # Blocks the arriving step restores from dst are about to leave it: their room counts.
        over = len(self.lru[dst]) - self.cap[dst] - self._leaving[dst]
        if over > 0:
            self._make_room(dst, over, now)
            for b in victims:  # whatever the order could not take (protected blocks filled it)
                if len(self.lru[dst]) - self._leaving[dst] <= self.cap[dst]:
                    break
                if self.loc.get(b) == dst:
                    self._move(b, None)
        moved = sum(1 for b in victims if self.loc.get(b, -1) >= dst)
        if src == ACC:
            self.m["offloaded"] += moved
        return self._transfer(dst, moved, now) if moved else now

    def _make_room(self, tier: int, k: int, now: float) -> float:
        """Free ``k`` blocks of ``tier`` in the policy's order (LRU once the order runs out),
        never pinned blocks nor those the arriving step reads. Returns when any copy-out is through."""
        if k <= 0:
            return now
        victims: list[int] = []
        taken: set[int] = set()
        processed: set[str] = set()
        loc, pins, keep = self.loc, self.pins, self._keep

        def ok(b: int) -> bool:
            return loc.get(b) == tier and b not in pins and b not in taken and b not in keep

        name = TIER_NAMES[tier]
        closed = self.prefix_closed
        view = self._view(now)
        for item in self.policy.order(view, name):
            if isinstance(item, str):
                s = self.sessions.get(item)
                if s is None:
                    continue
                processed.add(item)
                # The view's count of the session's blocks in the tier (fresh: nothing moves
                # until the victims are chosen) ends the walk at the last of them.
                v = view.sessions.get(item)
                left = getattr(v, name) if v is not None else len(s.chain)
                if tier == ACC and s.state == RUNNING and len(s.pinned) >= left:
                    continue  # its step pins every block of it on the accelerator: nothing to take
                chain = s.chain
                i = s.hi[tier] - 1  # (its top block in the tier)
                while i >= 0 and left > 0:
                    b = chain[i]
                    i -= 1
                    if loc.get(b) != tier:
                        continue
                    left -= 1
                    if b in keep:  # the arriving step reads it (and, prefix-closed, all before it)
                        if closed:
                            break
                        continue
                    if b in pins or b in taken:
                        continue
                    if not self._free_to_take(b, processed):
                        if closed:
                            break  # a live session after this one needs it, and all before it
                        continue
                    victims.append(b)
                    taken.add(b)
                    if len(victims) >= k:
                        break
            elif ok(item):
                victims.append(item)
                taken.add(item)
            if len(victims) >= k:
                break
        if len(victims) < k:
            for b in self.lru[tier]:
                if ok(b):
                    victims.append(b)
                    taken.add(b)
                    if len(victims) >= k:
                        break
        return self._demote(victims, tier, now)

    def _view(self, now: float) -> KVView:
        loc, ready, live = self.loc, self.ready, self.live
        for sid in self.dirty:
            s = self.sessions.get(sid)
            if s is None:
                self.views.pop(sid, None)
                continue
            counts = [0, 0, 0]
            in_flight = own = 0
            for b in s.chain:
                t = loc.get(b)
                if t is not None:
                    counts[t] += 1
                    if b not in live:
                        own += 1
                    if b in ready:
                        in_flight += 1
            # A finished session whose cached blocks are all held by live sessions too (a shared
            # system prompt) has nothing left for a policy to decide: forget it, or every finished
            # session under a prompt that never leaves the cache stays in the view for good.
            if s.state == FINISHED and not own:
                self._release(s)  # nothing left to decide about
                del self.sessions[sid]
                self.views.pop(sid, None)
                continue
            self.views[sid] = SessionView(sid, s.state, s.node, s.key, s.last_access, s.paused_since, len(s.chain),
                                          counts[0], counts[1], counts[2], counts[1] + counts[2], in_flight,
                                          s.chain)
        self.dirty.clear()
        return KVView(now, self.tiers, self.cost,
                      {name: self.cap[i] for i, name in enumerate(TIER_NAMES)},
                      {name: len(self.lru[i]) for i, name in enumerate(TIER_NAMES)},
                      MappingProxyType(self.views), self.graph.view(), self.arrivals,
                      lambda tier: iter(self.lru[TIER_NAMES.index(tier)]),
                      lambda tier: self._stale(TIER_NAMES.index(tier)), self._where,
                      # (an order that leaves blocks out keeps its merge only on prefix-closed chains)
                      self._down if self.prefix_closed else None)

    # -- events ------------------------------------------------------------------------------

    def _arrive(self, step, now: float) -> None:
        self._epoch += 1
        s = self.sessions.get(step.session)
        if s is None:
            s = self.sessions[step.session] = _Session(step.session)
        elif s.state == PAUSED:
            pause = now - s.paused_since
            self.graph.observe_pause(s.node, s.key, pause)
            overlap = common_prefix(s.chain, step.blocks) / len(s.chain) if s.chain else 1.0
            self.graph.observe_transition(s.node, step.node, overlap)
        self._hold(s, step.blocks)
        self.dirty.add(s.id)
        bs = self.cost.block_size
        chain = step.blocks
        loc, pins = self.loc, self.pins
        # The reusable prefix, and what it needs restored.
        hit = 0
        for b in chain:
            t = loc.get(b)
            if t is None or (t != ACC and t not in self.restorable):
                break
            hit += 1
        # Pin what is already on the accelerator; make room for the rest.
        missing = 0
        for b in chain:
            if loc.get(b) == ACC:
                pins[b] = pins.get(b, 0) + 1
            else:
                missing += 1
        done = now
        self._keep = frozenset(chain)  # room-making in lower tiers must not discard what this step restores
        for b in chain[:hit]:
            t = loc[b]
            if t != ACC:
                self._leaving[t] += 1
        short = missing - (self.cap[ACC] - len(self.lru[ACC]))
        if short > 0:
            done = self._make_room(ACC, short, now)
        self._keep = frozenset()
        self._leaving = [0, 0, 0]
        room = self.cap[ACC] - len(self.lru[ACC])
        restores = [0, 0, 0]
        placed_upto = len(chain)
        pinned = []
        for i, b in enumerate(chain):
            t = loc.get(b)
            if t == ACC:
                pinned.append(b)
                continue
            if room <= 0:
                placed_upto = min(placed_upto, i)
                continue  # no room: recomputed, not kept (a lower-tier copy stays)
            room -= 1
            if t is not None and i < hit:
                restores[t] += 1
            self._move(b, ACC)
            pins[b] = pins.get(b, 0) + 1
            pinned.append(b)
        hit = min(hit, placed_upto)
        for t in self.lower:  # restores that found no room stayed behind: back within capacity
            over = len(self.lru[t]) - self.cap[t]
            if over > 0:
                self._make_room(t, over, now)
        stall_until = done
        for t in (1, 2):
            if restores[t]:
                stall_until = max(stall_until, self._transfer(t, restores[t], now))
                self.m["restored"] += restores[t]
        acc_hit = 0
        ready = self.ready
        for b in chain[:hit]:
            r = ready.pop(b, None)
            if r is not None and r > now:
                stall_until = max(stall_until, r)  # a prefetch still in flight
            else:
                acc_hit += 1
        acc_hit -= sum(restores)  # prefix hits restored on demand are not accelerator hits
        self.stall += max(0.0, stall_until - now)
        prompt = len(chain) * bs + step.tail_tokens
        self.m["prompt"] += prompt
        self.m["hit"] += hit * bs
        self.m["acc_hit"] += max(0, acc_hit) * bs
        self.m["recomputed"] += prompt - hit * bs
        # Recency: the tail is older than the head, so LRU takes a chain from its end.
        lru = self.lru[ACC]
        for b in reversed(chain):
            if b in lru:
                lru.move_to_end(b)
        s.state, s.node, s.last_access, s.paused_since = RUNNING, step.node, now, None
        s.pinned = tuple(pinned)

    def _end(self, step, now: float) -> None:
        self._epoch += 1
        s = self.sessions[step.session]
        pins = self.pins
        for b in s.pinned:
            n = pins[b] - 1
            if n:
                pins[b] = n
            else:
                del pins[b]
        s.pinned = ()
        if step.last:
            self._release(s, forget=False)  # no longer live: what only it held is stale now
            s.state = FINISHED
            self.graph.observe_end(step.node)
        else:
            s.state, s.paused_since = PAUSED, now
            s.key = AgentGraph.key(step.node, step.tool)
        self.dirty.add(s.id)

    def _drop(self, s: _Session) -> None:
        self._epoch += 1
        chain = s.chain
        self._release(s)
        for b in chain:
            if b not in self.live and b not in self.pins:
                self._move(b, None)
        if s.state == FINISHED:
            del self.sessions[s.id]
        self.dirty.add(s.id)

    def _own_victims(self, s: _Session, want: float, victims: list[int], taken: set[int]) -> None:
        """Add the session's unpinned accelerator blocks no other live session holds, tail first."""
        mine = 0 if s.state == FINISHED else 1
        chain, loc, pins, live, closed = s.chain, self.loc, self.pins, self.live, self.prefix_closed
        i = s.hi[ACC] - 1  # (its top block on the accelerator)
        while i >= 0:
            if len(victims) >= want:
                return
            b = chain[i]
            i -= 1
            if loc.get(b) != ACC:
                continue
            if live.get(b, 0) > mine:
                if closed:
                    break  # another live session holds it, and every block before it
                continue
            if b not in pins and b not in taken:
                victims.append(b)
                taken.add(b)

    def _apply(self, actions, now: float) -> None:
        for a in actions:
            if isinstance(a, Trim):
                if self._idle_trim == (self._epoch, a):
                    continue  # the same Trim freed nothing and nothing changed since
                want = len(self.lru[ACC]) - a.target
                victims: list[int] = []
                taken: set[int] = set()
                for b in self._stale(ACC):
                    if len(victims) >= want:
                        break
                    if b not in self.pins:
                        victims.append(b)
                        taken.add(b)
                views, dirty = self.views, self.dirty
                for sid in a.sessions:
                    if len(victims) >= want:
                        break
                    v = views.get(sid)
                    if v is not None and not v.accelerator and sid not in dirty:
                        continue  # nothing of it on the accelerator (unchanged since the view)
                    s = self.sessions.get(sid)
                    if s is not None and s.state != RUNNING:
                        self._own_victims(s, want, victims, taken)
                self._idle_trim = None if victims else (self._epoch, a)
                self._demote(victims, ACC, now)
                continue
            s = self.sessions.get(a.session)
            if s is None or s.state == RUNNING:
                continue  # a running step's KV is in use
            if isinstance(a, Drop):
                self._drop(s)
            elif isinstance(a, Evict):
                victims = []
                self._own_victims(s, math.inf if a.blocks is None else a.blocks, victims, set())
                self._demote(victims, ACC, now)
            elif isinstance(a, Prefetch):
                room = self.cap[ACC] - len(self.lru[ACC])
                todo: dict[int, list[int]] = {}
                for b in s.chain:
                    t = self.loc.get(b)
                    if t is None:
                        break  # past a missing block nothing is useful
                    if t != ACC:
                        if room <= 0:
                            break
                        todo.setdefault(t, []).append(b)
                        room -= 1
                for t, blocks in todo.items():
                    land = self._transfer(t, len(blocks), now)
                    for b in blocks:
                        self._move(b, ACC)
                        self.ready[b] = land
                    self.m["prefetched"] += len(blocks)

    def run(self) -> SimResult:
        """Replay the whole trace; the measured :class:`SimResult`."""
        t_wall = time.perf_counter()
        steps = self.trace.steps
        ticks = self.policy.ticks
        next_tick = steps[0].at + self.tick_s if steps else math.inf
        for now, arrival, i in self.trace.timeline():
            if ticks:
                while next_tick < now:  # periodic looks between events
                    self._apply(self.policy.tick(self._view(next_tick)), next_tick)
                    next_tick += self.tick_s
            if arrival:
                self.arrivals += 1
                self._arrive(steps[i], now)
            else:
                self._end(steps[i], now)
            if ticks:
                self._apply(self.policy.tick(self._view(now)), now)
        bpb = self.cost.bytes_per_block
        m = self.m
        return SimResult(self.policy.name, self.trace.name, self.tiers.describe(), self.cap[ACC], sum(self.cap),
                         len(self.trace.steps), m["prompt"], m["recomputed"], m["hit"], m["acc_hit"],
                         m["offloaded"] * bpb, m["prefetched"] * bpb, m["restored"] * bpb, round(self.stall, 6),
                         m["peak"] * bpb, m["discarded"], round(time.perf_counter() - t_wall, 3))


def simulate(trace: Trace, tiers: Tiers, policy: Policy, cost: CostModel | None = None,
             tick: float | None = None) -> SimResult:
    """Replay ``trace`` on ``tiers`` with ``policy``; cost model and tick from ``agents.kv`` unless given."""
    import dask_agents.config as c

    if cost is None:
        cost = CostModel.from_config()
    if tick is None:
        tick = c.seconds("kv.tick")
    return Simulator(trace, tiers, policy, cost, tick, int(c.get("kv.min-samples"))).run()
