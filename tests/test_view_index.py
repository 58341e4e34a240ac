"""The incremental view index (scheduler_plugin/view_index.py) against a from-scratch rebuild,
the balance policy's sorted thief pools against its linear scan, and a tiny run of
benchmarks/control_scale.py. The scheduler here is the benchmark's emulated one: the real
plugin's hooks run against it, as Dask would call them."""

from __future__ import annotations

import json
import random
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks import control_scale as cs
from dask_agents.calls import ANNOTATION
from dask_agents.scheduler_plugin.actions import Migrate, SetPriority
from dask_agents.scheduler_plugin.policies.balance import LateBindingBalance
from dask_agents.scheduler_plugin.view import CallView, ClusterView, ComponentView, WorkerView
from dask_agents.scheduler_plugin.view_index import BindingMap, PlacedMap, Tally, scan_view

BIG = 10**9
FIELDS = ("workers", "calls", "sessions", "components", "kv_affinity", "kv_tokens", "models")


def _views(em: cs.Emulation, max_calls: int = BIG) -> tuple[ClusterView, ClusterView]:
    """(incremental, rebuilt) views of the same instant."""
    p = em.plugin
    now = time.time()
    idle = dict(p.view_index.idle_since)
    inc = p.view_index.build(now, max_calls, ())
    ref = scan_view(p.view_sources, now, BIG, idle, ())
    return inc, ref


def _assert_equal(inc: ClusterView, ref: ClusterView) -> None:
    for f in FIELDS:
        a, b = dict(getattr(inc, f)), dict(getattr(ref, f))
        assert a == b, f"{f} differs: only incremental {set(a.items()) - set(b.items())!r:.800}, " \
                       f"only rebuilt {set(b.items()) - set(a.items())!r:.800}"
    assert inc.truncated == ref.truncated and inc.draining == ref.draining


def _processing(em: cs.Emulation, pick: int, started: bool | None = False) -> cs.ETask | None:
    """A processing task (not started, started, or either), chosen by ``pick``."""
    cands = [em.s.tasks[k] for k in em.open if em.s.tasks[k].state == "processing"]
    if started is not None:
        cands = [t for t in cands if (t in t.processing_on.executing or t in t.processing_on.long_running) == started]
    return cands[pick % len(cands)] if cands else None


def _apply(em: cs.Emulation, op: str, pick: int) -> None:
    """One random event: Dask's own moves, hooks, the enforcement layer, a control tick..."""
    p, s = em.plugin, em.s
    if op == "session":
        em.add_session()
    elif op == "churn":
        em.churn(1 + pick % 25)
    elif op == "steal":  # Dask moved a queued task without a transition (its own stealing)
        ts = _processing(em, pick)
        if ts is not None:
            thief = s.workers[sorted(s.workers)[pick % len(s.workers)]]
            s.extensions["stealing"].move_task_request(ts, ts.processing_on, thief)
    elif op == "refused":  # the plugin recorded a move the victim then refused
        ts = _processing(em, pick)
        if ts is not None:
            target = sorted(s.workers)[pick % len(s.workers)]
            if target != ts.processing_on.address:
                p.on_migrated(ts.key, ts.processing_on.address, target)
    elif op == "migrate":
        ts = _processing(em, pick)
        if ts is not None:
            target = sorted(s.workers)[pick % len(s.workers)]
            p.control.enforcer.apply([Migrate(ts.key, ts.processing_on.address, target)], "test")
    elif op == "priority":
        keys = [k for k in em.open if s.tasks[k].state in ("processing", "queued", "waiting")]
        if keys:
            key = keys[pick % len(keys)]
            p.control.enforcer.apply([SetPriority(key, (0, 0, -pick % 7, 0, pick))], "test")
    elif op == "report":  # an LLM call's worker reported its tokens: the session's context grows
        keys = [k for k in em.open if p.state.calls[k].kind == "llm" and s.tasks[k].state == "processing"]
        if keys:
            key = keys[pick % len(keys)]
            p._on_reports(worker=s.tasks[key].processing_on.address, reports=[{
                "key": key, "started": 1.0, "finished": 2.0,
                "metrics": {"prompt_tokens": 100 + pick % 50, "output_tokens": 8}}])
    elif op == "close":
        sids = sorted(p.state.sessions)
        if sids:
            p.sessions.close(sids[pick % len(sids)], time.time())
    elif op == "tick":  # every default policy through the enforcement layer, window bounded
        p.control.max_calls = 1 + pick % 40
        p.control.tick()
    elif op == "bounded":
        _check_bounded(em, 1 + pick % 30)


