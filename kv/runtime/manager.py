"""The component-side KV manager of one vLLM engine: a :mod:`dask_agents.kv.runtime.policies` policy, driven by the
workflow, enforced on the engine's real KV (:class:`dask_agents.kv.runtime.engine_kv.EngineKV`).

It plays, against a real engine, the part :mod:`dask_agents.kv.offline.simulator` plays against a trace: it keeps
each session's workflow state, learns the Agent Execution Graph online, builds a
:class:`~dask_agents.kv.runtime.view.KVView` from the engine's own state and applies what the policy suggests.

Session state. ``running`` (a request of the session is in the engine, or the controller said
its next step started), ``paused`` (its last request finished; it waits on a tool kind such as
``code_exec`` or on a dependency key, ``after:<node>`` when nobody said), ``finished``. The
global controller sends :meth:`KVManager.hint`; without hints the manager infers running/paused
from the engine's own admissions and finishes, so it works (less well) without a controller.

Learning. A pause lasts from a session's request finish to its next admission
(``AgentGraph.observe_pause`` under the key it waited on); the transition between the two steps
records how much of the previous prompt's blocks the next prompt starts with (the prefix
overlap, as the simulator measures it: what the workflow reuses, not what the cache happened to
keep). Tool-kind priors are scaled by ``agents.emulation.time-scale`` (emulated tools sleep that
much shorter), so a sped-up run predicts the pauses it will see.

Enforcement (everything runs on the engine thread between steps, as ``dask_agents.kv.runtime.vllm_compat`` requires):

- ``Evict`` -> offload to the first lower tier (host, else disk), tail first; discarded without one.
- ``Trim`` -> stale blocks (cached, owned by no live session) are freed, then the listed
  sessions' blocks go down a tier (tail first), until device use is at the target.
- ``Prefetch`` -> blocks come back from host/disk into empty device room only (never by
  discarding another cached block). ``Drop`` -> invalidate.
- A full host tier makes room in the policy's order of the host tier (``order(view, "host")``,
  read as the simulator reads it; ``EngineKV.host_victims``): under a bounded host tier which
  session's copy is lost matters as much as which leaves the device. LRU keeps the tier's own
  order (least recently stored first).
- Demand (:meth:`KVManager.prepare`, before every step): vLLM takes cached blocks in LRU order
  when a request needs room, and drops them. So the manager works out the blocks the next step
  will allocate (running requests' next prefill chunk or decoded token, then the waiting
  requests the scheduler will admit) and, where the empty blocks do not cover them, frees the
  difference itself in the policy's eviction order (``order``), copying blocks live sessions
  own to the lower tier, as the simulator's enforcer does on an arrival; then it restores the
  admitted requests' prefixes from host/disk. vLLM's own LRU only takes what this misses.
- WA-LRU's tool-aware TTL: protected paused sessions are pinned (``EngineKV.retain``) for the rest
  of their TTL within the pin budget, so vLLM's LRU cannot take them either; pins go when the
  session resumes or the TTL ends, and ``EngineKV.maintain`` releases them if they would ever
  keep the engine from admitting anything.

When it looks: at most once per ``agents.kv.tick`` seconds (an idle engine loop wakes that
often while a manager runs, so prefetches start on time), except that a session end (its
blocks are freed at once) and, under WA-LRU, a session's pause (its TTL pin) look at the next
loop iteration. Admissions and request finishes happen nearly every step of a busy engine; a
look after each of them cost more than the steps it served (the state changes they make are
seen by the next look, and demand is met by ``prepare`` before every step regardless).

Cost on the engine thread: a look is O(sessions + running requests): a session's residency is
kept by its KV backend as blocks move (the emulated engine; ``EngineKV`` counts by a walk of
the session's blocks), device use and stale blocks come from vLLM's KV events
(``dask_agents.kv.runtime.device_index``), not from walking the block pool. ``prepare`` is
O(running + waiting requests) unless room must be made; room-making ranks only the blocks that
can be freed (vLLM's free queue: cached, unreferenced) and frees a batch, down to
``theta-high`` of the device when the free queue allows, so it runs rarely. ``report()``
counts the time.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from dask_agents.kv.runtime import vllm_compat as vc
from dask_agents.kv.runtime.aeg import AgentGraph, LatencyModel
from dask_agents.kv.runtime.blocks import ACCELERATOR, DISK, HOST, CostModel, Tier, Tiers, common_prefix
from dask_agents.kv.runtime.engine_kv import EngineKV, KVDirectiveError
from dask_agents.kv.runtime.policies import LRU, WALRU, Policy, get_policy
from dask_agents.kv.runtime.sizing import KVGeometry
from dask_agents.kv.runtime.tool_latency import scaled_prior
from dask_agents.kv.runtime.view import (
    FINISHED,
    PAUSED,
    RUNNING,
    Drop,
    Evict,
    KVView,
    Prefetch,
    SessionView,
    Trim,
)

logger = logging.getLogger(__name__)

STATES = (RUNNING, PAUSED, FINISHED)
DEFAULT_NODE = "llm"
"""Step label of a session's requests on this engine when no hint named it."""


