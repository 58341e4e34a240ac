"""Peer frameworks for ``benchmarks/e2e.py``: the same workflow logic on Ray and on LangGraph,
against the same EMULATED engine class and the same tools. Kept small on purpose; both import
lazily, so a missing peer only skips its variant.

This module holds the machinery every workflow's peers share, and the Open-SWE logic;
``e2e_finance.py`` and ``e2e_router.py`` subclass :class:`RayPeer` and :class:`LangGraphPeer`
with their own logic (and a LangGraph graph of their own).

Engines: ``replicas`` engine replicas, each hosting one EMULATED engine per model of ``models``
(name -> emulation parameters; default: the Open-SWE engine ``coder``). ``split`` (model ->
number of replicas, in ``models`` order; None: every model on every replica) makes a STATIC
assignment of replicas to models: replica i serves only the model its place in the split gives
it (the router workflow's chat/coder split; the other engine of a replica stays idle, as in the
plain-Dask router baseline, whose workers host both engines).

Neither framework manages LLM engines, so each needs a rule for which replica (of the call's
model) serves a call (``routing``, swept by e2e.py at the calibration load; the best is kept):
``round_robin`` per call; ``least_loaded`` (fewest calls in flight, counted by the driver);
``session_sticky`` (a request's first call of a model goes to that model's least loaded
replica, the rest follow it: its session-specific prefix is cached there).

- Ray: each engine replica lives in an async actor (``num_cpus=0``) that awaits the engine's
  future; tools run in two threaded actors (16 threads each, like 2 Dask workers x 16); agents
  are coroutines in the driver awaiting actor calls (the fast Ray form in
  ../shared/notes/peers-measured.md: Ray tasks per agent step were 2-7x slower there).
- LangGraph: a ``StateGraph`` per request (Open-SWE: plan -> ``Send`` one ``develop`` per
  subtask -> test -> (``Send`` the failing ``develop`` again -> test)*); engines are in-process
  objects shared by every request's coroutines; tools run on a 32-thread pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, Callable, TypedDict  # module level: the graph's state hints resolve here

from benchmarks.legacy import e2e_swe as swe

ROUTINGS = ("round_robin", "least_loaded", "session_sticky")
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Router:
    """Which engine replica serves a call (driver-side; used from one event loop only)."""

    def __init__(self, n: int, rule: str):
        if rule not in ROUTINGS:
            raise ValueError(f"unknown routing {rule!r} (known: {', '.join(ROUTINGS)})")
        if n < 1:
            raise ValueError("a model needs at least one engine replica")
        self.rule, self.inflight, self.rr, self.sticky = rule, [0] * n, 0, {}

    def pick(self, session: str) -> int:
        if self.rule == "round_robin":
            self.rr = (self.rr + 1) % len(self.inflight)
            i = self.rr
        elif self.rule == "session_sticky" and session in self.sticky:
            i = self.sticky[session]
        else:
            self.rr += 1
            n = len(self.inflight)
            i = min(range(n), key=lambda j: (self.inflight[j], (j - self.rr) % n))
            if self.rule == "session_sticky":
                self.sticky[session] = i
        self.inflight[i] += 1
        return i

    def done(self, i: int) -> None:
        self.inflight[i] -= 1


def _result(host, out) -> dict:
    toks = out.outputs[0].token_ids
    return {"text": host.tokenizer.decode(toks), "prompt_tokens": len(out.prompt_token_ids),
            "cached_tokens": out.num_cached_tokens, "output_tokens": len(toks)}


def replica_groups(models: list[str], replicas: int, split: dict | None) -> dict[str, list[int]]:
    """Per model, the replicas serving it: all of them (``split`` None), or consecutive blocks
    of ``split[model]`` replicas in ``models`` order."""
    if split is None:
        return {m: list(range(replicas)) for m in models}
    if set(split) != set(models) or sum(split.values()) != replicas or min(split.values()) < 1:
        raise ValueError(f"split {split} must give each of {models} at least one of the {replicas} replicas")
    out, i = {}, 0
    for m in models:
        out[m] = list(range(i, i + split[m]))
        i += split[m]
    return out


class _AsyncPeer:
    """What both peers share: engine replicas per model, routing, tools, and the Open-SWE logic
    as coroutines over ``llm`` and ``tool`` (other workflows override ``solve``)."""

    name = "peer"

    def __init__(self, tool_threads: int = 32, routing: str = "least_loaded", models: dict | None = None,
                 replicas: int = 2, split: dict | None = None):
        self.tool_threads = tool_threads
        self.routing = routing
        self.models = {k: dict(v) for k, v in (models or {swe.MODEL: swe.ENGINE}).items()}
        self.replicas = replicas
        self.split = split
        replica_groups(list(self.models), replicas, split)  # validate now
        self.routers: dict[str, Router] = {}
        self._groups: dict[str, list[int]] = {}

    # -- engines, routing, tools (per framework) -------------------------------------------------

    async def _generate(self, replica: int, model: str, prompt: str, max_tokens: int) -> dict:
        raise NotImplementedError

    async def call_tool(self, fn: Callable, *args: Any) -> Any:
        """Run ``fn(*args)`` (a module-level function: an EMULATED tool body) on a tool thread."""
        raise NotImplementedError

    async def llm(self, spec, prompt: str, max_tokens: int, model: str | None = None) -> dict:
        """One call on a replica of ``model`` (default: the first model) chosen by ``routing``."""
        model = model or next(iter(self.models))
        router = self.routers[model]
        i = router.pick(spec.id)
        try:
            return await self._generate(self._groups[model][i], model, prompt, max_tokens)
        finally:
            router.done(i)

    async def tool(self, kind: str, payload: str, emulated_s: float, time_scale: float, answer: tuple = ()) -> str:
        return await self.call_tool(swe.sleep_tool, kind, payload, emulated_s, time_scale, answer)

    def describe_engines(self) -> str:
        per = ", ".join(self.models)
        if self.split is None:
            return f"{self.replicas} replicas, each hosting model(s) {per}"
        return f"{self.replicas} replicas hosting {per}; static split {self.split}"

    # -- the Open-SWE logic ----------------------------------------------------------------------

    async def plan(self, spec):
        await self.llm(spec, swe.plan_prompt(spec), swe.PLAN_TOKENS)
        return swe.subtasks_of(spec)

    async def implement(self, spec, subtasks, k, feedback, attempt):
        subtask, ts = subtasks[k], spec.tool_time_scale
        docs = await self.tool("file_io", subtask, spec.doc_s[k][attempt], ts, swe.doc_args(spec, k, attempt))
        answer = await self.llm(spec, swe.patch_prompt(spec, subtasks, k, attempt, docs, feedback), swe.PATCH_TOKENS)
        await self.tool("code_exec", f"{subtask} attempt {attempt}", spec.code_s[k][attempt], ts)
        return swe.make_patch(spec, subtasks, k, attempt, answer["output_tokens"])

    async def test(self, spec, patches, rnd):
        await self.llm(spec, swe.review_prompt(spec, patches), swe.REVIEW_TOKENS)
        await self.tool("code_exec", f"pytest {spec.id} round {rnd}", spec.test_s[rnd], spec.tool_time_scale)
        return swe.tester_report(spec, rnd)

    def run(self, specs, arrivals, timeout: float) -> list[dict]:
        from benchmarks.legacy.e2e import drive_async

        self._groups = replica_groups(list(self.models), self.replicas, self.split)
        self.routers = {m: Router(len(g), self.routing) for m, g in self._groups.items()}
        return asyncio.run(drive_async(self.solve, specs, arrivals, timeout))

    def extra(self) -> dict:
        return {}


# -- Ray -----------------------------------------------------------------------------------------

class EngineActor:
    """One engine replica in a Ray async actor: an EMULATED engine per model of ``models``."""

    def __init__(self, models: dict):
        self.hosts = {m: swe.make_engine(m, p) for m, p in models.items()}

    async def generate(self, prompt: str, max_tokens: int, model: str | None = None) -> dict:
        host = self.hosts[model] if model else next(iter(self.hosts.values()))
        out = await asyncio.wrap_future(swe.engine_call(host, prompt, max_tokens, uuid.uuid4().hex))
        return _result(host, out)

    async def stats(self) -> list[dict]:
        return [h.stats() for h in self.hosts.values()]


class ToolActor:
    """Tools on a threaded Ray actor (``max_concurrency`` threads)."""

    def run(self, kind: str, payload: str, emulated_s: float, time_scale: float, answer: tuple = ()) -> str:
        return swe.sleep_tool(kind, payload, emulated_s, time_scale, answer)

    def call(self, fn: Callable, *args: Any) -> Any:
        """Any EMULATED tool body (a module-level function, shipped by reference)."""
        return fn(*args)


class RayPeer(_AsyncPeer):
    name = "ray"

    def describe(self) -> dict:
        import ray

        return {"framework": f"ray {ray.__version__}",
                "engines": f"{self.replicas} async actors (num_cpus=0): {self.describe_engines()}",
                "tools": f"2 threaded actors x {self.tool_threads // 2} threads",
                "agents": "coroutines in the driver awaiting actor calls", "routing": self.routing,
                "init": "ray.init(num_cpus=2, include_dashboard=False, _node_ip_address='127.0.0.1')"}

    def __enter__(self) -> "RayPeer":
        import ray

        ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
                 logging_level="ERROR", configure_logging=True,
                 job_config=ray.job_config.JobConfig(code_search_path=[_ROOT]))
        engine_cls = ray.remote(num_cpus=0)(EngineActor)
        tool_cls = ray.remote(num_cpus=0, max_concurrency=max(1, self.tool_threads // 2))(ToolActor)
        self.actors = [engine_cls.remote(self.models) for _ in range(self.replicas)]
        self.tools = [tool_cls.remote() for _ in range(2)]
        ray.get([e.stats.remote() for e in self.actors])  # all up
        self._next_tool = 0
        return self

    def __exit__(self, *exc: Any) -> None:
        import ray

        with contextlib.suppress(Exception):
            ray.shutdown()

    def engine_stats(self) -> list[dict]:
        """Per replica and model (replica-major): the engines' counters."""
        import ray

        return [s for ss in ray.get([e.stats.remote() for e in self.actors]) for s in ss]

    async def _generate(self, replica, model, prompt, max_tokens):
        return await self.actors[replica].generate.remote(prompt, max_tokens, model)

    async def call_tool(self, fn, *args):
        self._next_tool = (self._next_tool + 1) % len(self.tools)
        return await self.tools[self._next_tool].call.remote(fn, *args)

    async def solve(self, spec: swe.RequestSpec) -> dict:
        subtasks = await self.plan(spec)
        patches = list(await asyncio.gather(*(self.implement(spec, subtasks, k, None, 0)
                                              for k in range(len(subtasks)))))
        retries = 0
        report = await self.test(spec, patches, 0)
        while not report.passed:
            retries += 1
            k = report.failing
            patches[k] = await self.implement(spec, subtasks, k, report.log, retries)
            report = await self.test(spec, patches, retries)
        return {"retries": retries, "passed": report.passed, "patches": len(patches)}


