"""The control plane at scale: one full control pass over up to 262,144 live futures, and the
fast path with the control loop running vs stopped.

Part 1, EMULATED scheduler (no real workers)
--------------------------------------------
A scheduler of ``W`` emulated workers (1,024 and 2,048; one in eight hosts the ``coder`` LLM
engine, every worker hosts 8 component instances: 8,192 and 16,384) holds Open-SWE-shaped
sessions (examples/swe/workflow.py: planner -> 2-4 developers in parallel, each with a
doc-search tool, an LLM call and a code-exec tool -> tester with an LLM call and code-exec ->
retries of a failing developer and the tester with probability 0.35, up to 3). Each session is
caught at a random point of its life: the calls made so far are live futures (finished ones
held in memory by the client, the frontier waiting on dependencies, held back by the
scheduler, queued on a worker, executing, or seceded while their nested calls run).

The *real* scheduler plugin (``AgentsSchedulerPlugin``) and control loop run against it: the
emulator creates Dask-like task/worker state objects and calls the plugin's ``update_graph``
and ``transition`` hooks as Dask would, so the workflow state, the bindings and the
incremental view index are built by the production code paths. One *control pass* is
``ControlLoop.tick()``: view build + every default policy (prioritize, balance, reallocate,
batching) + the enforcement layer validating and applying their actions to the emulated
state (priority messages to workers are counted, never sent; moves are applied in place).
Between two timed passes a batch of events (1% of the live futures, at least 200: starts,
finishes, dependencies resolving) goes through the hooks, and the hook cost per transition
is timed. Passes are timed with the incremental view (``ViewIndex``) and with the original
from-scratch rebuild (``scan_view``) on the same emulated state.

Both take at most ``agents.control.max-calls-per-tick`` (5,000) waiting calls per pass; the
incremental view takes whole worker queues and rotates, so every waiting call is in a view
within ``passes_per_rotation`` passes (the carry-over). The incremental passes run as the loop
does, under ``agents.control.pass-budget`` (40 ms): a pass over budget makes the next window
smaller (``calls_in_view_median`` says what it settled to, ``passes_per_rotation`` what that
costs in coverage); the rebuild and unbounded passes take the whole window. At the largest size, ``unbounded``
times the incremental view with every waiting call in one pass (no window) for comparison.
Timings are wall-clock medians (``pass_ms``) and the pass's thread CPU time (``pass_cpu_ms``,
what it costs the scheduler's event loop when it has a core: the machine is shared).

Part 2, REAL LocalCluster
-------------------------
``LocalCluster(n_workers=2, threads_per_worker=4, processes=False)`` with ``da.install``.
Worker B holds ``background`` waiting calls (pinned there, blocked behind a gate) so every
pass has work; sequential no-op tool calls (``da.stub(tool)(i).result()`` in a session) are
timed with the control loop running (``da.control(client).start()``) and stopped, in
alternating blocks (order rotated every round). ``fast_path_latency_ratio`` = median latency
running / median latency stopped.

Part 3, REAL LocalClusters (``nested``)
---------------------------------------
Two ``LocalCluster(n_workers=2, threads_per_worker=4, processes=True)``, both ``da.install``-ed.
The loaded one's scheduler holds ``nested_live`` (2^18 in the full run) live stub calls, each
depending on a plain task held back by a gate (submitted in chunks of 4,096, each waited for);
inside a component (``nested_probes``) ``nested_calls`` sequential nested tool calls take the
worker-local fast path and are timed there, in rounds alternating between the loaded and the
idle cluster. ``ratio_p50`` = median latency loaded / idle cluster; the loaded cluster is also
timed before and after its load.

Reproduce::

    .venv/bin/python benchmarks/control_scale.py --quick --json benchmarks/results/control-scale-quick.json

JSON: ``{"config", "passes": [...], "fast_path": {...}, "nested_fast_path": {...}, "summary": {"pass_ms_at_262144",
"fast_path_latency_ratio", ...}}`` and a growth plot next to it (``<json stem>.png``).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import operator
import os
import platform
import random
import statistics
import sys
import threading
import time
from typing import Any

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from distributed.collections import HeapSet  # noqa: E402

import dask_agents as da  # noqa: E402
from dask_agents.calls import ANNOTATION  # noqa: E402
from dask_agents.stats import percentile  # noqa: E402
from dask_agents.scheduler_plugin.control import ControlLoop  # noqa: E402
from dask_agents.scheduler_plugin.plugin import AgentsSchedulerPlugin  # noqa: E402

MODEL = "coder"
LLM = "llm.coder"
INSTANCES_PER_WORKER = 8


# -- emulated Dask scheduler state ---------------------------------------------------------------
class ETask:
    """The attributes of ``distributed.scheduler.TaskState`` that dask-agents reads."""

    __slots__ = ("key", "dependencies", "priority", "annotations", "worker_restrictions", "loose_restrictions",
                 "resource_restrictions", "host_restrictions", "nbytes", "state", "processing_on", "__weakref__")

    def __init__(self, key: str, dependencies: set, order: int):
        self.key = key
        self.dependencies = dependencies
        self.priority = (0, 0, order)
        self.annotations: dict = {}
        self.worker_restrictions: set | None = None
        self.loose_restrictions = False
        self.resource_restrictions: dict | None = None
        self.host_restrictions: set | None = None
        self.nbytes = -1
        self.state = "released"
        self.processing_on: EWorker | None = None


class EWorker:
    """The attributes of ``distributed.scheduler.WorkerState`` that dask-agents reads."""

    __slots__ = ("address", "name", "nthreads", "processing", "executing", "long_running")

    def __init__(self, address: str, nthreads: int):
        self.address = address
        self.name = address
        self.nthreads = nthreads
        self.processing: set = set()
        self.executing: dict = {}
        self.long_running: set = set()


class _Steal:
    """A move engine that applies a move at once (a steal the victim confirmed)."""

    def __init__(self) -> None:
        self.moves = 0

    def move_task_request(self, ts: ETask, victim: EWorker, thief: EWorker) -> str:
        self.moves += 1
        victim.processing.discard(ts)
        thief.processing.add(ts)
        ts.processing_on = thief
        return f"steal-{self.moves}"


class _Loop:
    def add_callback(self, *args: Any, **kwargs: Any) -> None:
        pass


class EScheduler:
    """The scheduler attributes dask-agents reads; messages are counted, never sent."""

    def __init__(self, n_workers: int, nthreads: int):
        self.tasks: dict[str, ETask] = {}
        self.workers = {f"tcp://w{i}:1": EWorker(f"tcp://w{i}:1", nthreads) for i in range(n_workers)}
        self.running = set(self.workers.values())
        self.queued = HeapSet(key=operator.attrgetter("priority"))
        self.stream_comms: dict = {}
        self.periodic_callbacks: dict = {}
        self.extensions = {"stealing": _Steal()}
        self.handlers: dict = {}
        self.stream_handlers: dict = {}
        self.loop = _Loop()
        self.sent = 0
        self.events = 0

    def worker_send(self, address: str, msg: dict) -> None:
        """Count a scheduler -> worker message (enforcement planning: nothing is sent)."""
        self.sent += 1

    def log_event(self, topic: str, msg: dict) -> None:
        """Count an event-topic record."""
        self.events += 1


# -- the Open-SWE workload ---------------------------------------------------------------------
def swe_session(rng: random.Random) -> list[dict]:
    """Calls of one Open-SWE request in creation order: {component, method, kind, parent, deps}
    (parent/deps are indexes into the list)."""
    calls: list[dict] = []

    def add(component: str, kind: str, parent: int | None = None, deps: tuple = (), method: str | None = None,
            tool_kind: str | None = None) -> int:
        calls.append({"component": component, "kind": kind, "parent": parent, "deps": list(deps),
                      "method": method, "tool_kind": tool_kind})
        return len(calls) - 1

    def developer(plan: int, after: tuple) -> int:
        d = add("Developer", "agent", deps=(plan, *after), method="implement")
        doc = add("doc_search", "tool", parent=d, tool_kind="file_io")
        llm = add(LLM, "llm", parent=d, deps=(doc,))
        add("code_exec", "tool", parent=d, deps=(llm,), tool_kind="code_exec")
        return d

    def tester(devs: list[int]) -> int:
        t = add("Tester", "agent", deps=tuple(devs), method="test")
        llm = add(LLM, "llm", parent=t)
        add("code_exec", "tool", parent=t, deps=(llm,), tool_kind="code_exec")
        return t

    plan = add("Planner", "agent", method="plan")
    add(LLM, "llm", parent=plan)
    devs = [developer(plan, ()) for _ in range(rng.choice([2, 3, 3, 4]))]
    t = tester(devs)
    for _ in range(3):  # MAX_RETRIES, FAIL_PROBABILITY as in examples/swe/workflow.py
        if rng.random() >= 0.35:
            break
        k = rng.randrange(len(devs))
        devs[k] = developer(plan, (t,))
        t = tester(devs)
    return calls


class Emulation:
    """An emulated cluster with the real scheduler plugin and control loop on it."""

    def __init__(self, n_workers: int, seed: int = 0, nthreads: int = 16, max_calls: int | None = None):
        self.rng = random.Random(seed)
        self.s = EScheduler(n_workers, nthreads)
        self.plugin = p = AgentsSchedulerPlugin()
        p.scheduler = self.s
        # LLM calls are placed at creation here, as before admission existed: holding them needs
        # Dask's transitions (no-worker -> processing), which this emulated scheduler does not run
        p.admission.enabled = False
        addrs = sorted(self.s.workers)
        n_engines = max(n_workers // 8, 1)
        self.engines = addrs[:n_engines]
        self.agent_workers = addrs[n_engines:] or addrs
        for a in addrs:
            p.register_worker(a, [MODEL] if a in self.engines else [])
        p.control = ControlLoop(p)
        if max_calls is not None:
            p.control.max_calls = max_calls
        p.prioritizing = True
        self.order = 0
        self.sessions = 0
        self.open: list[str] = []  # keys of open calls (for churn), swap-removed
        self.pos: dict[str, int] = {}
        self.session_keys: dict[str, list[str]] = {}
        self.session_open: dict[str, int] = {}
        self.completed = 0
        self.hook_seconds = 0.0
        self.hook_calls = 0

    # -- Dask's side of a transition, then the plugin's hook ---------------------------------
    def transition(self, ts: ETask, finish: str, worker: EWorker | None = None) -> None:
        """Move ``ts`` to ``finish`` in the emulated scheduler, then call the plugin hook."""
        s = self.s
        start = ts.state
        if start == "processing":
            ws = ts.processing_on
            ws.processing.discard(ts)
            ws.executing.pop(ts, None)
            ws.long_running.discard(ts)
            ts.processing_on = None
        elif start == "queued":
            s.queued.discard(ts)
        ts.state = finish
        if finish == "processing":
            if worker is None:
                worker = self._placement(ts)
            worker.processing.add(ts)
            ts.processing_on = worker
        elif finish == "queued":
            s.queued.add(ts)
        elif finish == "memory":
            ts.nbytes = 2000
        t = time.perf_counter()
        self.plugin.transition(ts.key, start, finish, stimulus_id="emulated")
        self.hook_seconds += time.perf_counter() - t
        self.hook_calls += 1

    def _placement(self, ts: ETask) -> EWorker:
        if ts.worker_restrictions:
            w = next(iter(ts.worker_restrictions))
            if w in self.s.workers or not ts.loose_restrictions:  # loose (a preference): as Dask, anywhere else
                return self.s.workers[w]
        return self.s.workers[self.rng.choice(self.agent_workers)]

    def _open(self, key: str) -> None:
        self.pos[key] = len(self.open)
        self.open.append(key)

    def _close(self, key: str) -> None:
        i = self.pos.pop(key, None)
        if i is None:
            return
        last = self.open.pop()
        if last != key:
            self.open[i] = last
            self.pos[last] = i

    # -- sessions -------------------------------------------------------------------------------
    def add_session(self) -> int:
        """Submit one session caught at a random point of its life; returns its live futures."""
        rng = self.rng
        sid = f"s{self.sessions}"
        self.sessions += 1
        shape = swe_session(rng)
        made = rng.randint(1, len(shape))
        frontier = rng.randint(1, 8)
        keys = [f"{c['component']}-{sid}-{i}" for i, c in enumerate(shape[:made])]
        self.session_keys[sid] = keys
        self.session_open[sid] = 0
        anns = {}
        tasks = []
        now = time.time()
        for i, c in enumerate(shape[:made]):
            deps = {self.s.tasks[keys[d]] for d in c["deps"]}
            ts = ETask(keys[i], deps, self.order)
            self.order += 1
            self.s.tasks[ts.key] = ts
            tasks.append(ts)
            anns[ts.key] = {
                "call": ts.key, "component": c["component"], "method": c["method"], "kind": c["kind"],
                "session": sid, "tenant": None, "creator": keys[c["parent"]] if c["parent"] is not None else "driver",
                "deps": [keys[d] for d in c["deps"]], "created": now, "stateful": False,
                "model": MODEL if c["kind"] != "tool" else None, "tool_kind": c["tool_kind"],
                **({"llm_model": MODEL} if c["kind"] == "llm" else {}),
            }
        t = time.perf_counter()
        self.plugin.update_graph(self.s, client="emulated", keys=set(keys), tasks=keys,
                                 annotations={ANNOTATION: anns}, priority={}, stimulus_id="emulated")
        self.hook_seconds += time.perf_counter() - t
        self.hook_calls += len(keys)
        done = set()
        parents = {c["parent"] for c in shape[:made] if c["parent"] is not None}
        for i, ts in enumerate(tasks):
            self.transition(ts, "waiting")
            if i < made - frontier:
                self.transition(ts, "processing")
                self.transition(ts, "memory")
                done.add(i)
                continue
            self._open(ts.key)
            self.session_open[sid] += 1
            c = shape[i]
            if any(d not in done for d in c["deps"]):
                continue  # waits on its dependencies
            if i in parents:  # an agent whose nested calls run: seceded
                self.transition(ts, "processing")
                ts.processing_on.long_running.add(ts)
                continue
            r = rng.random()
            if r < 0.15 and c["kind"] == "tool":
                self.transition(ts, "queued")  # root-ish, held back by the scheduler
            else:
                self.transition(ts, "processing")
                if r > 0.6:
                    ts.processing_on.executing[ts] = 0.0
        if not self.session_open[sid]:
            self._complete(sid)
        return made

    def _complete(self, sid: str) -> None:
        """The driver got its answer: it leaves the session and releases its futures."""
        self.plugin.sessions.close(sid, time.time())
        for key in self.session_keys.pop(sid):
            ts = self.s.tasks.pop(key)
            self.transition(ts, "forgotten")
        del self.session_open[sid]
        self.completed += 1

    def fill(self, live: int) -> None:
        """Add sessions until ``live`` futures exist."""
        while len(self.s.tasks) < live:
            self.add_session()

    def churn(self, n: int) -> None:
        """``n`` events through the hooks: calls start, finish, become runnable, get placed."""
        rng = self.rng
        for _ in range(n):
            if not self.open:
                return
            key = self.open[rng.randrange(len(self.open))]
            ts = self.s.tasks[key]
            if ts.state == "waiting":
                if all(d.state == "memory" for d in ts.dependencies):
                    self.transition(ts, "processing")
            elif ts.state == "queued":
                self.transition(ts, "processing")
            elif ts.state == "processing":
                ws = ts.processing_on
                if ts in ws.executing or ts in ws.long_running or rng.random() < 0.5:
                    self.transition(ts, "memory")
                    self._close(key)
                    sid = key.rsplit("-", 2)[1]
                    self.session_open[sid] -= 1
                    if not self.session_open[sid]:  # done: a new request takes its place
                        self._complete(sid)
                        self.add_session()
                else:
                    ws.executing[ts] = 0.0

    def counts(self) -> dict:
        """Live futures by state, sessions, bindings, component instances."""
        by: dict[str, int] = {}
        for ts in self.s.tasks.values():
            st = ts.state
            if st == "processing":
                ws = ts.processing_on
                st = "running" if ts in ws.executing or ts in ws.long_running else "queued-on-worker"
            by[st] = by.get(st, 0) + 1
        p = self.plugin
        return {"live_futures": len(self.s.tasks), "by_state": by, "sessions": len(p.state.sessions),
                "bindings": len(p.bindings), "replicas_with_open_calls": len(p.view_index.per_replica)}


# -- part 1: control passes ----------------------------------------------------------------------
def measure_passes(live: int, n_workers: int, reps: int, seed: int, modes: tuple[str, ...]) -> list[dict]:
    """Build an emulated cluster with ``live`` futures; time control passes in each mode."""
    gc.collect()
    em = Emulation(n_workers, seed=seed)
    t0 = time.perf_counter()
    em.fill(live)
    build_s = time.perf_counter() - t0
    setup_hook_us = em.hook_seconds / max(em.hook_calls, 1) * 1e6
    counts = em.counts()
    loop = em.plugin.control
    events = max(live // 100, 200)
    out = []
    waiting = counts["by_state"].get("queued-on-worker", 0) + counts["by_state"].get("queued", 0)
    index = em.plugin.view_index
    timed_index = _TimedIndexHook(index)
    bounded = loop.max_calls
    budget = loop.pass_budget
    for mode in modes:
        # "unbounded": the incremental view with every waiting call in every pass (no window);
        # the pass budget (the window adapting to pass time) applies to the incremental view only
        loop.incremental = mode in ("incremental", "unbounded")
        loop.max_calls = 10**9 if mode == "unbounded" else bounded
        loop.pass_budget = budget if mode == "incremental" else 0.0
        loop.adapt_window(0.0, 0)  # start from the whole window
        # Warm up to the steady state of a running loop: one full rotation of the window, so
        # call views are cached except for calls that changed since (the churn's), and the
        # window settled to the pass budget.
        for _ in range(2 if mode != "incremental" else min(max(2 + math.ceil(waiting / loop.max_calls), 12), 40)):
            em.churn(events)
            loop.tick()
        em.hook_seconds = 0.0
        em.hook_calls = 0
        timed_index.reset()
        ticks = []
        gc_was = gc.isenabled()
        for _ in range(reps):
            em.churn(events)
            gc.disable()  # the pass itself, not a collection the churn provoked
            try:
                c0 = time.thread_time()
                tick = loop.tick()
                tick["cpu_seconds"] = time.thread_time() - c0  # immune to other processes' load
                ticks.append(tick)
            finally:
                if gc_was:
                    gc.enable()
        ms = sorted(t["seconds"] * 1000 for t in ticks)
        by_state = em.counts()["by_state"]
        waiting_end = by_state.get("queued-on-worker", 0) + by_state.get("queued", 0)
        view_ms = sorted(t["view_seconds"] * 1000 for t in ticks)
        cpu_ms = sorted(t["cpu_seconds"] * 1000 for t in ticks)
        applied: dict[str, int] = {}
        for t in ticks:
            for k, v in t["applied"].items():
                applied[k] = applied.get(k, 0) + v
        row = {
            "mode": mode, "live_futures": counts["live_futures"], "workers": n_workers,
            "component_instances": n_workers * INSTANCES_PER_WORKER, "sessions": counts["sessions"],
            "by_state": counts["by_state"], "bindings": counts["bindings"],
            "replicas_with_open_calls": counts["replicas_with_open_calls"],
            "pass_ms_median": statistics.median(ms), "pass_ms_p90": ms[min(int(0.9 * len(ms)), len(ms) - 1)],
            "pass_ms_min": ms[0], "pass_cpu_ms_median": statistics.median(cpu_ms),
            "view_ms_median": statistics.median(view_ms),
            "policies_and_enforcement_ms_median": statistics.median(
                sorted((t["seconds"] - t["view_seconds"]) * 1000 for t in ticks)),
            "calls_in_view_median": statistics.median(t["calls_in_view"] for t in ticks),
            "pass_budget_ms": loop.pass_budget * 1000, "max_calls_per_tick": loop.max_calls,
            "waiting_calls": waiting_end,  # queued on workers or held back by the scheduler, after the passes
            # passes until every waiting call was in a view (the window's carry-over)
            "passes_per_rotation": 1 if not any(t["truncated"] for t in ticks) else
            math.ceil(waiting_end / max(statistics.median(t["calls_in_view"] for t in ticks), 1)),
            "truncated": sum(bool(t["truncated"]) for t in ticks), "reps": reps,
            "events_between_passes": events, "actions_applied": applied,
            "hook_us_per_event": em.hook_seconds / max(em.hook_calls, 1) * 1e6,
            "index_hook_us_per_event": timed_index.us_per_call(),
            "setup_hook_us_per_event": setup_hook_us, "setup_s": build_s,
        }
        out.append(row)
        print(f"  {mode:11s} live={row['live_futures']:7d} W={n_workers:5d} sessions={row['sessions']:6d} "
              f"pass {row['pass_ms_median']:7.2f} ms (cpu {row['pass_cpu_ms_median']:7.2f}, p90 {row['pass_ms_p90']:7.2f}; view {row['view_ms_median']:6.2f}, "
              f"policies+enforce {row['policies_and_enforcement_ms_median']:6.2f}) calls in view "
              f"{row['calls_in_view_median']:.0f} hook {row['hook_us_per_event']:.1f} us/event "
              f"(index {row['index_hook_us_per_event']:.2f})", flush=True)
    index.on_transition = timed_index.inner
    loop.max_calls = bounded
    loop.pass_budget = budget
    return out


class _TimedIndexHook:
    """Times the view index's share of the transition hook (the cost incremental views add
    to the scheduler's critical path)."""

    def __init__(self, index: Any):
        self.inner = index.on_transition
        self.seconds = 0.0
        self.calls = 0
        index.on_transition = self

    def __call__(self, *args: Any) -> None:
        t = time.perf_counter()
        self.inner(*args)
        self.seconds += time.perf_counter() - t
        self.calls += 1

    def reset(self) -> None:
        self.seconds = 0.0
        self.calls = 0

    def us_per_call(self) -> float:
        return self.seconds / max(self.calls, 1) * 1e6


