"""The Router workflow of ``benchmarks/e2e.py`` (``--workflow router``) under skewed phases, on
EMULATED engines for two models (``chat``, ``coder``) on 4 engine workers.

Everything timed here is EMULATED: the engines are :class:`dask_agents.worker_plugin.emulated.EmulatedEngineHost`
(a cost model), the code-exec tool sleeps a latency drawn from ``dask_agents.kv.runtime.tool_latency``'s code_exec prior.

Workflow (``examples/router/workflow.py``'s control flow): a classifier (one short LLM call on
``coder``, max_tokens 1) routes the request by the code-fence rule; the chat branch makes one
call on ``chat``; the coding branch a draft call on ``coder``, an EMULATED code_exec tool, and a
final call on ``coder`` (max_tokens <= 8) whose prompt extends the draft's.

Requests: ``examples.router.trace.skewed`` over the Azure LLM 2023 trace (code + conversation;
``../shared/traces``, CC-BY 4.0): ``phases`` equal phases whose dominant label alternates
(coding first; 95% dominant), token counts from the trace rows (prompt capped at
``MAX_PROMPT_TOKENS``, output at ``MAX_OUTPUT_TOKENS``), text synthetic and seeded
(``examples.router.workflow.make_requests``). The trace's arrival times are rescaled so the
mean rate is the offered load. Every random draw (tool latency included) is made up front, so
every variant sends the same prompts and sleeps the same tool latencies.

Variants
--------
``dask``          plain Dask, 4 worker processes, each hosting both EMULATED engines (only the
                  engine of the model a worker is assigned to ever gets calls). A STATIC split of
                  the 4 workers between chat and coder (swept: 1/3, 2/2, 3/1 chat/coder; best kept);
                  each request's LLM tasks restricted to its model's workers and session-pinned
                  (per model, the worker with the fewest requests pinned at the request's start;
                  ``workers=[addr], allow_other_workers=False``), as the swe baseline's
                  ``session_sticky``. The sweep entries share one cluster (the split is a driver
                  choice) and the best split's number is its sweep run.
``dask-agents``   ``da.install(client, models={0: ["chat"], 1: ["chat"], 2: ["coder"], 3: ["coder"]})``
                  (start at 2/2), every default policy on; ``reallocate`` may move workers.
``dask-agents-no-reallocate``  the same with reallocation off (stays 2/2).
``ray``           Ray (``e2e_peers``' machinery): 4 engine replicas in async actors (``num_cpus=0``),
                  each hosting both EMULATED engines, as plain Dask's workers do; the request's
                  logic a coroutine in the driver; code_exec on the threaded tool actors. A STATIC
                  split of the 4 replicas between chat and coder, chosen by the same sweep as plain
                  Dask's (1/3, 2/2, 3/1 at the calibration load, on one instance; the best split's
                  number is its sweep run); within a model's replicas a request's calls are
                  ``session_sticky`` (its first call of the model goes to the replica with the
                  fewest calls in flight, the rest follow), the counterpart of plain Dask's pinning.
``langgraph``     LangGraph: a StateGraph per request (classify -> conditional edge -> chat | code),
                  4 replicas of in-process engine objects (both models each), tools on a thread
                  pool; the same split sweep and routing as Ray.
Peers that are not importable are skipped (reported so, their summary keys null).
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any, Callable, TypedDict  # module level: the graph's state hints resolve here

import dask
import distributed

import dask_agents as da
from benchmarks.legacy import e2e_swe as swe
from dask_agents.kv.runtime.tool_latency import prior

MODELS = ("chat", "coder")
WORKERS = 4
# EMULATED engine of both models: 4 sequences per iteration, 20 ms per iteration, 0.1 ms per
# fresh prompt token (no chunked prefill), prefix caching, wall time = emulated time.
ENGINE = {"max_batch": 4, "decode_s_per_step": 0.02, "decode_s_per_seq": 5e-5, "prefill_s_per_token": 1e-4,
          "prefill_s_per_token_pos": 0.0, "kv_blocks": 2048, "block_size": 16, "time_scale": 1.0}
MAX_PROMPT_TOKENS, MAX_OUTPUT_TOKENS = 2048, 64
TOOL_TIME_SCALE = 0.1
TRACE_START_S = 260.0  # from 260 s on both labels alternate in the trace (examples.router)
SPLITS = ((1, 3), (2, 2), (3, 1))  # (chat workers, coder workers) of plain Dask's static sweep
START_SPLIT = (2, 2)

# The prompts are the example workflow's own (examples/router/workflow.py).
from examples.router.workflow import CHAT_SYSTEM, CLASSIFIER_CHARS, CODE_SYSTEM, FENCE, ROUTER_SYSTEM  # noqa: E402,F401
FINAL_TOKENS = 8


@dataclass(frozen=True)
class RouterSpec:
    """One Router request with every draw made (identical in every variant)."""

    id: str
    label: str  # "code" / "conversation"
    text: str
    max_tokens: int
    seed: int
    phase: int
    tool_s: float  # EMULATED code_exec latency (unscaled; coding requests only)

    @property
    def branch(self) -> str:
        return "code" if self.label == "code" else "chat"

    def ideal_latency(self) -> float:
        """Critical path with no queueing: one sequence per iteration, only the system prompt cached."""
        p = ENGINE
        step = p["decode_s_per_step"] + p["decode_s_per_seq"]

        def llm(prompt: str, cached: int, out: int) -> float:
            return ((max(0, len(prompt) - cached)) * p["prefill_s_per_token"] + out * step) * p["time_scale"]

        t = llm(classifier_prompt(self), len(ROUTER_SYSTEM), 1)
        if self.branch == "chat":
            return t + llm(chat_prompt(self), len(CHAT_SYSTEM), self.max_tokens)
        draft = draft_prompt(self)
        return (t + llm(draft, len(CODE_SYSTEM), self.max_tokens) + self.tool_s * TOOL_TIME_SCALE
                + llm(final_prompt(self), len(draft), FINAL_TOKENS))

    def check_outcome(self, out: dict) -> None:
        if out.get("branch") != self.branch or out.get("calls") != (2 if self.branch == "chat" else 3):
            raise AssertionError(f"{self.id}: outcome {out} differs from the spec (branch {self.branch})")


def classifier_prompt(s: RouterSpec) -> str:
    return f"{ROUTER_SYSTEM}Request {s.id}: {s.text[:CLASSIFIER_CHARS]}\nRoute:"


def chat_prompt(s: RouterSpec) -> str:
    return f"{CHAT_SYSTEM}Request {s.id}\nUser: {s.text}\nAssistant:"


def draft_prompt(s: RouterSpec) -> str:
    return f"{CODE_SYSTEM}Request {s.id}\nUser: {s.text}\nCode:"


def final_prompt(s: RouterSpec) -> str:
    return draft_prompt(s) + f"\nCode ran in {s.tool_s * 1000:.0f} ms, exit 0.\nFinal answer:"


def route_of(text: str) -> str:
    return "code" if FENCE in text[:CLASSIFIER_CHARS] else "chat"


def make_specs(n: int, seed: int, phases: int = 3) -> tuple[list[RouterSpec], list[float]]:
    """``n`` requests in ``phases`` skewed phases (coding first) and their trace arrival offsets (s)."""
    from examples.router.trace import Trace, skewed
    from examples.router.workflow import make_requests

    arr = skewed(Trace.load(), n, phases=phases, seed=seed, start_s=TRACE_START_S)
    reqs = make_requests(arr, seed=seed, max_prompt_tokens=MAX_PROMPT_TOKENS, max_output_tokens=MAX_OUTPUT_TOKENS)
    code_exec = prior("code_exec")
    specs = []
    for i, r in enumerate(reqs):
        rng = random.Random(f"e2e-router-tool-{seed}-{i}")
        specs.append(RouterSpec(id=f"r{i:04d}", label=r.label, text=r.text, max_tokens=r.max_tokens, seed=r.seed,
                                phase=r.phase, tool_s=code_exec.sample(rng) if r.label == "code" else 0.0))
    return specs, [r.at for r in reqs]


def arrivals_at(trace_at: list[float], rate: float) -> list[float]:
    """The trace's arrival offsets rescaled to a mean rate of ``rate`` requests/s."""
    span = trace_at[-1] - trace_at[0] if len(trace_at) > 1 else 0.0
    if span <= 0:
        return [i / rate for i in range(len(trace_at))]
    f = (len(trace_at) - 1) / rate / span
    return [(a - trace_at[0]) * f for a in trace_at]


