"""A LangGraph ReAct agent on dask-agents: LangGraph's graph and nodes as written, the model a
``ChatDaskAgents`` (each turn a dask-agents LLM call in the request's session), its tools
``@da.tool``s (each call a dask-agents tool call, placed and recorded by the scheduler).

    python -m examples.langgraph.react      # a LocalCluster with the built-in model

The graph: ``agent`` (the model, bound to the tools) -> ``tools`` while the model calls tools,
back to ``agent``; then the end. With the built-in dummy-weight model the first turn is forced
to call a tool (``tool_choice="required"``) and later turns may not call any (``"none"``), so
the loop runs one round of tools whatever the random weights write; with a real model leave
``tool_choice`` to the model.
"""

from __future__ import annotations

from typing import Annotated, TypedDict

from langchain_core.messages import AnyMessage, ToolMessage
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages

import dask_agents as da
from dask_agents.langchain import ChatDaskAgents

FILES = {"parser.py": "def parse(text):\n    return text.splitlines()[:-1]\n", "test_parser.py": "assert parse('a\\nb')"}


@da.tool(kind="file_io")
def read_file(path: str) -> str:
    """Read a file of the repository."""
    return FILES[path]


@da.tool(kind="code_exec")
def run_tests(verbose: bool) -> str:
    """Run the repository's tests."""
    return "1 failed: test_parser.py::test_last_line" if verbose else "1 failed"


# the tools' schemas for the model (enums keep a dummy model's arguments valid)
TOOL_SPECS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file of the repository.",
                                      "parameters": {"type": "object", "properties": {
                                          "path": {"type": "string", "enum": sorted(FILES)}}, "required": ["path"]}}},
    {"type": "function", "function": {"name": "run_tests", "description": "Run the repository's tests.",
                                      "parameters": {"type": "object", "properties": {
                                          "verbose": {"type": "boolean"}}, "required": ["verbose"]}}},
]
TOOLS = {"read_file": da.stub(read_file), "run_tests": da.stub(run_tests)}


class State(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


def build(model: str = "coder", max_tokens: int = 64):
    """The compiled graph."""
    llm = ChatDaskAgents(model=model, max_tokens=max_tokens)
    first = llm.bind_tools(TOOL_SPECS, tool_choice="required")
    later = llm.bind_tools(TOOL_SPECS, tool_choice="none")

    def agent(state: State) -> dict:
        called = any(isinstance(m, ToolMessage) for m in state["messages"])
        return {"messages": [(later if called else first).invoke(state["messages"])]}

    def tools(state: State) -> dict:
        calls = state["messages"][-1].tool_calls
        futures = [TOOLS[c["name"]](**c["args"]) for c in calls]  # the tool calls run in parallel
        return {"messages": [ToolMessage(content=f.value(), tool_call_id=c["id"]) for c, f in zip(calls, futures)]}

    def route(state: State) -> str:
        return "tools" if state["messages"][-1].tool_calls else END

    graph = StateGraph(State)
    graph.add_node("agent", agent)
    graph.add_node("tools", tools)
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", route, ["tools", END])
    graph.add_edge("tools", "agent")
    return graph.compile()


def run(client, issue: str = "The parser drops the last line.") -> dict:
    """Run the graph for one issue in its own session; returns the final state and the session id."""
    app = build()
    with da.session(client, name="langgraph-react") as s:
        state = app.invoke({"messages": [("system", "You fix bugs in small Python repositories. " * 4),
                                         ("user", issue)]})
    return {"state": state, "session": s.id}


if __name__ == "__main__":
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=1, threads_per_worker=8) as cluster, Client(cluster) as client:
        da.install(client, models=["coder"])
        out = run(client)
        for m in out["state"]["messages"]:
            print(type(m).__name__, getattr(m, "tool_calls", None) or str(m.content)[:60])
        print(da.session_graph(client, out["session"]))
