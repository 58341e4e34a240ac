"""The Financial Analyst workflow (Nalar's FinQA-like evaluation): per request, one session in
which several analysts study one company's report in parallel, a summarizer combines their
findings, and then the user asks 1-2 follow-up questions after a think-time pause.

Every LLM prompt of a request starts with the same long context (a system prompt and the
company's report), so within a session the prefix is shared: the parallel analysts share it with
each other, and the follow-ups, which arrive after the pause in the SAME session, find it in the
KV cache of the worker that served the session (the scheduler routes a session's LLM calls
there). The analysts query a database with the EMULATED ``db_query`` tool
(:mod:`dask_agents.emulation`: it sleeps a latency drawn from SAGA's db_query prior times the
time scale ``agents.emulation.time-scale``).

Inputs are synthetic and deterministic in the seed: each company's report is a few hundred bytes
of generated text with made-up figures (with the byte tokenizer, one token per byte).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import dask_agents as da
from dask_agents.emulation import db_query_tool

SYSTEM = (
    "You are a financial analyst on an equity research team. Read the company report below, "
    "cite the figures you rely on, state uncertainty plainly and keep answers short.\n"
)
ASPECTS = ("revenue", "profitability", "risk", "cash-flow")
FOLLOW_UPS = (
    "How sensitive is next year's margin to a 10% drop in revenue?",
    "Is the dividend covered by free cash flow?",
    "Which risk would you watch most closely, and why?",
    "How does the debt maturity profile affect liquidity?",
    "What would change your recommendation?",
)
SECTORS = ("semiconductors", "retail", "logistics", "biotech", "utilities", "software")


@dataclass(frozen=True)
class FinanceRequest:
    """One user request: a company report to analyse, and the follow-ups the user will ask.

    ``think_s``: the user's pause before each follow-up, in seconds of the experiment (the
    workflow multiplies them by its ``time_scale``)."""

    id: str
    company: str
    report: str
    seed: int
    aspects: tuple[str, ...] = ASPECTS
    follow_ups: tuple[str, ...] = ()
    think_s: tuple[float, ...] = ()


@dataclass(frozen=True)
class Analysis:
    """One analyst's answer (or a follow-up answer)."""

    aspect: str
    text: str
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    worker: str
    emulated: bool


@dataclass
class FinanceOutcome:
    """What the driver saw for one request."""

    request: FinanceRequest
    session: str
    latency: float  # whole session, think time included
    analysis_latency: float  # until the summary was there
    follow_up_latencies: list[float] = field(default_factory=list)
    analyses: list[Analysis] = field(default_factory=list)
    summary: Analysis | None = None
    follow_ups: list[Analysis] = field(default_factory=list)

    @property
    def emulated(self) -> bool:
        """True if any LLM answer came from the EMULATED engine."""
        return any(a.emulated for a in [*self.analyses, *self.follow_ups, *([self.summary] if self.summary else [])])


def context(request: FinanceRequest) -> str:
    """The long prefix every prompt of ``request`` starts with."""
    return f"{SYSTEM}\n=== Annual report: {request.company} ===\n{request.report}\n=== End of report ===\n"


def _analysis(aspect: str, r: da.LLMResult) -> Analysis:
    return Analysis(aspect=aspect, text=r.text, prompt_tokens=r.prompt_tokens, cached_tokens=r.cached_tokens,
                    output_tokens=r.output_tokens, worker=r.worker, emulated=r.emulated)


@da.agent(model="coder")
class Analyst:
    """Studies one aspect of a report (a database query, then an LLM call), or answers a follow-up."""

    def analyze(self, request: FinanceRequest, aspect: str, model: str = "coder", max_tokens: int = 16) -> Analysis:
        """Query the figures for ``aspect`` (EMULATED db_query) and ask the LLM about them."""
        rows = da.stub(db_query_tool)(f"SELECT * FROM facts WHERE company='{request.company}' AND topic='{aspect}'",
                                      seed=request.seed).value()
        prompt = (context(request) + f"Database: {aspect} facts retrieved in {rows['latency_s'] * 1000:.0f} ms.\n"
                  f"Task: analyse the company's {aspect}.\nAnalysis:")
        answer = da.llm(model).generate(prompt, max_tokens=max_tokens, seed=request.seed).value()
        return _analysis(aspect, answer)

    def follow_up(self, request: FinanceRequest, question: str, model: str = "coder", max_tokens: int = 16) -> Analysis:
        """Answer a follow-up question about the same report (its prefix is cached by now)."""
        prompt = context(request) + f"Follow-up question from the client: {question}\nAnswer:"
        answer = da.llm(model).generate(prompt, max_tokens=max_tokens, seed=request.seed).value()
        return _analysis("follow-up", answer)


