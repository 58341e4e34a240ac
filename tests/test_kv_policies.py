"""Each KV policy's decisions on hand-made cases (views built by hand, and short replays)."""

from __future__ import annotations

import math
from types import MappingProxyType

import dask
import pytest

from dask_agents.kv.runtime.aeg import AgentGraph
from dask_agents.kv.runtime.policies import LRU, POLICIES, WALRU, Nalar, Ours, Params, get_policy
from dask_agents.kv.offline.simulator import Simulator
from dask_agents.kv.runtime.tool_latency import prior
from dask_agents.kv.runtime.view import FINISHED, PAUSED, RUNNING, Drop, Evict, KVView, Prefetch, SessionView, Trim
from tests.kv_helpers import COST, PARAMS, step, tiers, trace


def session(sid, state=PAUSED, key="file_io", paused_since=0.0, acc=10, host=0, node="act", last_access=0.0):
    """A session view holding ``acc`` accelerator and ``host`` host blocks."""
    return SessionView(sid, state, node, key, last_access, paused_since if state == PAUSED else None,
                       acc + host, acc, host, 0, host, 0)


def view(now, sessions, cap=100, used=None, host=0, graph=None, lru=()):
    """A view at ``now`` over ``sessions`` (use defaults to the sessions' accelerator blocks)."""
    t = tiers(cap, host)
    used = sum(s.accelerator for s in sessions) if used is None else used
    return KVView(now, t, COST, {"accelerator": cap, "host": host, "disk": 0},
                  {"accelerator": used, "host": sum(s.host for s in sessions), "disk": 0},
                  MappingProxyType({s.id: s for s in sessions}), (graph or AgentGraph()).view(), 0,
                  lambda tier: iter(lru), lambda tier: iter(()))


def evicted(actions):
    """Sessions whose blocks the actions free (by Evict, or listed in a Trim)."""
    out = []
    for a in actions:
        out += list(a.sessions) if isinstance(a, Trim) else [a.session] if isinstance(a, Evict) else []
    return out


def trim_target(actions):
    return next(a.target for a in actions if isinstance(a, Trim))


# -- WA-LRU: TTL and thresholds ---------------------------------------------------------------

def test_walru_keeps_a_paused_session_inside_its_ttl_and_evicts_one_past_p95_first():
    p95_file, p95_code = prior("file_io").p95, prior("code_exec").p95
    now = 10.0
    inside = session("inside", key="file_io", paused_since=now - 0.5 * p95_file, last_access=0.0)  # older access
    past = session("past", key="code_exec", paused_since=now - 2 * p95_code, last_access=5.0)
    w = WALRU(PARAMS)
    v = view(now, [inside, past], cap=25, used=20)  # 80%: between theta-low and theta-high
    assert w.ttl(v, inside) == pytest.approx(p95_file) and not w.expired(v, inside) and w.expired(v, past)
    assert list(w.order(v, "accelerator")) == ["past", "inside"]  # past its tool's P95 goes first
    acts = w.tick(v)
    assert evicted(acts) == ["past"]  # the protected one is kept
    assert trim_target(acts) == math.floor(0.70 * 25)  # down to theta-low


def test_walru_thresholds():
    now = 100.0
    fresh = [session(f"s{i}", key="web_api", paused_since=now - 0.1) for i in range(3)]  # all protected
    w = WALRU(PARAMS)
    assert w.tick(view(now, fresh, cap=100, used=30)) == ()  # below theta-low: nothing
    assert evicted(w.tick(view(now, fresh, cap=40, used=30))) == []  # 75%: stale blocks only, nobody expired
    acts = w.tick(view(now, fresh, cap=32, used=30))  # 94% > theta-high: even protected ones go
    assert sorted(evicted(acts)) == ["s0", "s1", "s2"] and trim_target(acts) == math.floor(0.90 * 32)


def test_walru_ttl_is_capped():
    w = WALRU(Params(ttl_max=2.0))
    s = session("w", key="web_api", paused_since=0.0)  # web_api P95 is 4.5 s
    assert w.ttl(view(0, [s]), s) == 2.0
    assert w.expired(view(2.5, [s]), s) and not w.expired(view(1.5, [s]), s)


def test_ours_takes_a_session_paused_past_every_learned_pause_for_gone():
    """No end signal: a session paused 10 s at a key whose 40 observed pauses all ended within
    1.2 s has almost surely left, so it goes before a live session 1 s into a pause that lasts
    about 100 s (by expected next use alone the live one went first: Lindy gives the silent
    one only 10 s more)."""
    g = AgentGraph()
    for i in range(40):
        g.observe_pause("act", "fast", 0.8 + 0.01 * i)
        g.observe_pause("act", "slow", 95.0 + 0.25 * i)
    now = 20.0
    silent = session("silent", key="fast", paused_since=now - 10.0, last_access=now - 10.0)
    live = session("live", key="slow", paused_since=now - 1.0, last_access=now - 1.0)
    v = view(now, [silent, live], graph=g)
    assert Ours.next_use(v, silent) == math.inf and Ours.next_use(v, live) < math.inf
    assert list(Ours(PARAMS).order(v, "accelerator")) == ["silent", "live"]
    just = session("silent", key="fast", paused_since=now - 1.0, last_access=now - 1.0)  # within the pauses seen
    assert Ours.next_use(view(now, [just, live], graph=g), just) < math.inf


