"""A router between two models over the Azure LLM inference trace 2023's skew shifts, in the
realistic regime: contexts of thousands of tokens, outputs of hundreds.

One request is one session. A **classifier** on ``coder`` reads the request (shared system prompt
of ~1,000 tokens + the request text, 500-2,000 tokens) and answers with a route (5-20 output
tokens); then

- the **chat branch** (a ``conversation`` row of the trace): one call on ``chat`` whose prompt
  is the conversation so far + the request, the trace row's ``ContextTokens`` x 4 clipped into
  2-12k tokens, and whose output is the row's ``GeneratedTokens`` clipped into 100-800;
- the **coding branch** (a ``code`` row): a draft on ``coder`` (prompt and output from the row as
  above), an EMULATED ``code_exec`` tool (SAGA's code_exec prior, P50/P95/P99
  180 / 2,400 / 28,000 ms: ``prior("code_exec")``) whose output (100-1,000 tokens) is appended,
  then a final answer on ``coder`` (100-300 output tokens) whose prompt extends the draft's
  (draft prompt + draft + the run's output).

The trace (``examples.router.trace``: ``AzureLLMInferenceTrace_code.csv`` and ``_conv.csv``
shipped in ``dask_agents/data/traces/azure-llm-2023``; Azure Public Dataset, CC-BY 4.0; Patel et
al., Splitwise, ISCA 2024) gives the labels, sizes and arrival times. Its 2023 contexts are short
(medians ~1.5k code, ~1k conversation tokens; generated medians 13 and 129), so the sizes are
scaled (x4, clipped) into the regime of today's long-context chats and coding assistants, keeping
each service's relative spread. Scenario ``skew`` (the previous harness's):
``skewed(trace, n, phases=3, dominance=0.95, first="code", start_s=260)``: three equal phases,
coding-dominant, chat-dominant, coding-dominant, each >= 95% its dominant label; each request
takes the next unused trace row of its label (from trace second 260 on, where both services are
active) and the trace's own arrival times. :meth:`Router.arrivals` replays those times at the
offered rate: each phase's trace gaps are rescaled so the phase's mean rate is the offered rate
(relative timing inside a phase kept, bursts included; no Poisson draw), the next phase starting
one mean gap after.

Every draw is made up front in :func:`make_specs`; prompts are pure functions of the spec; text
is seeded synthetic ASCII (one character is one token); a coding request's text is fenced
(```), a chat request's never is, and the classifier's route is that fence rule (an emulated
model answers nothing meaningful), so a request's branch is always its trace label.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

from dask_agents.kv.runtime.tool_latency import prior

from benchmarks.e2e.program import LLMCall, Runtime, ToolCall, call
from benchmarks.e2e.workflows.text import synthetic_text

SYSTEM = synthetic_text("router-system", 1000)  # the application's shared system prompt
MODELS = ("chat", "coder")
FENCE = "```"
TEXT_TOKENS = (500, 2_000)  # the request text: the row's ContextTokens clipped
CONTEXT_SCALE, CONTEXT_TOKENS = 4, (2_000, 12_000)  # a branch prompt: ContextTokens x 4, clipped
OUTPUT_TOKENS = (100, 800)  # chat answer / code draft: the row's GeneratedTokens clipped
ROUTE_TOKENS = (5, 20)
RESULT_TOKENS = (100, 1_000)  # the code run's output
FINAL_TOKENS = (100, 300)
CODE_EXEC = prior("code_exec")
PHASES, DOMINANCE, TRACE_START_S = 3, 0.95, 260.0


@dataclass(frozen=True)
class Spec:
    """One Router request with every draw made. ``label``: the trace's (``code`` /
    ``conversation``); ``at``: its trace arrival (s from the first of the sequence); ``trace_ctx``
    / ``trace_gen``: the row's counts; ``text``, ``context``, ``out``: the request text, the
    branch prompt's body and the branch's (first) output, in tokens; ``tool_s``, ``result``,
    ``final``: the coding branch's code_exec latency (emulated s), its output and the final
    answer's length (0 on the chat branch)."""

    id: str
    seed: int
    label: str
    phase: int
    at: float
    trace_ctx: int
    trace_gen: int
    text: int
    context: int
    route: int
    out: int
    tool_s: float
    result: int
    final: int

    @property
    def branch(self) -> str:
        return "code" if self.label == "code" else "chat"


def _clip(x: int, bounds: tuple) -> int:
    return max(bounds[0], min(bounds[1], x))


@functools.lru_cache(maxsize=1)
def _trace():
    from examples.router.trace import Trace

    return Trace.load()


def trace_start(seed: int) -> float:
    """Where seed ``seed``'s requests start in the trace: its own 100 s window (the trace has ~8
    arrivals/s, so a point's requests fit in it), measure seeds (< 1000) in windows 0-24, the
    choose phase's sweep seeds (>= 1000) in windows 28-31: no measured request is a sweep's."""
    window = seed % 25 if seed < 1000 else 28 + (seed - 1000) % 4
    return TRACE_START_S + 100.0 * window


@functools.lru_cache(maxsize=64)
def _skewed(n: int, seed: int):
    from examples.router.trace import skewed

    return skewed(_trace(), n, phases=PHASES, dominance=DOMINANCE, first="code", seed=seed,
                  start_s=trace_start(seed))