def specs_for(base: list[RouterSpec], tag: str) -> list[RouterSpec]:
    prefix = hashlib.sha1(tag.encode()).hexdigest()[:8]
    return [replace(s, id=f"{prefix}-{s.id}") for s in base]


def describe_specs(specs: list[RouterSpec], phases: int) -> dict:
    ideal = sorted(s.ideal_latency() for s in specs)
    by_phase = {}
    for k in range(phases):
        ph = [s for s in specs if s.phase == k]
        by_phase[str(k)] = {"requests": len(ph), "code_share": sum(s.label == "code" for s in ph) / max(len(ph), 1)}
    return {"requests": len(specs), "phases": by_phase,
            "mean_chat_max_tokens": _mean([s.max_tokens for s in specs if s.branch == "chat"]),
            "mean_code_max_tokens": _mean([s.max_tokens for s in specs if s.branch == "code"]),
            "mean_prompt_chars": _mean([len(s.text) for s in specs]),
            "ideal_latency_mean_s": _mean(ideal), "ideal_latency_max_s": max(ideal) if ideal else float("nan")}


def _mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def model_entry() -> dict:
    return {"model": "emulated-router", "engine": "emulated", "tokenizer": "byte", "max-model-len": 8192,
            "enable-prefix-caching": True, "emulation": dict(ENGINE)}