# -- LangGraph -------------------------------------------------------------------------------------

def _merge(a: dict, b: dict) -> dict:
    return {**(a or {}), **(b or {})}


class SWEState(TypedDict, total=False):
    """The graph state of one request; ``patches`` (subtask -> Patch) merges parallel developers."""

    spec: Any
    subtasks: list
    patches: Annotated[dict, _merge]
    round: int
    retries: int
    report: Any


class LangGraphPeer(_AsyncPeer):
    name = "langgraph"
    graph_description = "StateGraph: plan -> Send(develop) per subtask -> test -> Send(develop) on failure"

    def describe(self) -> dict:
        from importlib.metadata import version

        return {"framework": f"langgraph {version('langgraph')}", "graph": self.graph_description,
                "engines": f"in-process engine objects: {self.describe_engines()}",
                "tools": f"ThreadPoolExecutor({self.tool_threads})", "routing": self.routing}

    def __enter__(self) -> "LangGraphPeer":
        # hosts[replica][model]: one EMULATED engine per model on every replica
        self.hosts = [{m: swe.make_engine(m, p) for m, p in self.models.items()} for _ in range(self.replicas)]
        self.pool = ThreadPoolExecutor(self.tool_threads, thread_name_prefix="e2e-lg-tool")
        self.graph = self._build()
        return self

    @property
    def engines(self) -> list:
        """Every engine host, replica-major (one per replica when there is one model)."""
        return [h for r in self.hosts for h in r.values()]

    def __exit__(self, *exc: Any) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        for e in self.engines:
            e.close()

    def engine_stats(self) -> list[dict]:
        return [e.stats() for e in self.engines]

    async def _generate(self, replica, model, prompt, max_tokens):
        host = self.hosts[replica][model]
        out = await asyncio.wrap_future(swe.engine_call(host, prompt, max_tokens, uuid.uuid4().hex))
        return _result(host, out)

    async def call_tool(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def _build(self):
        from langgraph.graph import END, START, StateGraph
        from langgraph.types import Send

        async def plan(state: SWEState) -> dict:
            return {"subtasks": await self.plan(state["spec"]), "round": 0, "retries": 0}

        def fan_out(state: SWEState) -> list:
            return [Send("develop", {"spec": state["spec"], "subtasks": state["subtasks"], "k": k,
                                     "feedback": None, "attempt": 0}) for k in range(len(state["subtasks"]))]

        async def develop(job: dict) -> dict:
            p = await self.implement(job["spec"], job["subtasks"], job["k"], job["feedback"], job["attempt"])
            return {"patches": {job["k"]: p}}

        async def test(state: SWEState) -> dict:
            patches = [state["patches"][k] for k in sorted(state["patches"])]
            report = await self.test(state["spec"], patches, state["round"])
            return {"report": report, "round": state["round"] + 1,
                    "retries": state["retries"] + (0 if report.passed else 1)}

        def after_test(state: SWEState):
            report = state["report"]
            if report.passed:
                return END
            return [Send("develop", {"spec": state["spec"], "subtasks": state["subtasks"], "k": report.failing,
                                     "feedback": report.log, "attempt": state["retries"]})]

        g = StateGraph(SWEState)
        g.add_node("plan", plan)
        g.add_node("develop", develop)
        g.add_node("test", test)
        g.add_edge(START, "plan")
        g.add_conditional_edges("plan", fan_out, ["develop"])
        g.add_edge("develop", "test")
        g.add_conditional_edges("test", after_test, ["develop", END])
        return g.compile()

    async def solve(self, spec: swe.RequestSpec) -> dict:
        state = await self.graph.ainvoke({"spec": spec, "patches": {}}, {"recursion_limit": 50})
        return {"retries": state["retries"], "passed": state["report"].passed, "patches": len(state["patches"])}


def make(name: str, tool_threads: int = 32, routing: str = "least_loaded") -> _AsyncPeer:
    """A peer backend of the Open-SWE workflow by name (``ray`` or ``langgraph``)."""
    cls = {"ray": RayPeer, "langgraph": LangGraphPeer}[name]
    return cls(tool_threads=tool_threads, routing=routing)


__all__ = ["LangGraphPeer", "RayPeer", "Router", "make", "replica_groups"]