class ScaledGraph(AgentGraph):
    """An :class:`AgentGraph` whose tool-latency priors are scaled by ``scale`` (emulated tools
    that sleep ``scale`` times their latency)."""

    def __init__(self, min_samples: int = 20, scale: float = 1.0):
        super().__init__(min_samples)
        if not scale > 0:
            raise ValueError(f"prior scale must be > 0, got {scale}")
        self.scale = float(scale)

    def latency(self, key: str) -> LatencyModel:
        """The latency model of ``key`` (its kind's prior scaled, created on first use)."""
        m = self.latencies.get(key)
        if m is None:
            m = self.latencies[key] = LatencyModel(scaled_prior(key, self.scale), self.min_samples)
        return m


@dataclass
class ManagerStats:
    """Counters of one manager (monotonic, except the peaks)."""

    ticks: int = 0
    tick_seconds: float = 0.0  # time spent in ticks (view + policy + enforcement)
    room_seconds: float = 0.0  # time spent in prepare() (room for the next step, restores)
    room_blocks: int = 0  # blocks freed in the policy's order for the next step
    room_looks: int = 0  # times room was made (each ranks the free queue once)
    host_looks: int = 0  # times a full host tier made room in the policy's order
    pauses_observed: int = 0
    pins: int = 0  # pins taken for TTL-protected sessions
    errors: int = 0  # directives the engine refused (logged)
    peak_device_blocks: int = 0  # highest device use a look saw
    peak_host_blocks: int = 0
    actions: Counter = field(default_factory=Counter)

    def as_dict(self) -> dict[str, Any]:
        """The counters as a plain dict."""
        d = dict(self.__dict__)
        d["actions"] = dict(self.actions)
        return d


@dataclass
class _Session:
    state: str = RUNNING
    node: str = DEFAULT_NODE  # label of its latest step
    wait_key: str = ""  # latency key of its pause
    last_access: float = 0.0  # when its latest request was admitted
    paused_since: float | None = None
    live: int = 0  # its requests in this engine
    chain: list = field(default_factory=list)  # its latest prompt's block hashes
    finished_at: float | None = None  # finish time of its last request (start of the pause to learn)
    pending: tuple[str, str | None] | None = None  # (state, wait key) hinted while requests ran
    next_node: str | None = None  # label of the step a running hint announced
    resume_by: float | None = None  # a running hint with no request yet: back to paused after this


