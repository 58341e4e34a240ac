"""The ``agents`` annotation every dask-agents call carries: its name, its fields and their
checks, and the names it uses for LLM components and sessions. A leaf module (it imports
nothing of dask-agents), shared by the client API and the scheduler and worker plugins."""

from __future__ import annotations

import re
from typing import Any

ANNOTATION = "agents"
"""Name of the Dask annotation that carries call metadata to the scheduler and workers."""


_TEXT_FIELDS = ("call", "component", "method", "kind", "session", "tenant", "creator", "model", "tool_kind",
                "llm_model", "opened_on", "stream")
_INT_FIELDS = ("llm_prompt_len", "llm_max_tokens")  # an LLM call's size, for KV admission
_REPLICA_FIELDS = ("min_replicas", "max_replicas")  # a bounded component's replicas, for reallocation
MAX_REPLICAS = 2**16
"""Largest replica bound an annotation may carry (more workers than any cluster has)."""
MAX_LABEL = 256
"""Longest text an annotation field may carry."""


def sanitize_annotation(ann: Any) -> dict | None:
    """The ``agents`` annotation ``ann`` with every field of the type the plugins expect, or
    None if it is not a mapping.

    Annotations come from any client (``dask.annotate(agents=...)`` works without
    dask-agents): the scheduler and worker plugins should read them through this. Text fields
    (``call component method kind session tenant creator model tool_kind llm_model
    opened_on stream``) are strings of at most ``MAX_LABEL`` characters or None; ``deps`` a list of strings;
    ``created`` a finite number or None; ``stateful`` a bool (only ``True`` is true);
    ``batching`` None or ``{"max_batch": int >= 1, "max_wait": finite float >= 0}``;
    ``llm_prompt_len`` and ``llm_max_tokens`` ints in ``[0, 2**31]`` or None; ``min_replicas``
    and ``max_replicas`` ints in ``[0, MAX_REPLICAS]`` and ``[1, MAX_REPLICAS]`` or None (both
    None unless both are valid and ordered); ``timeout`` a finite number > 0 or None. Wrong
    values become None (or the empty default); unknown fields are dropped."""
    import math

    if not isinstance(ann, dict):
        return None
    out: dict[str, Any] = {}
    for f in _TEXT_FIELDS:
        if f in ann:
            v = ann[f]
            out[f] = v if isinstance(v, str) and len(v) <= MAX_LABEL else None
    deps = ann.get("deps")
    out["deps"] = [d for d in deps if isinstance(d, str)] if isinstance(deps, (list, tuple)) else []
    created = ann.get("created")
    ok = isinstance(created, (int, float)) and not isinstance(created, bool) and math.isfinite(created)
    out["created"] = float(created) if ok else None
    out["stateful"] = ann.get("stateful") is True
    for f in _INT_FIELDS:
        if f in ann:
            v = ann[f]
            out[f] = v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 2**31 else None
    if "max_replicas" in ann:
        lo, hi = (ann.get(f) for f in _REPLICA_FIELDS)
        ok = all(isinstance(v, int) and not isinstance(v, bool) for v in (lo, hi)) and 0 <= lo <= hi <= MAX_REPLICAS
        out["min_replicas"], out["max_replicas"] = (lo, hi) if ok and hi >= 1 else (None, None)
    if "timeout" in ann:
        t = ann["timeout"]
        ok = isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t > 0
        out["timeout"] = float(t) if ok else None
    b = ann.get("batching")
    out["batching"] = None
    if isinstance(b, dict):
        mb, mw = b.get("max_batch"), b.get("max_wait", 0.0)
        if (isinstance(mb, int) and not isinstance(mb, bool) and mb >= 1 and isinstance(mw, (int, float))
                and not isinstance(mw, bool) and math.isfinite(mw) and mw >= 0):
            out["batching"] = {"max_batch": mb, "max_wait": float(mw)}
    return out


def component_name(model: str) -> str:
    """The component name of a model's calls: ``llm.<model>``.

    Model names often hold '-' (which Dask's key_split treats as a separator): the component
    name keeps letters, digits, '_' and '.' so keys split back to it exactly."""
    return "llm." + re.sub(r"[^A-Za-z0-9_.]", "_", model)


SESSION_LABEL = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:+@-]{0,127}")
"""What a session name (and a tenant) may be."""
