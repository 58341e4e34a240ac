"""Open-SWE as coding agents run it today: long contexts that grow with every tool observation,
outputs of hundreds of tokens, tools from milliseconds to minutes.

One request is one issue (one session):

- **planner**: reads the issue and the repository context (8-20k tokens, seeded per issue) under
  a shared system prompt, writes a plan (300-800 output tokens);
- **developers**, one per subtask (2-4), in parallel: each runs a ReAct loop of 4-8 steps: an
  LLM call (100-400 output tokens: its next action) then a tool (a file tool in 60% of steps,
  a code run otherwise), whose observation (0.5-4k tokens) is appended to the agent's
  transcript, so each call's prompt is the previous call's prompt + its output + the
  observation: contexts grow from ~10-22k to 30-60k tokens;
- **tester**: reviews every developer's final patch (the tail of its transcript) under the plan
  (100-300 output tokens), then runs the test suite (seconds to minutes);
- on a failing round (seeded, probability 0.35, at most 3 retries) the failing developer
  resumes its own transcript with the failure log (1-3k tokens) for 2-4 more steps, and the
  tester runs again.

Tool latencies (emulated seconds, :class:`ToolLatency` through P50/P95/P99):

- ``file_io`` (read, grep, edit): 2 / 45 / 320 ms, so with 60% of tool calls on files about a
  third of all tool calls finish within 3 ms (Nalar: "over 30% of tool calls finish within 3
  ms");
- ``code_exec`` (a developer's snippet run): SAGA's code_exec prior, 180 / 2,400 / 28,000 ms;
- ``test_run`` (the tester's suite): 15 / 120 / 360 s, heavy-tailed to minutes (Nalar: "some
  over 5 minutes"; a repository's test suite, not a snippet).

Output lengths by role follow Copilot's coding-agent sessions (~530 output tokens per call on
~68k-token prompts, 86% cached: ../shared/notes/realistic-regime.md) scaled to these shorter
sessions. Text is seeded synthetic code-like ASCII (one character is one token of the engines'
byte tokenizer); an LLM call's output in the transcript is the spec's text of the call's
``max_tokens`` length, so every variant builds identical prompts. Every random draw is made up
front in :func:`make_specs`.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from dataclasses import dataclass

from dask_agents.kv.runtime.tool_latency import ToolLatency, prior

from benchmarks.e2e.program import LLMCall, Runtime, ToolCall, call
from benchmarks.e2e.workflows.text import synthetic_text

SYSTEM_TOKENS = 1200  # the shared system prompt (tool descriptions, rules)
SYSTEM = synthetic_text("swe-system", SYSTEM_TOKENS)
CONTEXT_TOKENS = (8_000, 20_000)
PLAN_TOKENS = (300, 800)
STEP_TOKENS = (100, 400)
REVIEW_TOKENS = (100, 300)
OBSERVATION_TOKENS = (500, 4_000)
LOG_TOKENS = (1_000, 3_000)
SUBTASKS = (2, 4)
STEPS = (4, 8)
RETRY_STEPS = (2, 4)
FILE_SHARE = 0.6
FAIL_PROBABILITY = 0.35
MAX_RETRIES = 3
TOOLS = {"file_io": ToolLatency.from_ms(2, 45, 320), "code_exec": prior("code_exec"),
         "test_run": ToolLatency.from_ms(15_000, 120_000, 360_000)}
PHASE_CONTEXT_FACTOR = 2.0  # the phase scenario: the second half's repository context, x the drawn one


@dataclass(frozen=True)
class Step:
    """One ReAct step of a developer: its output length, tool kind, latency and observation length."""

    out: int
    tool: str
    tool_s: float
    obs: int


@dataclass(frozen=True)
class Spec:
    """One Open-SWE request with every draw made. ``steps[k][a]``: developer ``k``'s steps at
    attempt ``a``; ``failing[r]``: the subtask failing round ``r`` (None: passed); ``system``:
    the system prompt's length."""

    id: str
    seed: int
    context: int
    plan: int
    steps: tuple
    review: tuple
    test_s: tuple
    failing: tuple
    logs: tuple
    system: int = SYSTEM_TOKENS

    @property
    def retries(self) -> int:
        return len(self.failing) - 1


def _steps(rng: random.Random, n: int) -> tuple:
    out = []
    for _ in range(n):
        kind = "file_io" if rng.random() < FILE_SHARE else "code_exec"
        out.append(Step(rng.randint(*STEP_TOKENS), kind, TOOLS[kind].sample(rng), rng.randint(*OBSERVATION_TOKENS)))
    return tuple(out)


