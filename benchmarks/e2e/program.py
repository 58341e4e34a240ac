"""What a request does, written once and run by every variant: the workflow programs' interface.

A workflow (``benchmarks/e2e/workflows/``) is a plain Python function ``program(rt, spec)`` over a
:class:`Runtime`. Its agents are module-level functions ``agent_fn(ctx, *args)`` over a
:class:`Ctx`: they make LLM calls (:class:`LLMCall`) and tool calls (:class:`ToolCall`) one after
the other, as an agent does. The program starts agents (``rt.agent``), waits for them
(``rt.gather``), and pauses for a user's think time (``rt.think``). Every variant
(``benchmarks/e2e/variants/``) implements the two interfaces in its own framework's idiom:
plain Dask runs an agent as a task making nested calls through ``worker_client``, dask-agents as
a component method calling ``da.llm`` and tool stubs, Ray in driver threads calling engine
actors, LangGraph as a graph whose LLM calls go over HTTP to an OpenAI-compatible server.
:mod:`benchmarks.e2e.ideal` runs the same programs in virtual time to get each request's ideal
latency.

So every variant sends the same prompts (byte for byte) in the same dependency order, and
sleeps the same tool latencies; everything random was drawn up front into the spec.

Timing. Every call is stamped four times: ``issued`` (the caller asked), ``started`` (its
body began: the engine received the request, the tool started sleeping, the agent function
started), ``ended`` (the body ended) and ``returned`` (the caller has the result). Framework
overhead of a call is ``(started - issued) + (returned - ended)``; an agent's own overhead adds
that of the calls it made in sequence; a gather adds the overhead along the branch that
finished last. So ``rt.rec.overhead_s`` is the framework overhead on the request's critical
path, whatever the framework. (An engine's own queueing is not overhead: it is inside
``started .. ended``.) Clocks are ``time.time()`` of processes on one machine. The same sum is
kept in parts (``rt.rec.parts``: ``<kind>_in`` before bodies, ``<kind>_out`` after them, for
kinds ``agent``, ``llm`` and ``tool``) so a gap between frameworks shows where it is paid.

Time scale: emulated seconds x ``time_scale`` = wall seconds, one scale for engines and tools,
applied by the variant (engines through ``EmulationParams.time_scale``, tools by
:func:`sleep_tool`), never by a program.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Protocol, TypeVar

T = TypeVar("T")

MODEL = "coder"  # the default model name of every workflow's LLM calls


@dataclass(frozen=True)
class LLMCall:
    """One LLM call: ``prompt`` is text (the engines' byte tokenizer: one character, one token)."""

    session: str
    role: str
    prompt: str
    max_tokens: int
    model: str = MODEL


@dataclass(frozen=True)
class LLMOut:
    """What an LLM call returns to the agent (the engine's counts; the text is the program's)."""

    prompt_tokens: int
    cached_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class ToolCall:
    """One EMULATED tool call: sleeps ``emulated_s`` x the run's time scale, returns ``answer``."""

    kind: str  # file_io, code_exec, web_api, db_query (kv/runtime/tool_latency's kinds)
    emulated_s: float
    answer: str = ""


@dataclass
class Stamp:
    """Four times of one call (see the module docstring) and what it was."""

    what: str  # "llm:<role>", "tool:<kind>", "agent:<role>"
    issued: float
    started: float
    ended: float
    returned: float
    inner_overhead_s: float = 0.0  # an agent's: overhead of the calls it made, in sequence

    @property
    def overhead_s(self) -> float:
        """Framework overhead of this call: before its body, after it, and inside (agents)."""
        return max(0.0, self.started - self.issued) + max(0.0, self.returned - self.ended) + self.inner_overhead_s


class Ctx(Protocol):
    """What an agent function sees: blocking LLM and tool calls in its session."""

    session: str

    def llm(self, call: LLMCall) -> LLMOut: ...

    def tool(self, call: ToolCall) -> str: ...


@dataclass
class AgentResult(Generic[T]):
    """An agent's return value with the times of its body (stamped where it ran)."""

    value: T
    started: float
    ended: float
    inner_overhead_s: float
    llm: list[LLMOut] = field(default_factory=list)
    parts: dict = field(default_factory=dict)  # inner_overhead_s by part (``Recorder.parts``)


class Handle(Protocol[T]):
    """A started agent; :meth:`Runtime.gather` waits for it."""


class Runtime(Protocol):
    """What a request's program sees (it runs where the variant drives requests); ``rec`` holds
    the request's accounting (:class:`Recorder`) for the runner."""

    session: str
    rec: "Recorder"

    def agent(self, role: str, fn: Callable[..., T], *args: Any) -> Handle[T]:
        """Start ``fn(ctx, *args)`` as the agent ``role`` of this session; returns at once."""
        ...

    def gather(self, handles: list[Handle[T]]) -> list[T]:
        """Wait for the agents; their values in order. Adds the critical branch's overhead."""
        ...

    def think(self, seconds: float) -> None:
        """A user's pause of ``seconds`` emulated seconds (think time between turns)."""
        ...


def call(rt: Runtime, role: str, fn: Callable[..., T], *args: Any) -> T:
    """Run one agent and wait for it."""
    return rt.gather([rt.agent(role, fn, *args)])[0]


class Recorder:
    """Per-request accounting every runtime shares: the critical path's overhead, LLM counts."""

    def __init__(self) -> None:
        self.overhead_s = 0.0
        self.parts: dict[str, float] = {}  # overhead_s by part: agent/llm/tool, _in (before the body) or _out
        self.llm: list[LLMOut] = []
        self.calls = 0

    def add_gather(self, issued: list[float], results: list[AgentResult], returned: float) -> None:
        """Account a gather: the branch whose body ended last is the critical one."""
        if not results:
            return
        i = max(range(len(results)), key=lambda j: results[j].ended)
        r = results[i]
        self.overhead_s += Stamp("agent", issued[i], r.started, r.ended, returned, r.inner_overhead_s).overhead_s
        add_part(self.parts, "agent", issued[i], r.started, r.ended, returned)
        for k, v in r.parts.items():
            self.parts[k] = self.parts.get(k, 0.0) + v
        for x in results:
            self.llm.extend(x.llm)
            self.calls += 1


class AgentClock:
    """Inside an agent: the body's start, and the overhead of the calls it makes in sequence."""

    def __init__(self) -> None:
        self.started = time.time()
        self.overhead_s = 0.0
        self.parts: dict[str, float] = {}
        self.llm: list[LLMOut] = []

    def add(self, issued: float, started: float, ended: float, returned: float, kind: str = "llm") -> None:
        """One call made in sequence (``kind``: ``llm`` or ``tool``), stamped four times."""
        self.overhead_s += max(0.0, started - issued) + max(0.0, returned - ended)
        add_part(self.parts, kind, issued, started, ended, returned)

    def result(self, value: Any) -> AgentResult:
        return AgentResult(value, self.started, time.time(), self.overhead_s, self.llm, self.parts)


def add_part(parts: dict, kind: str, issued: float, started: float, ended: float, returned: float) -> None:
    """Add one call's overhead to ``parts``: ``<kind>_in`` (issued -> started) and ``<kind>_out``
    (ended -> returned)."""
    parts[f"{kind}_in"] = parts.get(f"{kind}_in", 0.0) + max(0.0, started - issued)
    parts[f"{kind}_out"] = parts.get(f"{kind}_out", 0.0) + max(0.0, returned - ended)


class FuturesRuntime:
    """A request's :class:`Runtime` for every variant whose agent invocations are futures:
    ``start_agent(role, fn, args)`` starts one (a driver thread, a Dask task, a dask-agents
    component call, a LangGraph invocation) and returns something whose ``result()`` is the
    agent's :class:`AgentResult`."""

    def __init__(self, session: str, start_agent: Callable[[str, Callable, tuple], Any], time_scale: float):
        self.session, self._start, self.time_scale = session, start_agent, time_scale
        self.rec = Recorder()

    def agent(self, role: str, fn: Callable, *args: Any) -> tuple[float, Any]:
        return time.time(), self._start(role, fn, args)

    def gather(self, handles: list) -> list:
        results = [f.result() for _, f in handles]
        self.rec.add_gather([t for t, _ in handles], results, time.time())
        return [r.value for r in results]

    def think(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds * self.time_scale)


def sleep_tool(call: ToolCall, time_scale: float) -> tuple[str, float, float]:
    """The body of every EMULATED tool: sleep ``emulated_s * time_scale``; returns the answer and
    the body's start and end (wall clock)."""
    t0 = time.time()
    slept = call.emulated_s * time_scale
    if slept > 0:
        time.sleep(slept)
    return call.answer, t0, time.time()


# -- what the runner hands every variant, and what it asks of workflows and variants -----------

@dataclass(frozen=True)
class Setup:
    """The resources of one run, identical for every variant (recorded in the run's config).

    ``engine``: the emulated engine's parameters (``EmulationParams`` fields, host tier
    included), ``replicas``: engine replicas (one per engine worker/actor/server), ``models``:
    model name -> replica count (sums to ``replicas``; one model unless the workflow routes
    between models), ``time_scale``: wall seconds per emulated second for engines and tools,
    ``max_model_len``: the engines' context limit, ``tool_threads``: threads for tools and
    agents per engine worker (peers: x replicas in one pool), ``entry``: the engines'
    ``agents.llm.models`` entry where they are not emulated (a REAL vLLM engine; ``engine``
    then holds its fitted cost shape, what the ideal bound uses)."""

    engine: dict
    replicas: int
    models: tuple = ((MODEL, 2),)
    time_scale: float = 1.0
    max_model_len: int = 131072
    tool_threads: int = 64
    entry: dict | None = None

    def engine_params(self) -> dict:
        """The engine parameters with this run's time scale (what every variant's engines get)."""
        return {**self.engine, "time_scale": self.time_scale}

    def model_names(self) -> list[str]:
        return [m for m, _ in self.models]

    def replica_models(self) -> list[str]:
        """The model each replica hosts, replica by replica."""
        return [m for m, n in self.models for _ in range(n)]

    def describe(self) -> dict:
        return {"engine": dict(self.engine), "replicas": self.replicas, "models": dict(self.models),
                "time_scale": self.time_scale, "max_model_len": self.max_model_len,
                "tool_threads": self.tool_threads, **({"entry": dict(self.entry)} if self.entry else {})}


class Workflow(Protocol):
    """One workflow (``benchmarks/e2e/workflows/<name>.py`` exposes ``WORKFLOW``): ``scenarios``
    it runs under, ``shared_prefix`` (the system prompt every session shares: the ideal bound's
    perfect cache holds it), optionally ``models`` (default ``("coder",)``) and
    ``arrivals(scenario, n, rate, seed)`` (default: Poisson, or MMPP for ``bursty``)."""

    name: str
    scenarios: tuple
    shared_prefix: str

    def make_specs(self, n: int, seed: int, scenario: str) -> list:
        """``n`` requests with every random draw made (ids unique to the seed)."""
        ...

    def program(self, rt: Runtime, spec: Any) -> Any:
        """What one request does."""
        ...

    def check(self, spec: Any, value: Any) -> None:
        """Raise if a request's result is not what its spec says it must be."""
        ...

    def think_s(self, spec: Any) -> float:
        """Emulated seconds of user think time in the request (left out of its latency)."""
        ...


class Variant(Protocol):
    """One framework/configuration under test; a context manager that starts and stops it."""

    name: str

    def __enter__(self) -> "Variant": ...

    def __exit__(self, *exc: Any) -> None: ...

    def session(self, session_id: str, models: tuple | None = None) -> Any:
        """A context manager yielding the :class:`Runtime` of one request (its session);
        ``models``: the models it will call (None: any of the run's)."""
        ...

    def engine_stats(self) -> list[dict]:
        """Every engine's counters now (``EmulatedEngineHost.stats()``), replica order."""
        ...

    def describe(self) -> dict:
        """What was run: the Setup as the variant applied it, and the variant's own knobs."""
        ...