# -- part 2: the fast path on a real LocalCluster ----------------------------------------------------
GATE = threading.Event()


def _blocked(i: int) -> int:
    GATE.wait(600)
    return i


@da.tool
def probe(i: int) -> int:
    """The no-op whose latency is measured."""
    return i


def measure_fast_path(rounds: int, calls: int, background: int) -> dict:
    """Sequential stub-call latency with the control loop running vs stopped."""
    from distributed import Client, LocalCluster

    import dask

    GATE.clear()
    # this driver stops and starts the loop: the (in-process) scheduler lets clients do it
    allow = dask.config.set({"agents.control.client-actions": True})
    cluster = LocalCluster(n_workers=2, threads_per_worker=4, processes=False, dashboard_address=":0")
    client = Client(cluster)
    try:
        da.install(client)
        ctl = da.control(client)
        workers = sorted(client.scheduler_info()["workers"])
        b = workers[1]
        with da.session(client, name="background"):
            bg = [client.submit(_blocked, i, workers=[b], pure=False) for i in range(background)]
        deadline = time.time() + 60
        while sum(f.status == "pending" for f in bg) < background and time.time() < deadline:
            time.sleep(0.05)
        stub = da.stub(probe)
        lat: dict[str, list[float]] = {"running": [], "stopped": []}
        per_round: dict[str, list[float]] = {"running": [], "stopped": []}
        with da.session(client, name="probe"):
            for i in range(20):  # warm-up
                stub(i).result()
            n = 0
            for r in range(rounds):
                order = ("running", "stopped") if r % 2 == 0 else ("stopped", "running")
                for mode in order:
                    (ctl.start if mode == "running" else ctl.stop)()
                    time.sleep(0.15)
                    block = []
                    for _ in range(calls):
                        t = time.perf_counter()
                        if stub(n).result() != n:
                            raise AssertionError("wrong result")
                        block.append(time.perf_counter() - t)
                        n += 1
                    lat[mode].extend(block)
                    per_round[mode].append(statistics.median(block))
            ctl.start()
            time.sleep(0.5)
            stats = ctl.stats()
        GATE.set()
        client.gather(bg)
    finally:
        GATE.set()
        client.close()
        cluster.close()
        allow.__exit__(None, None, None)

    def pct(xs: list[float], q: float) -> float:
        return percentile(xs, 100 * q)

    out = {
        "rounds": rounds, "calls_per_block": calls, "background_waiting_calls": background,
        "running": {"p50_ms": pct(lat["running"], 0.5) * 1000, "p95_ms": pct(lat["running"], 0.95) * 1000},
        "stopped": {"p50_ms": pct(lat["stopped"], 0.5) * 1000, "p95_ms": pct(lat["stopped"], 0.95) * 1000},
        "ratio_p50": pct(lat["running"], 0.5) / pct(lat["stopped"], 0.5),
        "ratio_p95": pct(lat["running"], 0.95) / pct(lat["stopped"], 0.95),
        "ratio_paired_round_medians": statistics.median(
            a / b for a, b in zip(per_round["running"], per_round["stopped"])),
        "loop_ticks": stats.get("ticks"), "loop_tick_ms_p50": (stats.get("tick_seconds_p50") or 0) * 1000,
        "loop_tick_ms_p99": (stats.get("tick_seconds_p99") or 0) * 1000,
        # the loop's watchdog (scheduler_plugin/watchdog.py): restarts during the measurement
        "watchdog_incidents": [{k: i.get(k) for k in ("action", "kind", "error", "policy") if k in i}
                               for i in stats.get("incidents", [])],
    }
    print(f"  fast path: p50 running {out['running']['p50_ms']:.2f} ms vs stopped {out['stopped']['p50_ms']:.2f} ms "
          f"(ratio {out['ratio_p50']:.3f}, p95 ratio {out['ratio_p95']:.3f}); loop ticks {out['loop_ticks']}, "
          f"tick p50 {out['loop_tick_ms_p50']:.2f} ms p99 {out['loop_tick_ms_p99']:.2f} ms", flush=True)
    return out