def make_spec(rid: str, seed: int, tokens: float = 1.0, tools: float = 1.0) -> Spec:
    """One request from its seed (a pure function of the arguments). ``tokens`` and ``tools``
    scale every length and tool latency after the draws (the same draws at every scale: a
    smaller engine, ``benchmarks/e2e_real.py``, gets the same requests shrunk)."""
    rng = random.Random(f"swe-{seed}")
    n = rng.randint(*SUBTASKS)
    failing: list = []
    for _ in range(MAX_RETRIES):
        if rng.random() >= FAIL_PROBABILITY:
            break
        failing.append(rng.randrange(n))
    failing.append(None)
    attempts = [1] * n
    for k in failing[:-1]:
        attempts[k] += 1
    steps = tuple(tuple(_steps(rng, rng.randint(*(STEPS if a == 0 else RETRY_STEPS))) for a in range(attempts[k]))
                  for k in range(n))
    rounds = len(failing)
    spec = Spec(rid, seed, rng.randint(*CONTEXT_TOKENS), rng.randint(*PLAN_TOKENS), steps,
                tuple(rng.randint(*REVIEW_TOKENS) for _ in range(rounds)),
                tuple(TOOLS["test_run"].sample(rng) for _ in range(rounds)), tuple(failing),
                tuple(rng.randint(*LOG_TOKENS) for _ in range(rounds)))
    return spec if (tokens, tools) == (1.0, 1.0) else scaled(spec, tokens, tools)


def scaled(spec: Spec, tokens: float, tools: float) -> Spec:
    """``spec`` with every length x ``tokens`` (at least one token) and every tool latency x ``tools``."""
    n = lambda x: max(1, round(x * tokens))  # noqa: E731
    steps = tuple(tuple(tuple(Step(n(st.out), st.tool, st.tool_s * tools, n(st.obs)) for st in att) for att in dev)
                  for dev in spec.steps)
    return dataclasses.replace(spec, context=n(spec.context), plan=n(spec.plan), steps=steps,
                               review=tuple(n(x) for x in spec.review), test_s=tuple(x * tools for x in spec.test_s),
                               logs=tuple(n(x) for x in spec.logs), system=n(spec.system))


# -- prompts: pure functions of the spec ----------------------------------------------------------

@functools.lru_cache(maxsize=4096)
def _head(spec: Spec) -> str:
    system = SYSTEM if spec.system == SYSTEM_TOKENS else synthetic_text("swe-system", spec.system)
    return f"{system}\nSession {spec.id}\nIssue {spec.seed}:\n" + synthetic_text(f"ctx-{spec.seed}", spec.context)


def plan_prompt(spec: Spec) -> str:
    return _head(spec) + "\nPlan the subtasks."


def _after_plan(spec: Spec) -> str:
    return plan_prompt(spec) + synthetic_text(f"plan-{spec.seed}", spec.plan)


def dev_prompts(spec: Spec, k: int, attempt: int) -> list[str]:
    """Developer ``k``'s prompts at ``attempt``, step by step (each extends the one before)."""
    text = _after_plan(spec) + f"\nSubtask {k}: implement it.\n"
    out = []
    for a in range(attempt + 1):
        if a > 0:  # a retry resumes the transcript with the failure log
            r = [i for i, f in enumerate(spec.failing) if f == k][a - 1]
            text += "\nTests failed:\n" + synthetic_text(f"log-{spec.seed}-{r}", spec.logs[r]) + "\nFix it.\n"
        for j, st in enumerate(spec.steps[k][a]):
            if a == attempt:
                out.append(text)
            text += synthetic_text(f"act-{spec.seed}-{k}-{a}-{j}", st.out) + "\nObservation:\n" + \
                synthetic_text(f"obs-{spec.seed}-{k}-{a}-{j}", st.obs) + "\n"
    return out


def patch_of(spec: Spec, k: int, attempt: int) -> str:
    """Developer ``k``'s final patch at ``attempt``: its last action's text."""
    j = len(spec.steps[k][attempt]) - 1
    return synthetic_text(f"act-{spec.seed}-{k}-{attempt}-{j}", spec.steps[k][attempt][j].out)


def review_prompt(spec: Spec, attempts: list[int]) -> str:
    patches = "".join(f"\nPatch {k}:\n{patch_of(spec, k, a)}" for k, a in enumerate(attempts))
    return _after_plan(spec) + patches + "\nReview the patches."