# -- EMULATED tool (shared by both forms) --------------------------------------------------------

def _sleep_tool(payload: str, emulated_s: float) -> dict:
    time.sleep(emulated_s * TOOL_TIME_SCALE)
    return {"latency_s": emulated_s, "emulated": True, "bytes": len(payload)}


@da.tool(kind="code_exec")
def router_code_exec(payload: str, emulated_s: float) -> dict:
    """EMULATED code run: sleeps the spec's drawn latency x TOOL_TIME_SCALE."""
    return _sleep_tool(payload, emulated_s)


# -- dask-agents form ------------------------------------------------------------------------------

@da.agent(model="coder")
class RouterClassifier:
    def classify(self, spec: RouterSpec) -> str:
        da.llm("coder").generate(classifier_prompt(spec), max_tokens=1).value()
        return route_of(spec.text)


@da.agent(model="chat")
class RouterChat:
    def reply(self, spec: RouterSpec) -> int:
        da.llm("chat").generate(chat_prompt(spec), max_tokens=spec.max_tokens).value()
        return 1


@da.agent(model="coder")
class RouterCoder:
    def solve(self, spec: RouterSpec) -> int:
        da.llm("coder").generate(draft_prompt(spec), max_tokens=spec.max_tokens).value()
        da.stub(router_code_exec)(spec.id, spec.tool_s).value()
        da.llm("coder").generate(final_prompt(spec), max_tokens=FINAL_TOKENS).value()
        return 2


def solve_agents(client, spec: RouterSpec) -> dict:
    with da.session(client, name=spec.id):
        branch = da.stub(RouterClassifier).classify(spec).value()
        if branch == "code":
            calls = da.stub(RouterCoder).solve(spec).value()
        else:
            calls = da.stub(RouterChat).reply(spec).value()
    return {"branch": branch, "calls": 1 + calls}


# -- plain Dask form -------------------------------------------------------------------------------

PLUGIN = "e2e-router-engines"


class RouterEnginesPlugin(distributed.WorkerPlugin):
    """Hosts both EMULATED engines on a worker (plain Dask; the split is the driver's pinning)."""

    name = PLUGIN

    def setup(self, worker) -> None:
        self.hosts = {m: swe.make_engine(m, ENGINE) for m in MODELS}

    def teardown(self, worker) -> None:
        for h in getattr(self, "hosts", {}).values():
            h.close()


