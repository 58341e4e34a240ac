"""Our policy inside vLLM's offloading (kv/runtime/offload_policy.py), driven through vLLM's own
``CPUOffloadingManager`` (the OffloadingConnector's host tier, loaded by its out-of-tree policy
path as the connector loads it): what a request does there is lookup, load its hits, store the
rest, finish."""

from __future__ import annotations

import heapq
import itertools
import random

import pytest

pytest.importorskip("vllm.v1.kv_offload.cpu.policies.base")

from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key  # noqa: E402
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager  # noqa: E402

from dask_agents.kv.runtime import offload_policy as op  # noqa: E402

_ids = itertools.count()


def _manager(chunks: int, policy: str = "ours") -> CPUOffloadingManager:
    if policy == "ours":
        return CPUOffloadingManager(chunks, cache_policy=op.SessionCachePolicy.__name__,
                                    cache_policy_module_path=op.__name__)
    return CPUOffloadingManager(chunks, cache_policy=policy)


def _chain(*names: str) -> list:
    return [make_offload_key(n.encode().ljust(16, b"."), 0) for n in names]


def _request(m: CPUOffloadingManager, keys: list, session: str | None = None, states: tuple = ()) -> dict:
    """One request through the manager as the connector drives it: its prefix's hits are
    loaded, the rest stored; returns what hit and what its store evicted (None: no room)."""
    ctx = ReqContext(req_id=f"r{next(_ids)}", kv_hints=op.envelope(session, states))
    for i, k in enumerate(keys):
        ctx.set_offload_key_position(k, (i + 1) * 16)
    m.on_new_request(ctx)
    hits = []
    for k in keys:
        if m.lookup(k, ctx) != LookupResult.HIT:
            break
        hits.append(k)
    if hits:
        m.prepare_load(hits, ctx)
        m.complete_load(hits, ctx)
    out = m.prepare_store(keys, ctx)
    if out is not None:
        m.complete_store(out.keys_to_store, ctx)
    m.on_request_finished(ctx)
    return {"hits": hits, "evicted": None if out is None else list(out.evicted_keys)}


def test_without_hints_it_evicts_exactly_as_vllms_lru():
    """No session named anywhere: the same evictions, in the same order, as vLLM's LRU on a
    random stream of growing, branching and shared chains."""
    rng = random.Random(7)
    ours, lru = _manager(40), _manager(40, "lru")
    chains = {s: [f"sys{i}" for i in range(4)] for s in range(12)}
    for step in range(400):
        s = rng.randrange(12)
        chains[s] = chains[s] + [f"s{s}-{step}-{j}" for j in range(rng.randrange(1, 6))]
        if rng.random() < 0.1:
            chains[s] = chains[s][: rng.randrange(4, len(chains[s]) + 1)]  # a branch
        keys = _chain(*chains[s])
        assert _request(ours, keys) == _request(lru, keys), step


def test_finished_then_the_latest_expected_use_go_first_a_shared_prefix_stays():
    """Three sessions share a system prompt. B pauses on a quick file read, A on a test run,
    C ends; then a new session needs room. LRU would take B's chunks (its request came first);
    ours takes C's (finished), then A's (its tool runs for long), tail first, and keeps the
    shared prompt and B's."""
    now = [1000.0]
    m = _manager(16)
    m._policy.clock = lambda: now[0]
    sys_ = ["sys0", "sys1"]
    b, a, c = _chain(*sys_, "b0", "b1", "b2"), _chain(*sys_, "a0", "a1", "a2"), _chain(*sys_, "c0", "c1", "c2")
    _request(m, b, "B")
    _request(m, a, "A")
    _request(m, c, "C")
    now[0] += 0.01
    states = [("B", "paused", "coder", "file_io", now[0]), ("A", "paused", "coder", "code_exec", now[0]),
              ("C", "finished", "coder", None, now[0])]
    new = _chain(*sys_, "d0", "d1", "d2", "d3", "d4", "d5")  # 6 new chunks, 5 free: one must go
    got = _request(m, new, "D", tuple(states))
    assert got["hits"] == new[:2]
    assert got["evicted"] == [c[4]]  # C ended: its tail first
    more = _chain(*sys_, "d0", "d1", "d2", "d3", "d4", "d5", "d6", "d7", "d8", "d9", "d10")
    got = _request(m, more, "D")  # 5 more, none free
    assert got["evicted"] == [c[3], c[2], a[4], a[3], a[2]]  # the rest of C, then A (a test run), tail first
    policy = m._policy
    assert all(k in policy.chunks for k in b)  # B (back soon) and the shared prompt kept
    assert policy.hints_applied == 3

    lru = _manager(16, "lru")
    for keys in (b, a, c):
        _request(lru, keys)
    assert _request(lru, new)["evicted"] == [b[4]]  # what LRU takes: B, about to come back