def _check_bounded(em: cs.Emulation, max_calls: int) -> None:
    """A bounded window: whole worker queues, each exactly as the full rebuild has it."""
    inc, ref = _views(em, max_calls)
    assert set(inc.calls) <= set(ref.calls)
    for key, cv in inc.calls.items():
        assert ref.calls[key] == cv
    for address, wv in inc.workers.items():
        assert wv == ref.workers[address]  # complete queue, same counters
    on_workers = sum(len(w.queued) for w in inc.workers.values())
    assert on_workers <= max(max_calls, max((len(w.queued) for w in inc.workers.values()), default=0))
    assert inc.truncated or dict(inc.calls) == dict(ref.calls)


OPS = ["session", "session", "churn", "churn", "churn", "steal", "refused", "migrate", "priority", "report",
       "close", "tick", "bounded"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), workers=st.integers(1, 9),
       ops=st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 10**6)), min_size=1, max_size=40))
def test_incremental_view_equals_a_rebuild_after_random_events(seed, workers, ops):
    em = cs.Emulation(workers, seed=seed, nthreads=2)
    for _ in range(1 + seed % 6):
        em.add_session()
    for op, pick in ops:
        _apply(em, op, pick)
        _assert_equal(*_views(em))


def test_the_window_rotates_over_every_waiting_call():
    em = cs.Emulation(16, seed=3, nthreads=2)
    em.fill(600)
    full = set(_views(em)[1].calls)
    seen: set = set()
    for _ in range(len(full)):  # carry-over: bounded ticks together cover every waiting call
        inc = em.plugin.view_index.build(time.time(), 8, ())
        assert len(inc.calls) <= 8 + max(len(w.queued) for w in inc.workers.values())
        seen |= set(inc.calls)
        if seen >= full:
            break
    assert seen >= full and len(full) > 40


def _lose_worker(em: cs.Emulation, gone: str) -> None:
    """``gone`` leaves as Dask handles it: its processing tasks are released to run again
    (``waiting``), then the plugin's ``remove_worker`` hook runs."""
    s = em.s
    ws = s.workers.pop(gone)
    s.running.discard(ws)
    for ts in list(ws.processing):
        em.transition(ts, "waiting")
    em.plugin.remove_worker(s, gone, stimulus_id="test-remove")