def _dask_engine_stats(dask_worker) -> list:
    p = dask_worker.plugins.get(PLUGIN)
    return [h.stats() for h in p.hosts.values()] if p is not None else []


def llm_task(model: str, prompt: str, max_tokens: int) -> int:
    host = distributed.get_worker().plugins[PLUGIN].hosts[model]
    out = swe.engine_call(host, prompt, max_tokens, uuid.uuid4().hex).result()
    return len(out.outputs[0].token_ids)


def tool_task(payload: str, emulated_s: float) -> dict:
    return _sleep_tool(payload, emulated_s)


class Pinner:
    """Per model: the worker with the fewest requests pinned right now, ties rotating."""

    def __init__(self, groups: dict[str, list[str]]):
        from benchmarks.legacy.e2e_baselines import SessionPinner

        self.p = {m: SessionPinner(ws) for m, ws in groups.items()}


def solve_dask(client, spec: RouterSpec, pinner: Pinner) -> dict:
    held = []

    def pin(model: str) -> str:
        for m, w in held:
            if m == model:
                return w
        w = pinner.p[model].acquire()
        held.append((model, w))
        return w

    def llm(model: str, prompt: str, n: int) -> int:
        return client.submit(llm_task, model, prompt, n, pure=False, workers=[pin(model)],
                             allow_other_workers=False).result()

    try:
        llm("coder", classifier_prompt(spec), 1)
        branch = route_of(spec.text)
        if branch == "code":
            llm("coder", draft_prompt(spec), spec.max_tokens)
            client.submit(tool_task, spec.id, spec.tool_s, pure=False).result()
            llm("coder", final_prompt(spec), FINAL_TOKENS)
            calls = 3
        else:
            llm("chat", chat_prompt(spec), spec.max_tokens)
            calls = 2
        return {"branch": branch, "calls": calls}
    finally:
        for m, w in held:
            pinner.p[m].release(w)


# -- peers (e2e_peers' machinery) ------------------------------------------------------------------

class _RouterPeer:
    """The Router logic as a coroutine over a peer's ``llm`` (per model) and ``call_tool``."""

    async def classify(self, spec: RouterSpec) -> str:
        await self.llm(spec, classifier_prompt(spec), 1, model="coder")
        return route_of(spec.text)

    async def chat(self, spec: RouterSpec) -> int:
        await self.llm(spec, chat_prompt(spec), spec.max_tokens, model="chat")
        return 1

    async def code(self, spec: RouterSpec) -> int:
        await self.llm(spec, draft_prompt(spec), spec.max_tokens, model="coder")
        await self.call_tool(_sleep_tool, spec.id, spec.tool_s)
        await self.llm(spec, final_prompt(spec), FINAL_TOKENS, model="coder")
        return 2

    async def solve(self, spec: RouterSpec) -> dict:
        branch = await self.classify(spec)
        calls = await (self.code(spec) if branch == "code" else self.chat(spec))
        return {"branch": branch, "calls": 1 + calls}


class RouterState(TypedDict, total=False):
    spec: Any
    branch: str
    calls: int


def _peer_classes() -> dict:
    from benchmarks.legacy.e2e_peers import LangGraphPeer, RayPeer

    class RouterRayPeer(_RouterPeer, RayPeer):
        """Ray: 4 engine-replica actors (both models each), the logic a coroutine in the driver."""

    class RouterLangGraphPeer(_RouterPeer, LangGraphPeer):
        """LangGraph: classify -> conditional edge -> chat | code, per request."""

        graph_description = "StateGraph: classify -> conditional edge -> chat | code"

        def _build(self):
            from langgraph.graph import END, START, StateGraph

            async def classify(state: RouterState) -> dict:
                return {"branch": await self.classify(state["spec"])}

            async def chat(state: RouterState) -> dict:
                return {"calls": 1 + await self.chat(state["spec"])}

            async def code(state: RouterState) -> dict:
                return {"calls": 1 + await self.code(state["spec"])}

            g = StateGraph(RouterState)
            g.add_node("classify", classify)
            g.add_node("chat", chat)
            g.add_node("code", code)
            g.add_edge(START, "classify")
            g.add_conditional_edges("classify", lambda s: "code" if s["branch"] == "code" else "chat",
                                    ["chat", "code"])
            g.add_edge("chat", END)
            g.add_edge("code", END)
            return g.compile()

        async def solve(self, spec: RouterSpec) -> dict:
            state = await self.graph.ainvoke({"spec": spec})
            return {"branch": state["branch"], "calls": state["calls"]}

    return {"ray": RouterRayPeer, "langgraph": RouterLangGraphPeer}