def test_context_a_session_left_behind_goes_before_what_sessions_still_hold():
    """S compacts its context (a new chain after the system prompt): its old chain's chunks are
    no longer its, and go first, before the chunks of P (paused on a long test run), which a
    session ranking by owner alone would have taken (S comes back soon)."""
    now = [50.0]
    m = _manager(8)
    m._policy.clock = lambda: now[0]
    a = _chain("sys", "a0", "a1", "a2")
    p = _chain("sys", "p0", "p1")
    _request(m, a, "S")
    _request(m, p, "P")
    compacted = _chain("sys", "b0")
    assert _request(m, compacted, "S")["hits"] == compacted[:1]
    states = (("P", "paused", "coder", "code_exec", now[0]), ("S", "paused", "coder", "file_io", now[0]))
    got = _request(m, _chain("n0", "n1", "n2"), "N", states)
    assert got["evicted"] == [a[3], a[2]]  # S's old chain, tail first
    assert all(k in m._policy.chunks for k in p + compacted)


def _reference_evict(policy: op.SessionCachePolicy, n: int, protected: set) -> list | None:
    """What evict must pick, by its definition, computed the slow way: every candidate ranked by
    (its soonest holder's next use, oldest use first)."""
    candidates = [k for k in policy._evictable if k not in protected]
    if len(candidates) < n:
        return None
    nxt = policy.next_use()

    def order(k):
        owners = policy._owners.get(k)
        return (min(nxt[s] for s in owners) if owners else float("inf")), -policy._rank[k]

    return heapq.nlargest(n, candidates, key=order)


def test_evicting_level_by_level_picks_what_ranking_every_chunk_would():
    """The eviction walks sessions by expected use and reads only the chunks of the levels it
    reaches; on random agent traffic (shared prompts, compactions, tool pauses of every kind,
    ends, chunks in use) it picks the same chunks, in the same order, as ranking them all."""
    rng = random.Random(3)
    now = [0.0]
    m = _manager(60)
    policy = m._policy
    policy.clock = lambda: now[0]
    fast = policy.evict
    calls = []

    def checked(n, protected):
        want = _reference_evict(policy, n, protected)
        got = fast(n, protected)
        assert (None if got is None else [k for k, _ in got]) == want
        calls.append(n)
        return got

    policy.evict = checked
    chains = {s: ["sys0", "sys1"] for s in range(10)}
    kinds = ["file_io", "code_exec", "web_api", None]
    hints: list = []
    for step in range(600):
        now[0] += rng.expovariate(2.0)
        s = rng.randrange(10)
        if rng.random() < 0.08:
            chains[s] = ["sys0", "sys1", f"sum{s}-{step}"]  # a compaction
        chains[s] = chains[s] + [f"s{s}-{step}-{j}" for j in range(rng.randrange(1, 5))]
        _request(m, _chain(*chains[s]), f"S{s}", tuple(hints))
        hints = [(f"S{s}", "finished" if rng.random() < 0.05 else "paused", "coder", rng.choice(kinds), now[0])]
        if hints[0][1] == "finished":
            chains[s] = ["sys0", "sys1"]
    assert len(calls) > 100 and len(policy.chunks) > 30, (len(calls), len(policy.chunks))
    for _ in range(50):  # and direct calls with arbitrary protected sets
        keys = list(policy.chunks)
        protected = set(rng.sample(keys, rng.randrange(len(keys) + 1)))
        checked(rng.randrange(1, 8), protected)


