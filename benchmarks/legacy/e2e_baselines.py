"""Plain Dask form of the Open-SWE workflow for ``benchmarks/e2e.py`` (no dask-agents at all).

Written the way a careful Dask user would: the driver submits one task per agent step and
passes futures between them (the plan future goes to the developers, the patch futures to the
tester); agent tasks make their nested calls through ``worker_client()`` (which secedes, so a
waiting agent holds no worker thread); each LLM call is a task that runs on a worker and
calls the EMULATED engine that worker hosts (``EngineHostPlugin``: one
:class:`dask_agents.worker_plugin.emulated.EmulatedEngineHost` per worker, the class dask-agents hosts) and
waits for it, holding its thread as real work would; tools are plain tasks. Dask's own
scheduling, queuing and work stealing decide everything else.

Static configuration knobs (swept by e2e.py at the calibration load, best one kept):
``threads`` per worker, and ``llm_slots``: None (LLM tasks may run on any worker thread), or
k (every worker advertises resource ``LLM=k`` and each LLM task needs ``LLM=1``, so at most k
calls are in flight per engine and the rest wait in the scheduler, where Dask can place them
on whichever engine frees a slot first); ``routing``: ``none`` (Dask places every LLM task), or
``session_sticky`` (what a careful user does for KV reuse, the rule the peers get under the same
name: at a request's start the driver picks the worker with the fewest requests pinned to it,
ties rotating, and every LLM task of that request is submitted with ``workers=[addr],
allow_other_workers=False``, so the session's prompt prefix stays cached on that engine; agent
and tool tasks stay unpinned).

The hand-tuned cap baseline (``dask-capped`` in e2e.py): ``session_sticky`` plus a cap on the
requests live per engine (:class:`CappedPinner`): a request starts its work only once an engine
worker has fewer than ``cap`` requests pinned, holds that slot for its whole life (released
when it ends, also on error), and waits FIFO for the first engine with a free slot. It is the
static admission control a user would write by hand; e2e.py tunes ``cap`` after the fact.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import deque

from distributed import WorkerPlugin, get_worker, worker_client

from dask_agents.stats import percentile

from benchmarks.legacy import e2e_swe as swe

PLUGIN = "e2e-emulated-engine"


class EngineHostPlugin(WorkerPlugin):
    """Hosts one EMULATED engine per worker (plain Dask: no dask-agents plugin anywhere)."""

    name = PLUGIN

    def __init__(self, engine: dict | None = None):
        self.engine = dict(swe.ENGINE if engine is None else engine)
        self.host = None

    def setup(self, worker) -> None:
        self.host = swe.make_engine(swe.MODEL, self.engine)

    def teardown(self, worker) -> None:
        if self.host is not None:
            self.host.close()


def engine_stats(dask_worker) -> dict | None:
    """``client.run`` helper: this worker's engine counters (None if it hosts none)."""
    plugin = dask_worker.plugins.get(PLUGIN)
    return plugin.host.stats() if plugin is not None and plugin.host is not None else None


def llm_task(prompt: str, max_tokens: int) -> dict:
    """One LLM call on this worker's engine (holds the thread while the engine works)."""
    host = get_worker().plugins[PLUGIN].host
    out = swe.engine_call(host, prompt, max_tokens, uuid.uuid4().hex).result()
    toks = out.outputs[0].token_ids
    return {"text": host.tokenizer.decode(toks), "prompt_tokens": len(out.prompt_token_ids),
            "cached_tokens": out.num_cached_tokens, "output_tokens": len(toks)}


def doc_search_task(query: str, emulated_s: float, time_scale: float, answer: tuple) -> str:
    return swe.sleep_tool("file_io", query, emulated_s, time_scale, answer)


def code_exec_task(code: str, emulated_s: float, time_scale: float) -> str:
    return swe.sleep_tool("code_exec", code, emulated_s, time_scale)


