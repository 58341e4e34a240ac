"""Pydantic models shared by the client, the scheduler plugin and the worker plugin."""

from __future__ import annotations

from collections import Counter
from typing import Any, Literal, NotRequired, TypedDict

from pydantic import BaseModel, ConfigDict, Field

CallState = Literal["pending", "waiting", "queued", "processing", "running", "finished", "erred", "cancelled"]
"""Life of a call: created on the client (pending), known to the scheduler and waiting on
dependencies (waiting), runnable but held on the scheduler (queued), assigned to a worker
(processing), executing (running), and terminal (finished / erred / cancelled)."""

STATE_COLORS = {
    "pending": "#bdbdbd", "waiting": "#9e9e9e", "queued": "#fdd835", "processing": "#fb8c00",
    "running": "#1e88e5", "finished": "#43a047", "erred": "#e53935", "cancelled": "#424242",
}
"""Colour of a call node by state (session graphs: the Agents page, ``SessionGraph.visualize``)."""

DRIVER = "driver"
"""Creator of calls made by the user's program rather than by another call."""

NOT_ADMITTED = "not admitted"
"""A worker's refusal of a driver's direct call in a session the driver bound itself, which the
engine there could not admit (something of the model is short): the call takes the scheduler
path, which binds the session (``dask_agents/direct.py``, ``worker_plugin/direct.py``)."""


class CallReport(TypedDict):
    """A fast-path call's record: what a worker's local controller sends in its report batches
    (``worker_plugin/local.py``) and what the scheduler's collaborators get once it is checked
    (``scheduler_plugin/validate.local_call``). One type on both sides; a plain mapping on the
    wire. ``state`` is Dask's task state (``processing``, ``memory``, ``erred``, ``cancelled``);
    times are ``time.time()`` on the worker."""

    key: str
    ann: dict[str, Any]  # the call's ``agents`` annotation (CallMeta's fields and routing hints)
    state: str
    started: float | None
    finished: float | None
    error: NotRequired[str | None]  # erred: the error's text
    metrics: NotRequired[dict[str, Any] | None]  # tokens, cache hits, timings of the body
    client: NotRequired[str | None]  # a driver's direct call: its driver's client (worker_plugin/direct.py)


class CallMeta(BaseModel):
    """Metadata a call carries from its creation (Nalar's Table 1)."""

    model_config = ConfigDict(extra="forbid")
    call_id: str
    component: str
    method: str | None = None
    kind: str = "agent"
    session: str | None = None
    creator: str = DRIVER
    dependencies: list[str] = Field(default_factory=list)
    consumers: list[str] = Field(default_factory=list)
    executor: str | None = None
    state: CallState = "pending"
    created: float
    ready: float | None = None
    started: float | None = None
    finished: float | None = None


class GraphEdge(BaseModel):
    """An edge of a session graph: ``dependency`` (data flows src -> dst) or ``created`` (src made dst)."""

    src: str
    dst: str
    kind: Literal["dependency", "created"]