def test_a_removed_worker_leaves_nothing_behind():
    em = cs.Emulation(4, seed=5, nthreads=2)
    em.fill(400)
    p = em.plugin
    gone = "tcp://w0:1"  # the engine worker: it holds the LLM sessions' KV
    for key in [k for k in em.open if p.state.calls[k].kind == "llm"][:20]:  # sessions' KV sizes
        p._on_reports(worker=gone, reports=[{"key": key, "started": 1.0, "finished": 2.0,
                                             "metrics": {"prompt_tokens": 300, "output_tokens": 9}}])
    _assert_equal(*_views(em))
    vi = p.view_index
    assert vi.kv_tokens and gone in vi.where.values() and gone in p.placed_by_worker
    bound_there = {sid for (sid, _what), w in p.bindings.items() if w == gone}
    assert bound_there
    _lose_worker(em, gone)
    # straight after the hook, before any tick repairs anything
    assert gone not in vi.where.values() and gone not in vi.started and gone not in vi.on_worker
    assert all(w != gone for (_c, w) in vi.per_replica) and gone not in vi.idle_since and gone not in vi.ring
    assert not any(sid in bound_there for sid, _m in vi.kv_tokens)
    assert gone not in p.bindings.values() and not p.bindings.keys_on(gone)
    assert gone not in p.placed_by_worker and all(w != gone for w, _ in p.placed.values())
    assert all(w != gone for w, _ in p.open_placed) and gone not in p.bound
    # the LLM calls that waited on it were placed again on live workers
    assert p.recovery.counts["rerouted"] > 0 and p.recovery.counts["workers_lost"] == 1
    for ts in em.s.tasks.values():
        if ts.state in ("waiting", "no-worker", "queued", "released", "processing"):  # finished ones keep theirs
            # a loose preference (the model= hint's engine worker) may name it: Dask ignores it then
            assert ts.loose_restrictions or gone not in (ts.worker_restrictions or ()), ts.key
    inc, ref = _views(em)
    _assert_equal(inc, ref)


def _loose_calls(em: cs.Emulation, n: int, component: str = "echo") -> list[cs.ETask]:
    """``n`` session-less calls (plain submits of a tool), through ``update_graph``."""
    anns, tasks = {}, []
    for _ in range(n):
        ts = cs.ETask(f"{component}-loose-{em.order}", set(), em.order)
        em.order += 1
        em.s.tasks[ts.key] = ts
        tasks.append(ts)
        anns[ts.key] = {"call": ts.key, "component": component, "kind": "tool", "session": None}
    em.plugin.update_graph(em.s, client="c", keys={t.key for t in tasks}, tasks=[t.key for t in tasks],
                           annotations={ANNOTATION: anns}, priority={}, stimulus_id="test")
    return tasks


def test_calls_evicted_from_the_state_leave_the_index_when_they_end():
    em = cs.Emulation(3, seed=2, nthreads=2)
    p = em.plugin
    p.state.max_loose_calls = 10
    first = _loose_calls(em, 10)
    for i, ts in enumerate(first):
        em.transition(ts, "waiting")
        em.transition(ts, "processing")
        if i % 2:
            ts.processing_on.executing[ts] = 0.0  # started: a tick moves it to ``started``
    p.view_index.build(time.time(), BIG, ())
    vi = p.view_index
    assert any(vi.started.values()) and vi.replica_load("echo") and all(t.key in vi.where for t in first)
    second = _loose_calls(em, 10)  # past max_loose_calls: the first ten records are evicted, running
    assert not any(t.key in p.state.calls for t in first)
    for ts in first:
        em.transition(ts, "memory")
    keys = {t.key for t in first}
    assert not keys & set(vi.where) and not any(keys & set(st) for st in vi.started.values())
    assert not any(keys & set(q) for q in vi.on_worker.values()) and not vi.replica_load("echo")
    for ts in second:  # the index goes on as usual for the calls still recorded
        em.transition(ts, "waiting")
        em.transition(ts, "queued")
    assert set(vi.sched_queued) == {t.key for t in second}
    p.state.max_loose_calls = 0
    _loose_calls(em, 1)  # evicts the queued ones too
    for ts in second:
        em.transition(ts, "forgotten")
    assert not vi.sched_queued
    _assert_equal(*_views(em))


def test_binding_map_keeps_the_llm_affinity_in_step():
    b = BindingMap({("s1", "llm:coder"): "A", ("s1", "Dev"): "B"})
    b[("s2", "llm:coder")] = "C"
    b.setdefault(("s3", "llm:chat"), "D")
    assert dict(b.llm) == {("s1", "coder"): "A", ("s2", "coder"): "C", ("s3", "chat"): "D"}
    del b[("s1", "llm:coder")]
    assert b.pop(("s2", "llm:coder")) == "C" and b.pop(("nope", "llm:x"), None) is None
    assert dict(b.llm) == {("s3", "chat"): "D"} and dict(b) == {("s1", "Dev"): "B", ("s3", "llm:chat"): "D"}
    b.clear()
    assert dict(b.llm) == {} and not b