ROUTINGS = ("none", "session_sticky")


class SessionPinner:
    """Driver-side choice of the engine worker a request's LLM tasks are pinned to
    (``session_sticky``): the worker with the fewest requests pinned right now, ties rotating."""

    def __init__(self, workers: list[str]):
        if not workers:
            raise ValueError("no workers to pin to")
        self.workers = list(workers)
        self.active = dict.fromkeys(self.workers, 0)
        self.turn = 0
        self.lock = threading.Lock()

    def acquire(self) -> str:
        with self.lock:
            self.turn += 1
            n = len(self.workers)
            i = min(range(n), key=lambda j: (self.active[self.workers[j]], (j - self.turn) % n))
            addr = self.workers[i]
            self.active[addr] += 1
            return addr

    def release(self, addr: str) -> None:
        with self.lock:
            self.active[addr] -= 1


class PinnerClosed(RuntimeError):
    """The run ended while the request still waited for an engine slot."""


class CappedPinner:
    """``session_sticky`` with at most ``cap`` requests live per engine worker (the hand-tuned
    cap baseline). :meth:`acquire` blocks until an engine has a free slot; waiting requests are
    served first come, first served (a later request never overtakes an earlier one, even when
    a slot frees up just as it arrives); among the engines with a free slot it takes the one with
    the fewest requests live, ties rotating (as :class:`SessionPinner`). :meth:`release` frees the
    slot (the driver calls it in a ``finally``, so a failing request frees it too); :meth:`close`
    wakes every waiter with :class:`PinnerClosed` (the end of a run that timed out)."""

    def __init__(self, workers: list[str], cap: int):
        if not workers:
            raise ValueError("no workers to pin to")
        if int(cap) < 1:
            raise ValueError(f"cap must be >= 1, not {cap!r}")
        self.workers, self.cap = list(workers), int(cap)
        self.active = dict.fromkeys(self.workers, 0)
        self.peak = dict.fromkeys(self.workers, 0)  # most requests live at once, per engine
        self.turn = 0
        self.cond = threading.Condition()
        self.queue: deque = deque()  # tickets of the waiting requests, in arrival order
        self.waits: list[float] = []  # seconds each admitted request waited for its slot
        self.order: list[object] = []  # the tickets in the order they got a slot
        self.closed = False

    def _free(self) -> list[int]:
        return [j for j, w in enumerate(self.workers) if self.active[w] < self.cap]

    def acquire(self, ticket: object | None = None) -> str:
        """The engine worker this request is pinned to, once one has a free slot (FIFO)."""
        me = object() if ticket is None else ticket
        t0 = time.perf_counter()
        with self.cond:
            self.queue.append(me)
            try:
                while not self.closed and not (self.queue[0] is me and self._free()):
                    self.cond.wait()
                if self.closed:
                    raise PinnerClosed("the run ended while this request waited for an engine slot")
            finally:
                if self.queue and self.queue[0] is me:
                    self.queue.popleft()
                elif me in self.queue:
                    self.queue.remove(me)
                self.cond.notify_all()  # the next in line may fit too
            self.turn += 1
            n = len(self.workers)
            i = min(self._free(), key=lambda j: (self.active[self.workers[j]], (j - self.turn) % n))
            addr = self.workers[i]
            self.active[addr] += 1
            self.peak[addr] = max(self.peak[addr], self.active[addr])
            self.waits.append(time.perf_counter() - t0)
            self.order.append(me)
            return addr

    def release(self, addr: str) -> None:
        with self.cond:
            if self.active.get(addr, 0) <= 0:
                raise ValueError(f"release of {addr!r} without a live request there")
            self.active[addr] -= 1
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def stats(self) -> dict:
        """Driver-side waits for a slot (p50, p99, how many waited > 1 ms) and peak live requests."""
        import numpy as np

        w = np.asarray(self.waits, dtype=float)
        return {"cap": self.cap, "requests": int(w.size),
                "wait_p50_s": percentile(w, 50) if w.size else None,
                "wait_p99_s": percentile(w, 99) if w.size else None,
                "waited": int((w > 1e-3).sum()), "peak_live_per_engine": max(self.peak.values(), default=0)}