def make_spec(rid: str, seed: int, row) -> Spec:
    """One request from its trace row and seed (a pure function of the arguments)."""
    rng = random.Random(f"router-{seed}")
    code = row.label == "code"
    return Spec(rid, seed, row.label, row.phase, row.at, row.context_tokens, row.generated_tokens,
                _clip(row.context_tokens, TEXT_TOKENS), _clip(row.context_tokens * CONTEXT_SCALE, CONTEXT_TOKENS),
                rng.randint(*ROUTE_TOKENS), _clip(row.generated_tokens, OUTPUT_TOKENS),
                CODE_EXEC.sample(rng) if code else 0.0, rng.randint(*RESULT_TOKENS) if code else 0,
                rng.randint(*FINAL_TOKENS) if code else 0)


# -- prompts: pure functions of the spec ----------------------------------------------------------

def request_text(spec: Spec) -> str:
    if spec.branch != "code":
        return synthetic_text(f"rt-text-{spec.seed}", spec.text)
    return f"{FENCE}\n{synthetic_text(f'rt-text-{spec.seed}', spec.text - 2 * len(FENCE) - 2)}\n{FENCE}"


def route_of(text: str) -> str:
    return "code" if FENCE in text else "chat"


def classifier_prompt(spec: Spec) -> str:
    return (f"{SYSTEM}\nSession {spec.id}\nRoute the request: answer code or chat.\nRequest:\n"
            f"{request_text(spec)}\nRoute:")


@functools.lru_cache(maxsize=4096)
def branch_prompt(spec: Spec) -> str:
    """The chat call's or the draft's prompt: the conversation so far, then the request."""
    who = "the coding assistant: write code that runs" if spec.branch == "code" else "the chat assistant"
    history = synthetic_text(f"rt-history-{spec.seed}", spec.context - spec.text)
    return (f"{SYSTEM}\nSession {spec.id}\nYou are {who}.\nConversation:\n{history}\nUser:\n"
            f"{request_text(spec)}\nAssistant:")


def final_prompt(spec: Spec) -> str:
    return (branch_prompt(spec) + synthetic_text(f"rt-draft-{spec.seed}", spec.out) + "\nCode ran, output:\n"
            + synthetic_text(f"rt-result-{spec.seed}", spec.result) + "\nFinal answer:")


def prompts(spec: Spec) -> list[str]:
    """Every LLM call's prompt, in program order."""
    return [classifier_prompt(spec), branch_prompt(spec)] + ([final_prompt(spec)] if spec.branch == "code" else [])


def models_of(spec: Spec) -> tuple:
    """The models a request's calls use, in order of first use."""
    return ("coder",) if spec.branch == "code" else ("coder", "chat")


# -- the agents and the program -------------------------------------------------------------------

def classifier(ctx, spec: Spec) -> str:
    ctx.llm(LLMCall(ctx.session, "classifier", classifier_prompt(spec), spec.route, model="coder"))
    return route_of(request_text(spec))


def chatter(ctx, spec: Spec) -> int:
    ctx.llm(LLMCall(ctx.session, "chat", branch_prompt(spec), spec.out, model="chat"))
    return 1


def coder(ctx, spec: Spec) -> int:
    ctx.llm(LLMCall(ctx.session, "coder", branch_prompt(spec), spec.out, model="coder"))
    ctx.tool(ToolCall("code_exec", spec.tool_s, synthetic_text(f"rt-result-{spec.seed}", spec.result)))
    ctx.llm(LLMCall(ctx.session, "coder", final_prompt(spec), spec.final, model="coder"))
    return 2


def program(rt: Runtime, spec: Spec) -> dict:
    branch = call(rt, "classifier", classifier, spec)
    calls = call(rt, "coder", coder, spec) if branch == "code" else call(rt, "chat", chatter, spec)
    return {"branch": branch, "calls": 1 + calls}


def check(spec: Spec, value: dict) -> None:
    want = {"branch": spec.branch, "calls": 3 if spec.branch == "code" else 2}
    if value != want:
        raise AssertionError(f"{spec.id}: outcome {value} differs from the spec's {want}")


def phase_offsets(at: list[float], phase: list[int], rate: float) -> list[float]:
    """Trace arrival times at ``rate``/s: each phase's gaps rescaled to a mean rate of ``rate``,
    the next phase one mean gap (``1 / rate``) after the last arrival of the one before."""
    out: list[float] = []
    for k in sorted(set(phase)):
        ts = [a for a, p in zip(at, phase) if p == k]
        span = ts[-1] - ts[0]
        start = out[-1] + 1 / rate if out else 0.0
        out += [start + ((t - ts[0]) * (len(ts) - 1) / rate / span if span > 0 else i / rate)
                for i, t in enumerate(ts)]
    return out


class Router:
    """The workflow object the runner uses (``benchmarks/e2e/program.py``'s Workflow)."""

    name = "router"
    scenarios = ("skew",)
    models = MODELS
    shared_prefix = SYSTEM

    def make_specs(self, n: int, seed: int, scenario: str = "skew") -> list[Spec]:
        if scenario not in self.scenarios:
            raise ValueError(f"unknown scenario {scenario!r} (known: {', '.join(self.scenarios)})")
        rows = _skewed(max(n, PHASES), seed)[:n]  # fewer than PHASES requests: the first phases' first
        return [make_spec(f"router-s{seed}-{i:04d}", seed * 100_003 + i, row) for i, row in enumerate(rows)]

    def arrivals(self, scenario: str, n: int, rate: float, seed: int) -> list[float]:
        """Offsets (emulated s) at ``rate``/s following the trace's timing in each phase."""
        specs = self.make_specs(n, seed, scenario)
        return phase_offsets([s.at for s in specs], [s.phase for s in specs], rate)

    program = staticmethod(program)
    check = staticmethod(check)
    models_of = staticmethod(models_of)

    def think_s(self, spec: Spec) -> float:
        return 0.0


WORKFLOW = Router()