def test_binding_map_indexes_bindings_by_worker():
    b = BindingMap({("s1", "llm:coder"): "A", ("s1", "Dev"): "A", ("s2", "Dev"): "B"})
    assert sorted(b.keys_on("A")) == [("s1", "Dev"), ("s1", "llm:coder")] and b.keys_on("Z") == []
    b[("s1", "Dev")] = "B"  # rebound: leaves A's index
    assert b.keys_on("A") == [("s1", "llm:coder")] and sorted(b.keys_on("B")) == [("s1", "Dev"), ("s2", "Dev")]
    del b[("s1", "llm:coder")]
    b.pop(("s2", "Dev"))
    assert "A" not in b.by_worker and b.keys_on("B") == [("s1", "Dev")]
    assert b.popitem() == (("s1", "Dev"), "B") and b.by_worker == {} and dict(b.llm) == {}


def test_placed_map_and_tally_keep_their_indexes():
    pm = PlacedMap()
    pm["k1"] = ("A", "llm:coder")
    pm.update({"k2": ("A", "Dev"), "k3": ("B", "Dev")})
    assert pm.by_worker == {"A": {"k1": "llm:coder", "k2": "Dev"}, "B": {"k3": "Dev"}}
    pm["k1"] = ("B", "llm:coder")
    assert pm.by_worker == {"A": {"k2": "Dev"}, "B": {"k3": "Dev", "k1": "llm:coder"}}
    del pm["k2"]
    assert pm.pop("k3") == ("B", "Dev") and pm.pop("nope", None) is None
    assert pm.by_worker == {"B": {"k1": "llm:coder"}}
    pm.clear()
    assert pm.by_worker == {} and not pm
    t = Tally()
    assert t[("A", "Dev")] == 0 and not t  # a read inserts nothing
    t[("A", "Dev")] += 1
    t.decrement(("A", "Dev"))
    t.decrement(("B", "Dev"))  # never below zero, never a zero entry
    assert t == {}


def test_moving_or_rebinding_a_placed_call_keeps_the_bookkeeping():
    em = cs.Emulation(4, seed=7, nthreads=2)
    em.fill(150)
    p = em.plugin
    key, (source, what) = next((k, v) for k, v in p.placed.items() if v[1].startswith("llm:"))
    target = next(w for w in em.s.workers if w != source)
    before = p.open_placed[(source, what)]
    assert p.placement.move_placed(key, target) == (source, what)
    assert p.placed[key] == (target, what) and p.placed_by_worker[target][key] == what
    assert key not in p.placed_by_worker.get(source, {}) and p.open_placed[(source, what)] == before - 1
    assert p.placement.move_placed("not-placed", target) is None
    # a session rebound to another engine (its old one is no longer a candidate): the new
    # engine never held its KV, so the context to recompute there is not the old engine's
    sid = next(sid for (sid, w), _ in p.bindings.items() if w == what and p.state.sessions[sid].state != "completed")
    p.state.sessions[sid].context_tokens[what[4:]] = 500
    old = p.bindings[(sid, what)]
    new_engine = next(w for w in em.s.workers if w != old)
    ts = cs.ETask(f"{cs.LLM}-{sid}-extra", set(), em.order)
    em.s.tasks[ts.key] = ts
    p.state.touched.discard(sid)
    p.placement.place(ts, sid, what, [new_engine])
    assert p.bindings[(sid, what)] == new_engine and what[4:] not in p.state.sessions[sid].context_tokens
    assert sid in p.state.touched  # the view's kv_tokens entry is redone at the next tick


# -- balance: sorted thief pools choose exactly what the scan chose ---------------------------

