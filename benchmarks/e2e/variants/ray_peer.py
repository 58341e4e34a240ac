"""The Ray peer: engines in async actors, tools in threaded actors, agents as driver threads.

The shape is :class:`benchmarks.e2e.variants.common.InProcess` with Ray between the agents and
the engines/tools: each engine replica is an async actor (``num_cpus=0``) hosting ONE EMULATED
engine, each tool call goes to a threaded tool actor, and the agents stay ordinary Python in
driver threads calling the actors with ``ray.get`` (what a careful Ray user writes: no Ray
task per agent step, which measured 2-7x slower). Ray manages no LLM engine, so the driver picks
the replica (:class:`common.Router`, per model).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
import uuid
from typing import Any

from benchmarks.e2e.program import LLMCall, LLMOut, Setup, ToolCall, sleep_tool
from benchmarks.e2e.variants.common import DriverAgents, make_engine

# The repository root, on the job's code_search_path (workers put it on sys.path): actors import
# ``benchmarks`` and ``dask_agents`` from it whatever the driver's cwd (a runtime_env would do too,
# but costs seconds at start).
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


class EngineActor:
    """One engine replica as a Ray async actor: ONE EMULATED engine for ``model``."""

    def __init__(self, model: str, setup: Setup):
        self.host = make_engine(model, setup)

    async def generate(self, prompt: str, max_tokens: int) -> tuple[int, int, int, float, float]:
        """Run one call on the engine: ``(prompt_tokens, cached_tokens, output_tokens, received,
        finished)``, the last two the wall clock when the call arrived here and when it ended."""
        received = time.time()
        host = self.host
        ids = host.tokenizer.encode(prompt)
        # The host's future resolves on its stepping thread; awaiting it keeps the actor's event
        # loop free for the other calls in flight (the engine batches them).
        fut = host.submit(uuid.uuid4().hex, ids, host.sampling_params(max_tokens, 0.0, None), None)
        out = await asyncio.wrap_future(fut)
        finished = time.time()
        return (len(out.prompt_token_ids), int(out.num_cached_tokens or 0), len(out.outputs[0].token_ids),
                received, finished)

    async def stats(self) -> dict:
        """The engine's counters (``EmulatedEngineHost.stats()``)."""
        return self.host.stats()


class ToolActor:
    """EMULATED tools on a threaded Ray actor (``max_concurrency`` threads sleep in parallel)."""

    def run(self, call: ToolCall, time_scale: float) -> tuple[str, float, float]:
        """The tool's body: its answer and when it started and ended (wall clock)."""
        return sleep_tool(call, time_scale)


class RayPeer(DriverAgents):
    """Ray as its users would deploy it for agents: one async engine actor per replica, one
    threaded tool actor per replica (round-robin), agents as driver threads calling them."""

    name = "ray"

    def __init__(self, setup: Setup, routing: str = "session_sticky", threads: int = 512):
        self.setup, self.routing, self.threads = setup, routing, threads
        self.engines: list[Any] = []
        self.tools: list[Any] = []

    def __enter__(self) -> "RayPeer":
        # Must be in the environment before Ray starts its processes: loopback only, no phoning home.
        os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")
        import ray

        ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
                 logging_level="ERROR", configure_logging=True,
                 job_config=ray.job_config.JobConfig(code_search_path=[_ROOT]))
        try:
            # num_cpus=0: actors mostly wait (engines on their stepping thread, tools in sleep), so
            # they must not be capped by the 2 logical CPUs.
            engine_cls = ray.remote(num_cpus=0)(EngineActor)
            tool_cls = ray.remote(num_cpus=0, max_concurrency=self.setup.tool_threads)(ToolActor)
            self.engines = [engine_cls.remote(m, self.setup) for m in self.setup.replica_models()]
            self.tools = [tool_cls.remote() for _ in range(self.setup.replicas)]
            ray.get([e.stats.remote() for e in self.engines])  # every engine loaded before requests
        except BaseException:
            ray.shutdown()
            raise
        self._next_tool = itertools.count()  # next() on a count is atomic under the GIL
        self._start_routing(self.threads, "e2e-ray-agent")
        return self

    def __exit__(self, *exc: Any) -> None:
        import ray

        self.pool.shutdown(wait=False, cancel_futures=True)
        with contextlib.suppress(Exception):
            ray.shutdown()
        self.engines, self.tools = [], []

    def _generate(self, replica: int, call: LLMCall) -> tuple[LLMOut, float, float]:
        import ray

        p, c, o, received, finished = ray.get(self.engines[replica].generate.remote(call.prompt, call.max_tokens))
        return LLMOut(p, c, o), received, finished

    def _tool(self, call: ToolCall) -> tuple[str, float, float]:
        import ray

        actor = self.tools[next(self._next_tool) % len(self.tools)]
        return ray.get(actor.run.remote(call, self.setup.time_scale))

    def engine_stats(self) -> list[dict]:
        """Every engine actor's counters, replica order."""
        import ray

        return ray.get([e.stats.remote() for e in self.engines])

    def describe(self) -> dict:
        """The framework, how engines/tools/agents are deployed, routing and the Setup."""
        import ray

        n, t = self.setup.replicas, self.setup.tool_threads
        return {"framework": f"ray {ray.__version__}",
                "engines": f"{n} async actors (num_cpus=0), one EMULATED engine each",
                "tools": f"{n} threaded actors (num_cpus=0, max_concurrency={t}), round-robin",
                "agents": "driver threads calling actors (ray.get)", "agent_threads": self.threads,
                "routing": self.routing,
                "init": "ray.init(num_cpus=2, include_dashboard=False, _node_ip_address='127.0.0.1')",
                "setup": self.setup.describe()}