class SessionGraph(BaseModel):
    """A session's live call graph as the scheduler rebuilt it."""

    session: str
    state: Literal["active", "closing", "completed"]
    progress: int = Field(description="completed calls")
    nodes: list[CallMeta]
    edges: list[GraphEdge]

    def node(self, call_id: str) -> CallMeta:
        """The node with this call id (KeyError if absent)."""
        for n in self.nodes:
            if n.call_id == call_id:
                return n
        raise KeyError(call_id)

    def __repr__(self) -> str:
        states = Counter(n.state for n in self.nodes)
        counts = ", ".join(f"{k} {v}" for k, v in sorted(states.items()))
        return (f"<SessionGraph {self.session!r} {self.state}: {len(self.nodes)} calls"
                f"{f' ({counts})' if counts else ''}, {len(self.edges)} edges>")

    __str__ = __repr__

    def to_networkx(self) -> Any:
        """The graph as a ``networkx.DiGraph``: one node per call (its ``CallMeta`` fields as
        attributes), one edge per ``GraphEdge`` (``kind``: "dependency" or "created"); the
        session id and state as graph attributes. Needs networkx."""
        try:
            import networkx as nx
        except ImportError:
            raise ImportError("SessionGraph.to_networkx needs networkx (pip install networkx)") from None
        g = nx.DiGraph(session=self.session, state=self.state, progress=self.progress)
        for n in self.nodes:
            g.add_node(n.call_id, **n.model_dump(exclude={"call_id"}))
        for e in self.edges:
            g.add_edge(e.src, e.dst, kind=e.kind)
        return g

    def layout(self) -> dict[str, tuple[int, int]]:
        """``call id -> (x, y)``: x = depth (the longest chain of dependencies and creators
        before the call), y = its order within that depth (creation order)."""
        preds: dict[str, list[str]] = {n.call_id: [] for n in self.nodes}
        for e in self.edges:
            if e.src in preds and e.dst in preds and e.src != e.dst:
                preds[e.dst].append(e.src)
        depth: dict[str, int] = {}

        def d(k: str, seen: frozenset = frozenset()) -> int:
            if k not in depth:
                depth[k] = 1 + max((d(p, seen | {k}) for p in preds[k] if p not in seen), default=-1)
            return depth[k]

        rows: Counter = Counter()
        out = {}
        for n in sorted(self.nodes, key=lambda n: n.created):
            x = d(n.call_id)
            out[n.call_id] = (x, rows[x])
            rows[x] += 1
        return out

    def visualize(self, filename: str | None = None) -> Any:
        """A Bokeh figure of the graph as the Agents page draws it (x: depth, nodes coloured by
        state, labelled by component; dashed edges: "created"); written as HTML to
        ``filename`` when given. Returns the figure."""
        from bokeh.models import ColumnDataSource, HoverTool, LabelSet
        from bokeh.plotting import figure, output_file, save

        pos = self.layout()
        nodes = {"key": [], "x": [], "y": [], "component": [], "state": [], "color": []}
        for n in self.nodes:
            x, y = pos[n.call_id]
            nodes["key"].append(n.call_id)
            nodes["x"].append(x)
            nodes["y"].append(-y)
            nodes["component"].append(n.component)
            nodes["state"].append(n.state)
            nodes["color"].append(STATE_COLORS.get(n.state, "#9e9e9e"))
        fig = figure(title=repr(self), height=420, sizing_mode="stretch_width", toolbar_location="above",
                     x_axis_label="depth")
        fig.yaxis.visible = False
        for kind, dash in (("dependency", "solid"), ("created", "dashed")):
            es = [e for e in self.edges if e.kind == kind and e.src in pos and e.dst in pos]
            if es:
                fig.segment([pos[e.src][0] for e in es], [-pos[e.src][1] for e in es],
                            [pos[e.dst][0] for e in es], [-pos[e.dst][1] for e in es],
                            line_color="#9e9e9e", line_dash=dash, legend_label=kind)
        src = ColumnDataSource(nodes)
        r = fig.scatter("x", "y", source=src, size=14, color="color", line_color="#424242")
        fig.add_layout(LabelSet(x="x", y="y", text="component", source=src, x_offset=9, y_offset=-6,
                                text_font_size="9pt"))
        fig.add_tools(HoverTool(renderers=[r], tooltips=[("call", "@key"), ("component", "@component"),
                                                         ("state", "@state")]))
        if filename is not None:
            output_file(filename, title=f"session {self.session}")
            save(fig)
        return fig


class ComponentStats(BaseModel):
    """Per-component statistics of the flattened workflow graph."""

    component: str
    calls: int
    visits_per_session: float
    mean_duration: float | None
    std_duration: float | None


class WorkflowGraph(BaseModel):
    """The flattened workflow graph over all sessions seen (Nalar's p_v, edges, durations)."""

    sessions: int
    components: list[ComponentStats]
    edges: dict[str, int] = Field(description="'src->dst' component edge -> count")


class ToolCall(BaseModel):
    """A tool call the model made (``LLMResult.message.tool_calls``): dispatch ``name`` with
    ``arguments`` to the matching ``@da.tool``, then answer with a ``{"role": "tool",
    "tool_call_id": id, "content": ...}`` message."""

    id: str
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    type: str = "function"


class ChatMessage(BaseModel):
    """The assistant turn of a ``chat`` call: its text and the tool calls parsed from it.
    Append it to the conversation as it is (``chat`` takes it back as a message)."""

    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class Completion(BaseModel):
    """One of the ``n`` completions of a call (``LLMResult.choices``)."""

    index: int = 0
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    # the stop string or token id that ended it (vLLM's stop_reason), None at EOS or length
    stop_reason: str | int | None = None
    # per output token, the top ``logprobs`` alternatives: token id -> log probability
    logprobs: list[dict[int, float]] | None = None
    message: ChatMessage | None = None  # chat: the completion as an assistant turn


class LLMResult(BaseModel):
    """What ``llm(model).generate(...)`` and ``.chat(...)`` resolve to. ``text``,
    ``token_ids``, ``finish_reason``, ``logprobs`` and ``message`` are the first completion's;
    ``choices`` holds all ``n``."""

    model: str
    text: str
    token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    worker: str
    finish_reason: str | None = None
    emulated: bool = False  # produced by the emulated engine: a cost model, not a real LLM
    # When the engine received the request and when its output was complete (POSIX seconds,
    # the worker's clock; vLLM's RequestOutput.metrics arrival_time/finished_time): the time
    # between them is the engine's, queueing inside it included; the rest of a call's latency
    # is the framework's.
    arrival_time: float | None = None
    finished_time: float | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] | None = None
    message: ChatMessage | None = None  # chat calls: the assistant turn (content, tool_calls)
    choices: list[Completion] = Field(default_factory=list)
