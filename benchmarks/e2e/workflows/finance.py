"""A financial analyst with follow-ups, in the realistic regime: long filings as context,
outputs of hundreds of tokens, a user who reads the summary before asking more.

One request is one client's session:

- **analysts**, one per aspect (3-5 of revenue, profitability, risk, cash flow, valuation), in
  parallel: each runs a ``db_query`` tool call (SAGA's db_query prior, P50/P95/P99
  120 / 890 / 3,500 ms: ``prior("db_query")``, ``dask_agents.kv.runtime.tool_latency``) whose
  answer (200-1,000 tokens of rows) goes into an LLM call over the company's report context
  (annual report + notes, 6-16k tokens, seeded per request) under a shared system prompt of
  ~1,000 tokens; each analysis is 200-500 output tokens;
- **summarizer**: one LLM call over the report and every analysis (300-700 output tokens);
- **follow-ups**: 1-3 questions from the user, each AFTER A HUMAN THINK TIME of 20-120 s,
  log-uniform (median sqrt(20 x 120) ≈ 49 s, near the Mooncake conversation trace's inter-turn
  gap P50 ≈ 54 s: ../shared/notes/realistic-regime.md; its P90 ≈ 279 s tail is cut at 120 s to
  keep runs short). Each follow-up is one LLM call whose prompt is the previous call's prompt +
  its output + the question (20-200 tokens), 150-400 output tokens. So whether the session's
  KV survived the user's pause decides the follow-up's prefill: ~0.1-0.6k tokens where it did,
  the whole 10-25k-token history where it did not (0.4-1 s of prefill at the engine's cost).

The think time (:meth:`Finance.think_s`) is left out of the request's latency by the runner and
by :func:`benchmarks.e2e.ideal.ideal`. Output lengths are those of analyst-style reports
(hundreds of tokens, as Copilot's ~530 output tokens per call in realistic-regime.md); they
are drawn up front, and an LLM call's output in the history is the spec's seeded text of the
call's ``max_tokens`` length, so every variant builds identical prompts. Text is seeded
synthetic ASCII (:mod:`benchmarks.e2e.workflows.text`; one character is one token).
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass

from dask_agents.kv.runtime.tool_latency import prior

from benchmarks.e2e.program import LLMCall, Runtime, ToolCall, call
from benchmarks.e2e.workflows.text import synthetic_text

SYSTEM = synthetic_text("finance-system", 1000)  # the shared system prompt (role, house style, tools)
ASPECTS = ("revenue", "profitability", "risk", "cash flow", "valuation")
COMPANIES = ("Acme Corp", "Globex", "Initech", "Umbrella plc", "Stark Industries", "Wayne Enterprises",
             "Hooli", "Soylent", "Tyrell", "Cyberdyne")
REPORT_TOKENS = (6_000, 16_000)  # annual report + notes to the financial statements
ROWS_TOKENS = (200, 1_000)  # one db_query answer
ANALYSIS_TOKENS = (200, 500)
SUMMARY_TOKENS = (300, 700)
QUESTION_TOKENS = (20, 200)
ANSWER_TOKENS = (150, 400)
ANALYSTS = (3, 5)
FOLLOW_UPS = (1, 3)
THINK_S = (20.0, 120.0)  # log-uniform: the user's pause before each follow-up (emulated s)
DB_QUERY = prior("db_query")


@dataclass(frozen=True)
class Spec:
    """One Financial Analyst request with every draw made. ``aspects[k]`` is analyst ``k``'s;
    ``db_s``/``rows``/``analysis`` are per analyst; ``questions``/``think``/``answers`` per
    follow-up (``think[j]``: the user's pause before question ``j``, emulated s)."""

    id: str
    seed: int
    company: str
    report: int
    aspects: tuple
    db_s: tuple
    rows: tuple
    analysis: tuple
    summary: int
    questions: tuple
    think: tuple
    answers: tuple


def make_spec(rid: str, seed: int) -> Spec:
    """One request from its seed (a pure function of the arguments)."""
    rng = random.Random(f"finance-{seed}")
    n = rng.randint(*ANALYSTS)
    aspects = tuple(sorted(rng.sample(range(len(ASPECTS)), n)))
    m = rng.randint(*FOLLOW_UPS)
    lo, hi = math.log(THINK_S[0]), math.log(THINK_S[1])
    return Spec(rid, seed, rng.choice(COMPANIES), rng.randint(*REPORT_TOKENS),
                tuple(ASPECTS[a] for a in aspects),
                tuple(DB_QUERY.sample(rng) for _ in range(n)),
                tuple(rng.randint(*ROWS_TOKENS) for _ in range(n)),
                tuple(rng.randint(*ANALYSIS_TOKENS) for _ in range(n)),
                rng.randint(*SUMMARY_TOKENS),
                tuple(rng.randint(*QUESTION_TOKENS) for _ in range(m)),
                tuple(math.exp(rng.uniform(lo, hi)) for _ in range(m)),
                tuple(rng.randint(*ANSWER_TOKENS) for _ in range(m)))


# -- prompts: pure functions of the spec ----------------------------------------------------------

@functools.lru_cache(maxsize=4096)
def context(spec: Spec) -> str:
    """System prompt, the session (first request-specific text), the report and its notes."""
    return (f"{SYSTEM}\nSession {spec.id}\n=== Annual report: {spec.company} ===\n"
            + synthetic_text(f"fin-report-{spec.seed}", spec.report) + "\n=== End of report ===\n")


def rows_of(spec: Spec, k: int) -> str:
    """The db_query answer of analyst ``k`` (what the tool returns, in every variant)."""
    return synthetic_text(f"fin-rows-{spec.seed}-{k}", spec.rows[k])


def analyst_prompt(spec: Spec, k: int) -> str:
    a = spec.aspects[k]
    return context(spec) + f"Database ({a}):\n{rows_of(spec, k)}\nTask: analyse the company's {a}.\nAnalysis:"


def analysis_text(spec: Spec, k: int) -> str:
    return synthetic_text(f"fin-analysis-{spec.seed}-{k}", spec.analysis[k])


def summary_prompt(spec: Spec) -> str:
    found = "".join(f"- {a}:\n{analysis_text(spec, k)}\n" for k, a in enumerate(spec.aspects))
    return context(spec) + "Analysts' findings:\n" + found + "Write the investment summary:"


def followup_prompts(spec: Spec) -> list[str]:
    """Every follow-up's prompt: the previous call's prompt + its output + the question."""
    prev, out_text = summary_prompt(spec), synthetic_text(f"fin-summary-{spec.seed}", spec.summary)
    out = []
    for j, q in enumerate(spec.questions):
        prev = prev + out_text + "\nClient: " + synthetic_text(f"fin-q-{spec.seed}-{j}", q) + "\nAnswer:"
        out.append(prev)
        out_text = synthetic_text(f"fin-answer-{spec.seed}-{j}", spec.answers[j])
    return out


def prompts(spec: Spec) -> list[str]:
    """Every LLM call's prompt, in program order (analysts, summary, follow-ups)."""
    return [analyst_prompt(spec, k) for k in range(len(spec.aspects))] + [summary_prompt(spec)] + \
        followup_prompts(spec)


# -- the agents and the program -------------------------------------------------------------------

def analyst(ctx, spec: Spec, k: int) -> int:
    ctx.tool(ToolCall("db_query", spec.db_s[k], rows_of(spec, k)))  # the rows are in the prompt
    ctx.llm(LLMCall(ctx.session, "analyst", analyst_prompt(spec, k), spec.analysis[k]))
    return k


def summarizer(ctx, spec: Spec, analyses: list[int]) -> int:
    ctx.llm(LLMCall(ctx.session, "summarizer", summary_prompt(spec), spec.summary))
    return len(analyses)


def follow_up(ctx, spec: Spec, j: int) -> int:
    ctx.llm(LLMCall(ctx.session, "follow_up", followup_prompts(spec)[j], spec.answers[j]))
    return j


def program(rt: Runtime, spec: Spec) -> dict:
    analyses = rt.gather([rt.agent("analyst", analyst, spec, k) for k in range(len(spec.aspects))])
    summarized = call(rt, "summarizer", summarizer, spec, analyses)
    answered = []
    for j, pause in enumerate(spec.think):
        rt.think(pause)  # the user reads, then asks (same session)
        answered.append(call(rt, "follow_up", follow_up, spec, j))
    return {"analyses": analyses, "summarized": summarized, "follow_ups": answered}


def check(spec: Spec, value: dict) -> None:
    n, m = len(spec.aspects), len(spec.questions)
    want = {"analyses": list(range(n)), "summarized": n, "follow_ups": list(range(m))}
    if value != want:
        raise AssertionError(f"{spec.id}: outcome {value} differs from the spec's {want}")


class Finance:
    """The workflow object the runner uses (``benchmarks/e2e/program.py``'s Workflow)."""

    name = "finance"
    scenarios = ("stationary", "bursty")  # bursty: the runner's MMPP arrivals, same requests
    shared_prefix = SYSTEM

    def make_specs(self, n: int, seed: int, scenario: str = "stationary") -> list[Spec]:
        if scenario not in self.scenarios:
            raise ValueError(f"unknown scenario {scenario!r} (known: {', '.join(self.scenarios)})")
        return [make_spec(f"finance-s{seed}-{i:04d}", seed * 100_003 + i) for i in range(n)]

    program = staticmethod(program)
    check = staticmethod(check)

    def think_s(self, spec: Spec) -> float:
        return float(sum(spec.think))


WORKFLOW = Finance()
