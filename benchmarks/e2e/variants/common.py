"""What the variants share: engine hosts, the LLM call body on a host, replica routing, the
open-loop session runtime for variants whose agents run as threads in the driver."""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from benchmarks.e2e.program import (
    AgentClock,
    AgentResult,
    LLMCall,
    LLMOut,
    FuturesRuntime,
    Setup,
    ToolCall,
    sleep_tool,
)

ROUTINGS = ("round_robin", "least_loaded", "session_sticky")


def model_entry(setup: Setup, workflow_aware: bool = False) -> dict:
    """The ``agents.llm.models`` entry of every engine of a run: the Setup's own entry (a real
    engine) or the EMULATED engine of its profile. Every variant gets the same engine, prefix
    cache and host tier; a baseline's engine is workflow-blind (``kv-policy`` as the Setup says:
    ``none`` on an emulated engine, whose LRU host tier is the engine's own), while dask-agents
    (``workflow_aware``) runs the product's configured KV policy on it (``agents.kv.policy``)."""
    if setup.entry is not None:
        entry = dict(setup.entry)
    else:
        entry = {"engine": "emulated", "model": "emulated", "tokenizer": "byte", "max-model-len": setup.max_model_len,
                 "enable-prefix-caching": True, "emulation": setup.engine_params(), "kv-policy": "none"}
    if workflow_aware:
        entry.pop("kv-policy", None)
    return entry


def make_engine(name: str, setup: Setup) -> Any:
    """One engine host of a baseline, started: the class dask-agents' worker plugin hosts for
    the run's entry (:func:`model_entry`)."""
    from dask_agents.model_settings import ModelSettings
    from dask_agents.worker_plugin.engines import make_host

    host = make_host(name, ModelSettings(**model_entry(setup)))
    host.start()
    host.wait_loaded(30 if setup.entry is None else 600)  # a real engine loads in tens of seconds
    return host


def generate_on(host: Any, call: LLMCall, session: str | None = None) -> tuple[LLMOut, float, float]:
    """Run one LLM call on an engine host and wait: its counts, and when the engine received it
    and finished it (wall clock). ``session`` is passed to the engine only by variants whose
    engine knows sessions (dask-agents does it itself; a workflow-blind engine gets None)."""
    received = time.time()  # (before tokenizing: every variant stamps receipt here)
    ids = host.tokenizer.encode(call.prompt)
    fut = host.submit(uuid.uuid4().hex, ids, host.sampling_params(call.max_tokens, 0.0, None), session)
    out = fut.result()
    done = time.time()
    return (LLMOut(len(out.prompt_token_ids), int(out.num_cached_tokens or 0), len(out.outputs[0].token_ids)),
            received, done)


class Router:
    """Which replica of a model serves a call; thread-safe. ``round_robin`` per call;
    ``least_loaded`` (fewest calls in flight); ``session_sticky`` (a session's first call goes
    to the least loaded replica, the rest follow it while the session lives: its prefix is
    cached there; :meth:`forget` when the session ends)."""

    def __init__(self, n: int, rule: str):
        if rule not in ROUTINGS:
            raise ValueError(f"unknown routing {rule!r} (known: {', '.join(ROUTINGS)})")
        if n < 1:
            raise ValueError("a model needs at least one engine replica")
        self.rule, self.inflight, self.rr, self.sticky = rule, [0] * n, -1, {}
        self.lock = threading.Lock()

    def pick(self, session: str) -> int:
        with self.lock:
            if self.rule == "round_robin":
                self.rr = (self.rr + 1) % len(self.inflight)
                i = self.rr
            elif self.rule == "session_sticky" and session in self.sticky:
                i = self.sticky[session]
            else:
                i = min(range(len(self.inflight)), key=lambda j: (self.inflight[j], j))
                if self.rule == "session_sticky":
                    self.sticky[session] = i
            self.inflight[i] += 1
            return i

    def done(self, i: int) -> None:
        with self.lock:
            self.inflight[i] -= 1

    def forget(self, session: str) -> None:
        with self.lock:
            self.sticky.pop(session, None)


def replica_groups(setup: Setup) -> dict[str, list[int]]:
    """Model -> the replica indices hosting it (``setup.models`` in order)."""
    out: dict[str, list[int]] = {}
    for i, m in enumerate(setup.replica_models()):
        out.setdefault(m, []).append(i)
    return out


