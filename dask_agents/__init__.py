"""dask-agents: agent, tool and LLM calls as workflow-aware Dask futures.

    import dask_agents as da

    @da.agent(model="coder")
    class Developer:
        def implement(self, subtask): ...

    client = Client(LocalCluster(...)); da.install(client)
    dev = da.stub(Developer)
    with da.session(client):
        patch = dev.implement("fix the bug")   # AgentFuture, returned at once
"""

from __future__ import annotations

import dask_agents.config  # noqa: F401  (registers agents.* defaults)
from dask_agents.client_api import session_graph, telemetry, workflow_graph
from dask_agents.control import Control, control
from dask_agents.context import call_id as current_call
from dask_agents.context import session_id as current_session
from dask_agents.components import ComponentSpec, agent, spec_of, tool
from dask_agents.errors import (
    AgentsError,
    CallEscapeError,
    CallFailedError,
    CallLostError,
    CallDepthError,
    LimitError,
    ClientClosedError,
    CallTimeoutError,
    ConfigError,
    EngineStepError,
    EngineLoadError,
    EngineStoppedError,
    HintError,
    InstanceLostError,
    InvalidRequestError,
    NoSessionError,
    NotAllowedError,
    SessionClosedError,
    NoClientError,
    NotAComponentError,
    NotInstalledError,
    PromptTooLongError,
    ResultNotSerializableError,
    UnknownModelError,
)
from dask_agents.futures import AgentFuture
from dask_agents.hints import BatchingHint, ComponentHints, ToolHints
from dask_agents.install import install, installed
from dask_agents.llm import LLM, llm
from dask_agents.models import CallMeta, ChatMessage, Completion, LLMResult, SessionGraph, ToolCall, WorkflowGraph
from dask_agents.progress import progress
from dask_agents.scaling import ClusterLink, attach_cluster
from dask_agents.session import Session, session
from dask_agents.stubs import FunctionStub, Stub, stub

__version__ = "0.1.0"

__all__ = [
    "AgentFuture", "AgentsError", "ClusterLink", "attach_cluster", "BatchingHint", "CallEscapeError", "CallFailedError", "ClientClosedError", "CallMeta", "CallTimeoutError",
    "ChatMessage", "Completion", "ToolCall",
    "ComponentHints", "ConfigError", "ComponentSpec", "Control", "control", "EngineLoadError", "EngineStepError", "EngineStoppedError", "FunctionStub", "HintError", "InstanceLostError", "InvalidRequestError", "NoSessionError", "NotAllowedError", "CallLostError", "CallDepthError", "LimitError", "SessionClosedError", "LLM", "LLMResult",
    "NoClientError", "NotAComponentError", "NotInstalledError", "PromptTooLongError", "ResultNotSerializableError", "Session",
    "SessionGraph", "Stub", "ToolHints", "UnknownModelError", "WorkflowGraph", "agent", "current_call", "current_session", "install",
    "installed", "llm", "progress", "session", "session_graph", "spec_of", "stub", "telemetry", "tool",
    "workflow_graph",
]
