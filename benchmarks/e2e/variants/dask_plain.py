"""Plain Dask as a careful user runs an agent workflow on it (no dask-agents anywhere), and the
two hand-tuned baselines built on it.

- Agents are tasks: the driver submits one task per agent invocation and gathers them; an agent
  task makes its LLM calls as nested tasks through ``worker_client()`` (which secedes, so a
  waiting agent holds no worker thread) and calls its tools inline (plain Python functions: a
  3 ms file tool costs 3 ms). Each LLM task runs on an engine worker and calls the EMULATED
  engine that worker hosts (:class:`EngineHostPlugin`, one per worker, the class every variant
  gets), holding its thread while the engine works.
- Knobs (``dask`` static, swept): ``threads`` per worker; ``llm_slots`` (None, or k: each LLM
  task needs resource ``LLM=1`` of the k each worker advertises, so calls beyond k wait in the
  scheduler); ``routing``: ``none`` (Dask places LLM tasks) or ``session_sticky`` (at a request's
  start the driver pins it, per model, to the engine worker with the fewest live requests, and
  submits its LLM tasks with ``workers=[addr], allow_other_workers=False``: its prefix stays
  cached there).
- ``dask-capped``: ``session_sticky`` plus at most ``cap`` requests live per engine worker: a
  request waits FIFO in the driver for a free slot and holds it for its life (the static
  admission control a user writes by hand; ``cap`` swept per scenario).
- ``dask-ttl``: ``session_sticky`` plus a Continuum-style static pin: after each LLM call the
  engine pins the calling agent's KV (Continuum pins per program: each agent invocation is one
  to the engine, so a paused developer pins its own transcript, not its siblings' or the whole
  request's) for ``ttl`` emulated seconds (renewed by its next call; within the engine's pin
  budget; released when nothing can run, so pins never wedge the engine), so an agent paused on
  a tool finds its prefix when it returns (``ttl`` swept per scenario).
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections import deque
from functools import partial
from typing import Any, Callable, Iterator

from distributed import WorkerPlugin, get_worker, worker_client

from benchmarks.e2e.program import AgentClock, AgentResult, FuturesRuntime, LLMCall, Setup, ToolCall, sleep_tool
from benchmarks.e2e.variants.common import generate_on, make_engine

PLUGIN = "e2e-emulated-engine"


class EngineHostPlugin(WorkerPlugin):
    """Hosts one EMULATED engine per worker: worker ``i`` (its name) hosts replica ``i``'s model."""

    name = PLUGIN

    def __init__(self, setup: Setup):
        self.run_setup = setup  # (``setup`` is WorkerPlugin's hook)
        self.host: Any = None
        self.model: str | None = None

    def setup(self, worker: Any) -> None:
        self.model = self.run_setup.replica_models()[int(worker.name)]
        self.host = make_engine(self.model, self.run_setup)

    def teardown(self, worker: Any) -> None:
        if self.host is not None:
            self.host.close()


def _plugin(dask_worker: Any = None) -> EngineHostPlugin:
    return (dask_worker or get_worker()).plugins[PLUGIN]


def engine_stats(dask_worker: Any) -> dict | None:
    """``client.run`` helper: this worker's engine counters and model."""
    p = dask_worker.plugins.get(PLUGIN)
    return None if p is None or p.host is None else {**p.host.stats(), "model": p.model}


def llm_task(call: LLMCall, ttl_wall_s: float | None, program: str | None = None) -> tuple:
    """One LLM call on this worker's engine (holds the thread while the engine works);
    ``program``: the calling agent invocation (what a TTL pin covers)."""
    host = _plugin().host
    if ttl_wall_s is None:
        return generate_on(host, call)
    out = generate_on(host, call, session=program)  # the TTL pin needs the engine to know the program
    # Pinned between engine steps (on the stepping thread: the KV is not thread-safe), and not
    # waited for: an engine that pins at a request's end (Continuum) adds nothing to the call.
    # A pin beyond the engine's pin budget pins fewer blocks; it does not fail.
    ttl = ttl_wall_s
    host.kv_call(lambda kv: kv.retain(program, ttl_s=ttl))
    return out


class _Ctx:
    def __init__(self, session: str, clock: AgentClock, pins: dict, llm_slots: int | None, ttl: float | None,
                 time_scale: float, model_workers: dict):
        self.session, self.clock, self.pins, self.model_workers = session, clock, pins, model_workers
        self.llm_slots, self.ttl, self.time_scale = llm_slots, ttl, time_scale
        self.program = f"{session}/{uuid.uuid4().hex[:12]}"  # this agent invocation (a TTL pin's unit)

    def llm(self, call: LLMCall):
        kw: dict = {"key": f"llm-{call.role}-{uuid.uuid4().hex}", "pure": False}
        addr = self.pins.get(call.model)
        # pinned to its session's engine, or to any worker hosting the call's model
        kw.update(workers=[addr] if addr is not None else self.model_workers[call.model], allow_other_workers=False)
        if self.llm_slots:
            kw["resources"] = {"LLM": 1}
        issued = time.time()
        with worker_client() as c:
            out, started, ended = c.submit(llm_task, call, self.ttl, self.program, **kw).result()
        self.clock.add(issued, started, ended, time.time())
        self.clock.llm.append(out)
        return out

    def tool(self, call: ToolCall) -> str:
        issued = time.time()
        answer, started, ended = sleep_tool(call, self.time_scale)
        self.clock.add(issued, started, ended, time.time(), kind="tool")
        return answer