# -- the agents and the program -------------------------------------------------------------------

def planner(ctx, spec: Spec) -> int:
    ctx.llm(LLMCall(ctx.session, "planner", plan_prompt(spec), spec.plan))
    return len(spec.steps)


def developer(ctx, spec: Spec, k: int, attempt: int) -> int:
    for j, (prompt, st) in enumerate(zip(dev_prompts(spec, k, attempt), spec.steps[k][attempt])):
        ctx.llm(LLMCall(ctx.session, "developer", prompt, st.out))
        obs = synthetic_text(f"obs-{spec.seed}-{k}-{attempt}-{j}", st.obs)
        ctx.tool(ToolCall(st.tool, st.tool_s, obs))
    return attempt


def tester(ctx, spec: Spec, attempts: list[int], rnd: int) -> int | None:
    ctx.llm(LLMCall(ctx.session, "tester", review_prompt(spec, attempts), spec.review[rnd]))
    ctx.tool(ToolCall("test_run", spec.test_s[rnd], f"round {rnd}"))
    return spec.failing[rnd]


def program(rt: Runtime, spec: Spec) -> dict:
    n = call(rt, "planner", planner, spec)
    attempts = rt.gather([rt.agent("developer", developer, spec, k, 0) for k in range(n)])
    rnd = 0
    failing = call(rt, "tester", tester, spec, attempts, rnd)
    while failing is not None:
        attempts[failing] = call(rt, "developer", developer, spec, failing, attempts[failing] + 1)
        rnd += 1
        failing = call(rt, "tester", tester, spec, attempts, rnd)
    return {"rounds": rnd + 1, "attempts": list(attempts)}


def check(spec: Spec, value: dict) -> None:
    want = {"rounds": len(spec.failing), "attempts": [len(s) - 1 for s in spec.steps]}
    if value != want:
        raise AssertionError(f"{spec.id}: outcome {value} differs from the spec's {want}")


def phase(specs: list[Spec], max_len: int) -> list[Spec]:
    """The phase scenario: the second half's repository contexts x PHASE_CONTEXT_FACTOR (cut back
    where a prompt would not fit ``max_len``)."""
    half = len(specs) // 2
    out = list(specs[:half])
    for s in specs[half:]:
        new = dataclasses.replace(s, context=int(s.context * PHASE_CONTEXT_FACTOR))
        over = longest_prompt(new) + 1024 - max_len
        out.append(dataclasses.replace(new, context=new.context - over) if over > 0 else new)
    return out


def longest_prompt(spec: Spec) -> int:
    return max(len(p) for k in range(len(spec.steps)) for a in range(len(spec.steps[k]))
               for p in dev_prompts(spec, k, a))


def max_output(spec: Spec) -> int:
    return max([spec.plan, *spec.review, *(st.out for dev in spec.steps for att in dev for st in att)])


class SWE:
    """The workflow object the runner uses (``benchmarks/e2e/program.py``'s Workflow).
    ``tokens``/``tools``: every length / tool latency scaled (:func:`scaled`; 1: the realistic
    regime); ``max_len``: the engines' context limit, which every prompt plus its output must fit."""

    scenarios = ("stationary", "bursty", "phase")

    def __init__(self, tokens: float = 1.0, tools: float = 1.0, max_len: int = 131072):
        self.tokens, self.tools, self.max_len = tokens, tools, max_len
        self.name = "swe" if (tokens, tools) == (1.0, 1.0) else f"swe-x{tokens:g}"
        # cached on every engine once warm: the ideal bound's perfect cache has it
        self.shared_prefix = synthetic_text("swe-system", max(1, round(SYSTEM_TOKENS * tokens)))

    def make_specs(self, n: int, seed: int, scenario: str) -> list[Spec]:
        specs = [make_spec(f"swe-s{seed}-{i:04d}", seed * 100_003 + i, self.tokens, self.tools) for i in range(n)]
        specs = phase(specs, self.max_len) if scenario == "phase" else specs
        for s in specs:
            if longest_prompt(s) + max_output(s) > self.max_len:
                raise ValueError(f"{s.id}: a prompt of {longest_prompt(s)} tokens and its output do not fit "
                                 f"{self.max_len} positions")
        return specs

    program = staticmethod(program)
    check = staticmethod(check)

    def think_s(self, spec: Spec) -> float:
        return 0.0


WORKFLOW = SWE()