def test_ours_discounts_a_wait_where_sessions_pile_up_that_never_came_back():
    """No end signal: at "turn" (a user's think time) 20 pauses were seen to end, all within
    30-49 s; 30 other sessions sit there past 20 s (most of them have left). Of the pauses that
    got past 20 s, 20 ended and 31 are open (its own included): a session 20 s in returns with
    probability 20/51, so its expected next use is 51/20 of its residual pause, and it goes
    before a session of the same residual at a key where it waits alone (20/21)."""
    g = AgentGraph()
    for i in range(20):
        g.observe_pause("act", "turn", 30.0 + i)
        g.observe_pause("act", "tool", 30.0 + i)
    now = 100.0
    waiting = [session(f"w{i}", key="turn", paused_since=now - 20.0 - i) for i in range(30)]
    me = session("me", key="turn", paused_since=now - 20.0, last_access=5.0)
    other = session("other", key="tool", paused_since=now - 20.0, last_access=0.0)
    v = view(now, [me, other, *waiting], cap=1000, graph=g)
    pauses = Ours.open_pauses(v)
    assert len(pauses["turn"]) == 31 and pauses["turn"] == sorted(pauses["turn"])
    residual = g.latency("turn").residual(20.0)
    assert Ours.next_use(v, me) == pytest.approx(residual)  # without the open pauses: as before
    assert Ours.next_use(v, me, pauses) == pytest.approx(residual * (20 + 31) / 20)
    assert Ours.next_use(v, other, pauses) == pytest.approx(residual * (20 + 1) / 20)
    order = list(Ours(PARAMS).order(v, "accelerator"))
    assert order.index("me") < order.index("other")  # (by last access alone "other" went first)


# -- session ends ------------------------------------------------------------------------------

@pytest.mark.parametrize("cls", [Nalar, Ours])
def test_a_finished_session_is_dropped_at_once(cls):
    done = session("done", state=FINISHED)
    live = session("live")
    acts = cls(PARAMS).tick(view(1.0, [done, live], cap=1000))
    assert Drop("done") in acts and Drop("live") not in acts


def test_finished_sessions_leave_memory_at_once_in_a_replay():
    t = trace(step("a", 0, [1, 2, 3], last=True), step("b", 5, [7, 8], last=True))
    for name, keeps in (("lru", True), ("wa_lru", True), ("nalar", False), ("ours", False)):
        sim = Simulator(t, tiers(10), get_policy(name, PARAMS), COST, tick=0.1)
        sim.run()
        assert (len(sim.lru[0]) == 5) is keeps, name  # LRU and WA-LRU keep them until memory is needed


# -- prefetch ----------------------------------------------------------------------------------

def trained_graph(pause=1.0, n=30):
    """An AEG that saw ``n`` pauses of exactly ``pause`` seconds after ``act`` steps (no hint)."""
    g = AgentGraph(min_samples=20)
    for _ in range(n):
        g.observe_pause("act", "after:act", pause)
        g.observe_transition("act", "act", 1.0)
    return g


@pytest.mark.parametrize("cls", [Nalar, Ours, WALRU])
def test_prefetch_starts_before_the_predicted_resume(cls):
    g = trained_graph(pause=1.0)
    restore = COST.transfer_s(10, tiers(100, 50).host)  # 10 blocks from host: 0.1 s
    lead = restore + PARAMS.prefetch_margin
    off = session("off", key="after:act", paused_since=0.0, acc=0, host=10)
    early = cls(PARAMS).tick(view(0.5, [off], cap=100, used=50, host=50, graph=g))
    late = cls(PARAMS).tick(view(1.0 - lead + 0.01, [off], cap=100, used=50, host=50, graph=g))
    assert Prefetch("off") not in early
    assert Prefetch("off") in late  # issued at most `lead` before the resume predicted at 1.0 s