class ScanBalance(LateBindingBalance):
    """The same policy forced onto its linear scan (an overridden ``movable`` disables pools)."""

    def movable(self, call, thief):
        return super().movable(call, thief)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_balance_pools_match_the_linear_scan(data):
    rng = random.Random(data.draw(st.integers(0, 2**20)))
    n_workers = data.draw(st.integers(2, 12))
    calls, workers = [], []
    for w in range(n_workers):
        models = tuple(m for m in ("coder", "chat") if rng.random() < 0.4)
        queued = []
        for _ in range(rng.choice([0, 0, 1, 3, 8, 20])):
            k = f"c{len(calls)}"
            model = rng.choice([None, None, "coder", "chat"])
            calls.append(CallView(
                key=k, component=rng.choice(["Dev", "Test", "llm.coder"]), kind="llm" if model else "agent",
                session=f"s{rng.randrange(5)}", tenant=None, worker=f"W{w}", priority=(0, 0, 0, 0, rng.randrange(100)),
                created=0.0, ready=0.0, stateful=rng.random() < 0.1, model=model, restricted=rng.random() < 0.05,
                input_bytes=rng.choice([0, 10**5, 10**7]), batch_max=None))
            queued.append(k)
        queued.sort(key=lambda k: calls[int(k[1:])].priority)
        workers.append(WorkerView(address=f"W{w}", nthreads=rng.choice([1, 2, 4]),
                                  processing=len(queued) + rng.randrange(3), running=rng.randrange(3),
                                  queued=tuple(queued), models=models,
                                  idle_since=rng.choice([None, 0.0, 99.9]), agents_ready=rng.random() < 0.9))
    comps = {c: ComponentView(c, rng.choice([None, 0.01, 0.2, 1.0]), 10, 1.0) for c in ("Dev", "Test", "llm.coder")}
    affinity = {(f"s{i}", "coder"): f"W{rng.randrange(n_workers)}" for i in range(5) if rng.random() < 0.5}
    view = ClusterView.freeze(100.0, {w.address: w for w in workers}, {c.key: c for c in calls}, {}, comps, affinity)
    opts = {"alpha": rng.choice([0.0, 0.2]), "beta": rng.choice([0.0, 0.02]), "max_moves": rng.choice([3, 64])}
    assert list(LateBindingBalance(**opts)(view)) == list(ScanBalance(**opts)(view))


# -- fast view constructors and the pass budget --------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_fast_constructors_build_what_the_dataclasses_build(data):
    """``make_*_view`` (slots set through their descriptors) against the dataclasses' own
    ``__init__``: equal objects of the same type, still frozen; a wrong number of values is
    refused (a field added to a view without its call site fails here)."""
    import dataclasses

    import pytest

    from dask_agents.scheduler_plugin import view as v

    values = {str: st.text(max_size=5), "s?": st.none() | st.text(max_size=5), int: st.integers(-5, 10**6),
              float: st.floats(allow_nan=False), "f?": st.none() | st.floats(allow_nan=False), bool: st.booleans(),
              tuple: st.tuples(st.integers(), st.integers()), "t": st.lists(st.text(max_size=3), max_size=3).map(tuple),
              "i?": st.none() | st.integers(1, 64)}
    types = {"address": str, "nthreads": int, "processing": int, "running": int, "queued": "t", "models": "t",
             "idle_since": "f?", "agents_ready": bool, "key": str, "component": str, "kind": str, "session": "s?",
             "tenant": "s?", "worker": "s?", "priority": tuple, "created": float, "ready": "f?", "stateful": bool,
             "model": "s?", "restricted": bool, "input_bytes": int, "batch_max": "i?", "id": str, "progress": int,
             "open_calls": int, "state": str, "workflow": "s?"}
    for cls, make in ((v.WorkerView, v.make_worker_view), (v.CallView, v.make_call_view),
                      (v.SessionView, v.make_session_view)):
        fs = dataclasses.fields(cls)
        kwargs = {f.name: data.draw(values[types[f.name]]) for f in fs}
        made = make(*kwargs.values())
        assert made == cls(**kwargs) and type(made) is cls
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(made, fs[0].name, None)
        with pytest.raises(TypeError, match=f"{cls.__name__} needs its {len(fs)} fields"):
            make(*list(kwargs.values())[:-1])
    with pytest.raises(TypeError, match="slotted dataclass without default_factory"):
        v.fast_constructor(ClusterView)


