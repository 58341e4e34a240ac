"""The incremental view index (scheduler_plugin/view_index.py) against a from-scratch rebuild,
the balance policy's sorted thief pools against its linear scan, and a tiny run of
benchmarks/control_scale.py. The scheduler here is the benchmark's emulated one: the real
plugin's hooks run against it, as Dask would call them."""

from __future__ import annotations

import json
import random
import threading
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks import control_scale as cs
from scheduler_plugin import dask_compat
from scheduler_plugin.actions import Migrate, SetPriority
from scheduler_plugin.policies.balance import LateBindingBalance
from scheduler_plugin.view import CallView, ClusterView, ComponentView, WorkerView
from scheduler_plugin.view_index import BindingMap, scan_view

BIG = 10**9
FIELDS = ("workers", "calls", "sessions", "components", "kv_affinity", "kv_tokens", "models")


def _views(em: cs.Emulation, max_calls: int = BIG) -> tuple[ClusterView, ClusterView]:
    """(incremental, rebuilt) views of the same instant."""
    p = em.plugin
    now = time.time()
    idle = dict(p.view_index.idle_since)
    inc = p.view_index.build(now, max_calls, ())
    ref = scan_view(p, now, BIG, idle, ())
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
            p._close(sids[pick % len(sids)], time.time())
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


def test_a_removed_worker_leaves_nothing_behind():
    em = cs.Emulation(4, seed=5, nthreads=2)
    em.fill(400)
    p, s = em.plugin, em.s
    for key in [k for k in em.open if p.state.calls[k].kind == "llm"][:20]:  # sessions' KV sizes
        p._on_reports(worker="tcp://w0:1", reports=[{"key": key, "started": 1.0, "finished": 2.0,
                                                      "metrics": {"prompt_tokens": 300, "output_tokens": 9}}])
    _assert_equal(*_views(em))
    gone = "tcp://w0:1"  # the engine worker: it holds the LLM sessions' KV
    assert p.view_index.kv_tokens
    ws = s.workers.pop(gone)
    s.running.discard(ws)
    for ts in list(ws.processing):  # Dask reschedules its tasks
        em.transition(ts, "waiting")
    for k in [k for k, w in p.bindings.items() if w == gone]:  # as the plugin's remove_worker does
        del p.bindings[k]
        if k[1].startswith("llm:"):
            p.state.forget_kv(k[0], k[1][4:])
    p.view_index.on_worker_removed(gone)
    inc, ref = _views(em)
    _assert_equal(inc, ref)
    assert gone not in p.view_index.on_worker and gone not in p.view_index.ring and not p.view_index.kv_tokens


def test_binding_map_keeps_the_llm_affinity_in_step():
    b = BindingMap({("s1", "llm:coder"): "A", ("s1", "Dev"): "B"})
    b[("s2", "llm:coder")] = "C"
    b.setdefault(("s3", "llm:chat"), "D")
    assert b.llm == {("s1", "coder"): "A", ("s2", "coder"): "C", ("s3", "chat"): "D"}
    del b[("s1", "llm:coder")]
    assert b.pop(("s2", "llm:coder")) == "C" and b.pop(("nope", "llm:x"), None) is None
    assert b.llm == {("s3", "chat"): "D"} and dict(b) == {("s1", "Dev"): "B", ("s3", "llm:chat"): "D"}
    b.clear()
    assert b.llm == {} and not b


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


# -- the Dask internal the index added --------------------------------------------------------

def test_started_on_worker_reads_executing_and_seceded_tasks():
    ws = cs.EWorker("tcp://w:1", 2)
    a, b, c = (cs.ETask(k, set(), i) for i, k in enumerate("abc"))
    ws.processing |= {a, b, c}
    ws.executing[a] = 0.0
    ws.long_running.add(b)
    assert dask_compat.started_on_worker(ws, a) and dask_compat.started_on_worker(ws, b)
    assert not dask_compat.started_on_worker(ws, c)


GATE = threading.Event()


def _wait(i: int) -> int:
    GATE.wait(30)
    return i


def test_started_on_worker_on_a_real_scheduler():
    from distributed import Client, LocalCluster

    from tests.conftest import wait_for

    gate = GATE
    gate.clear()
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster, \
            Client(cluster) as client:
        run = client.submit(_wait, 1, pure=False)
        waiting = client.submit(_wait, 2, pure=False)
        s = cluster.scheduler
        ws = next(iter(s.workers.values()))
        wait_for(lambda: len(ws.processing) == 2 and len(ws.executing) == 1, timeout=20)
        started = [ts for ts in ws.processing if dask_compat.started_on_worker(ws, ts)]
        assert len(started) == 1
        gate.set()
        client.gather([run, waiting])


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
