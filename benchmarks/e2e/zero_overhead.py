"""What a framework with no overhead at all gets on a unit: the same requests, arrivals and
EMULATED engines, replayed in virtual time.

The ideal bound (:mod:`benchmarks.e2e.ideal`) gives each request the engines to itself
(single-sequence steps, no queueing). Under load no framework can have that: a request's
decode steps carry the other requests' sequences and their prefill chunks, since the engine
batches them. This replay measures that part apart from any framework's cost: every request's
program runs at its arrival, its agents start at once, tools take exactly their emulated
latency, and each LLM call joins its engine's queue the instant it is made, on engines that
are the cost model itself (:class:`~dask_agents.worker_plugin.emulated_kv.EmulatedScheduler`,
stepped in virtual time: no pacing, no GIL, no wall clock). Calls go to replicas as the
peers' routers send them (``session_sticky`` by default: a session's first call to the
replica with the fewest calls in flight, the rest follow it). The engines are workflow-blind
(vLLM's FCFS admission, LRU host tier), as every baseline's.

It is a reference, not a lower bound: a scheduler that reorders the engines' queues or spreads
sessions differently may do better on some requests. What it shows is how much of a variant's
distance from the ideal bound is the load itself, which overhead cannot explain and which no
cut of overhead can recover.

How much of that load a scheduler could win by order is estimated by the same replay with an
oracle's priorities on the engines' queues (``order``; the engines admit and preempt by
priority, as vLLM's priority policy does): ``"sjf"``, the request whose whole ideal latency is
shortest first; ``"srpt"``, the request whose ideal remaining work (from this call's start on
its ideal path, its pauses left out) is least first. The oracle knows every request's future,
which no scheduler does; SRPT is the mean-optimal order on one server, a strong estimate (not a
proof) on engines that batch. Where the engines' queues are empty (every call admitted at
once), no order changes anything: the replay shows whether they are.

The replay: every simulated activity (a request's program, each agent it starts) is a thread
that blocks on virtual waits (:class:`VirtualClock`); time moves to the next event only when
every thread is blocked, so the result is deterministic and independent of the machine.
"""

from __future__ import annotations

import heapq
import itertools
import math
import statistics
import threading
import uuid
from collections import deque
from typing import Any, Callable

from benchmarks.e2e.program import LLMCall, LLMOut, Recorder, ToolCall

ORDERS = ("fcfs", "sjf", "srpt")


class VirtualClock:
    """Discrete events over threads, one running at a time. A simulated thread runs until it
    blocks (:meth:`block`) or ends; then the next thread made ready (:meth:`wake`, in the order
    they were woken) runs; when none is ready, :meth:`run` advances ``now`` to the earliest timer
    and fires it (on the coordinator's thread). One at a time and in a fixed order: the replay is
    deterministic and needs no locks of its own."""

    def __init__(self) -> None:
        self.now = 0.0
        self._cv = threading.Condition()
        self._running = False  # a simulated thread runs (the coordinator waits)
        self._ready: deque[threading.Event] = deque()
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self.error: BaseException | None = None

    def at(self, t: float, action: Callable[[], None]) -> None:
        """Run ``action`` at virtual time ``t`` (not before now; FIFO among equal times)."""
        heapq.heappush(self._timers, (max(t, self.now), next(self._order), action))

    def spawn(self, fn: Callable[..., Any], *args: Any) -> None:
        """Start a simulated thread (it runs when its turn comes)."""
        go = threading.Event()

        def body() -> None:
            go.wait()
            try:
                fn(*args)
            except BaseException as e:  # noqa: BLE001  (the replay fails with it: run() raises)
                self.error = self.error or e
            finally:
                self._yield()

        threading.Thread(target=body, daemon=True, name="zero-overhead").start()
        self._ready.append(go)

    def _yield(self) -> None:
        with self._cv:
            self._running = False
            self._cv.notify_all()

    def block(self, event: threading.Event) -> None:
        """From a simulated thread: wait until ``event`` is woken (:meth:`wake`)."""
        self._yield()
        event.wait()

    def wake(self, event: threading.Event) -> None:
        """Make the thread blocked (or about to block) on ``event`` ready to run."""
        self._ready.append(event)

    def sleep(self, seconds: float) -> None:
        """From a simulated thread: ``seconds`` of virtual time pass."""
        done = threading.Event()
        self.at(self.now + max(0.0, seconds), lambda: self.wake(done))
        self.block(done)

    def run(self) -> None:
        """Run ready threads, then fire timers in time order, until neither is left."""
        while True:
            with self._cv:
                self._cv.wait_for(lambda: not self._running)
            if self.error is not None:
                raise self.error
            if self._ready:
                self._running = True
                self._ready.popleft().set()
                continue
            if not self._timers:
                return
            t, _, action = heapq.heappop(self._timers)
            self.now = t
            action()