def test_prefetched_session_resumes_without_stall_in_a_replay():
    # 25 sessions teach the AEG that 'act' steps pause exactly 1 s; then 'a' pauses 1 s while 'b'
    # needs the whole accelerator (so 'a' goes to host) and finishes before 'a' resumes.
    steps = []
    for i in range(25):
        steps += [step(f"t{i}", i * 0.01, [], duration=0.0, tool=None),
                  step(f"t{i}", i * 0.01 + 1.0, [], duration=0.0, tool=None, last=True)]
    steps += [step("a", 10.0, [1, 2, 3, 4], duration=0.1, tool=None),
              step("b", 10.2, [5, 6, 7, 8], duration=0.1, last=True),
              step("a", 11.1, [1, 2, 3, 4, 9], duration=0.1, tool=None, last=True)]
    t = trace(*steps)
    out = {}
    for name in ("lru", "ours", "nalar"):
        sim = Simulator(t, tiers(5, 8, host_bw_blocks_per_s=100.0), get_policy(name, PARAMS), COST, tick=0.01)
        out[name] = sim.run()
    assert out["lru"].stall_s > 0 and out["lru"].bytes_prefetched == 0  # restored on demand
    for name in ("ours", "nalar"):
        assert out[name].bytes_prefetched > 0 and out[name].stall_s < out["lru"].stall_s, name
    # The host link moves 100 blocks/s (4 blocks: 0.04 s). Ours starts the prefetch early enough
    # that it is through when 'a' resumes: nothing is restored on demand, and the only stall left
    # is 'b' waiting for 'a''s 3 blocks to be copied out to make room at 10.2 s.
    host = tiers(5, 8, host_bw_blocks_per_s=100.0).host
    assert out["ours"].bytes_restored == 0
    assert out["ours"].stall_s == pytest.approx(COST.transfer_s(3, host))


# -- Nalar's offload rule ----------------------------------------------------------------------

def test_nalar_offloads_only_sessions_idle_longer_than_the_round_trip():
    g = AgentGraph()
    long_ = session("long", key="code_exec", paused_since=0.0, acc=40)   # code_exec mean ~1.5 s
    short = session("short", key="file_io", paused_since=0.0, acc=40)    # file_io mean ~0.1 s
    v = view(0.0, [long_, short], cap=84, used=80, host=100, graph=g)   # 95% used, reserve 10%
    round_trip = 2 * COST.transfer_s(40, tiers(1, 100).host)
    assert g.latency("code_exec").mean() > round_trip > g.latency("file_io").mean()
    assert evicted(Nalar(PARAMS).tick(v)) == ["long"]
    assert evicted(Nalar(PARAMS).tick(view(0.0, [long_, short], cap=84, used=80, graph=g))) == []  # no host


# -- orders and registry -----------------------------------------------------------------------

def test_lru_order_is_the_views_lru_order():
    assert list(LRU(PARAMS).order(view(0, [], lru=(5, 4, 3)), "accelerator")) == [5, 4, 3]
    assert LRU(PARAMS).tick(view(0, [])) == ()


def test_ours_orders_by_expected_next_use():
    g = AgentGraph()
    now = 30.0
    soon = session("soon", key="file_io", paused_since=now - 0.01)
    running = session("run", state=RUNNING)
    tail = session("tail", key="code_exec", paused_since=now - 20.0)  # past P95: long residual
    done = session("done", state=FINISHED)
    order = list(Ours(PARAMS).order(view(now, [soon, running, tail, done], cap=1000, graph=g), "accelerator"))
    assert order.index("done") < order.index("tail") < order.index("soon")
    assert math.isinf(Ours.next_use(view(now, [done]), done))


def test_registry_and_config():
    assert set(POLICIES) == {"lru", "wa_lru", "nalar", "ours"}
    with pytest.raises(ValueError, match="unknown KV policy 'belady'.*lru, wa_lru, nalar, ours"):
        get_policy("belady")
    with dask.config.set({"agents.kv.theta-low": 0.5, "agents.kv.ttl-max": "3s"}):
        p = Params.from_config()
    assert p.theta_low == 0.5 and p.ttl_max == 3.0 and p.theta_high == 0.90
    with pytest.raises(ValueError, match="theta-low"):
        Params(theta_low=0.95, theta_high=0.9)


def test_walru_keeps_memory_under_theta_high_after_every_look():
    from dask_agents.kv.offline.traces import GenParams, generate

    t = generate(GenParams(sessions=8, seed=5, block_size=4, system_tokens=16, task_tokens=16, user_tokens=4,
                           summary_tokens=16, max_context=400))
    cap = t.peak_running() + 20
    sim = Simulator(t, tiers(cap), WALRU(PARAMS), COST, tick=0.25)
    apply, checked = sim._apply, []

    def check(actions, now):
        apply(actions, now)
        # What the enforcer may not take: pinned blocks and blocks other live sessions share.
        stuck = sum(1 for b in sim.lru[0] if b in sim.pins or sim.live.get(b, 0) > 1)
        assert len(sim.lru[0]) <= max(PARAMS.theta_high * cap, stuck) + 1e-9
        checked.append(now)

    sim._apply = check
    sim.run()
    assert checked
