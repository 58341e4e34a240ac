"""Component hints (Nalar's Table 2), validated with pydantic. Unknown keys are errors."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError, model_validator

from dask_agents.annotation import MAX_REPLICAS
from dask_agents.errors import HintError, short_repr

MAX_WAIT_S = 60.0
"""Upper bound of ``batching.max_wait`` (seconds)."""

ToolKind = Literal["file_io", "code_exec", "web_api", "db_query", "custom"]
"""Tool kinds the KV and latency models know; ``custom`` for anything else."""


class BatchingHint(BaseModel):
    """Coalesce calls of one component up to ``max_batch`` or ``max_wait`` seconds (recorded; used by the control plane)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    max_batch: StrictInt = Field(8, ge=1)
    # finite and bounded: a worker waits up to max_wait for a batch to fill (inf would wedge it)
    max_wait: float = Field(0.01, ge=0, le=MAX_WAIT_S, allow_inf_nan=False)


class ComponentHints(BaseModel):
    """Hints any component may carry.

    ``stateful``: all calls of one session go, in order, to one instance whose state lives
    for the session. ``model``: the LLM the component mostly calls (placement hint).
    ``resources``: Dask worker resources each call holds. ``min_replicas``/``max_replicas``:
    bounds for reallocation. ``batching``: coalescing hint. ``timeout``: seconds a call may
    take once sent to a worker (default ``agents.scheduler.call-timeout``); past it the call
    fails with :class:`~dask_agents.errors.CallTimeoutError`.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    stateful: StrictBool = False
    model: str | None = Field(None, min_length=1)
    resources: dict[str, float] = Field(default_factory=dict)
    min_replicas: StrictInt = Field(1, ge=0, le=MAX_REPLICAS)
    max_replicas: StrictInt | None = Field(None, ge=1, le=MAX_REPLICAS)
    batching: BatchingHint | None = None
    # seconds a call may take once the scheduler sent it to a worker; past it the call fails
    # with CallTimeoutError (None: agents.scheduler.call-timeout)
    timeout: float | None = Field(None, gt=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _resources(self) -> "ComponentHints":
        # Dask compares these with worker resources: a NaN, infinite or negative amount would
        # leave calls unrunnable (or over-subscribe workers) instead of failing here.
        for name, amount in self.resources.items():
            if not name or not name.strip():
                raise ValueError(f"resources: resource names must be non-empty, got {name!r}")
            if not math.isfinite(amount) or amount <= 0:
                raise ValueError(f"resources[{name!r}]: must be a finite amount > 0, got {amount!r}")
        return self

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
                problems.append(f"{loc}: {err['msg']} (got {short_repr(err.get('input'))})")
        known = ", ".join(sorted(cls.model_fields))
        raise HintError(
            f"invalid hints for component {component!r}: {'; '.join(problems)}. Known hints: {known}"
        ) from None