class Engine:
    """One EMULATED engine replica stepped in virtual time: a step starts when the engine has
    work and is not stepping; the sequences it finishes return at its end."""

    def __init__(self, clock: VirtualClock, params: Any, capacity_blocks: int):
        from dask_agents.worker_plugin.emulated_kv import EmulatedScheduler

        self.clock, self.sched = clock, EmulatedScheduler(params, capacity_blocks, True)
        self.stepping = False
        self.waiters: dict[str, threading.Event] = {}
        self.busy_s = 0.0

    def submit(self, ids: list[int], max_tokens: int, done: threading.Event, priority: tuple = ()) -> Any:
        """Queue a request (from a simulated thread); ``done`` is woken when it finishes."""
        from dask_agents.worker_plugin.emulated_kv import Sequence

        seq = Sequence(uuid.uuid4().hex, ids, max_tokens, priority=priority)
        self.waiters[seq.request_id] = done
        self.sched.add(seq)
        if not self.stepping:
            self.stepping = True
            self.clock.at(self.clock.now, self._step)  # the step starts once every thread has blocked
        return seq

    def _step(self) -> None:
        if self.clock.now > self.sched.now:  # idle time passes (for transfers in flight): one clock
            self.sched.advance(self.clock.now - self.sched.now)
        cost, finished = self.sched.step()
        if not cost and not finished:  # nothing could run (a request too big for the KV stays queued)
            self.stepping = False
            return
        self.busy_s += cost
        self.clock.at(self.clock.now + cost, lambda: self._end(finished))

    def _end(self, finished: list) -> None:
        for seq in finished:
            self.clock.wake(self.waiters.pop(seq.request_id))
        if self.sched.running or self.sched.waiting:
            self._step()
        else:
            self.stepping = False


class _Handle:
    def __init__(self) -> None:
        self.done, self.value, self.waiters = False, None, []  # (one simulated thread at a time: no lock)


class _Ctx:
    def __init__(self, rt: "ReplayRuntime"):
        self.rt, self.session = rt, rt.session

    def llm(self, call: LLMCall) -> LLMOut:
        return self.rt.replay.llm(self.session, call)

    def tool(self, call: ToolCall) -> str:
        self.rt.replay.clock.sleep(call.emulated_s)
        return call.answer


class ReplayRuntime:
    """One request's :class:`~benchmarks.e2e.program.Runtime` in the replay."""

    def __init__(self, replay: "Replay", session: str):
        self.replay, self.session = replay, session
        self.rec = Recorder()
        self.think_s = 0.0

    def agent(self, role: str, fn: Callable, *args: Any) -> _Handle:
        h = _Handle()
        clock = self.replay.clock

        def body() -> None:
            h.value, h.done = fn(_Ctx(self), *args), True
            for ev in h.waiters:
                clock.wake(ev)

        clock.spawn(body)
        return h

    def gather(self, handles: list) -> list:
        for h in handles:
            if not h.done:
                ev = threading.Event()
                h.waiters.append(ev)
                self.replay.clock.block(ev)
        return [h.value for h in handles]

    def think(self, seconds: float) -> None:
        if seconds > 0:
            self.think_s += seconds
            self.replay.clock.sleep(seconds)


class Oracle:
    """An oracle's priority of a call (:meth:`__call__`: session, model, prompt -> the engine's
    priority tuple, smaller first) for ``order`` (``"sjf"`` or ``"srpt"``, module docstring),
    from each request's ideal path (:func:`benchmarks.e2e.ideal.ideal_run`, the same engine
    parameters). A call its request's ideal path never made ranks by the request's whole
    latency and is counted in ``misses`` (none in the shipped workflows: each replay reports it)."""

    def __init__(self, wf: Any, specs: list, engine: dict, order: str):
        from benchmarks.e2e.ideal import ideal_run, run_shared

        self.order, self.misses = order, 0
        shared = run_shared(wf, specs)
        self.whole: dict[str, float] = {}
        self.left: dict[str, dict[tuple[str, str], float]] = {}
        for spec in specs:
            rt = ideal_run(wf, spec, engine, shared)
            self.whole[spec.id] = rt.latency
            left = self.left[spec.id] = {}
            for start, _, model, prompt in rt.sent:
                pauses = sum(s for at, s in rt.thinks if at >= start)
                left.setdefault((model, prompt), rt.now - start - pauses)

    def __call__(self, session: str, model: str, prompt: str) -> tuple:
        if self.order == "sjf":
            return (self.whole[session],)
        left = self.left[session].get((model, prompt))
        if left is None:
            self.misses += 1
            left = self.whole[session]
        return (left,)


