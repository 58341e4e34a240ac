"""Pydantic models shared by the client, the scheduler plugin and the worker plugin."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

CallState = Literal["pending", "waiting", "queued", "processing", "running", "finished", "erred", "cancelled"]
"""Life of a call: created on the client (pending), known to the scheduler and waiting on
dependencies (waiting), runnable but held on the scheduler (queued), assigned to a worker
(processing), executing (running), and terminal (finished / erred / cancelled)."""

DRIVER = "driver"
"""Creator of calls made by the user's program rather than by another call."""


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


class LLMResult(BaseModel):
    """What ``llm(model).generate(...)`` resolves to."""

    model: str
    text: str
    token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    worker: str
    finish_reason: str | None = None
    emulated: bool = False  # produced by the emulated engine: a cost model, not a real LLM