class KVManager:
    """KV policy for one engine (see the module docstring). Every method runs on the engine's
    stepping thread (``EngineHost.kv_call`` gets there), except :meth:`knows`."""

    def __init__(self, kv: EngineKV, policy: str | Policy | None = None, tick_s: float | None = None,
                 min_samples: int | None = None, prior_scale: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        import dask_agents.config as c

        self.kv = kv
        # the engine internals it reads, through its KV backend's compat layer: vLLM's
        # (kv/runtime/vllm_compat.py), or the emulated engine's (worker_plugin/emulated.py)
        self.vc = getattr(kv, "compat", vc)
        self.clock = clock
        self.policy = self._policy(policy if policy is not None else str(c.get("kv.policy")))
        self.tick_s = float(tick_s) if tick_s is not None else c.seconds("kv.tick")
        if min_samples is None:
            min_samples = int(c.get("kv.min-samples"))
        if prior_scale is None:
            prior_scale = float(c.get("emulation.time-scale", 1.0) or 1.0)
        self.graph = ScaledGraph(min_samples, prior_scale)
        self.stats = ManagerStats()
        self.arrivals = 0
        self._sessions: dict[str, _Session] = {}
        # session -> its request that vLLM has queued but not scheduled: the session's pin is
        # kept until the request holds its blocks itself (a waiting request references none,
        # so releasing at add_request would let the next step's allocations evict its prefix)
        self._unpin_when_running: dict[str, str] = {}
        self._events = False  # something happened since the last look
        self._urgent = False  # ... that the next loop iteration must look at (see poll)
        self._last_tick = -math.inf
        # cached blocks that may be stale (stored since last looked at, or of a finished session),
        # checked when a policy asks for stale blocks: never a walk of the whole cache
        self._stale: dict[Any, None] = {}
        parts = kv.parts
        self._capacity = parts.num_blocks - 1  # the null block holds nothing
        bpb, bs = kv.bytes_per_block, parts.block_size
        # A geometry with this engine's block bytes: policies only ask it for transfer times.
        self._geometry = KVGeometry(1, 1, max(1, bpb // (2 * bs)), 1, bs)
        # Until this engine has timed its own copies, transfer times use the configured bandwidths.
        configured = Tiers.from_config()
        self._bandwidth = {HOST: configured.host.bandwidth, DISK: configured.disk.bandwidth}
        if hasattr(kv, "host_victims"):  # a full host tier makes room in the policy's order
            kv.host_victims = self._host_victims

    # -- configuration ------------------------------------------------------------------------------

    @staticmethod
    def _policy(policy: str | Policy) -> Policy:
        return get_policy(policy) if isinstance(policy, str) else policy

    def set_policy(self, policy: str | Policy) -> None:
        """Switch the policy (what was learned stays); pins of the old policy are dropped."""
        self.policy = self._policy(policy)
        for sid in list(self._sessions):
            if self.kv.knows(sid):
                self.kv.release(sid)

    def knows(self, session: str) -> bool:
        """Whether this engine has seen ``session`` (safe from any thread: a dict lookup)."""
        return session in self._sessions

    # -- events from the engine host -----------------------------------------------------------------

    def on_admit(self, session: str | None, request_id: str, now: float | None = None) -> None:
        """A request was added to the engine: the session runs; learn the pause that ended;
        let EngineKV track its blocks; get the next step ready (:meth:`prepare`: room in the
        policy's order, its prefix restored from a lower tier if the scheduler admits it next)."""
        now = self.clock() if now is None else now
        self.arrivals += 1
        self._events = True
        hashes = self.vc.request_hashes(self.kv.parts, request_id)
        if session is not None and hashes is not None:
            st = self._sessions.get(session)
            if st is None:
                st = self._sessions[session] = _Session(last_access=now)
            elif st.finished_at is not None and st.live == 0:
                self._learn(st, hashes, now)
            st.node = st.next_node or st.node
            st.next_node = None
            st.state, st.last_access, st.paused_since, st.resume_by = RUNNING, now, None, None
            st.finished_at, st.pending = None, None
            st.live += 1
            st.chain = hashes
            if self.kv.knows(session) and self.kv.pinned(session):
                self._unpin_when_running[session] = request_id
        self.kv.on_admit(session, request_id, restore=False)  # restored by prepare(), when it is admitted
        try:
            self.prepare(now)
        except Exception:  # an optimisation: vLLM admits (and recomputes) without it
            self.stats.errors += 1
            logger.exception("KV manager: preparing admission of %s failed", request_id)

    def _learn(self, st: _Session, hashes: list, now: float) -> None:
        key = st.wait_key or AgentGraph.key(st.node, None)
        self.graph.observe_pause(st.node, key, max(0.0, now - st.finished_at))
        self.stats.pauses_observed += 1
        overlap = common_prefix(st.chain, hashes) / len(st.chain) if st.chain else 1.0
        self.graph.observe_transition(st.node, st.next_node or st.node, overlap)

    def on_finish(self, session: str | None, request_id: str, now: float | None = None) -> None:
        """A request finished: EngineKV takes its blocks for the session; a session with nothing
        left in the engine is paused (on what a hint said, else ``after:<node>``) or finished."""
        now = self.clock() if now is None else now
        self.kv.on_finish(session, request_id)
        st = self._sessions.get(session) if session is not None else None
        if st is None:
            return
        self._events = True
        st.live = max(0, st.live - 1)
        if st.live:
            return
        if self._unpin_when_running.pop(session, None) is not None and self.kv.knows(session):
            self.kv.release(session)  # it ran (and ended) within one step: the pin's job is done
        state, key = st.pending or (PAUSED, None)
        st.pending = None
        if state == FINISHED:
            self._finish(session, st, now)
        else:
            st.state, st.paused_since, st.finished_at = PAUSED, now, now
            st.wait_key = key or AgentGraph.key(st.node, None)
            self._paused()

    def _paused(self) -> None:
        """A session paused: WA-LRU pins it for its TTL at the next look, not a tick later
        (what it protects is evictable meanwhile)."""
        if isinstance(self.policy, WALRU):
            self._urgent = True

    def _finish(self, session: str, st: _Session, now: float) -> None:
        self._urgent = True  # a session end frees its blocks at the next look
        if st.state != FINISHED:
            self.graph.observe_end(st.node)
        st.state, st.paused_since, st.finished_at, st.resume_by = FINISHED, None, None, None
        if self.kv.knows(session):
            self._stale.update(dict.fromkeys(self.kv.blocks_of(session)))  # its blocks may be nobody's now

    # -- hints from the global controller ---------------------------------------------------------------

    def hint(self, session: str, state: str, node: str | None = None, wait_key: str | None = None,
             at: float | None = None) -> None:
        """The workflow's view of ``session``: ``"running"`` (its next step starts: its KV is
        needed soon), ``"paused"`` (the step labelled ``node`` ended and the session waits on
        ``wait_key``: a tool kind such as ``"code_exec"``, or a dependency key), or
        ``"finished"`` (it ended for good). ``at``: when that happened (this manager's clock;
        default now). A hint that arrives while the session's request is still in the engine
        applies when the request finishes. Raises KVDirectiveError for an unknown state or a
        session this engine never saw."""
        if state not in STATES:
            raise KVDirectiveError(f"unknown session state {state!r} (known: {', '.join(STATES)})")
        st = self._sessions.get(session)
        if st is None:
            raise KVDirectiveError(f"no KV for session {session!r} on this engine")
        now = self.clock()
        at = min(now, at) if at is not None else now
        self._events = True
        if state == RUNNING:
            st.next_node = node or st.next_node
            if st.live:
                return
            st.state, st.paused_since, st.last_access = RUNNING, None, at
            st.resume_by = at + self.policy.params.ttl_max  # if no request follows, it is paused again
            self._prefetch(session)  # its next request is coming: bring back what is below
            return
        if node:
            st.node = node
        if state == PAUSED:
            key = AgentGraph.key(st.node, wait_key)
            if st.live:
                st.pending = (PAUSED, key)
                return
            if key != st.wait_key and self.kv.knows(session) and self.kv.pinned(session):
                self.kv.release(session)  # pinned for the TTL of what it was thought to wait on
            st.wait_key = key
            if st.state != PAUSED:
                st.state, st.paused_since, st.resume_by = PAUSED, at, None
                if st.finished_at is None:
                    st.finished_at = at
            self._paused()
            return
        if st.live:  # finished: applies when its request is done
            st.pending = (FINISHED, None)
            return
        self._finish(session, st, at)
        if self.kv.knows(session):
            self.kv.release(session)

    # -- the periodic look ------------------------------------------------------------------------------

    def poll(self, now: float | None = None) -> bool:
        """Called by the engine loop between steps: look (:meth:`tick`) if ``tick_s`` passed
        since the last look or something that must not wait happened (a session end; under
        WA-LRU a pause), else only keep pins in order; then get the next step ready
        (:meth:`prepare`). Returns whether it looked. At most one look per ``tick_s`` otherwise:
        admissions and finishes come nearly every step of a busy engine."""
        now = self.clock() if now is None else now
        looked = False
        self._unpin_running()
        if self._urgent or now - self._last_tick >= self.tick_s:
            self.tick(now)
            looked = True
        else:
            self.kv.maintain(now)
        self.prepare(now)
        return looked

    def _unpin_running(self) -> None:
        """Release the pins of sessions whose queued request now runs (holds its blocks) or is gone."""
        for session, request_id in list(self._unpin_when_running.items()):
            st = self._sessions.get(session)
            if st is not None and st.live and not self.vc.allocated_blocks(self.kv.parts, request_id):
                continue  # still waiting in vLLM's queue: the pin keeps its prefix resident
            del self._unpin_when_running[session]
            if st is not None and self.kv.knows(session):
                self.kv.release(session)

    def tick(self, now: float | None = None) -> tuple:
        """One look: housekeeping, the policy's proactive actions applied, WA-LRU's TTL pins.
        Returns the actions the policy suggested."""
        now = self.clock() if now is None else now
        t0 = time.perf_counter()
        self._events = self._urgent = False
        self._last_tick = now
        self.kv.maintain(now)
        self._housekeep(now)
        view = self.view(now)
        actions: tuple = ()
        if self.policy.ticks:
            actions = self.policy.tick(view)
            if actions:
                self.apply(actions, view)
                view = self.view(now)
        if isinstance(self.policy, WALRU) and not (self.vc.waiting_requests(self.kv.parts)
                                                   and not self.vc.running_requests(self.kv.parts)):
            # (while maintain() just released pins so a waiting request can be admitted, re-pinning
            # would undo it: protection resumes once the engine runs again)
            self._pin_protected(view)
        self.stats.ticks += 1
        self.stats.tick_seconds += time.perf_counter() - t0
        return actions

    def _housekeep(self, now: float) -> None:
        for sid in list(self._sessions):
            st = self._sessions[sid]
            if not self.kv.knows(sid) and not st.live:
                del self._sessions[sid]  # invalidated (session end, a directive): nothing left here
            elif st.resume_by is not None and now > st.resume_by and not st.live:
                # "running" said, no request came: it waits on something after all
                st.state, st.paused_since, st.resume_by = PAUSED, now, None
                st.wait_key = st.wait_key or AgentGraph.key(st.node, None)

    # -- the view -------------------------------------------------------------------------------------

    def _lower(self) -> Tiers:
        bpb = self.kv.bytes_per_block
        tiers = self.kv.tiers
        bw = self._measured_bandwidth()
        return Tiers(Tier(ACCELERATOR, self._capacity * bpb),
                     Tier(HOST, tiers.host_bytes, bw or self._bandwidth[HOST]),
                     Tier(DISK, tiers.disk_bytes, self._bandwidth[DISK]))

    def _measured_bandwidth(self) -> float | None:
        """Bytes/s of this engine's copies between device and host, once enough were timed."""
        st = self.kv.stats
        moved = st.offloaded_bytes + st.restored_bytes
        secs = st.offload_seconds + st.restore_seconds
        if moved < 8 * self.kv.bytes_per_block or secs <= 0:
            return None
        return moved / secs

    def _live(self, sid: str) -> bool:
        st = self._sessions.get(sid)
        return st is None or st.state != FINISHED  # sessions it has no state for: assume live

    def view(self, now: float | None = None) -> KVView:
        """The KV state as a policy sees it, built from the engine's block pool and tiers."""
        now = self.clock() if now is None else now
        parts, kv = self.kv.parts, self.kv
        used = self.vc.used_blocks(parts)
        lower = kv.tier_blocks()
        bpb = kv.bytes_per_block
        sessions: dict[str, SessionView] = {}
        for sid, st in self._sessions.items():
            if not kv.knows(sid):
                continue
            r = kv.inspect(sid)
            wait_key = st.wait_key or AgentGraph.key(st.node, None)
            sessions[sid] = SessionView(sid, st.state, st.node, wait_key, st.last_access,
                                        st.paused_since if st.state == PAUSED else None, r.blocks,
                                        r.device_blocks, r.host_blocks, r.disk_blocks,
                                        r.host_blocks + r.disk_blocks, 0)
        s = self.stats
        s.peak_device_blocks = max(s.peak_device_blocks, used)
        s.peak_host_blocks = max(s.peak_host_blocks, lower["host"])

        host_blocks = getattr(kv, "host_blocks", None)  # (the host tier's blocks go by hash)

        def lru(tier: str) -> Iterator[Any]:  # a walk of vLLM's free queue, only if a policy asks
            if tier == ACCELERATOR:
                return (b.block_id for b in self.vc.cached_free_blocks(parts))
            return iter(host_blocks()) if tier == HOST and host_blocks is not None else iter(())

        def stale(tier: str) -> Iterator[Any]:
            if tier == ACCELERATOR:
                return (b.block_id for _, b in self._stale_blocks())
            if tier == HOST and host_blocks is not None:
                return (h for h in host_blocks() if self._is_stale(h))
            return iter(())

        return KVView(now, self._lower(), CostModel(self._geometry),
                      {ACCELERATOR: self._capacity, HOST: kv.tiers.host_bytes // bpb,
                       DISK: kv.tiers.disk_bytes // bpb},
                      {ACCELERATOR: used, HOST: lower["host"], DISK: lower["disk"]},
                      MappingProxyType(sessions), self.graph.view(), self.arrivals, lru, stale)

    def _host_victims(self, n: int) -> Iterator[bytes]:
        """Host blocks to drop so that ``n`` blocks can come (``EngineKV.host_victims``), in the
        policy's order of the host tier, read as the simulator reads it: blocks it lists (stale
        ones), then each session's host blocks tail first, a block several live sessions own
        at the turn of the last of them. Nothing under LRU: the tier's own order is LRU."""
        if isinstance(self.policy, LRU):
            return
        kv = self.kv
        t0 = time.perf_counter()
        came: set[str] = set()
        try:
            for item in self.policy.order(self.view(), HOST):
                if not isinstance(item, str):
                    yield item
                    continue
                came.add(item)
                if not kv.knows(item):
                    continue
                for h in reversed(kv.blocks_of(item)):
                    if kv.in_lower_tier(h) == HOST and all(o in came or not self._live(o) for o in kv.owners(h)):
                        yield h
        finally:
            self.stats.host_looks += 1
            self.stats.room_seconds += time.perf_counter() - t0

    def _is_stale(self, h: bytes | None) -> bool:
        """A cached block no live session owns (a finished session's, or no session's)."""
        return h is not None and not any(self._live(o) for o in self.kv.owners(h))

    def _stale_blocks(self) -> Iterator[tuple[Any, Any]]:
        """``(hash, block)`` of cached unreferenced blocks no live session owns, in the order
        they may have become stale. Candidates are the blocks the engine cached since the last
        look (``take_stored``: from vLLM's KV events) and the blocks of sessions that finished;
        one found owned by a live session or gone is forgotten (its owner's finish brings it
        back), one referenced now is kept for later. Amortised O(1) per block cached."""
        parts = self.kv.parts
        self._stale.update(dict.fromkeys(self.vc.take_stored(parts)))
        for h in list(self._stale):
            b = self.vc.lookup(parts, h)
            if b is None or not self._is_stale(h):
                self._stale.pop(h, None)
            elif self.vc.ref_count(b) == 0:
                yield h, b

    # -- enforcement ------------------------------------------------------------------------------------

    def apply(self, actions: tuple, view: KVView) -> None:
        """Apply the policy's actions through EngineKV (see the module docstring); a directive the
        engine refuses is logged and skipped, never raised into the engine loop."""
        tier = view.offload_tier.name if view.offload_tier is not None else None
        for a in actions:
            self.stats.actions[type(a).__name__] += 1
            try:
                if isinstance(a, Trim):
                    self._trim(a, tier)
                    continue
                st = self._sessions.get(a.session)
                if st is None or not self.kv.knows(a.session) or st.state == RUNNING:
                    continue  # gone, or a running step's KV: in use
                if isinstance(a, Drop):
                    self.kv.invalidate(a.session)
                    del self._sessions[a.session]
                elif isinstance(a, Evict):
                    self._down(a.session, a.blocks, tier)
                elif isinstance(a, Prefetch):
                    self._prefetch(a.session)
            except KVDirectiveError as e:
                self.stats.errors += 1
                logger.warning("KV manager: %s failed: %s", a, e)

    def _down(self, session: str, blocks: int | None, tier: str | None) -> int:
        """Move up to ``blocks`` of the session's device blocks a tier down (tail first)."""
        if tier is None:
            return self.kv.evict(session, blocks)
        return self.kv.offload(session, tier, blocks)

    def _prefetch(self, session: str) -> int:
        """Restore the session's lower-tier blocks into empty device room only."""
        if not self.kv.knows(session):
            return 0
        r = self.kv.inspect(session)
        want = r.host_blocks + r.disk_blocks
        if not want:
            return 0
        room = self.vc.empty_free_blocks(self.kv.parts, at_least=want)
        return self.kv.prefetch(session, room) if room else 0

    def _trim(self, a: Trim, tier: str | None) -> None:
        want = self._capacity - self.vc.empty_free_blocks(self.kv.parts) - a.target
        if want <= 0:
            return
        stale = [h for h, _ in itertools.islice(self._stale_blocks(), want)]
        done = self.kv.offload_blocks(stale, None)
        for sid in a.sessions:
            if done >= want:
                break
            st = self._sessions.get(sid)
            if st is None or st.state == RUNNING or not self.kv.knows(sid):
                continue
            done += self._down(sid, want - done, tier)

    def prepare(self, now: float | None = None) -> int:
        """Get the next step's allocations ready, before the step: make room for them in the
        policy's eviction order (owned blocks go a tier down, stale ones are freed) instead of
        letting vLLM take cached blocks in LRU order and drop them, then restore the prefixes
        of the requests it is about to admit from host/disk.

        The next step's blocks: the running requests' next chunk (a prompt longer than the
        step's token budget is prefilled in chunks) or decoded token, then the waiting requests
        in the scheduler's order while their first chunk fits in the free blocks, and the
        restorable prefix of the first one that does not (a smaller chunk of it may still be
        admitted). Restoring only then, not when a request is queued, keeps a long queue from
        restoring more than the device holds and evicting its own restores; the KV of requests
        further back may go a tier down meanwhile. Returns the blocks freed."""
        parts, kv = self.kv.parts, self.kv
        waiting = self.vc.waiting(parts)
        running = self.vc.running(parts)
        if not waiting and not running:
            return 0
        t0 = time.perf_counter()
        bs = parts.block_size
        budget = self.vc.token_budget(parts)
        need = 0
        for rid, ntok, done in running:  # vLLM schedules these first
            step = min(ntok - done, budget)
            if step <= 0:
                continue
            budget -= step
            if step == 1 and done % bs:
                continue  # a decoded token inside its last block: nothing new
            need += max(0, -(-(done + step) // bs) - self.vc.allocated_blocks(parts, rid))
        below = any(kv.tier_blocks().values())
        if not below:
            # Nothing below the device to restore: only room could be short. If the empty blocks
            # hold every waiting request whole, nothing is (the walk below costs a lookup per
            # prompt block per step while a request waits: milliseconds of the engine thread
            # for a 56k-token prompt, every call, with nothing to do).
            bound = need + sum(-(-ntok // bs) + 1 for _, ntok, _ in waiting)
            if self.vc.empty_free_blocks(parts, at_least=bound) >= bound:
                self.stats.room_seconds += time.perf_counter() - t0
                return 0
        free = self.vc.free_blocks(parts) - need  # empty + cached unreferenced: what vLLM can hand out
        keep: set[bytes] = set()
        plan, admit, taken = [], 0, 0
        held: set[bytes] = set()
        for _, ntok, hashes in waiting:
            if budget <= 0:
                break
            # the prefix found on the device or below, the part below, and the resident prefix
            # blocks nobody references yet (admitting takes them off the free pool)
            hit, restore, touched = self.vc.prefix_walk(parts, hashes, kv.in_lower_tier if below else None, held)
            chunk = min(ntok - hit * bs, budget)
            n = restore + -(-(hit * bs + chunk) // bs) - hit  # blocks it takes from the empty ones
            keep.update(hashes)
            if taken + n + len(touched) > free:
                r = min(restore, free - taken - len(touched))
                if r > 0:
                    plan.append((hashes, r))
                    admit += r
                break
            admit += n
            taken += n + len(touched)
            held.update(touched)
            budget -= chunk
            if restore:
                plan.append((hashes, restore))
        need += admit
        freed = 0
        short = need - self.vc.empty_free_blocks(parts, at_least=need) if need else 0
        if short > 0:
            freed = self._free(short, keep, self.clock() if now is None else now)
        for hashes, r in plan:
            room = self.vc.empty_free_blocks(parts, at_least=r)
            if room:
                kv.restore(hashes, limit=min(r, room))  # into empty blocks only: nothing cached is lost
        self.stats.room_blocks += freed
        self.stats.room_seconds += time.perf_counter() - t0
        return freed

    def _free(self, short: int, keep: set[bytes], now: float) -> int:
        """Free at least ``short`` device blocks (a batch, see :meth:`_batch`) in the policy's
        order, never ``keep`` nor referenced blocks (running requests', pinned).

        Only blocks vLLM could hand out are candidates: cached and unreferenced (its free
        queue). The policy's order is read as far as it lists blocks (stale ones: taken in
        that order); then each candidate is ranked where the order's walk would take it: at
        the turn of the last of its live owners (a block several sessions own goes once every
        live owner came up; a block no live session owns, at its first owner's turn), tail
        first within the turn (by position in the chain); candidates the order does not reach
        follow in LRU order, as vLLM would take them, except blocks of running sessions (e.g.
        just prefetched for a session that resumed). O(free queue + sessions), whatever the
        sessions' histories; nothing to do (no candidate) returns at once."""
        parts, kv, vc = self.kv.parts, self.kv, self.vc
        queue = vc.cached_free_blocks(parts)  # least recently used first
        if not queue:
            return 0
        view = self.view(now)
        tier = view.offload_tier.name if view.offload_tier is not None else None
        goal = self._batch(short, len(queue))
        down: list[bytes] = []  # owned by live sessions: a tier down
        drop: list[bytes] = []  # stale: freed
        taken: set[bytes] = set()

        def take(h: bytes | None, b: Any) -> None:
            if h is None or h in keep or h in taken or vc.ref_count(b) > 0:
                return
            taken.add(h)
            (drop if self._is_stale(h) else down).append(h)

        rank: dict[str, int] = {}  # session -> its turn in the order
        order = iter(self.policy.order(view, ACCELERATOR))
        for item in order:
            if isinstance(item, str):
                rank[item] = 0
                rank.update((sid, i) for i, sid in enumerate((x for x in order if isinstance(x, str)), 1))
                break
            if len(taken) >= goal:
                break
            b = parts.block_pool.blocks[item]
            take(vc.block_hash(b), b)
        if len(taken) < goal:
            last = len(rank)  # after every turn: the LRU fallback
            running = {sid for sid, st in self._sessions.items() if st.state == RUNNING}
            ranked = []
            for i, b in enumerate(queue):
                h = vc.block_hash(b)
                if h is None or h in keep or h in taken or vc.ref_count(b) > 0:
                    continue
                owners = kv.owners(h)
                turn, pos = last, 0
                live = [o for o in owners if self._live(o)]
                if live:
                    turns = [rank.get(o, -1) for o in live]
                    if min(turns) >= 0:
                        turn, pos = max(turns), -kv.block_tokens(h)
                    elif running and not running.isdisjoint(owners):
                        continue
                else:
                    turns = [rank[o] for o in owners if o in rank]
                    if turns:
                        turn, pos = min(turns), -kv.block_tokens(h)
                ranked.append((turn, pos, i, h, b))
            for _, _, _, h, b in heapq.nsmallest(goal - len(taken), ranked):
                take(h, b)
        self.stats.room_looks += 1
        return kv.offload_blocks(drop, None) + kv.offload_blocks(down, tier)

    def _batch(self, short: int, candidates: int) -> int:
        """How many blocks :meth:`_free` frees when ``short`` are missing: down to the
        ``theta-high`` mark of the device (what the next steps take is then ready, so the
        ranking runs once per batch, not every step), at most half the free queue
        (``candidates``: a small queue is not emptied for one request), at least ``short``."""
        high = math.floor(self.policy.params.theta_high * self._capacity)
        over = self.vc.used_blocks(self.kv.parts) + short - high
        return max(short, min(over, candidates // 2))

    def _pin_protected(self, view: KVView) -> None:
        """WA-LRU: pin paused sessions within their tool-aware TTL (most valuable first, within
        the pin budget) for the rest of their TTL."""
        policy = self.policy
        assert isinstance(policy, WALRU)
        protected = [s for s in view.sessions.values()
                     if s.state == PAUSED and s.accelerator and not policy.expired(view, s)]
        if not protected:
            return
        score = policy.scores(view, protected)
        for s in sorted(protected, key=lambda s: score[s.id]):
            if self.kv.pinned(s.id):
                continue
            left = policy.ttl(view, s) - view.elapsed(s)
            if left > 0 and self.kv.retain(s.id, left):
                self.stats.pins += 1

    # -- telemetry ---------------------------------------------------------------------------------------

    def session_state(self, session: str) -> dict[str, Any]:
        """The manager's state of one session (for tests and debugging)."""
        st = self._sessions.get(session)
        if st is None:
            raise KVDirectiveError(f"no KV for session {session!r} on this engine")
        return {"state": st.state, "node": st.node, "wait_key": st.wait_key, "live": st.live,
                "paused_since": st.paused_since}

    def report(self) -> dict[str, Any]:
        """Policy name, counters and what was learned (sizes only)."""
        return {"policy": self.policy.name, **self.stats.as_dict(), "sessions": len(self._sessions),
                "latency_keys": {k: m.n for k, m in self.graph.latencies.items()}}