def test_a_pass_over_budget_narrows_the_window_and_every_waiting_call_is_still_seen():
    """With a pass budget no pass can meet, the window falls to its floor; whole worker queues
    still rotate through it, so every call waiting throughout is in some view; with the budget
    off the window is max_calls again."""
    em = cs.Emulation(64, seed=3)
    em.fill(6000)
    loop = em.plugin.control
    loop.incremental = True
    loop.max_calls = 1000
    loop.pass_budget = 1e-9
    waiting = {k for k in em.open if em.s.tasks[k].state in ("processing", "queued")
               and not (em.s.tasks[k].state == "processing"
                        and (em.s.tasks[k] in em.s.tasks[k].processing_on.executing
                             or em.s.tasks[k] in em.s.tasks[k].processing_on.long_running))}
    assert len(waiting) > 2 * loop.MIN_WINDOW
    seen: set = set()
    windows = []
    for _ in range(60):
        windows.append(loop.window)
        view = loop.build_view()
        # a window cuts between worker queues, never inside one (at most one whole queue over)
        longest = max((len(w.queued) for w in view.workers.values()), default=0)
        assert len([c for c in view.calls.values() if c.worker]) <= loop.window + longest
        seen |= set(view.calls)
        loop.adapt_window(1.0, len(view.calls))
    assert windows[0] == 1000 and windows[-1] == loop.MIN_WINDOW and windows == sorted(windows, reverse=True)
    assert waiting <= seen
    loop.pass_budget = 10.0  # fast passes: it grows back, by steps, up to max_calls
    grown = []
    for _ in range(40):
        loop.adapt_window(0.0, 0)
        grown.append(loop.window)
    assert grown[0] > loop.MIN_WINDOW and grown[-1] == 1000 and grown == sorted(grown)
    loop.pass_budget = 1e-9
    loop.adapt_window(1.0, 10)  # the window was not what made it slow (10 calls): not cut
    assert loop.window == 1000
    loop.adapt_window(1.0, 1000)
    assert loop.window == 800
    loop.pass_budget = 0.0
    loop.adapt_window(1.0, 1000)
    assert loop.window == 1000
    loop.max_calls = 50  # an operator's lower bound wins at once
    assert loop.window == 50


def test_a_view_does_not_change_with_what_happens_after_it():
    """Policies read a view on other threads while the hooks go on: nothing the index does
    after building a view (sessions touched, a session's context growing, an LLM binding
    made or lost with its worker) may show through the view's sessions, ``kv_affinity`` or
    ``kv_tokens`` (the immutable maps are handed over without a copy)."""
    em = cs.Emulation(16, seed=5)
    em.fill(800)
    p, idx = em.plugin, em.plugin.view_index
    idx.sync_sessions()
    bound = [k for k in p.bindings.llm.keys() if k[0] in idx.sessions]
    assert bound, "the emulation binds sessions to engines"
    sid, model = bound[0]
    p.state.sessions[sid].context_tokens[model] = 1234
    p.state.touched.add(sid)
    view = idx.build(time.time(), BIG, ())
    assert view.kv_tokens[(sid, model)] == 1234
    fields = ("sessions", "kv_affinity", "kv_tokens")
    before = {f: dict(getattr(view, f)) for f in fields}
    # the churn must not end ``sid`` (its session would go, and with it what is checked below):
    # its open calls sit out the churn (which session is bound first varies between machines)
    held = [k for k in em.session_keys[sid] if k in em.pos]
    for k in held:
        em._close(k)
    em.churn(300)
    for k in held:
        em._open(k)
    assert sid in idx.sessions
    for _ in range(10):
        em.add_session()
    p.state.sessions[sid].context_tokens[model] = 4321
    p.state.touched.add(sid)
    idx.sync_sessions()
    assert idx.kv_tokens[(sid, model)] == 4321
    p.bindings[("s-new", f"llm:{cs.MODEL}")] = p.bindings.llm[(sid, model)]
    worker = p.bindings.llm[(sid, model)]
    del p.bindings[(sid, f"llm:{model}")]
    idx.on_worker_removed(worker, [(sid, model)])
    assert (sid, model) not in idx.kv_tokens and (sid, model) not in p.bindings.llm
    idx.build(time.time(), BIG, ())
    assert {f: dict(getattr(view, f)) for f in fields} == before


