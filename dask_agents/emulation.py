"""EMULATED tools for experiments at scale on CPUs. Every number they produce is EMULATED.

An emulated tool does no work: it sleeps for a latency drawn from the latency prior of its
kind (:mod:`dask_agents.kv.runtime.tool_latency`, SAGA's published P50/P95/P99) times a time scale, and returns
``{"kind", "name", "latency_s", "slept_s", "time_scale", "emulated": True}``. ``latency_s`` is the
emulated latency (what the real tool would take); ``slept_s = latency_s * time_scale`` is the
wall time actually spent. The draw is deterministic in ``(name, payload, seed)``, so reruns of an
experiment see the same latencies.

    import dask_agents as da
    from dask_agents.emulation import code_exec_tool, emulated_tool

    run_tests = da.stub(code_exec_tool)
    search = da.stub(emulated_tool("web_api", name="search_tool"))

The time scale is ``time_scale`` if given, else config ``agents.emulation.time-scale`` read at
call time (default 1.0: real time).

Pickling. Dask ships a function component by reference when it can (module + name), so each
emulated tool is a module-level function of this module: the four built-ins (``file_io_tool``,
``code_exec_tool``, ``web_api_tool``, ``db_query_tool``, plus ``custom_tool``) exist at import
time everywhere, and :func:`emulated_tool` registers each function it creates in this module's
globals under its name so (cloud)pickle finds it there. A process that unpickles such a
reference must have created the same name too: in-process clusters need nothing, but with
worker processes create custom names at import time of a module the workers also import.
"""

from __future__ import annotations

import random
import time
from typing import Any, Callable

from dask_agents.components import tool
from dask_agents.kv.runtime.tool_latency import PRIORS, prior

# Names this module created (and may hand out again); other globals are never replaced.
_CREATED: dict[str, tuple[str, float | None]] = {}


def _scale_name(time_scale: float) -> str:
    return format(time_scale, "g").replace(".", "_").replace("-", "m").replace("+", "")


def _time_scale(time_scale: float | None) -> float:
    if time_scale is not None:
        return time_scale
    import dask_agents.config as agents_config

    return float(agents_config.get("emulation.time-scale", 1.0))


def _make(kind: str, name: str, time_scale: float | None) -> Callable[..., dict]:
    latency = prior(kind)

    def emulated(payload: str = "", seed: int | str | None = None) -> dict[str, Any]:
        # Seeding Random with a str hashes it with SHA-512: the same in every process.
        rng = random.Random(f"{name}\x00{payload}\x00{seed}")
        latency_s = latency.sample(rng)
        scale = _time_scale(time_scale)
        slept = latency_s * scale
        if slept > 0:
            time.sleep(slept)
        return {"kind": kind, "name": name, "latency_s": latency_s, "slept_s": slept,
                "time_scale": scale, "emulated": True}

    # Named as the global it is stored under, so pickle/cloudpickle resolve it by reference.
    emulated.__name__ = emulated.__qualname__ = name
    emulated.__module__ = __name__
    emulated.__doc__ = (f"EMULATED {kind} tool: sleeps a latency drawn from the {kind} prior "
                        f"(P50/P95/P99 {latency.p50:g}/{latency.p95:g}/{latency.p99:g} s) times the time scale.")
    return tool(kind=kind)(emulated)


def emulated_tool(kind: str, name: str | None = None, time_scale: float | None = None) -> Callable[..., dict]:
    """An EMULATED tool of ``kind`` (a ``@da.tool(kind=kind)`` function ``f(payload="", seed=None)``).

    ``name``: the component name and the module-global name (default ``<kind>_tool``, or
    ``<kind>_tool_ts<scale>`` with an explicit ``time_scale``). ``time_scale``: fixed wall-time
    factor; None reads ``agents.emulation.time-scale`` at each call. Asking again for a name with
    the same kind and scale returns the same function; a name that is taken otherwise is an error.
    """
    if not isinstance(kind, str) or kind not in PRIORS:
        prior(str(kind))  # raises ValueError naming the known kinds
    if time_scale is not None and (isinstance(time_scale, bool) or not isinstance(time_scale, (int, float))):
        raise TypeError(f"time_scale must be a number or None, got {time_scale!r}")
    if time_scale is not None and not (time_scale >= 0 and time_scale != float("inf")):
        raise ValueError(f"time_scale must be a finite number >= 0, got {time_scale!r}")
    if name is None:
        name = f"{kind}_tool" if time_scale is None else f"{kind}_tool_ts{_scale_name(time_scale)}"
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"emulated tool name {name!r} must be a Python identifier (it becomes a module global)")
    existing = _CREATED.get(name)
    if existing is not None:
        if existing != (kind, time_scale):
            raise ValueError(f"emulated tool {name!r} already exists with kind/time_scale {existing}, "
                             f"not {(kind, time_scale)}")
        return globals()[name]
    if name in globals():
        raise ValueError(f"emulated tool name {name!r} clashes with a name of {__name__}")
    fn = _make(kind, name, time_scale)
    globals()[name] = fn
    _CREATED[name] = (kind, time_scale)
    return fn


file_io_tool = emulated_tool("file_io")
code_exec_tool = emulated_tool("code_exec")
web_api_tool = emulated_tool("web_api")
db_query_tool = emulated_tool("db_query")
custom_tool = emulated_tool("custom")

__all__ = ["code_exec_tool", "custom_tool", "db_query_tool", "emulated_tool", "file_io_tool", "web_api_tool"]