PEER_ROUTING = "session_sticky"


def make_peer(name: str, split: tuple[int, int] = START_SPLIT, tool_threads: int = 32):
    """A router peer backend (``ray`` or ``langgraph``): 4 replicas hosting both models, the
    ``split`` (chat, coder) of them static; calls session-sticky within a model's replicas."""
    cls = _peer_classes()[name]
    return cls(tool_threads=tool_threads, routing=PEER_ROUTING, models={m: dict(ENGINE) for m in MODELS},
               replicas=WORKERS, split=dict(zip(MODELS, split)))


# -- backends --------------------------------------------------------------------------------------

def _cluster(threads: int):
    from distributed import LocalCluster

    from benchmarks.legacy.e2e import NO_DASHBOARD

    return LocalCluster(n_workers=WORKERS, threads_per_worker=threads, processes=True, dashboard_address=None,
                        scheduler_kwargs=NO_DASHBOARD)


class DaskRouterBackend:
    kind = "dask"

    def __init__(self, split: tuple[int, int] = START_SPLIT, threads: int = 16):
        self.split, self.threads = tuple(split), threads
        self.cluster = self.client = None
        self.addrs: list[str] = []

    def describe(self) -> dict:
        return {"framework": f"dask/distributed {distributed.__version__}, no dask-agents",
                "cluster": f"LocalCluster(n_workers={WORKERS}, threads_per_worker={self.threads}, processes=True)",
                "split": {"chat": self.split[0], "coder": self.split[1]},
                "llm_routing": "static split; a request's LLM tasks pinned per model to one of that model's workers "
                               "(fewest requests pinned), workers=[addr], allow_other_workers=False"}

    def __enter__(self):
        from distributed import Client

        self.cluster = _cluster(self.threads)
        self.client = Client(self.cluster)
        self.client.register_plugin(RouterEnginesPlugin())
        self.client.wait_for_workers(WORKERS)
        self.addrs = sorted(self.client.scheduler_info()["workers"])
        return self

    def __exit__(self, *exc):
        for c in (self.client, self.cluster):
            if c is not None:
                with contextlib.suppress(Exception):
                    c.close()

    def engine_stats(self) -> list[dict]:
        return [s for ss in self.client.run(_dask_engine_stats).values() for s in ss]

    def run(self, specs, arrivals, timeout: float) -> list[dict]:
        from benchmarks.legacy.e2e import drive_threads

        n_chat = self.split[0]
        pinner = Pinner({"chat": self.addrs[:n_chat], "coder": self.addrs[n_chat:]})
        return drive_threads(lambda s: solve_dask(self.client, s, pinner), specs, arrivals, timeout)

    def extra(self) -> dict:
        return {}


def _agents_engine_stats(dask_worker) -> list:
    plugin = dask_worker.plugins.get("dask-agents")
    engines = getattr(plugin, "engines", None)
    if engines is None:
        return []
    return [engines.start(m).stats() for m in list(engines.hosted) if m in MODELS]


def _reassigns(client) -> list[dict]:
    return [e for _, e in client.get_events("agents-control") if e.get("action") == "reassign-done"]


def _model_workers(dask_scheduler=None) -> dict:
    from dask_agents.scheduler_plugin.plugin import NAME

    p = dask_scheduler.plugins[NAME]
    return {m: len(p.model_workers.get(m, ())) for m in MODELS}