def test_each_call_view_says_what_its_record_and_task_say():
    """The views are built positionally (``make_call_view``): each field must come from where
    it should (a swapped pair would be equally wrong in the incremental and rebuilt views)."""
    em = cs.Emulation(16, seed=9)
    em.fill(600)
    p = em.plugin
    view = p.view_index.build(time.time(), BIG, ())
    assert view.calls and view.sessions
    for cv in view.calls.values():
        rec, ts = p.state.calls[cv.key], em.s.tasks[cv.key]
        assert (cv.key, cv.component, cv.kind, cv.session, cv.model, cv.stateful, cv.batch_max) == (
            rec.key, rec.component, rec.kind, rec.session, rec.model, rec.stateful, rec.batch_max)
        assert (cv.created, cv.ready, cv.priority) == (rec.created, rec.ready, ts.priority)
        assert cv.worker == (ts.processing_on.address if ts.state == "processing" else None)
        assert cv.tenant == (p.state.sessions[rec.session].tenant if rec.session else None)
    for address, wv in view.workers.items():
        ws = em.s.workers[address]
        assert (wv.address, wv.nthreads, wv.processing) == (address, ws.nthreads, len(ws.processing))
        assert wv.agents_ready == (address in p.ready_workers)
    for sid, sv in view.sessions.items():
        r = p.state.sessions[sid]
        assert (sv.id, sv.tenant, sv.created, sv.progress, sv.open_calls, sv.state) == (
            r.id, r.tenant, r.created, r.progress, r.open_calls, r.state)


def test_set_priority_takes_plain_and_numpy_numbers_and_refuses_the_rest():
    import numpy as np
    import pytest

    from dask_agents.errors import AgentsError

    assert SetPriority("k", (0, 1.5, np.int64(3), np.float32(2.0), -7)).priority[2] == 3
    for bad in ((True, 1), (0, float("nan")), (0, float("inf")), (0, "1"), (0, None), (), (np.bool_(True),)):
        with pytest.raises((AgentsError, TypeError, ValueError), match="priority"):
            SetPriority("k", bad)


# -- the benchmark itself, tiny -----------------------------------------------------------------

def test_control_scale_smoke(tmp_path):
    out = tmp_path / "control-scale.json"
    assert cs.main(["--smoke", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    summary = doc["summary"]
    assert "pass_ms_at_262144" in summary and summary["fast_path_latency_ratio"] > 0
    assert {r["mode"] for r in doc["passes"]} == {"incremental", "rebuild", "unbounded"}
    assert all(r["pass_ms_median"] > 0 and r["live_futures"] >= 256 for r in doc["passes"])
    assert (tmp_path / "control-scale.png").stat().st_size > 0
    nested = doc["nested_fast_path"]  # nested fast-path calls while the scheduler held the background calls
    assert nested["live_futures"] == 200 and nested["scheduler_tasks_while_loaded"] >= 200
    assert nested["ratio_p50"] > 0 and nested["ratio_paired_round_medians"] > 0
    assert {"idle_before", "loaded", "idle_after", "idle_cluster"} <= set(nested)
