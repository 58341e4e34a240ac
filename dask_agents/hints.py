"""Component hints (Nalar's Table 2), validated with pydantic. Unknown keys are errors."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dask_agents.errors import HintError

ToolKind = Literal["file_io", "code_exec", "web_api", "db_query", "custom"]
"""Tool kinds the KV and latency models know; ``custom`` for anything else."""


class BatchingHint(BaseModel):
    """Coalesce calls of one component up to ``max_batch`` or ``max_wait`` seconds (recorded; used by the control plane)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    max_batch: int = Field(8, ge=1)
    max_wait: float = Field(0.01, ge=0)


class ComponentHints(BaseModel):
    """Hints any component may carry.

    ``stateful``: all calls of one session go, in order, to one instance whose state lives
    for the session. ``model``: the LLM the component mostly calls (placement hint).
    ``resources``: Dask worker resources each call holds. ``min_replicas``/``max_replicas``:
    bounds for reallocation. ``batching``: coalescing hint.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    stateful: bool = False
    model: str | None = None
    resources: dict[str, float] = Field(default_factory=dict)
    min_replicas: int = Field(1, ge=0)
    max_replicas: int | None = Field(None, ge=1)
    batching: BatchingHint | None = None

    @model_validator(mode="after")
    def _replica_bounds(self) -> "ComponentHints":
        if self.max_replicas is not None and self.max_replicas < self.min_replicas:
            raise ValueError(
                f"max_replicas ({self.max_replicas}) < min_replicas ({self.min_replicas})"
            )
        return self


class ToolHints(ComponentHints):
    """Hints of a tool: its ``kind`` drives the latency prior and KV retention decisions."""

    kind: ToolKind = "custom"


def validate_hints(cls: type[ComponentHints], component: str, hints: dict) -> ComponentHints:
    """Build ``cls(**hints)``; on failure raise :class:`HintError` naming the component and each bad key."""
    try:
        return cls(**hints)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            loc = ".".join(str(p) for p in err["loc"]) or "hints"
            if err["type"] == "extra_forbidden":
                problems.append(f"unknown hint {loc!r}")
            else:
                problems.append(f"{loc}: {err['msg']} (got {err.get('input')!r})")
        known = ", ".join(sorted(cls.model_fields))
        raise HintError(
            f"invalid hints for component {component!r}: {'; '.join(problems)}. Known hints: {known}"
        ) from None