class AgentsRouterBackend:
    kind = "dask-agents"

    def __init__(self, disabled: str | None = None, threads: int = 16):
        self.disabled, self.threads = disabled, threads
        self.cluster = self.client = None
        self._config: contextlib.ExitStack | None = None

    def describe(self) -> dict:
        return {"framework": f"dask-agents {da.__version__} on dask/distributed {distributed.__version__}",
                "cluster": f"LocalCluster(n_workers={WORKERS}, threads_per_worker={self.threads}, processes=True)",
                "install": "da.install(client, models={0: ['chat'], 1: ['chat'], 2: ['coder'], 3: ['coder']})",
                "start_split": {"chat": START_SPLIT[0], "coder": START_SPLIT[1]},
                "policies_off": [self.disabled] if self.disabled else []}

    def __enter__(self):
        from distributed import Client

        self._config = contextlib.ExitStack()
        settings: dict = {"agents.llm.models": {m: model_entry() for m in MODELS}}
        if self.disabled:
            settings[f"agents.control.policies.{self.disabled}.enabled"] = False
        self._config.enter_context(dask.config.set(settings))
        self.cluster = _cluster(self.threads)
        self.client = Client(self.cluster)
        self.client.wait_for_workers(WORKERS)
        names = sorted(w["name"] for w in self.client.scheduler_info()["workers"].values())
        models = {n: (["chat"] if i < START_SPLIT[0] else ["coder"]) for i, n in enumerate(names)}
        da.install(self.client, models=models)
        deadline = time.time() + 60
        while self.client.run_on_scheduler(_model_workers) != dict(zip(MODELS, START_SPLIT)):
            if time.time() > deadline:
                raise TimeoutError(f"engines not registered: {self.client.run_on_scheduler(_model_workers)}")
            time.sleep(0.1)  # waiting for the workers' engines to register
        self._seen = 0
        return self

    def __exit__(self, *exc):
        from benchmarks.legacy.e2e import close_quietly

        close_quietly(self.client, self.cluster, self._config)

    def engine_stats(self) -> list[dict]:
        return [s for ss in self.client.run(_agents_engine_stats).values() for s in ss]

    def run(self, specs, arrivals, timeout: float) -> list[dict]:
        from benchmarks.legacy.e2e import drive_threads

        return drive_threads(lambda s: solve_agents(self.client, s), specs, arrivals, timeout)

    def run_extra(self, t0_wall: float) -> dict:
        """Reallocation during the last run: reassign-done events since the previous call."""
        ev = _reassigns(self.client)
        new, self._seen = ev[self._seen:], len(ev)
        return {"reassign_done": len(new),
                "reassigns": [{"source": e.get("source"), "target": e.get("target"),
                               "seconds": e.get("seconds")} for e in new],
                "final_split": self.client.run_on_scheduler(_model_workers)}

    def extra(self) -> dict:
        try:
            st = da.control(self.client).stats()
            return {"control": {k: st.get(k) for k in ("policies", "ticks", "policy_errors", "applied", "rejected",
                                                           "drains")}}
        except Exception as e:
            return {"control": {"error": repr(e)}}


# -- runs ------------------------------------------------------------------------------------------

def run_loads(backend, base, trace_at, loads, seed, warmup, tag, log, measured=None) -> dict:
    from benchmarks.legacy import e2e

    out: dict[str, dict] = dict(measured or {})
    loads = [r for r in loads if e2e.load_key(r) not in out]
    if not loads:
        return out
    if warmup:
        warm = specs_for(base[:warmup], f"{tag}-warm")
        backend.run(warm, [0.2 * i for i in range(len(warm))], timeout=60)
        if hasattr(backend, "run_extra"):
            backend.run_extra(0)  # forget warm-up events
    for rate in sorted(loads):
        specs = specs_for(base, f"{tag}-L{e2e.load_key(rate)}")
        arrivals = arrivals_at(trace_at, rate)
        before = backend.engine_stats()
        t = time.perf_counter()
        records = backend.run(specs, arrivals, timeout=max(60.0, 2 * arrivals[-1]))
        wall = time.perf_counter() - t
        m = e2e.load_metrics(records, specs, rate)
        m["wall_s"] = wall
        m.update(e2e.cache_delta(before, backend.engine_stats()))
        m["busiest_engine_share"] = None  # engines of two models: not comparable
        by_phase = {}
        for k in sorted({s.phase for s in specs}):
            lat = [r["latency"] for r, s in zip(records, specs) if s.phase == k and r.get("ok")]
            by_phase[str(k)] = {"mean_s": _mean(lat), "p99_s": e2e.percentile(lat, 99)}
        m["phases"] = by_phase
        if hasattr(backend, "run_extra"):
            m.update(backend.run_extra(t))
        out[e2e.load_key(rate)] = m
        extra = f" reassign-done {m['reassign_done']}" if "reassign_done" in m else ""
        log(f"    {tag:36s} load {rate:4g}/s: mean {m['mean_s']:.2f}s p99 {m['p99_s']:.2f}s "
            f"thr {m['throughput_rps']:.2f}/s {'sustained' if m['sustained'] else 'NOT sustained'} "
            f"({m['completed']}/{m['requests']} done, {wall:.1f}s){extra}")
    return out


