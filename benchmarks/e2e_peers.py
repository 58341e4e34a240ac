"""Peer frameworks for ``benchmarks/e2e.py``: the same Open-SWE logic on Ray and on LangGraph,
against the same EMULATED engine class (two replicas, batch capacity 8 each) and the same
tools. Kept small on purpose; both import lazily, so a missing peer only skips its variant.

Neither framework manages LLM engines, so each needs a rule for which replica serves a call
(``routing``, swept by e2e.py at the calibration load; the best is kept):
``round_robin`` per call; ``least_loaded`` (fewest calls in flight, counted by the driver);
``session_sticky`` (a request's first call goes to the least loaded replica, the rest follow
it: its session-specific prefix is cached there).

- Ray: each engine replica lives in an async actor (``num_cpus=0``) that awaits the engine's
  future; tools run in two threaded actors (16 threads each, like 2 Dask workers x 16); agents
  are coroutines in the driver awaiting actor calls (the fast Ray form in
  ../shared/notes/peers-measured.md: Ray tasks per agent step were 2-7x slower there).
- LangGraph: a ``StateGraph`` per request: plan -> ``Send`` one ``develop`` per subtask ->
  test -> (``Send`` the failing ``develop`` again -> test)*; engines are in-process objects
  shared by every request's coroutines; tools run on a 32-thread pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, TypedDict  # module level: the graph's state hints resolve here

from benchmarks import e2e_swe as swe

ROUTINGS = ("round_robin", "least_loaded", "session_sticky")
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Router:
    """Which engine replica serves a call (driver-side; used from one event loop only)."""

    def __init__(self, n: int, rule: str):
        if rule not in ROUTINGS:
            raise ValueError(f"unknown routing {rule!r} (known: {', '.join(ROUTINGS)})")
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


class _AsyncPeer:
    """What both peers share: the request logic as coroutines over ``llm`` and ``tool``."""

    name = "peer"

    def __init__(self, tool_threads: int = 32, routing: str = "least_loaded"):
        self.tool_threads = tool_threads
        self.routing = routing
        self.router: Router | None = None

    async def llm(self, spec: swe.RequestSpec, prompt: str, max_tokens: int) -> dict:
        raise NotImplementedError

    async def tool(self, kind: str, payload: str, emulated_s: float, time_scale: float, answer: tuple = ()) -> str:
        raise NotImplementedError

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
        from benchmarks.e2e import drive_async

        self.router = Router(self.replicas, self.routing)
        return asyncio.run(drive_async(self.solve, specs, arrivals, timeout))

    def extra(self) -> dict:
        return {}


# -- Ray -----------------------------------------------------------------------------------------

class EngineActor:
    """One EMULATED engine replica in a Ray async actor."""

    def __init__(self, engine: dict):
        self.host = swe.make_engine(swe.MODEL, engine)

    async def generate(self, prompt: str, max_tokens: int) -> dict:
        out = await asyncio.wrap_future(swe.engine_call(self.host, prompt, max_tokens, uuid.uuid4().hex))
        return _result(self.host, out)

    async def stats(self) -> dict:
        return self.host.stats()


class ToolActor:
    """Tools on a threaded Ray actor (``max_concurrency`` threads)."""

    def run(self, kind: str, payload: str, emulated_s: float, time_scale: float, answer: tuple = ()) -> str:
        return swe.sleep_tool(kind, payload, emulated_s, time_scale, answer)


class RayPeer(_AsyncPeer):
    name = "ray"
    replicas = 2

    def describe(self) -> dict:
        import ray

        return {"framework": f"ray {ray.__version__}", "engines": "2 async actors (num_cpus=0), one engine each",
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
        self.engines = [engine_cls.remote(dict(swe.ENGINE)) for _ in range(self.replicas)]
        self.tools = [tool_cls.remote() for _ in range(2)]
        ray.get([e.stats.remote() for e in self.engines])  # all up
        self._next_tool = 0
        return self

    def __exit__(self, *exc: Any) -> None:
        import ray

        with contextlib.suppress(Exception):
            ray.shutdown()

    def engine_stats(self) -> list[dict]:
        import ray

        return ray.get([e.stats.remote() for e in self.engines])

    async def llm(self, spec, prompt, max_tokens):
        i = self.router.pick(spec.id)
        try:
            return await self.engines[i].generate.remote(prompt, max_tokens)
        finally:
            self.router.done(i)

    async def tool(self, kind, payload, emulated_s, time_scale, answer=()):
        self._next_tool = (self._next_tool + 1) % len(self.tools)
        return await self.tools[self._next_tool].run.remote(kind, payload, emulated_s, time_scale, answer)

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
    replicas = 2

    def describe(self) -> dict:
        from importlib.metadata import version

        return {"framework": f"langgraph {version('langgraph')}",
                "graph": "StateGraph: plan -> Send(develop) per subtask -> test -> Send(develop) on failure",
                "engines": "2 in-process engine objects", "tools": f"ThreadPoolExecutor({self.tool_threads})",
                "routing": self.routing}

    def __enter__(self) -> "LangGraphPeer":
        self.engines = [swe.make_engine() for _ in range(self.replicas)]
        self.pool = ThreadPoolExecutor(self.tool_threads, thread_name_prefix="e2e-lg-tool")
        self.graph = self._build()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        for e in self.engines:
            e.close()

    def engine_stats(self) -> list[dict]:
        return [e.stats() for e in self.engines]

    async def llm(self, spec, prompt, max_tokens):
        i = self.router.pick(spec.id)
        try:
            host = self.engines[i]
            out = await asyncio.wrap_future(swe.engine_call(host, prompt, max_tokens, uuid.uuid4().hex))
            return _result(host, out)
        finally:
            self.router.done(i)

    async def tool(self, kind, payload, emulated_s, time_scale, answer=()):
        return await asyncio.get_running_loop().run_in_executor(self.pool, swe.sleep_tool, kind, payload,
                                                                emulated_s, time_scale, answer)

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
    """A peer backend by name (``ray`` or ``langgraph``)."""
    cls = {"ray": RayPeer, "langgraph": LangGraphPeer}[name]
    return cls(tool_threads=tool_threads, routing=routing)


__all__ = ["LangGraphPeer", "RayPeer", "Router", "make"]