def _wait_for_file(path: str) -> str:
    """A plain Dask task that holds the background calls back until ``path`` exists."""
    while not os.path.exists(path):
        time.sleep(0.05)
    return path


@da.tool
def gated(gate: str, i: int) -> int:
    """A background call: depends on the gate task, so it waits in the scheduler (a live
    future the control loop sees) without holding a worker thread."""
    return i


@da.agent
def nested_probes(n: int) -> list[float]:
    """Inside a component: ``n`` sequential nested tool calls (the worker-local fast path),
    each timed from its creation to its value in the caller."""
    stub = da.stub(probe)
    out = []
    for i in range(n):
        t = time.perf_counter()
        if stub(i).value() != i:
            raise AssertionError("wrong result")
        out.append(time.perf_counter() - t)
    return out


def measure_nested_under_load(live: int, rounds: int, calls: int) -> dict:
    """Nested fast-path call latency on a REAL cluster (scheduler and 2 workers in their own
    processes, the control loop running) while the scheduler holds ``live`` waiting stub calls.

    Two identical clusters run side by side: the loaded one and an idle one; rounds alternate
    between them (the order flips every round), so drift of the machine between rounds hits
    both. The loaded cluster is also timed before the load and after it (A-B-A)."""
    import tempfile

    from distributed import Client, LocalCluster

    gate = os.path.join(tempfile.mkdtemp(prefix="control-scale-"), "open")
    clusters, clients = [], []
    phases: dict[str, list[float]] = {"idle_before": [], "loaded": [], "idle_after": [], "idle_cluster": []}
    per_round: dict[str, list[float]] = {"loaded": [], "idle_cluster": []}
    try:
        for _ in range(2):
            clusters.append(LocalCluster(n_workers=2, threads_per_worker=4, processes=True, dashboard_address=":0"))
            clients.append(Client(clusters[-1], set_as_default=False))
            da.install(clients[-1])
        client, idle_client = clients

        def probe_round(c: Client, name: str) -> None:
            with da.session(c, name=f"probe-{name}"):
                got = da.stub(nested_probes)(calls).value(timeout=600)
            phases[name].extend(got)
            if name in per_round:
                per_round[name].append(statistics.median(got))

        for c in clients:
            with da.session(c, name="warm-up"):
                da.stub(nested_probes)(calls).value(timeout=600)
        for _ in range(rounds):
            probe_round(client, "idle_before")
        t0 = time.perf_counter()
        bg: list = []
        held = 0
        with da.session(client, name="background"):
            held_back = client.submit(_wait_for_file, gate, pure=False)
            # In chunks, each waited for: submitted in one burst, 2^18 calls queue up faster than
            # the scheduler takes them in, and it then spends long stretches in one batch of
            # update-graph messages without reading the driver's socket (the driver's connection
            # timed out after 30 s in a first attempt; see the README)
            while len(bg) < live:
                bg.extend(da.stub(gated)(held_back, i) for i in range(len(bg), min(len(bg) + 4096, live)))
                while held < len(bg):  # the calls reach the scheduler in batches: poll until all are there
                    held = client.run_on_scheduler(lambda dask_scheduler: len(dask_scheduler.tasks)) - 1
                    time.sleep(0.05)
        held += 1  # with the gate task
        submit_s = time.perf_counter() - t0
        for r in range(rounds):
            for c, name in ((client, "loaded"), (idle_client, "idle_cluster"))[::1 if r % 2 == 0 else -1]:
                probe_round(c, name)
        stats = da.control(client).stats()
        open(gate, "w").close()
        for i in range(0, live, 4096):
            if client.gather(bg[i:i + 4096]) != list(range(i, min(i + 4096, live))):
                raise AssertionError("wrong background results")
        del bg, held_back
        for _ in range(rounds):
            probe_round(client, "idle_after")
    finally:
        open(gate, "a").close()
        for c in clients:
            c.close()
        for cl in clusters:
            cl.close()
    own_idle = phases["idle_before"] + phases["idle_after"]
    out = {"live_futures": live, "scheduler_tasks_while_loaded": held, "submit_s": submit_s, "rounds": rounds,
           "calls_per_round": calls,
           **{k: {"p50_ms": percentile(v, 50) * 1000, "p95_ms": percentile(v, 95) * 1000} for k, v in phases.items()},
           # the measure: loaded vs the idle cluster, rounds interleaved
           "ratio_p50": percentile(phases["loaded"], 50) / percentile(phases["idle_cluster"], 50),
           "ratio_p95": percentile(phases["loaded"], 95) / percentile(phases["idle_cluster"], 95),
           "ratio_paired_round_medians": statistics.median(
               a / b for a, b in zip(per_round["loaded"], per_round["idle_cluster"])),
           "ratio_paired_round_medians_spread": [min(a / b for a, b in zip(per_round["loaded"], per_round["idle_cluster"])),
                                                 max(a / b for a, b in zip(per_round["loaded"], per_round["idle_cluster"]))],
           # the same cluster before and after its load (not interleaved: drift shows here)
           "ratio_p50_vs_own_idle": percentile(phases["loaded"], 50) / percentile(own_idle, 50),
           "loop_ticks": stats.get("ticks"), "loop_tick_ms_p50": (stats.get("tick_seconds_p50") or 0) * 1000,
           "loop_tick_ms_p99": (stats.get("tick_seconds_p99") or 0) * 1000}
    print(f"  nested fast path with {live} live futures ({held} scheduler tasks): p50 {out['loaded']['p50_ms']:.3f} ms "
          f"vs idle cluster {out['idle_cluster']['p50_ms']:.3f} ms (ratio {out['ratio_p50']:.3f}, paired rounds "
          f"{out['ratio_paired_round_medians']:.3f}, p95 ratio {out['ratio_p95']:.3f}); same cluster before / after "
          f"{out['idle_before']['p50_ms']:.3f} / {out['idle_after']['p50_ms']:.3f} ms; loop tick p50 "
          f"{out['loop_tick_ms_p50']:.1f} ms", flush=True)
    return out