def test_a_request_that_cannot_find_room_changes_nothing():
    """Evict is all or nothing: with every other chunk protected or in use, the store is
    refused and the cache is as it was."""
    m = _manager(4)
    first = _chain("x0", "x1", "x2", "x3")
    _request(m, first, "X")
    before = dict(m._policy.chunks)
    assert m._policy.evict(5, set()) is None
    assert m._policy.evict(1, set(first)) is None
    assert m._policy.chunks == before


def test_a_pause_teaches_the_model_and_a_session_never_back_ranks_as_gone():
    """A session's next request after a pause on a tool kind adds that pause to the kind's
    latency model; past nearly every pause seen to end there, a session counts as gone."""
    now = [0.0]
    m = _manager(64)
    policy = m._policy
    policy.clock = lambda: now[0]
    for i in range(30):
        _request(m, _chain("sys", f"s{i}-0"), f"s{i}")
        ended = now[0]
        now[0] += 2.0  # a pause on web_api of 2 s; the hint saying so comes with the next request
        _request(m, _chain("sys", f"s{i}-0", f"s{i}-1"), f"s{i}", ((f"s{i}", "paused", "coder", "web_api", ended),))
    lat = policy.graph.latency("web_api")
    assert lat.n == 30 and lat.mean() == pytest.approx(2.0)
    t = now[0]
    _request(m, _chain("sys", "late-0"), "late")
    now[0] += 1.0
    _request(m, _chain("sys", "soon-0"), "soon", (("late", "paused", "coder", "web_api", t),))
    _request(m, _chain("sys", "x-0"), "x", (("soon", "paused", "coder", "web_api", now[0]),))
    now[0] += 0.5
    nxt = policy.next_use()
    assert nxt["late"] < nxt["soon"]  # paused 1.5 s and 0.5 s where every pause lasted 2 s
    now[0] += 10.0
    nxt = policy.next_use()
    assert nxt["late"] == float("inf") and nxt["soon"] == float("inf")  # past every pause seen to end


def test_chunks_stored_by_a_running_request_belong_to_its_session_at_once():
    """A long request stores chunks and is still running when another request needs room:
    they are its session's (a running session's KV is needed soon), not nobody's, so chunks
    of no session go before them."""
    m = _manager(6)
    _request(m, _chain("o0", "o1", "o2"))  # no session: nobody's
    ctx = ReqContext(req_id="long", kv_hints=op.envelope("L"))
    keys = _chain("l0", "l1", "l2")
    m.on_new_request(ctx)
    out = m.prepare_store(keys, ctx)
    m.complete_store(out.keys_to_store, ctx)  # stored; the request runs on
    policy = m._policy
    assert all(policy._owners[k] == {"L"} for k in keys)
    got = _request(m, _chain("n0", "n1"), "N")
    assert set(got["evicted"]) <= set(_chain("o0", "o1", "o2"))
    m.on_request_finished(ctx)


def test_malformed_hints_are_skipped():
    """Hints of another protocol, unknown states, bad times or no session change nothing."""
    from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope

    m = _manager(8)
    bad = KvHintsEnvelope(protocol_version="other/1", message_id="x",
                          actions=[KvHintAction("1", "dask-agents.request", "1", {"session": "S"})])
    ctx = ReqContext(req_id="r-bad", kv_hints=bad)
    m.on_new_request(ctx)
    m.prepare_store(_chain("k0"), ctx)
    m.on_request_finished(ctx)
    assert "S" not in m._policy.sessions
    _request(m, _chain("k1"), "T", (("T", "sleeping", None, None, 0.0), ("T", "paused", None, None, float("nan")),
                                    ("", "paused", None, None, 0.0)))
    st = m._policy.sessions["T"]
    assert st.state == "paused" and m._policy.hints_applied == 1


def test_extra_config_names_the_policy_for_the_connector():
    """What the OffloadingConnector's spec reads: the host tier's size, our policy's class and
    module (vLLM loads it out of tree by that path)."""
    from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory

    cfg = op.extra_config(1 << 30)
    assert cfg["cpu_bytes_to_use"] == 1 << 30
    cls = CachePolicyFactory.get_cache_policy_cls(cfg["eviction_policy"], cfg["cache_policy_module_path"])
    assert cls is op.SessionCachePolicy
