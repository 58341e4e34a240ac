"""What a KV policy sees (a read-only view) and what it may suggest (actions).

As in Dask's active memory manager, policies only *suggest*: they are pure functions of a
:class:`KVView` returning an eviction order or a tuple of actions, and the enforcer (the
simulator here, the vLLM adapter later) applies them within the hard rules: a tier never holds
more than its capacity, blocks of running steps are never moved, a block lives in one tier.

A session *holds* the blocks of its latest prompt (a finished session, of its last one) until
it is dropped; blocks shared by several sessions (a common prefix) have several holders. A block
no live session holds is *stale*: context a session moved past (after compacting, on another
branch) or a finished session's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping, Union

from dask_agents.kv.runtime.aeg import GraphView
from dask_agents.kv.runtime.blocks import ACCELERATOR, CostModel, Tiers

RUNNING, PAUSED, FINISHED = "running", "paused", "finished"
"""Session states: a step is running; it ended and the session waits (tool, user); it ended for good."""


@dataclass(frozen=True, slots=True)
class SessionView:
    """One session as a policy sees it (block counts are of the blocks it holds)."""

    id: str
    state: str
    node: str                    # label of its latest step (AEG node)
    wait_key: str                # latency key of its pause (tool kind or ``after:<node>``)
    last_access: float           # when its latest step arrived
    paused_since: float | None   # when its pause began (None unless paused)
    chain: int                   # blocks of its latest prompt
    accelerator: int             # its blocks on the accelerator (in flight included)
    host: int
    disk: int
    restorable: int              # blocks of its latest prompt in host or disk (what a prefetch brings back)
    in_flight: int               # blocks being prefetched
    blocks: tuple[int, ...] = ()  # its latest prompt's block ids, head first


@dataclass(frozen=True, slots=True)
class Evict:
    """Free up to ``blocks`` (None: all) of the session's accelerator blocks no other live session
    holds, tail first: they go to the next lower tier (which makes room by the policy's order),
    or are discarded when there is none."""

    session: str
    blocks: int | None = None


@dataclass(frozen=True, slots=True)
class Trim:
    """Bring accelerator use down to ``target`` blocks: stale blocks first (least recently used
    first), then the blocks of ``sessions`` in that order (each tail first, those no other live
    session holds). They go to the next lower tier or are discarded, as with :class:`Evict`; it
    stops short when nothing more may go (pinned, shared, running)."""

    target: int
    sessions: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Prefetch:
    """Bring the session's latest prompt back from host/disk, prefix first, into free room."""

    session: str


@dataclass(frozen=True, slots=True)
class Drop:
    """Invalidate the session's KV in every tier (blocks other live sessions hold stay)."""

    session: str


Action = Union[Evict, Trim, Prefetch, Drop]


@dataclass(frozen=True)
class KVView:
    """The KV state at ``now``: capacities and use per tier (in blocks), sessions, the AEG."""

    now: float
    tiers: Tiers
    cost: CostModel
    capacity: Mapping[str, int]
    used: Mapping[str, int]
    sessions: Mapping[str, SessionView]
    graph: GraphView
    arrivals: int = 0  # steps that have arrived so far (the one being served included)
    # Block identifiers per tier: the accelerator's block ids; a lower tier's may be whatever
    # the enforcer keys it by (the KV manager's host tier: block hashes).
    lru: Callable[[str], Iterator[int]] = field(repr=False, default=lambda tier: iter(()))
    stale: Callable[[str], Iterator[int]] = field(repr=False, default=lambda tier: iter(()))
    # The tier a block is in (None: not cached), where the caller can say cheaply (the
    # simulator); None otherwise. Lets a policy skip a chain's blocks that are not in a tier
    # instead of ranking them (the offline order walked every chain block per eviction).
    where: Callable[[int], str | None] | None = field(repr=False, default=None)
    # ``down(session, j, tier)``: walking the session's chain (``blocks``) from position ``j``
    # to its head, the position of the first block in ``tier`` that may leave it now (not
    # pinned by a running step nor read by the step being served), -1 if none: where the
    # caller can say cheaply (the simulator, which keeps each chain's top block per tier and
    # knows the pins); None otherwise. Walks from the tail then skip an evicted tail and a
    # running step's pinned prompt without ranking their blocks.
    down: Callable[[str, int, str], int] | None = field(repr=False, default=None)

    def usage(self, tier: str = ACCELERATOR) -> float:
        """Share of ``tier`` in use (1.0 for a tier of no capacity)."""
        cap = self.capacity.get(tier, 0)
        return self.used.get(tier, 0) / cap if cap else 1.0

    def free(self, tier: str = ACCELERATOR) -> int:
        """Free blocks in ``tier``."""
        return self.capacity.get(tier, 0) - self.used.get(tier, 0)

    def lru_blocks(self, tier: str = ACCELERATOR) -> Iterator[int]:
        """Blocks of ``tier``, least recently used first (a block's chain tail before its head)."""
        return self.lru(tier)

    def stale_blocks(self, tier: str = ACCELERATOR) -> Iterator[int]:
        """Blocks of ``tier`` in no session's latest prompt (context a session moved past, e.g. after
        compacting, or a finished session's), least recently used first."""
        return self.stale(tier)

    def elapsed(self, s: SessionView) -> float:
        """Seconds the session has been paused (0 unless paused)."""
        return self.now - s.paused_since if s.paused_since is not None else 0.0

    @property
    def offload_tier(self):
        """The tier evicted blocks go to first (host, else disk), or None without lower tiers."""
        lower = self.tiers.lower
        return lower[0] if lower else None

    def move_s(self, blocks: int) -> float:
        """Seconds to move ``blocks`` one way to or from the first lower tier (inf without one)."""
        t = self.offload_tier
        return math.inf if t is None else self.cost.transfer_s(blocks, t)