# -- report ----------------------------------------------------------------------------------------
def growth_exponent(rows: list[dict]) -> float | None:
    """Least-squares slope of log(pass ms) on log(live futures): 1 = linear, < 1 = sublinear."""
    pts = [(math.log(r["live_futures"]), math.log(r["pass_ms_median"])) for r in rows if r["pass_ms_median"] > 0]
    if len(pts) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx else None


def plot(passes: list[dict], path: str) -> None:
    """Pass time vs live futures, one line per (mode, workers): wall clock and thread CPU."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, field, what in ((axes[0], "pass_ms_median", "wall clock"), (axes[1], "pass_cpu_ms_median", "thread CPU")):
        for mode, style in (("incremental", "-o"), ("rebuild", "--s"), ("unbounded", "^")):
            for w in sorted({r["workers"] for r in passes}):
                rows = sorted((r for r in passes if r["mode"] == mode and r["workers"] == w),
                              key=lambda r: r["live_futures"])
                if rows:
                    ax.plot([r["live_futures"] for r in rows], [r[field] for r in rows], style,
                            label=f"{mode}, {w} workers")
        ax.axhline(50, color="grey", lw=0.8, ls=":", label="goal: 50 ms")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("live futures (EMULATED scheduler)")
        ax.set_title(f"one control pass, median {what}")
    axes[0].set_ylabel("ms (view + policies + enforcement)")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


CONFIGS = {
    "full": {"sizes": [2 ** k for k in range(10, 19)], "workers": [1024, 2048], "reps": 21,
             "rebuild_max": 2 ** 18, "fp_rounds": 40, "fp_calls": 100, "fp_background": 2000,
             "nested_live": 2 ** 18, "nested_rounds": 20, "nested_calls": 200},
    "quick": {"sizes": [2 ** k for k in range(10, 19, 2)], "workers": [1024, 2048], "reps": 15,
              "rebuild_max": 2 ** 18, "fp_rounds": 20, "fp_calls": 60, "fp_background": 1000,
              "nested_live": 2 ** 16, "nested_rounds": 6, "nested_calls": 100},
    "smoke": {"sizes": [2 ** 8, 2 ** 10], "workers": [64], "reps": 2, "rebuild_max": 2 ** 10,
              "fp_rounds": 2, "fp_calls": 10, "fp_background": 20,
              "nested_live": 200, "nested_rounds": 2, "nested_calls": 10},
}


PARTS = ("passes", "fast_path", "nested")


def run(config: dict, seed: int = 0, parts: tuple[str, ...] = PARTS) -> dict:
    """The parts asked for (all by default); returns the JSON document."""
    passes: list[dict] = []
    nested = None
    if "nested" in parts:
        nested = measure_nested_under_load(config["nested_live"], config["nested_rounds"], config["nested_calls"])
    if "passes" not in parts and "fast_path" not in parts:
        return {"passes": [], "fast_path": None, "nested_fast_path": nested,
                "summary": {"nested_fast_path_ratio_p50": nested["ratio_p50"] if nested else None,
                            "nested_fast_path_ratio_paired": nested["ratio_paired_round_medians"] if nested else None,
                            "goal_fast_path_ratio": 1.10}}
    for w in config["workers"]:
        for n in config["sizes"]:
            modes = ("incremental", "rebuild") if n <= config["rebuild_max"] else ("incremental",)
            if n == max(config["sizes"]):
                modes += ("unbounded",)
            passes.extend(measure_passes(n, w, config["reps"], seed, modes))
    fast = measure_fast_path(config["fp_rounds"], config["fp_calls"], config["fp_background"])
    inc = [r for r in passes if r["mode"] == "incremental"]
    top = [r for r in inc if r["live_futures"] >= 262144 and r["live_futures"] < 262144 * 1.01]
    largest = max(r["live_futures"] for r in inc)
    at_largest = [r for r in inc if r["live_futures"] == largest] or inc
    summary = {
        "pass_ms_at_262144": max(r["pass_ms_median"] for r in top) if top else None,
        "pass_cpu_ms_at_262144": max(r["pass_cpu_ms_median"] for r in top) if top else None,
        # what the pass budget left in the window there, and how many passes see every waiting call
        "calls_in_view_at_262144": min(r["calls_in_view_median"] for r in top) if top else None,
        "passes_per_rotation_at_262144": max(r["passes_per_rotation"] for r in top) if top else None,
        "pass_ms_at_largest": max(r["pass_ms_median"] for r in at_largest),
        "largest_live_futures": largest,
        "fast_path_latency_ratio": fast["ratio_p50"],
        "growth_exponent": {f"{m}_{w}": growth_exponent([r for r in passes if r["mode"] == m and r["workers"] == w])
                            for m in ("incremental", "rebuild") for w in config["workers"]},
        "unbounded_pass_ms_at_largest": max((r["pass_ms_median"] for r in passes
                                             if r["mode"] == "unbounded" and r["live_futures"] == largest), default=None),
        "rebuild_pass_ms_at_largest": max((r["pass_ms_median"] for r in passes
                                           if r["mode"] == "rebuild" and r["live_futures"] == largest), default=None),
        "hook_us_per_event_max": max(r["hook_us_per_event"] for r in inc),
        "nested_fast_path_ratio_p50": nested["ratio_p50"] if nested else None,
        "nested_fast_path_ratio_paired": nested["ratio_paired_round_medians"] if nested else None,
        "nested_fast_path_live_futures": nested["live_futures"] if nested else None,
        "goal_pass_ms": 50, "goal_fast_path_ratio": 1.10,
    }
    return {"passes": passes, "fast_path": fast, "nested_fast_path": nested, "summary": summary}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True, help="where to write the results (a PNG goes next to it)")
    ap.add_argument("--quick", action="store_true", help="every other size, fewer repetitions (< 5 min on 2 cores)")
    ap.add_argument("--smoke", action="store_true", help="a tiny configuration (tests)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--parts", default=",".join(PARTS),
                    help="comma-separated: passes (emulated control passes), fast_path (driver stub calls, loop "
                         "running vs stopped), nested (nested fast-path calls with the scheduler holding many "
                         "live futures); passes and fast_path run together")
    args = ap.parse_args(argv)
    parts = tuple(p for p in args.parts.split(",") if p)
    if not set(parts) <= set(PARTS):
        ap.error(f"unknown part in {args.parts!r} (known: {', '.join(PARTS)})")
    name = "smoke" if args.smoke else "quick" if args.quick else "full"
    config = dict(CONFIGS[name])
    import dask_agents.config as agents_config

    env = {"config_name": name, **config, "seed": args.seed, "python": platform.python_version(),
           "cpus": os.cpu_count(), "max_calls_per_tick": int(agents_config.get("control.max-calls-per-tick")),
           "max_actions_per_tick": int(agents_config.get("control.max-actions-per-tick")),
           "instances_per_worker": INSTANCES_PER_WORKER, "engine_workers": "1 in 8 (model coder)",
           "threads_per_emulated_worker": 16, "emulated": "part 1 (passes): EMULATED scheduler state; "
           "part 2 (fast_path) and part 3 (nested): real LocalClusters"}
    env["loadavg_start"] = os.getloadavg()
    print("configuration:", json.dumps(env), flush=True)
    t0 = time.time()
    doc = run(config, args.seed, parts)
    env["loadavg_end"] = os.getloadavg()
    doc = {"config": env, **doc, "wall_s": time.time() - t0}
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    png = os.path.splitext(args.json)[0] + ".png"
    if doc["passes"]:
        plot(doc["passes"], png)
    print(f"\n{'mode':11s} {'workers':>7s} {'live':>7s} {'sessions':>8s} {'waiting':>7s} {'pass ms':>8s} "
          f"{'cpu ms':>8s} {'view ms':>8s} {'in view':>7s} {'rotation':>8s}")
    for r in doc["passes"]:
        print(f"{r['mode']:11s} {r['workers']:7d} {r['live_futures']:7d} {r['sessions']:8d} {r['waiting_calls']:7d} "
              f"{r['pass_ms_median']:8.2f} {r['pass_cpu_ms_median']:8.2f} {r['view_ms_median']:8.2f} "
              f"{r['calls_in_view_median']:7.0f} {r['passes_per_rotation']:8d}")
    print("summary:", json.dumps(doc["summary"]))
    print(f"wrote {args.json}" + (f" and {png}" if doc["passes"] else "") + f" ({doc['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    # Run from the importable module: functions defined in __main__ are pickled by value, and
    # the ones sent to the LocalCluster here refer to a threading.Event (not picklable).
    from benchmarks import control_scale

    sys.exit(control_scale.main())