def run_benchmark(preset: dict, variants: list[str], seed: int = 0,
                  log: Callable[[str], None] = print) -> tuple[dict, dict]:
    """Run the selected variants of the router workflow; returns (variants, sweeps)."""
    from benchmarks.legacy import e2e

    base, trace_at = make_specs(preset["requests"], seed, preset["phases"])
    loads = sorted(preset["loads"])
    cal = preset["calibration_load"]
    out: dict[str, dict] = {}
    sweeps: dict[str, list] = {}
    if "dask" in variants:
        log("  plain Dask (router): static chat/coder split sweep at the calibration load")
        rows = []
        t = time.perf_counter()
        with DaskRouterBackend(threads=preset["threads"]) as b:
            for i, split in enumerate(preset["splits"]):
                b.split = tuple(split)
                tag = f"router-dask-split-{split[0]}-{split[1]}"
                m = run_loads(b, base, trace_at, [cal], seed, preset["warmup"] if i == 0 else 0, tag, log)
                rows.append({"config": {"chat_workers": split[0], "coder_workers": split[1]},
                             "metrics": m[e2e.load_key(cal)]})
            sweeps["dask"] = rows
            chosen = min(rows, key=lambda r: e2e.sweep_score(r["metrics"]))
            best = chosen["config"]
            b.split = (best["chat_workers"], best["coder_workers"])
            log(f"  plain Dask (router): best static split {best}")
            res = {"description": b.describe(),
                   "loads": run_loads(b, base, trace_at, loads, seed, 0, "router-dask", log,
                                      {e2e.load_key(cal): chosen["metrics"]})}
        res["best_config"] = best
        res["max_sustained_rps"] = e2e.max_sustained(res["loads"])
        res["wall_s"] = time.perf_counter() - t
        out["dask"] = res
    for name, disabled in (("dask-agents", None), ("dask-agents-no-reallocate", "reallocate")):
        if name not in variants:
            continue
        t = time.perf_counter()
        with AgentsRouterBackend(disabled=disabled, threads=preset["threads"]) as b:
            res = {"description": b.describe(),
                   "loads": run_loads(b, base, trace_at, loads, seed, preset["warmup"], f"router-{name}", log)}
            res.update(b.extra())
        res["max_sustained_rps"] = e2e.max_sustained(res["loads"])
        res["wall_s"] = time.perf_counter() - t
        out[name] = res
    for peer in ("ray", "langgraph"):
        if peer not in variants:
            continue
        ok, info = e2e.peer_available(peer)
        if not ok:
            log(f"  {peer} (router): SKIPPED, {info}")
            out[peer] = {"skipped": info}
            sweeps[peer] = []
            continue
        try:
            out[peer], sweeps[peer] = run_peer(peer, preset, base, trace_at, loads, seed, log)
            out[peer]["version"] = info
        except Exception as e:  # a broken peer install must not lose the other results
            log(f"  {peer} (router): FAILED ({type(e).__name__}: {e}); reported as skipped")
            out[peer] = {"skipped": f"failed: {type(e).__name__}: {e}"[:300]}
            sweeps[peer] = []
    return out, sweeps