def oracle(wf: Any, specs: list, engine: dict, order: str) -> Oracle | None:
    """The engines' queue order ``order`` (:data:`ORDERS`) for these requests: an
    :class:`Oracle`, or None for first come first served."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    return None if order == "fcfs" else Oracle(wf, specs, engine, order)


class Replay:
    """One unit's requests on zero-overhead agents and virtual-time engines (module docstring);
    ``priority``: each call's place in its engine's queue (:func:`oracle`; FCFS without)."""

    def __init__(self, setup: Any, routing: str = "session_sticky", priority: Oracle | None = None):
        from benchmarks.e2e import profile
        from benchmarks.e2e.variants.common import Router, replica_groups
        from dask_agents.worker_plugin.emulated_kv import H100_KV_BLOCKS
        from dask_agents.worker_plugin.tokenizer import ByteTokenizer

        self.clock = VirtualClock()
        p = profile.params(setup.engine)
        capacity = p.kv_blocks or H100_KV_BLOCKS  # (what the engine host takes when no KV size is given)
        self.engines = [Engine(self.clock, p, capacity) for _ in setup.replica_models()]
        self.groups = replica_groups(setup)
        self.routers = {m: Router(len(g), routing) for m, g in self.groups.items()}
        self.tokenizer = ByteTokenizer()
        self.priority = priority
        self.hits = self.queried = 0

    def llm(self, session: str, call: LLMCall) -> LLMOut:
        router = self.routers[call.model]
        i = router.pick(session)
        try:
            done = threading.Event()
            ids = self.tokenizer.encode(call.prompt)
            prio = self.priority(session, call.model, call.prompt) if self.priority else ()
            seq = self.engines[self.groups[call.model][i]].submit(ids, call.max_tokens, done, prio)
            self.clock.block(done)
        finally:
            router.done(i)
        self.queried += len(ids)
        self.hits += seq.cached_tokens
        return LLMOut(len(ids), seq.cached_tokens, len(seq.output))

    def run(self, wf: Any, specs: list, offsets: list[float]) -> list[float]:
        """Each request's latency (emulated s, its think time left out), in ``specs`` order."""
        out = [math.nan] * len(specs)

        def request(i: int) -> None:
            spec, start = specs[i], self.clock.now
            rt = ReplayRuntime(self, spec.id)
            wf.check(spec, wf.program(rt, spec))
            for r in self.routers.values():
                r.forget(spec.id)
            out[i] = self.clock.now - start - rt.think_s

        for i, off in enumerate(offsets):
            self.clock.at(off, lambda i=i: self.clock.spawn(request, i))
        self.clock.run()
        return out


def replay(wf: Any, specs: list, offsets: list[float], setup: Any, routing: str = "session_sticky",
           order: str = "fcfs") -> dict:
    """The zero-overhead reference of one unit, over the runner's measured window
    (:func:`benchmarks.e2e.stats.window`): mean, P50 and P99 latency (emulated s), every
    request's latency, the prefix hit rate, the prefill tokens computed and each engine's busy
    seconds; ``order``: the engines' queue order (:data:`ORDERS`, module docstring)."""
    from benchmarks.e2e import stats

    prio = oracle(wf, specs, setup.engine, order)
    r = Replay(setup, routing, prio)
    lat = r.run(wf, specs, offsets)
    w = [x["latency"] for x in stats.window([{"arrival": a, "latency": x} for a, x in zip(offsets, lat)])]
    return {"mean_s": statistics.fmean(w), "p50_s": stats.percentile(w, 50), "p99_s": stats.percentile(w, 99),
            "latencies_s": [round(x, 4) for x in lat], "hit_rate": r.hits / r.queried if r.queried else None,
            "prefill_tokens": sum(e.sched.counters["prefill_tokens"] for e in r.engines),
            "engine_busy_s": [round(e.busy_s, 3) for e in r.engines], "routing": routing, "order": order,
            "oracle_misses": prio.misses if prio else 0}


def unit_reference(wf: Any, setup: Any, scenario: str, rate_rps: float, seed: int, requests: int,
                   routing: str = "session_sticky", order: str = "fcfs") -> dict:
    """:func:`replay` of the measure phase's unit (the same requests and arrivals as
    :func:`benchmarks.e2e.runner.measure` makes for it)."""
    from benchmarks.e2e.runner import arrivals

    specs = wf.make_specs(requests, seed, scenario)
    return replay(wf, specs, arrivals(wf, scenario, len(specs), rate_rps, seed), setup, routing, order)