def agent_task(session: str, fn: Callable, args: tuple, pins: dict, llm_slots: int | None, ttl: float | None,
               time_scale: float, model_workers: dict) -> AgentResult:
    """One agent invocation as a task."""
    clock = AgentClock()
    return clock.result(fn(_Ctx(session, clock, pins, llm_slots, ttl, time_scale, model_workers), *args))


class Pinner:
    """Driver-side engine choice per request (``session_sticky``), optionally capped: at most
    ``cap`` requests live per engine worker, waiting FIFO for a free slot (see the module
    docstring). :meth:`close` wakes waiters with RuntimeError (a run that timed out)."""

    def __init__(self, workers: list[str], cap: int | None = None):
        if not workers:
            raise ValueError("no workers to pin to")
        if cap is not None and int(cap) < 1:
            raise ValueError(f"cap must be >= 1, not {cap!r}")
        self.workers, self.cap = list(workers), cap
        self.active = dict.fromkeys(self.workers, 0)
        self.turn = 0
        self.cond = threading.Condition()
        self.queue: deque = deque()
        self.waits: list[float] = []
        self.closed = False

    def _free(self) -> list[int]:
        return [j for j, w in enumerate(self.workers) if self.cap is None or self.active[w] < self.cap]

    def acquire(self) -> str:
        me, t0 = object(), time.perf_counter()
        with self.cond:
            self.queue.append(me)
            try:
                while not self.closed and not (self.queue[0] is me and self._free()):
                    self.cond.wait()
                if self.closed:
                    raise RuntimeError("the run ended while this request waited for an engine slot")
            finally:
                if me in self.queue:
                    self.queue.remove(me)
                self.cond.notify_all()
            self.turn += 1
            n = len(self.workers)
            i = min(self._free(), key=lambda j: (self.active[self.workers[j]], (j - self.turn) % n))
            self.active[self.workers[i]] += 1
            self.waits.append(time.perf_counter() - t0)
            return self.workers[i]

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


class PlainDask:
    """``dask`` (static), ``dask-capped`` (``cap``) or ``dask-ttl`` (``ttl``, emulated seconds)."""

    def __init__(self, setup: Setup, threads: int = 64, llm_slots: int | None = None, routing: str = "none",
                 cap: int | None = None, ttl: float | None = None):
        if routing not in ("none", "session_sticky"):
            raise ValueError(f"unknown routing {routing!r} (none, session_sticky)")
        if (cap or ttl) and routing != "session_sticky":
            raise ValueError("cap and ttl pin sessions: they need routing='session_sticky'")
        self.setup, self.threads, self.llm_slots, self.routing = setup, threads, llm_slots, routing
        self.cap, self.ttl = cap, ttl
        self.ttl_wall = None if ttl is None else ttl * setup.time_scale
        self.name = "dask-capped" if cap else "dask-ttl" if ttl else "dask"
        self.cluster = self.client = None

    def __enter__(self) -> "PlainDask":
        from distributed import Client, LocalCluster

        kw = {"resources": {"LLM": self.llm_slots}} if self.llm_slots else {}
        self.cluster = LocalCluster(n_workers=self.setup.replicas, threads_per_worker=self.threads, processes=True,
                                    dashboard_address=None, scheduler_kwargs={"dashboard_address": "127.0.0.1:0"},
                                    **kw)
        self.client = Client(self.cluster)
        self.client.register_plugin(EngineHostPlugin(self.setup))
        self.client.wait_for_workers(self.setup.replicas)
        stats = self.client.run(engine_stats)
        by_model: dict[str, list[str]] = {}
        for addr in sorted(stats):
            by_model.setdefault(stats[addr]["model"], []).append(addr)
        self.by_model = by_model
        self.pinners = {m: Pinner(ws, self.cap) for m, ws in by_model.items()} if self.routing != "none" else {}
        self.workers = sorted(stats, key=lambda a: self.client.scheduler_info()["workers"][a]["name"])
        return self

    def __exit__(self, *exc: Any) -> None:
        for p in getattr(self, "pinners", {}).values():
            p.close()
        for c in (self.client, self.cluster):
            with contextlib.suppress(Exception):
                c.close()

    @contextlib.contextmanager
    def session(self, session_id: str, models: tuple | None = None) -> Iterator[FuturesRuntime]:
        """Pins (session_sticky) or slots (capped) for the models the request calls; without
        routing its LLM tasks may run on any worker hosting their model."""
        pins: dict[str, str] = {}
        try:
            for m in models or tuple(self.by_model):
                pins[m] = self.pinners[m].acquire() if self.pinners else None
            yield FuturesRuntime(session_id, partial(self._start_agent, session_id, pins), self.setup.time_scale)
        finally:
            for m, addr in pins.items():
                if addr is not None:
                    self.pinners[m].release(addr)

    def _start_agent(self, session: str, pins: dict, role: str, fn: Callable, args: tuple) -> Any:
        """One agent invocation as a task (the driver submits it; it makes its own nested calls)."""
        return self.client.submit(agent_task, session, fn, args, pins, self.llm_slots, self.ttl_wall,
                                  self.setup.time_scale, self.by_model, key=f"{role}-{uuid.uuid4().hex}", pure=False)

    def engine_stats(self) -> list[dict]:
        stats = self.client.run(engine_stats)
        return [stats[a] for a in self.workers]

    def describe(self) -> dict:
        import distributed

        return {"framework": f"dask/distributed {distributed.__version__}, no dask-agents",
                "setup": self.setup.describe(), "threads": self.threads, "llm_slots": self.llm_slots,
                "routing": self.routing, "cap": self.cap, "ttl_s": self.ttl,
                "agents": "one task per agent invocation; LLM calls nested via worker_client; tools inline",
                "engines": f"{self.setup.replicas} worker processes, one EMULATED engine each (EngineHostPlugin)"}