def run_peer(name: str, preset: dict, base, trace_at, loads, seed, log) -> tuple[dict, list[dict]]:
    """A peer's static chat/coder split by plain Dask's sweep (at the calibration load, on one
    instance, warm-up before the first split only), then every other load with the best split."""
    from benchmarks.legacy import e2e

    cal = preset["calibration_load"]
    t = time.perf_counter()
    rows = []
    with make_peer(name, tool_threads=e2e.PEER_TOOL_THREADS) as b:
        for i, split in enumerate(preset["splits"]):
            b.split = dict(zip(MODELS, split))
            m = run_loads(b, base, trace_at, [cal], seed, preset["warmup"] if i == 0 else 0,
                          f"router-{name}-split-{split[0]}-{split[1]}", log)
            rows.append({"config": {"chat_workers": split[0], "coder_workers": split[1]},
                         "metrics": m[e2e.load_key(cal)]})
        chosen = min(rows, key=lambda r: e2e.sweep_score(r["metrics"]))
        best = chosen["config"]
        b.split = {"chat": best["chat_workers"], "coder": best["coder_workers"]}
        log(f"  {name} (router): best static split {best}")
        res = {"description": {**b.describe(), "split": dict(b.split)},
               "loads": run_loads(b, base, trace_at, loads, seed, 0, f"router-{name}", log,
                                  {e2e.load_key(cal): chosen["metrics"]})}
    res["best_config"] = best
    res["max_sustained_rps"] = e2e.max_sustained(res["loads"])
    res["wall_s"] = time.perf_counter() - t
    return res, rows


VARIANTS = ["dask", "dask-agents", "dask-agents-no-reallocate", "ray", "langgraph"]

# Quick: 180 requests (60 per phase, ~10 s at 6/s). With the peers' split sweeps that is 11 runs,
# ~7 minutes on 2 cores. Shorter phases change the result, not just the noise: at 120 requests
# (~6.7 s phases) reallocation moved replicas too late for the phase they were meant for, and
# dask-agents was slower than dask-agents-no-reallocate (mean 2.30 s vs 1.93 s, P99 8.2 s vs 4.0 s,
# one run), while at 180 it was faster (1.91 s vs 2.28 s, one run).
QUICK = {"loads": [6.0], "calibration_load": 6.0, "requests": 180, "phases": 3, "warmup": 6, "threads": 16,
         "splits": [list(s) for s in SPLITS]}
FULL = {"loads": [4.0, 6.0, 8.0], "calibration_load": 6.0, "requests": 360, "phases": 3, "warmup": 8, "threads": 16,
        "splits": [list(s) for s in SPLITS]}


def build_config(preset: dict, seed: int, variants: list[str]) -> dict:
    base, trace_at = make_specs(preset["requests"], seed, preset["phases"])
    cal = preset["calibration_load"]
    arr = arrivals_at(trace_at, cal)
    return {
        "workflow": "router", "variants": variants, "loads_rps": sorted(preset["loads"]),
        "requests_per_load": preset["requests"], "phases": preset["phases"],
        "phase_seconds_at_reference_load": arr[-1] / preset["phases"] if arr else None,
        "warmup_requests": preset["warmup"], "calibration_load_rps": cal, "reference_load_rps": cal,
        "engine": {"models": list(MODELS), "engine_workers": WORKERS, **ENGINE, "prefix_caching": True,
                   "class": "dask_agents.worker_plugin.emulated.EmulatedEngineHost",
                   "max_prompt_tokens": MAX_PROMPT_TOKENS, "max_output_tokens": MAX_OUTPUT_TOKENS},
        "tools": {"code_exec": "code_exec prior, drawn up front", "time_scale": TOOL_TIME_SCALE},
        "trace": f"Azure LLM inference trace 2023 (code + conversation), skewed phases from {TRACE_START_S:g}s, "
                 "arrival times rescaled to the offered load",
        "requests": describe_specs(base, preset["phases"]),
        "threads": preset["threads"], "dask_splits_chat_coder": preset["splits"],
        "peers": {"engines": f"{WORKERS} replicas, both models on each, static split swept as plain Dask's",
                  "routing": f"{PEER_ROUTING} within a model's replicas", "tool_threads": 32},
    }