def _llm(c, prompt: str, max_tokens: int, llm_slots: int | None, worker: str | None = None) -> dict:
    kw: dict = {"resources": {"LLM": 1}} if llm_slots else {}
    if worker is not None:  # session_sticky: this request's engine only
        kw.update(workers=[worker], allow_other_workers=False)
    return c.submit(llm_task, prompt, max_tokens, pure=False, **kw).result()


def plan_task(spec: swe.RequestSpec, llm_slots: int | None, worker: str | None = None) -> list[str]:
    with worker_client() as c:  # secedes: the wait below holds no worker thread
        _llm(c, swe.plan_prompt(spec), swe.PLAN_TOKENS, llm_slots, worker)
    return swe.subtasks_of(spec)


def implement_task(spec: swe.RequestSpec, subtasks: list[str], k: int, feedback: str | None, attempt: int,
                   llm_slots: int | None, worker: str | None = None) -> swe.Patch:
    subtask = subtasks[k]
    ts = spec.tool_time_scale
    with worker_client() as c:
        docs = c.submit(doc_search_task, subtask, spec.doc_s[k][attempt], ts, swe.doc_args(spec, k, attempt),
                        pure=False).result()
        answer = _llm(c, swe.patch_prompt(spec, subtasks, k, attempt, docs, feedback), swe.PATCH_TOKENS, llm_slots,
                      worker)
        c.submit(code_exec_task, f"{subtask} attempt {attempt}", spec.code_s[k][attempt], ts, pure=False).result()
    return swe.make_patch(spec, subtasks, k, attempt, answer["output_tokens"])


def tester_task(spec: swe.RequestSpec, patches: list[swe.Patch], rnd: int, llm_slots: int | None,
                worker: str | None = None) -> swe.Report:
    with worker_client() as c:
        _llm(c, swe.review_prompt(spec, patches), swe.REVIEW_TOKENS, llm_slots, worker)
        c.submit(code_exec_task, f"pytest {spec.id} round {rnd}", spec.test_s[rnd], spec.tool_time_scale,
                 pure=False).result()
    return swe.tester_report(spec, rnd)


def solve_dask(client, spec: swe.RequestSpec, llm_slots: int | None = None,
               pinner: SessionPinner | CappedPinner | None = None) -> dict:
    """Drive one request with plain Dask futures (the same control flow as ``solve_agents``);
    with ``pinner`` (routing ``session_sticky``, or the capped form) all its LLM tasks run on
    one engine worker, whose slot the request holds until it ends (errors included)."""
    worker = pinner.acquire() if pinner is not None else None
    try:
        return _solve(client, spec, llm_slots, worker)
    finally:
        if worker is not None:
            pinner.release(worker)


def _solve(client, spec: swe.RequestSpec, llm_slots: int | None, w: str | None) -> dict:
    plan = client.submit(plan_task, spec, llm_slots, w, pure=False)
    n = len(plan.result())  # like len(subtasks) in the dask-agents driver: wait for the plan
    patches = [client.submit(implement_task, spec, plan, k, None, 0, llm_slots, w, pure=False) for k in range(n)]
    retries = 0
    report = client.submit(tester_task, spec, patches, 0, llm_slots, w, pure=False).result()
    while not report.passed:
        retries += 1
        k = report.failing
        patches[k] = client.submit(implement_task, spec, plan, k, report.log, retries, llm_slots, w, pure=False)
        report = client.submit(tester_task, spec, list(patches), retries, llm_slots, w, pure=False).result()
    done = client.gather(patches)
    return {"retries": retries, "passed": report.passed, "patches": len(done)}