@da.agent(model="coder")
class Summarizer:
    """Combines the analysts' findings into one note."""

    def summarize(self, request: FinanceRequest, analyses: list[Analysis], model: str = "coder",
                  max_tokens: int = 24) -> Analysis:
        """One LLM call over the report and every analyst's answer."""
        findings = "\n".join(f"- {a.aspect}: {a.text[:80]!r}" for a in analyses)
        prompt = context(request) + f"Analysts' findings:\n{findings}\nWrite the investment summary:"
        answer = da.llm(model).generate(prompt, max_tokens=max_tokens, seed=request.seed).value()
        return _analysis("summary", answer)


def analyze_company(client, request: FinanceRequest, model: str = "coder", time_scale: float = 1.0,
                    max_tokens: int = 16) -> FinanceOutcome:
    """Drive one request in its own session: analysts in parallel, the summary, then the follow-ups,
    each after the user's think time (``request.think_s`` times ``time_scale``)."""
    analyst, summarizer = da.stub(Analyst), da.stub(Summarizer)
    t0 = time.time()
    with da.session(client, name=request.id) as s:
        analyses = [analyst.analyze(request, aspect, model=model, max_tokens=max_tokens) for aspect in request.aspects]
        summary = summarizer.summarize(request, analyses, model=model, max_tokens=max_tokens + 8).value()
        t_summary = time.time()
        follow_ups, follow_up_latencies = [], []
        for question, think in zip(request.follow_ups, request.think_s):
            time.sleep(think * time_scale)  # the user reads the summary, then asks (same session)
            t1 = time.time()
            follow_ups.append(analyst.follow_up(request, question, model=model, max_tokens=max_tokens).value())
            follow_up_latencies.append(time.time() - t1)
        done = [a.value() for a in analyses]
    return FinanceOutcome(request=request, session=s.id, latency=time.time() - t0, analysis_latency=t_summary - t0,
                          follow_up_latencies=follow_up_latencies, analyses=done, summary=summary,
                          follow_ups=follow_ups)


def _report(rng: random.Random, company: str, sector: str) -> str:
    revenue = rng.uniform(0.5, 40.0)
    growth = rng.uniform(-12, 25)
    margin = rng.uniform(-5, 32)
    lines = [
        f"{company} operates in {sector}. Fiscal year revenue was ${revenue:.2f}B, {growth:+.1f}% year on year; "
        f"operating margin {margin:.1f}%.",
        "Quarterly revenue ($B): " + ", ".join(f"Q{q} {revenue / 4 * rng.uniform(0.85, 1.15):.2f}" for q in range(1, 5)) + ".",
        f"Operating cash flow ${revenue * rng.uniform(0.05, 0.3):.2f}B; capital expenditure ${revenue * rng.uniform(0.02, 0.15):.2f}B; "
        f"dividend ${rng.uniform(0, 2):.2f} per share.",
        f"Net debt ${rng.uniform(-2, 15):.2f}B, {rng.randrange(1, 9)} years average maturity; interest cover {rng.uniform(1.5, 20):.1f}x.",
        "Principal risks: " + ", ".join(rng.sample(["supplier concentration", "currency exposure", "regulatory review",
                                                     "customer churn", "input-cost inflation", "litigation",
                                                     "cyber security", "key-person dependence"], 3)) + ".",
        f"Guidance: revenue growth of {rng.uniform(-5, 20):.0f}% next year, margin {rng.choice(['stable', 'expanding', 'under pressure'])}.",
    ]
    return "\n".join(lines)


def make_requests(n: int, seed: int, follow_ups: tuple[int, int] = (1, 2),
                  think_s: tuple[float, float] = (2.0, 8.0)) -> list[FinanceRequest]:
    """``n`` reproducible requests: a synthetic report each, 1-2 follow-ups (``follow_ups`` bounds)
    with think times drawn uniformly from ``think_s`` seconds."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        sector = rng.choice(SECTORS)
        company = f"{rng.choice(['Acme', 'Northwind', 'Globex', 'Initech', 'Umbrella', 'Stark', 'Wayne'])} " \
                  f"{rng.choice(['Holdings', 'Industries', 'Systems', 'Group'])} {i}"
        k = rng.randint(*follow_ups)
        out.append(FinanceRequest(
            id=f"fin{i}", company=company, report=_report(rng, company, sector), seed=rng.randrange(1 << 30),
            follow_ups=tuple(rng.sample(FOLLOW_UPS, k)),
            think_s=tuple(round(rng.uniform(*think_s), 3) for _ in range(k)),
        ))
    return out
