"""dask-agents: the workflow written in its programming model, every default policy on.

Each agent role is a component (``@da.agent``, one per role name, so the control plane keeps
per-component statistics); an invocation is a stub call returning an ``AgentFuture``; inside
it LLM calls are ``da.llm(model).generate(...)`` and tools are ``@da.tool`` components with
their kind (``file_io``, ``code_exec``, ...) as the hint the KV policies read. Every request is
a ``da.session``. The engines are the same EMULATED engines, hosted by dask-agents' worker
plugin from the ``agents.llm.models`` entry (``engine: emulated``), replica ``i`` on worker
``i``. Ablations switch one policy off (``disabled``: ``admission``, ``kv`` or a control policy).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator

import dask
import dask_agents as da

from benchmarks.e2e.program import (AgentClock, AgentResult, FuturesRuntime, LLMCall, LLMOut, Setup, ToolCall,
                                    sleep_tool)
from benchmarks.e2e.variants.common import model_entry

ROLES = ("planner", "developer", "tester", "analyst", "summarizer", "followup", "classifier", "chat", "coder",
         "agent")
POLICIES = ("prioritize", "balance", "reallocate", "batching")


class RoleAgent:
    """Runs one agent function of a workflow program (``fn(ctx, *args)``) as this component."""

    def run(self, fn: Callable, args: tuple, time_scale: float) -> AgentResult:
        clock = AgentClock()
        return clock.result(fn(_Ctx(da.current_session(), clock, time_scale), *args))


# One component per role name, defined at import so workers find them by reference.
COMPONENTS = {r: da.agent(name=r)(type(r.title(), (RoleAgent,), {"__module__": __name__})) for r in ROLES}
globals().update({c.__name__: c for c in COMPONENTS.values()})


@da.tool(kind="file_io")
def tool_file_io(call: ToolCall, time_scale: float) -> tuple:
    """A file tool (read, grep, edit): EMULATED latency."""
    return sleep_tool(call, time_scale)


@da.tool(kind="code_exec")
def tool_code_exec(call: ToolCall, time_scale: float) -> tuple:
    """A code run in a sandbox: EMULATED latency."""
    return sleep_tool(call, time_scale)


@da.tool(kind="code_exec")
def tool_test_run(call: ToolCall, time_scale: float) -> tuple:
    """A test-suite run (a code run of minutes): EMULATED latency."""
    return sleep_tool(call, time_scale)


@da.tool(kind="db_query")
def tool_db_query(call: ToolCall, time_scale: float) -> tuple:
    """A database query: EMULATED latency."""
    return sleep_tool(call, time_scale)


@da.tool(kind="web_api")
def tool_web_api(call: ToolCall, time_scale: float) -> tuple:
    """A web API call: EMULATED latency."""
    return sleep_tool(call, time_scale)


TOOLS = {"file_io": tool_file_io, "code_exec": tool_code_exec, "test_run": tool_test_run,
         "db_query": tool_db_query, "web_api": tool_web_api}


class _Ctx:
    def __init__(self, session: str | None, clock: AgentClock, time_scale: float):
        self.session, self.clock, self.time_scale = session or "", clock, time_scale

    def llm(self, call: LLMCall) -> LLMOut:
        issued = time.time()
        r = da.llm(call.model).generate(call.prompt, max_tokens=call.max_tokens).value()
        returned = time.time()
        out = LLMOut(r.prompt_tokens, r.cached_tokens, r.output_tokens)
        self.clock.add(issued, r.arrival_time or issued, r.finished_time or returned, returned)
        self.clock.llm.append(out)
        return out

    def tool(self, call: ToolCall) -> str:
        issued = time.time()
        answer, started, ended = da.stub(TOOLS[call.kind])(call, self.time_scale).value()
        self.clock.add(issued, started, ended, time.time(), kind="tool")
        return answer


# The product's knobs that are durations or rates of the workload (defaults for a real H100-class
# deployment, in wall seconds): with the engine and tools running ``time_scale`` x faster, a user
# deploying this engine sets them from it, as the baselines' TTL is scaled (dask_plain.py).
SCALED_SECONDS = {"agents.scheduler.admission.max-wait": 30.0, "agents.kv.ttl-max": 60.0}


def deployment_settings(setup: Setup) -> dict:
    """dask-agents' rate and duration knobs for the run's engine, not left at defaults written
    for another: its prefill rate (admission's rebinding, the balance policy's move price, the
    KV policies' recompute cost) and decode step from the engine profile, and the waits in
    :data:`SCALED_SECONDS` at the run's time scale (wall seconds per emulated second). A real
    engine's entry (``setup.entry``) keeps the defaults: they are written for real time."""
    if setup.entry is not None:
        return {}
    scale = setup.time_scale
    prefill_rate = 1.0 / (setup.engine["prefill_s_per_token"] * scale)  # tokens per wall second
    return {"agents.scheduler.admission.prefill-rate": prefill_rate,
            "agents.control.policies.balance.options.prefill-rate": prefill_rate,
            "agents.kv.prefill-tokens-per-s": prefill_rate,
            "agents.kv.decode-s-per-token": setup.engine["decode_s_per_step"] * scale,
            **{k: v * scale for k, v in SCALED_SECONDS.items()}}


# Ablations that are one knob of a part, not a whole policy: the knobs that turn them off
KNOB_ABLATIONS = {
    "park": {"agents.scheduler.admission.park": False},  # pause and resume at tool boundaries
    # Agent Fair Share: no session ever counts as starved (progress order alone)
    "fair-share": {"agents.control.policies.prioritize.options.fair-share-slowdown": 1e12},
}


class DaskAgents:
    """``dask-agents`` (every policy on) or an ablation (``disabled``: ``admission``, ``kv`` (the
    engines' KV left workflow-blind, as the baselines'), a control policy, or a part in
    :data:`KNOB_ABLATIONS`)."""

    def __init__(self, setup: Setup, threads: int = 64, disabled: str | None = None,
                 overrides: dict | None = None, name: str | None = None):
        if disabled not in (None, "admission", "kv") + POLICIES + tuple(KNOB_ABLATIONS):
            raise ValueError(f"unknown ablation {disabled!r}")
        self.setup, self.threads, self.disabled = setup, threads, disabled
        self.overrides = dict(overrides or {})  # agents.* knobs of this variant (dask-agents@KEY=VALUE)
        self.name = name or (f"dask-agents-no-{disabled}" if disabled else "dask-agents")
        self.cluster = self.client = None
        self._config: contextlib.ExitStack | None = None
        self.models = {i: [m] for i, m in enumerate(setup.replica_models())}  # replica i on worker i

    def settings(self) -> dict:
        # ``kv`` off: the engines run the baselines' workflow-blind KV (their own LRU host tier)
        out: dict = {"agents.llm.models": {m: model_entry(self.setup, workflow_aware=self.disabled != "kv")
                                           for m in self.setup.model_names()},
                     **deployment_settings(self.setup)}
        if self.disabled == "admission":
            out["agents.scheduler.admission.enabled"] = False
        elif self.disabled in KNOB_ABLATIONS:
            out.update(KNOB_ABLATIONS[self.disabled])
        elif self.disabled and self.disabled != "kv":
            out[f"agents.control.policies.{self.disabled}.enabled"] = False
        out.update(self.overrides)
        return out

    def __enter__(self) -> "DaskAgents":
        from distributed import Client, LocalCluster

        self._config = contextlib.ExitStack()
        self._config.enter_context(dask.config.set(self.settings()))  # before the workers start
        self.cluster = LocalCluster(n_workers=self.setup.replicas, threads_per_worker=self.threads, processes=True,
                                    dashboard_address=None, scheduler_kwargs={"dashboard_address": "127.0.0.1:0"})
        self.client = Client(self.cluster)
        da.install(self.client, models=self.models)
        info = self.client.scheduler_info()["workers"]
        self.workers = sorted(info, key=lambda a: int(info[a]["name"]))
        return self

    def __exit__(self, *exc: Any) -> None:
        for c in (self.client, self.cluster, self._config):
            if c is not None:
                with contextlib.suppress(Exception):
                    c.close()

    @contextlib.contextmanager
    def session(self, session_id: str, models: tuple | None = None) -> Iterator[FuturesRuntime]:
        scale = self.setup.time_scale

        def start(role: str, fn: Callable, args: tuple) -> Any:
            return da.stub(COMPONENTS.get(role, COMPONENTS["agent"])).run(fn, args, scale)

        with da.session(self.client, name=session_id):
            yield FuturesRuntime(session_id, start, scale)

    def engine_stats(self) -> list[dict]:
        stats = self.client.run(_engine_stats)
        return [stats.get(a) or {} for a in self.workers]  # one entry per worker: before/after pair up

    def describe(self) -> dict:
        import distributed

        return {"framework": f"dask-agents {da.__version__} on dask/distributed {distributed.__version__}",
                "setup": self.setup.describe(), "threads": self.threads,
                "install": f"da.install(client, models={self.models})",
                "disabled": self.disabled, "overrides": self.overrides,
                "agents": "one component per role; LLM via da.llm; tools as da.tool",
                "kv_policy": dask.config.get("agents.kv.policy"), "deployment": deployment_settings(self.setup),
                "admission": self.client.run_on_scheduler(_admission_summary) if self.client is not None else None}


def _admission_summary(dask_scheduler: Any) -> dict | None:
    """What the scheduler's admission did in this run: counts and the waits of the calls it
    held (None: the plugin is not installed)."""
    plugin = dask_scheduler.plugins.get("dask-agents")
    if plugin is None:
        return None
    snap = plugin.admission.snapshot()
    return {k: snap[k] for k in ("enabled", "counts", "wait_p50_s", "wait_p99_s")} | {
        "limit_factors": [e["limit_factor"] for e in snap["engines"]]}


def _engine_stats(dask_worker: Any) -> dict | None:
    plugin = dask_worker.plugins.get("dask-agents")
    engines = getattr(plugin, "engines", None)
    if engines is None:
        return None
    for m in list(engines.hosted):
        return {**engines.start(m).stats(), "model": m}
    return None
