"""The LangGraph peer as users deploy it: agents run as LangGraph graphs in the driver, and every
LLM call goes over HTTP (httpx) to an OpenAI-compatible server per engine replica, through a
router that keeps a session on one server by its ``X-Session-Id`` header
(:mod:`benchmarks.e2e.variants.http_engine`). No engine lives in the driver process: LangGraph
does not manage engines, so a deployment serves them apart and calls them over the network.

Each agent invocation (``rt.agent``) is one ``graph.invoke`` of a compiled one-node
``StateGraph`` (built once) on a driver thread pool; the node runs the agent function with a
context whose LLM calls POST ``/v1/completions`` and whose tools sleep on a tool thread pool.
Parallel agents are parallel invokes (the program's ``rt.agent`` / ``rt.gather``).
"""

from __future__ import annotations

import os

# No LangSmith tracing (it would send every run over the network): before langgraph imports.
os.environ["LANGSMITH_TRACING"] = "false"
os.environ["LANGCHAIN_TRACING_V2"] = "false"

from concurrent.futures import Future, ThreadPoolExecutor  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from typing import Any, Callable, Iterator, TypedDict  # noqa: E402  (module level: the state's hints resolve here)

from benchmarks.e2e.program import AgentResult, LLMCall, LLMOut, Setup, ToolCall, sleep_tool  # noqa: E402
from benchmarks.e2e.program import FuturesRuntime  # noqa: E402
from benchmarks.e2e.variants.common import ROUTINGS, run_agent_in_thread  # noqa: E402
from benchmarks.e2e.variants.http_engine import SESSION_HEADER, HTTPEngines  # noqa: E402


class AgentState(TypedDict, total=False):
    """The graph's state: one agent invocation in, its :class:`AgentResult` out."""

    session: str
    role: str
    fn: Callable[..., Any]
    args: tuple
    result: AgentResult


class LLMHTTPError(RuntimeError):
    """An LLM call the router or an engine server answered with an error."""


class LangGraphPeer:
    """LangGraph over HTTP engine servers (see the module docstring); a :class:`Variant`.

    ``routing``: the router's rule (``session_sticky`` | ``least_loaded`` | ``round_robin``);
    ``threads``: driver threads running graph invocations (agents in flight at once)."""

    name = "langgraph"
    graph_description = "StateGraph START -> agent -> END, one invoke per agent (compiled once)"

    def __init__(self, setup: Setup, routing: str = "session_sticky", threads: int = 512):
        if routing not in ROUTINGS:
            raise ValueError(f"unknown routing {routing!r} (known: {', '.join(ROUTINGS)})")
        self.setup, self.routing, self.threads = setup, routing, threads
        self.servers: HTTPEngines | None = None

    def __enter__(self) -> "LangGraphPeer":
        import httpx

        self.graph = self._build()
        self.servers = HTTPEngines(self.setup, self.routing).__enter__()
        try:
            # One pooled client shared by every agent thread (httpx.Client is thread-safe); no
            # timeout: a call waits as long as the engine queues it. trust_env=False: loopback only.
            self.http = httpx.Client(base_url=self.servers.url, timeout=None, trust_env=False,
                                     limits=httpx.Limits(max_connections=1000, max_keepalive_connections=1000))
            self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="e2e-lg-agent")
            self.tools = ThreadPoolExecutor(self.setup.tool_threads * self.setup.replicas,
                                            thread_name_prefix="e2e-lg-tool")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        for name in ("pool", "tools"):
            if hasattr(self, name):
                getattr(self, name).shutdown(wait=False, cancel_futures=True)
        if hasattr(self, "http"):
            self.http.close()
        if self.servers is not None:
            self.servers.__exit__(*exc)
            self.servers = None

    # -- the graph --------------------------------------------------------------------------------

    def _build(self) -> Any:
        from langgraph.graph import END, START, StateGraph

        def agent(state: AgentState) -> dict:
            session = state["session"]
            result = run_agent_in_thread(session, state["fn"], state["args"],
                                         lambda call: self._llm(session, call), self._tool)
            return {"result": result}

        g = StateGraph(AgentState)
        g.add_node("agent", agent)
        g.add_edge(START, "agent")
        g.add_edge("agent", END)
        return g.compile()

    def _invoke(self, session: str, role: str, fn: Callable, args: tuple) -> AgentResult:
        state = self.graph.invoke({"session": session, "role": role, "fn": fn, "args": args})
        return state["result"]

    # -- the agent's calls ------------------------------------------------------------------------

    def _llm(self, session: str, call: LLMCall) -> tuple[LLMOut, float, float]:
        """One LLM call over HTTP: its counts, and when the engine server received and finished it."""
        r = self.http.post("/v1/completions", headers={SESSION_HEADER: session},
                           json={"model": call.model, "prompt": call.prompt, "max_tokens": call.max_tokens,
                                 "temperature": 0.0})
        if r.status_code != 200:
            raise LLMHTTPError(f"POST /v1/completions ({call.role}) -> {r.status_code}: {r.text[:500]}")
        body = r.json()
        usage, timing = body["usage"], body["x_timing"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return (LLMOut(usage["prompt_tokens"], int(cached or 0), usage["completion_tokens"]),
                timing["received"], timing["finished"])

    def _tool(self, call: ToolCall) -> tuple[str, float, float]:
        return self.tools.submit(sleep_tool, call, self.setup.time_scale).result()

    # -- the Variant interface --------------------------------------------------------------------

    @contextmanager
    def session(self, session_id: str, models: tuple | None = None) -> Iterator[FuturesRuntime]:
        """One request's runtime: its agents are graph invocations on the driver pool. (The
        router keeps the session's backend in its own LRU map, as a deployed router does.)"""
        def start(role: str, fn: Callable, args: tuple) -> Future:
            return self.pool.submit(self._invoke, session_id, role, fn, args)

        yield FuturesRuntime(session_id, start, self.setup.time_scale)

    def engine_stats(self) -> list[dict]:
        """Every engine server's ``/stats`` (the host's counters plus ``"server"``), replica order."""
        if self.servers is None:
            raise RuntimeError("LangGraphPeer is not started")
        return self.servers.stats()

    def describe(self) -> dict:
        from importlib.metadata import version

        n = len(self.setup.replica_models())
        return {"name": self.name, "framework": f"langgraph {version('langgraph')}",
                "graph": self.graph_description,
                "engines": f"{n} OpenAI-compatible HTTP servers (aiohttp) on loopback, one EMULATED engine each",
                "router": f"session header {SESSION_HEADER}, {self.routing}",
                "http_client": "httpx.Client (max_connections=1000, keep-alive, no timeout)",
                "agents": f"ThreadPoolExecutor({self.threads}) running graph.invoke",
                "tools": f"ThreadPoolExecutor({self.setup.tool_threads * self.setup.replicas})",
                "routing": self.routing, "setup": self.setup.describe()}
