"""Our KV policy inside vLLM's offloading: a cache policy for the ``OffloadingConnector``'s host tier.

vLLM's ``OffloadingConnector`` copies KV blocks to host memory and, when a store needs room
there, evicts in the order of its ``CachePolicy`` (``lru`` and ``arc`` built in; an out-of-tree
one is named by ``eviction_policy`` and ``cache_policy_module_path`` in the connector's extra
config). Neither built-in knows that a block belongs to an agent session that is waiting on a
two-minute test run, or that ended a second ago. :class:`SessionCachePolicy` ranks the host
tier's chunks as our policy ranks sessions (``policies.Ours.next_use``: the expected time until
the session reads its KV again over the probability that it does, from the online agent graph
of ``kv/runtime/aeg.py``): first the chunks nobody holds (of finished sessions, of no session,
and context a session left behind: a compaction or a branch, past where its latest prompt
went another way), then the furthest expected use; a chunk several sessions share (a system
prompt) goes by its soonest holder; a session's chunks go tail first; least recently used among
equals. With no hints at all it evicts exactly as vLLM's LRU does. On generated coding-agent
traces replayed through vLLM's manager (``benchmarks/offload_policy.py``) it recomputes 0.86x
LRU's tokens with the host tier at half the peak footprint (ARC: 1.04x); left-behind context
kept as its session's made it 1.06x. An eviction costs 0.1-0.2 ms there.

What it knows travels with the requests, through vLLM's orchestrator hints
(``AsyncLLM.generate(kv_hints=...)``, handed to the offloading manager in each request's
``ReqContext``): the request's session, and the session-state hints the worker received since
the engine's last request (running; paused after a step on a wait key; finished), as the worker
plugin gives them to every engine (``EngineHost.kv_hint``). Nothing else crosses into the
engine core's process, where this policy runs. :func:`envelope` builds what the host attaches.

The pause model learns in that process as the worker-side KV manager's does
(``kv/runtime/manager.py``): a pause is from a session's last request finishing to its next
request arriving, under the key it waited on.
"""

from __future__ import annotations

import heapq
import math
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope
from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus, order_request_keys

from dask_agents.kv.runtime.aeg import AgentGraph
from dask_agents.kv.runtime.policies import Ours
from dask_agents.kv.runtime.view import FINISHED, PAUSED, RUNNING

__all__ = ["PROTOCOL", "SessionCachePolicy", "envelope", "extra_config"]

PROTOCOL = "dask-agents/1"
_REQUEST, _STATE = "dask-agents.request", "dask-agents.session-state"
STATES = (RUNNING, PAUSED, FINISHED)  # (as kv/runtime/manager.py's hints)


def envelope(session: str | None, states: Sequence[tuple[str, str, str | None, str | None, float]] = ()
             ) -> KvHintsEnvelope | None:
    """The hints one request carries: its ``session`` and the state changes ``(session, state,
    node, wait_key, at)`` (``at``: Unix time) received since the engine's last request. None
    when there is nothing to say."""
    actions = [KvHintAction(action_id=str(i), action_type=_STATE, action_version="1",
                            payload={"session": s, "state": st, "node": node, "wait_key": key, "at": at})
               for i, (s, st, node, key, at) in enumerate(states)]
    if session is not None:
        actions.append(KvHintAction(action_id="request", action_type=_REQUEST, action_version="1",
                                    payload={"session": session}))
    if not actions:
        return None
    return KvHintsEnvelope(protocol_version=PROTOCOL, message_id=uuid.uuid4().hex, actions=actions)


def extra_config(cpu_bytes: int, policy: str = "ours") -> dict[str, Any]:
    """The ``kv_connector_extra_config`` of an ``OffloadingConnector`` whose host tier
    (``cpu_bytes``) evicts by :class:`SessionCachePolicy` (``policy`` ours) or vLLM's own LRU
    (``lru``: workflow-blind, the baseline). ValueError for any other policy."""
    if policy == "lru":
        return {"cpu_bytes_to_use": int(cpu_bytes), "eviction_policy": "lru"}
    if policy != "ours":
        raise ValueError(f"kv-connector: offloading evicts by kv-policy ours or lru, not {policy!r}")
    return {"cpu_bytes_to_use": int(cpu_bytes), "eviction_policy": SessionCachePolicy.__name__,
            "cache_policy_module_path": __name__}