class ThreadCtx:
    """An agent's context for variants that run agents as driver threads: ``llm_fn(call) ->
    (LLMOut, started, ended)`` and ``tool_fn(call) -> (answer, started, ended)`` do the work."""

    def __init__(self, session: str, clock: AgentClock, llm_fn: Callable, tool_fn: Callable):
        self.session, self.clock, self._llm, self._tool = session, clock, llm_fn, tool_fn

    def llm(self, call: LLMCall) -> LLMOut:
        issued = time.time()
        out, started, ended = self._llm(call)
        self.clock.add(issued, started, ended, time.time())
        self.clock.llm.append(out)
        return out

    def tool(self, call: ToolCall) -> str:
        issued = time.time()
        answer, started, ended = self._tool(call)
        self.clock.add(issued, started, ended, time.time(), kind="tool")
        return answer


def run_agent_in_thread(session: str, fn: Callable, args: tuple, llm_fn: Callable, tool_fn: Callable) -> AgentResult:
    """The body of an agent run as a driver thread (Ray, LangGraph, in-process)."""
    clock = AgentClock()
    value = fn(ThreadCtx(session, clock, llm_fn, tool_fn), *args)
    return clock.result(value)


class DriverAgents:
    """What variants whose agents are driver threads share (the in-process floor, Ray): a
    :class:`Router` per model picks the replica of each LLM call, ``_generate(replica, call)``
    runs it there (the variant's own way), ``_tool(call)`` runs a tool; ``per_agent`` routes by
    agent invocation instead of by session. Subclasses set ``setup``, ``routing``, ``pool``,
    ``groups`` and ``routers`` in ``__enter__`` (:meth:`_start_routing`)."""

    per_agent = False

    def _start_routing(self, threads: int, prefix: str) -> None:
        self.groups = replica_groups(self.setup)
        self.routers = {m: Router(len(g), self.routing) for m, g in self.groups.items()}
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix=prefix)
        self._agents = itertools.count()

    def _generate(self, replica: int, call: LLMCall) -> tuple[LLMOut, float, float]:
        raise NotImplementedError

    def _tool(self, call: ToolCall) -> tuple[str, float, float]:
        raise NotImplementedError

    def _llm(self, key: str, call: LLMCall) -> tuple[LLMOut, float, float]:
        router = self.routers[call.model]
        i = router.pick(key)
        try:
            return self._generate(self.groups[call.model][i], call)
        finally:
            router.done(i)

    @contextmanager
    def session(self, session_id: str, models: tuple | None = None) -> Iterator[FuturesRuntime]:
        """The runtime of one request; its sticky replicas are forgotten when it ends."""
        keys: list[str] = []

        def start(role: str, fn: Callable, args: tuple) -> Future:
            key = f"{session_id}/{next(self._agents)}" if self.per_agent else session_id
            keys.append(key)
            return self.pool.submit(run_agent_in_thread, session_id, fn, args,
                                    lambda c: self._llm(key, c), self._tool)

        try:
            yield FuturesRuntime(session_id, start, self.setup.time_scale)
        finally:
            for r in self.routers.values():
                for key in set(keys) | {session_id}:
                    r.forget(key)


class InProcess(DriverAgents):
    """The floor: engines as objects in the driver process, agents as threads calling them
    directly, no framework at all (``session_sticky`` routing). Used by tests and as the
    reference the ideal bound is checked against; not a peer anyone deploys."""

    name = "inprocess"

    def __init__(self, setup: Setup, routing: str = "session_sticky", threads: int = 512, per_agent: bool = False):
        self.setup, self.routing, self.threads = setup, routing, threads
        # per_agent: route by agent invocation, not by session: with as many replicas as a
        # request runs agents at once, every agent has an engine to itself (single-sequence
        # steps), which is the ideal bound's assumption; the tests check the bound against it.
        self.per_agent = per_agent
        self.hosts: list[Any] = []

    def __enter__(self) -> "InProcess":
        self.hosts = [make_engine(m, self.setup) for m in self.setup.replica_models()]
        self._start_routing(self.threads, "e2e-agent")
        self.tools = ThreadPoolExecutor(self.setup.tool_threads * self.setup.replicas, thread_name_prefix="e2e-tool")
        return self

    def __exit__(self, *exc: Any) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.tools.shutdown(wait=False, cancel_futures=True)
        for h in self.hosts:
            h.close()

    def _generate(self, replica: int, call: LLMCall) -> tuple[LLMOut, float, float]:
        return generate_on(self.hosts[replica], call)

    def _tool(self, call: ToolCall) -> tuple[str, float, float]:
        return self.tools.submit(sleep_tool, call, self.setup.time_scale).result()

    def engine_stats(self) -> list[dict]:
        return [h.stats() for h in self.hosts]

    def describe(self) -> dict:
        return {"setup": self.setup.describe(), "routing": self.routing,
                "agents": "driver threads calling in-process engine objects (no framework)"}