@dataclass
class _Session:
    """One session as the host tier sees it (the fields ``Ours.next_use`` reads, and what the
    pause model learns from)."""

    state: str = RUNNING
    node: str = "llm"
    wait_key: str = "after:llm"
    paused_since: float | None = None
    finished_at: float | None = None  # its last request's end: where the pause it learns from starts
    next_node: str | None = None
    live: int = 0  # its requests in the engine now
    pending: tuple[str, str | None] | None = None  # a state hint that came while a request ran
    keys: dict = field(default_factory=dict)  # its chunks in the cache -> their end-token position (or None)


@dataclass
class _Request:
    """What the policy keeps on a request's ``ReqContext`` (set once, at its first callback)."""

    session: str | None


class _View:
    """What ``Ours.next_use`` and ``Ours.open_pauses`` ask of a view: the graph, the sessions and
    a session's elapsed pause."""

    def __init__(self, graph: AgentGraph, sessions: dict[str, _Session], now: float):
        self.graph, self.sessions, self.now = graph.view(), sessions, now

    def elapsed(self, s: _Session) -> float:
        return self.now - s.paused_since if s.paused_since is not None else 0.0


class SessionCachePolicy(CachePolicy):
    """vLLM ``CachePolicy`` that evicts host-tier chunks by their sessions' expected next use
    (see the module docstring). Loaded by vLLM from its name and this module's path."""

    # sessions remembered with no chunk in the cache (a long pause still teaches the model when
    # the session comes back); the oldest are forgotten past this
    MAX_SESSIONS = 65536

    def __init__(self, cache_capacity: int, clock: Callable[[], float] = time.time):
        super().__init__(cache_capacity)
        self.clock = clock
        self.graph = AgentGraph()
        self.chunks: dict[OffloadKey, ChunkStatus] = {}
        self.sessions: OrderedDict[str, _Session] = OrderedDict()
        self._evictable: set[OffloadKey] = set()
        self._rank: dict[OffloadKey, int] = {}
        self._next_rank = 0
        self._owners: dict[OffloadKey, set[str]] = {}  # chunk in the cache -> sessions that used it
        self._nobody: set[OffloadKey] = set()  # chunks in the cache no session holds
        self._claims: dict[OffloadKey, str] = {}  # chunk being stored -> the session storing it
        self.hints_applied = 0

    # -- what the requests say ----------------------------------------------------------------
    def _request(self, ctx: ReqContext) -> _Request:
        """The request's session, its hints applied once (at the first callback that sees it)."""
        r = ctx.get_state(_Request)
        if r is not None:
            return r
        session = None
        hints = ctx.kv_hints
        if hints is not None and getattr(hints, "protocol_version", None) == PROTOCOL:
            for a in hints.actions:
                p = a.payload if isinstance(a.payload, dict) else {}
                sid = p.get("session")
                if not isinstance(sid, str) or not sid:
                    continue
                if a.action_type == _STATE:
                    self._hint(sid, p.get("state"), p.get("node"), p.get("wait_key"), p.get("at"))
                elif a.action_type == _REQUEST:
                    session = sid
        r = _Request(session)
        ctx.set_state(r)
        if session is not None:
            self._begin(session)
        return r

    def _session(self, sid: str) -> _Session:
        st = self.sessions.get(sid)
        if st is None:
            st = self.sessions[sid] = _Session()
            while len(self.sessions) > self.MAX_SESSIONS:
                old, s = next(iter(self.sessions.items()))
                if s.keys or s.live:  # (never drop one that holds chunks: they name it)
                    self.sessions.move_to_end(old)
                    break
                del self.sessions[old]
        else:
            self.sessions.move_to_end(sid)
        return st

    def _begin(self, sid: str) -> None:
        """A request of ``sid`` arrived: the session runs; the pause that ended is learned."""
        now = self.clock()
        st = self._session(sid)
        if st.live == 0 and st.finished_at is not None and st.state != FINISHED:
            self.graph.observe_pause(st.node, st.wait_key, max(0.0, now - st.finished_at))
            self.graph.observe_transition(st.node, st.next_node or st.node, 1.0)
        st.node = st.next_node or st.node
        st.next_node, st.pending, st.finished_at, st.paused_since = None, None, None, None
        st.state = RUNNING
        st.live += 1

    def _end(self, sid: str) -> None:
        """A request of ``sid`` finished: with none left, the session pauses (on what a hint
        said, else after its step) or ends."""
        st = self.sessions.get(sid)
        if st is None or st.live == 0:
            return
        st.live -= 1
        if st.live:
            return
        now = self.clock()
        state, key = st.pending or (PAUSED, None)
        st.pending = None
        if state == FINISHED:
            self._finish(st)
        else:
            st.state, st.paused_since, st.finished_at = PAUSED, now, now
            st.wait_key = key or AgentGraph.key(st.node, None)

    def _finish(self, st: _Session) -> None:
        if st.state != FINISHED:
            self.graph.observe_end(st.node)
        st.state, st.paused_since, st.finished_at = FINISHED, None, None

    def _hint(self, sid: str, state: Any, node: Any, wait_key: Any, at: Any) -> None:
        """A session-state hint (as ``KVManager.hint``): applied now, or when the session's
        request in the engine finishes. Malformed ones are skipped."""
        if state not in STATES:
            return
        node = node if isinstance(node, str) and node else None
        wait_key = wait_key if isinstance(wait_key, str) and wait_key else None
        now = self.clock()
        at = min(now, float(at)) if isinstance(at, (int, float)) and math.isfinite(at) else now
        if state == FINISHED and sid not in self.sessions:
            return  # nothing of it here to rank
        st = self._session(sid)
        self.hints_applied += 1
        if state == RUNNING:
            st.next_node = node or st.next_node
            if not st.live:
                st.state, st.paused_since = RUNNING, None
            return
        if node:
            st.node = node
        if state == PAUSED:
            key = AgentGraph.key(st.node, wait_key)
            if st.live:
                st.pending = (PAUSED, key)
                return
            st.wait_key = key
            if st.state != PAUSED:
                st.state, st.paused_since = PAUSED, at
                if st.finished_at is None:
                    st.finished_at = at
            return
        if st.live:
            st.pending = (FINISHED, None)
            return
        self._finish(st)

    # -- ownership and recency ----------------------------------------------------------------
    def _own(self, keys: Iterable[OffloadKey], sid: str | None, ctx: ReqContext | None = None) -> None:
        if sid is None:
            return
        st = self._session(sid)
        for k in keys:
            owners = self._owners.get(k)
            if owners is not None:
                owners.add(sid)
                self._nobody.discard(k)
                if st.keys.get(k) is None:
                    st.keys[k] = ctx.get_offload_key_position(k) if ctx is not None else None

    def _drop_stale(self, sid: str, keys: list[OffloadKey], ctx: ReqContext) -> None:
        """``sid``'s request offered ``keys`` (the part of its prompt past the device's prefix
        hit): chunks it held at those positions or later that this prompt does not have are
        context it left behind (compaction, a branch), no longer its to keep: nobody's now
        unless another session holds them, and they go first, as stale blocks do in ``Ours``."""
        st = self.sessions.get(sid)
        positions = [p for k in keys if (p := ctx.get_offload_key_position(k)) is not None]
        if st is None or not positions:
            return
        start, offered = min(positions), set(keys)
        for k, p in list(st.keys.items()):
            if p is not None and p >= start and k not in offered:
                del st.keys[k]
                owners = self._owners.get(k)
                if owners is not None:
                    owners.discard(sid)
                    if not owners:
                        self._nobody.add(k)

    def _disown(self, key: OffloadKey) -> None:
        self._nobody.discard(key)
        for sid in self._owners.pop(key, ()):
            st = self.sessions.get(sid)
            if st is not None:
                st.keys.pop(key, None)

    def _update_recency(self, keys: Iterable[OffloadKey]) -> None:
        for k in keys:
            if k in self.chunks:
                self._next_rank += 1
                self._rank[k] = self._next_rank

    # -- CachePolicy ------------------------------------------------------------------------------
    def get(self, key: OffloadKey) -> ChunkStatus | None:
        return self.chunks.get(key)

    def insert(self, key: OffloadKey, chunk: ChunkStatus) -> None:
        self.chunks[key] = chunk
        self._next_rank += 1
        self._rank[key] = self._next_rank
        self._owners[key] = set()
        self._nobody.add(key)
        sid = self._claims.pop(key, None)
        if sid is not None:
            self._own((key,), sid)
        if chunk.ref_cnt == 0:
            self._evictable.add(key)

    def remove(self, key: OffloadKey) -> None:
        self.chunks.pop(key, None)
        self._rank.pop(key, None)
        self._evictable.discard(key)
        self._disown(key)

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        keys = list(keys)
        r = self._request(req_context)
        self._own(keys, r.session, req_context)
        self._update_recency(reversed(keys))  # the head newest: a chain's tail goes first

    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        # chunks about to be stored belong to the request's session from their insert on:
        # unowned, they would rank as nobody's and be the first to go while the request runs
        r = self._request(req_context)
        if r.session is not None:
            for k in keys:
                self._claims[k] = r.session

    def on_request_finished(self, key_groups: Sequence[Sequence[OffloadKey]], insertion_only_keys: set[OffloadKey],
                            reused_keys: set[OffloadKey], req_context: ReqContext) -> None:
        r = self._request(req_context)
        keys = order_request_keys(key_groups, req_context)
        for k in keys:
            self._claims.pop(k, None)  # (a store that never inserted)
        self._own(keys, r.session, req_context)
        if r.session is not None:
            self._drop_stale(r.session, keys, req_context)
        self._update_recency(reversed(keys))
        if r.session is not None:
            self._end(r.session)

    def mark_evictable(self, key: OffloadKey) -> None:
        if key in self.chunks:
            self._evictable.add(key)

    def mark_non_evictable(self, key: OffloadKey) -> None:
        self._evictable.discard(key)

    def clear(self) -> None:
        """Drop every chunk (the learned pause model and the sessions' states stay: they are
        the workflow's, not the cache's)."""
        self.chunks.clear()
        self._rank.clear()
        self._evictable.clear()
        self._owners.clear()
        self._nobody.clear()
        self._claims.clear()
        for st in self.sessions.values():
            st.keys.clear()

    def next_use(self, now: float | None = None) -> dict[str, float]:
        """Each session holding chunks: ``Ours.next_use`` (seconds over probability; inf: gone)."""
        view = _View(self.graph, self.sessions, self.clock() if now is None else now)
        pauses = Ours.open_pauses(view)
        memo: dict = {}
        return {sid: Ours.next_use(view, s, pauses, memo) for sid, s in self.sessions.items() if s.keys}

    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        """Exactly ``n`` evictable chunks outside ``protected``, the latest expected use first
        (None, changing nothing, if there are fewer): by chunk, the largest (soonest holder's
        ``next_use``, then oldest use), taken level by level: the sessions of one ``next_use``
        (nobody's chunks with the finished and gone) merged by recency, a shared chunk at its
        soonest holder's level. Cost: the sessions' ranking, then only the chunks of the
        levels it reaches (and nobody's: few, as they go first)."""
        if n <= 0:
            return []
        evictable = self._evictable
        if len(evictable) - sum(1 for k in protected if k in evictable) < n:
            return None
        nxt = self.next_use()
        levels: dict[float, list[str]] = {}
        for sid, score in nxt.items():
            levels.setdefault(score, []).append(sid)
        levels.setdefault(math.inf, [])
        rank, owners_of = self._rank, self._owners
        chosen: list[OffloadKey] = []
        taken: set[OffloadKey] = set()
        for score in sorted(levels, reverse=True):
            streams = [sorted((rank[k], k) for k in self.sessions[sid].keys if k in evictable and k not in protected)
                       for sid in levels[score]]
            if score == math.inf:
                streams.append(heapq.nsmallest(n - len(chosen), ((rank[k], k) for k in self._nobody
                                                                if k in evictable and k not in protected)))
            for _, k in heapq.merge(*streams):
                if k in taken:
                    continue
                owners = owners_of[k]
                if owners and min(nxt[o] for o in owners) != score:
                    continue  # a sooner holder keeps it to a later level
                taken.add(k)
                chosen.append(k)
                if len(chosen) == n:
                    break
            if len(chosen) == n:
                break
        out = []
        for k in chosen:
            out.append((k, self.chunks.pop(k)))
            self._evictable.discard(k)
            self._rank.pop(k, None)
            self._disown(k)
        return out
