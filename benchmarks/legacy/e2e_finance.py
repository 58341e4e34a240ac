"""The Financial Analyst workflow of ``benchmarks/e2e.py`` (``--workflow finance``): request specs,
the prompts every variant sends, the EMULATED resources, and the workflow in every form (plain
Dask, dask-agents, Ray, LangGraph).

Everything timed here is EMULATED: the engines are :class:`dask_agents.worker_plugin.emulated.EmulatedEngineHost`
(a cost model) and the ``db_query`` tool sleeps a latency drawn from SAGA's db_query prior
(``dask_agents.kv.runtime.tool_latency``; P50/P95/P99 120/890/3500 ms) times ``TOOL_TIME_SCALE``.

Control flow: ``examples/finance/workflow.py``'s. One session per request: one analyst per
aspect (revenue, profitability, risk, cash-flow) in parallel, each a ``db_query`` tool call then
an LLM call; a summarizer (one LLM call over the report and every analyst's finding); then the
user's 1-2 follow-up questions in the SAME session, each after a think-time pause (the user
reads the summary, then asks), each one LLM call. ``max_tokens`` as in the example: 16 per
analysis and answer, 24 for the summary. The requests (company, report figures, follow-up
questions, how many, think times) are the example's ``make_requests``; the benchmark adds what a
request needs to be the same work in every framework, drawn up front from seeded RNGs
(:class:`FinanceSpec`): each ``db_query`` latency, the length of each query's answer, and the
report's notes.

Prompts carry the session's history (one ASCII character is one token of the byte tokenizer)::

    context      system prompt (167 tokens, shared by every session) + "Session <id>"
                 + the example's report (~600 tokens of figures)
                 + notes to the financial statements (1500-3000 tokens, seeded per request)
    analyst k    context + the db_query answer for aspect k (100-300 tokens) + the task
    summarizer   context + every analyst's finding (aspect order) + "Write the investment summary:"
    follow-up j  summarizer prompt + the summary + earlier questions and answers + question j

So the parallel analysts share the context (a sibling admitted after the first one on the same
engine finds it cached), the summary reuses the context, and every follow-up extends the
previous call's prompt: it prefills ~60-100 tokens where that session's KV still is, ~2.5-4k
where it is not (0.25-0.4 s of prefill at the engine's cost). Outputs come from the spec
(seeded synthetic text of the call's ``max_tokens`` characters), not from the engine, so the
history is the same in every variant.

Request latency (``e2e.make_record``) is arrival to completion minus the request's think time:
the pauses are the user's, identical everywhere, and counting them would only dilute the
differences. The user's pauses are short in ``--quick`` (0.3-1.2 s) and 1-3 s in the full run;
they keep more sessions in flight than the work alone would, and a paused session's KV sits
unreferenced in the engine's LRU cache, where newer sessions' prompts can evict it.

Forms (all read the same :class:`FinanceSpec`, build every prompt with the functions here):

- dask-agents: :class:`FinanceAnalyst` (``analyze``, ``follow_up``) and :class:`FinanceSummarizer`
  (``summarize``) are examples/finance/workflow.py's ``Analyst`` and ``Summarizer`` reading the
  spec (own names: the example's components keep theirs); ``solve_agents`` is the example's
  ``analyze_company`` (one ``da.session``, the pauses in the driver).
- plain Dask: one task per agent step, nested calls through ``worker_client()``, LLM tasks on
  the engine of the worker they run on (``e2e_baselines``), optional session-sticky pinning.
- Ray / LangGraph: ``e2e_peers``' machinery (engine actors / in-process engines, tool threads,
  the routing rules); LangGraph runs one graph per session's analysis (``Send`` one analyst per
  aspect -> summarize) and a one-node follow-up graph per question after the pause (the app
  keeps the session's history: the prompt is built from it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import random
import statistics
import time
from dataclasses import dataclass
from typing import (  # module level: the graphs' state hints resolve here
    Annotated,
    Any,
    TypedDict,
)

import dask_agents as da
from dask_agents.stats import percentile
from benchmarks.legacy import e2e_swe as swe
from benchmarks.legacy.e2e_peers import LangGraphPeer, RayPeer, _merge
from examples.finance.workflow import SYSTEM, FinanceRequest, make_requests
from dask_agents.kv.runtime.tool_latency import prior

MODEL = swe.MODEL  # "coder": the model examples/finance's agents call
ANALYSIS_TOKENS, SUMMARY_TOKENS, ANSWER_TOKENS = 16, 24, 16  # the example's max_tokens (summary: +8)
NOTES_TOKENS = (1500, 3000)  # notes to the financial statements, per request
DB_TOKENS = (100, 300)  # one db_query answer
TOOL_TIME_SCALE = 0.1  # wall seconds per emulated tool second (SAGA's db_query prior x 0.1)
THINK_QUICK = (0.3, 1.2)  # the user's pause before each follow-up, wall seconds (--quick)
THINK_FULL = (1.0, 3.0)

# The EMULATED engine of every variant: the Open-SWE engine's costs (e2e_swe.ENGINE: batch 8,
# 20 ms per iteration, 0.1 ms per fresh prompt token, no chunked prefill, 2048 KV blocks of 16
# tokens per replica with prefix reuse) at time scale 1.0 (wall = emulated). A request prefills
# ~4.3k tokens at best (every call where its session's KV is: 0.43 s of engine time), up to
# about twice that when its calls are spread over both replicas; a replica holds ~9 sessions'
# histories (~3.5k tokens each).
ENGINE = {**swe.ENGINE, "time_scale": 1.0}
REPLICAS = 2

_WORDS = ("revenue", "margin", "EBITDA", "guidance", "segment", "impairment", "goodwill", "lease", "deferred",
          "tax", "accrual", "hedge", "currency", "dividend", "buyback", "covenant", "maturity", "coupon",
          "liquidity", "capex", "working", "capital", "inventory", "receivables", "payables", "backlog",
          "churn", "pricing", "volume", "mix", "cost", "inflation", "provision", "contingent", "litigation",
          "pension", "amortization", "depreciation", "fiscal", "quarter", "year", "on", "per", "share", "net",
          "gross", "operating", "free", "cash", "flow", "debt", "equity", "ratio", "of", "the", "and", "in",
          "to", "was", "increased", "decreased", "by", "%", "$", "bn", "m", "0.4", "1.2", "3.5", "12", "27",
          "(note", "7)", ";", ",", ".")


def synthetic_text(seed: str, n: int) -> str:
    """Exactly ``n`` ASCII characters of filing-like text, a pure function of (seed, n)."""
    return swe.synthetic_text(seed, n, _WORDS, 0.06)


# -- requests ------------------------------------------------------------------------------

@dataclass(frozen=True)
class FinanceSpec:
    """One Financial Analyst request with every random draw made (identical in every variant).

    ``request``: the example's request (company, report, seed, aspects, follow-up questions,
    ``think_s``: the user's pause before each, in wall seconds here); ``notes_tokens``: length of
    the report's notes; ``db_s[k]``: EMULATED latency (s, unscaled) of aspect ``k``'s db_query;
    ``db_tokens[k]``: length of its answer."""

    request: FinanceRequest
    notes_tokens: int
    db_s: tuple
    db_tokens: tuple
    tool_time_scale: float = TOOL_TIME_SCALE

    @property
    def id(self) -> str:
        return self.request.id

    @property
    def aspects(self) -> tuple:
        return self.request.aspects

    @property
    def pause_s(self) -> float:
        """The user's think time in all (excluded from the request's latency)."""
        return float(sum(self.request.think_s))

    def ideal_latency(self) -> float:
        return ideal_latency(self)

    def check_outcome(self, out: dict) -> None:
        """Every variant must do exactly the request's work."""
        if (out.get("analyses") != len(self.aspects) or out.get("summary") != 1
                or out.get("follow_ups") != len(self.request.follow_ups)):
            raise AssertionError(f"{self.id}: outcome {out} differs from the spec ({len(self.aspects)} analyses, "
                                 f"1 summary, {len(self.request.follow_ups)} follow-ups)")


def make_specs(n: int, seed: int, think: tuple = THINK_FULL, tool_time_scale: float = TOOL_TIME_SCALE
               ) -> list[FinanceSpec]:
    """``n`` reproducible requests: the example's ``make_requests(n, seed, think_s=think)`` with
    fixed-length ids and the benchmark's draws (tool latencies, text lengths)."""
    db = prior("db_query")
    out = []
    for i, r in enumerate(make_requests(n, seed, think_s=tuple(think))):
        r = dataclasses.replace(r, id=f"f{i:04d}")
        rng = random.Random(f"e2e-fin-tools-{r.seed}")
        db_s = tuple(db.sample(rng) for _ in r.aspects)
        trng = random.Random(f"e2e-fin-text-{r.seed}")
        notes = trng.randint(*NOTES_TOKENS)
        db_tok = tuple(trng.randint(*DB_TOKENS) for _ in r.aspects)
        out.append(FinanceSpec(r, notes, db_s, db_tok, tool_time_scale))
    return out


def with_id(spec: FinanceSpec, new_id: str) -> FinanceSpec:
    """The same request under another id (same draws, same text lengths)."""
    return dataclasses.replace(spec, request=dataclasses.replace(spec.request, id=new_id))


def specs_for(base: list[FinanceSpec], tag: str) -> list[FinanceSpec]:
    """As ``e2e.specs_for``: ids prefixed by an 8-character digest of ``tag`` (fresh
    session-specific prompts per run, the same prompt lengths everywhere)."""
    import hashlib

    prefix = hashlib.sha1(tag.encode()).hexdigest()[:8]
    return [with_id(s, f"{prefix}-{s.id}") for s in base]


# -- prompts (shared by every variant) ----------------------------------------------------------

def context(spec: FinanceSpec) -> str:
    """System prompt, the session id (first request-specific text: cache isolation between
    runs), the example's report and the seeded notes."""
    r = spec.request
    notes = synthetic_text(f"fin-notes-{r.seed}", spec.notes_tokens)
    return (f"{SYSTEM}Session {r.id}\n=== Annual report: {r.company} ===\n{r.report}\n"
            f"Notes to the financial statements:\n{notes}\n=== End of report ===\n")


def db_args(spec: FinanceSpec, k: int) -> tuple:
    """The db_query tool's arguments beyond the query: (answer seed, aspect index, length)."""
    return spec.request.seed, k, spec.db_tokens[k]


def db_answer(seed: int, k: int, n: int) -> str:
    """The db_query tool's answer (``n`` characters): what the tool returns, in every variant."""
    return synthetic_text(f"fin-db-{seed}-{k}", n)


def db_query_body(query: str, emulated_s: float, time_scale: float, seed: int, k: int, n: int) -> str:
    """The body of the EMULATED db_query tool in every variant: sleep, then the seeded answer."""
    slept = emulated_s * time_scale
    if slept > 0:
        time.sleep(slept)
    return db_answer(seed, k, n)


def db_query_text(spec: FinanceSpec, k: int) -> str:
    return f"SELECT * FROM facts WHERE company='{spec.request.company}' AND topic='{spec.aspects[k]}'"


def analyst_prompt(spec: FinanceSpec, k: int, rows: str) -> str:
    aspect = spec.aspects[k]
    return context(spec) + f"Database ({aspect}): {rows}\nTask: analyse the company's {aspect}.\nAnalysis:"


def analysis_text(spec: FinanceSpec, k: int) -> str:
    return synthetic_text(f"fin-analysis-{spec.request.seed}-{k}", ANALYSIS_TOKENS)


def summary_prompt(spec: FinanceSpec) -> str:
    findings = "".join(f"- {a}: {analysis_text(spec, k)}\n" for k, a in enumerate(spec.aspects))
    return context(spec) + "Analysts' findings:\n" + findings + "Write the investment summary:"


def summary_text(spec: FinanceSpec) -> str:
    return synthetic_text(f"fin-summary-{spec.request.seed}", SUMMARY_TOKENS)


def answer_text(spec: FinanceSpec, j: int) -> str:
    return synthetic_text(f"fin-answer-{spec.request.seed}-{j}", ANSWER_TOKENS)


def followup_prompt(spec: FinanceSpec, j: int) -> str:
    """Follow-up ``j``: the summarizer's prompt, the summary, the earlier turns, question ``j``
    (so it extends follow-up ``j - 1``'s prompt, and follow-up 0 the summarizer's)."""
    qs = spec.request.follow_ups
    turns = "".join(f"Client: {qs[i]}\nAnswer: {answer_text(spec, i)}\n" for i in range(j))
    return summary_prompt(spec) + " " + summary_text(spec) + "\n" + turns + f"Client: {qs[j]}\nAnswer:"


def session_calls(spec: FinanceSpec) -> list[dict]:
    """Every LLM call of the request: ``{"role", "prompt", "max_tokens", "reusable"}``, where
    ``reusable`` is the prompt's longest prefix an earlier call of the session (or a sibling
    analyst listed before it) sent, or the shared system prompt."""
    ctx = len(context(spec))
    calls = []
    for k in range(len(spec.aspects)):
        calls.append({"role": "analysis", "max_tokens": ANALYSIS_TOKENS,
                      "prompt": analyst_prompt(spec, k, db_answer(*db_args(spec, k))),
                      "reusable": len(SYSTEM) if k == 0 else ctx})
    s = summary_prompt(spec)
    calls.append({"role": "summary", "max_tokens": SUMMARY_TOKENS, "prompt": s, "reusable": ctx})
    prev = len(s)
    for j in range(len(spec.request.follow_ups)):
        p = followup_prompt(spec, j)
        calls.append({"role": "follow_up", "max_tokens": ANSWER_TOKENS, "prompt": p, "reusable": prev})
        prev = len(p)
    return calls


def _cacheable(n: int, prefix: int, bs: int) -> int:
    """Tokens of an ``n``-token prompt a cache holding its first ``prefix`` tokens can serve
    (full blocks; the engine always computes the last prompt token)."""
    return min(((n - 1) // bs) * bs, (prefix // bs) * bs)


@functools.lru_cache(maxsize=4096)
def ideal_latency(spec: FinanceSpec) -> float:
    """A lower bound of the request's latency (think time excluded): no queueing, no framework
    overhead, one sequence per engine iteration, every block an earlier call of the session
    sent cached. The analysts: at least one of them computes the context, and none finishes
    before its own query and its call with the context cached."""
    p = ENGINE
    bs, scale = p["block_size"], p["time_scale"]
    step = p["decode_s_per_step"] + p["decode_s_per_seq"]

    def llm(prompt: str, prefix: int, out: int) -> float:
        n = len(prompt)
        return ((n - _cacheable(n, prefix, bs)) * p["prefill_s_per_token"] + out * step) * scale

    ts = spec.tool_time_scale
    ctx = len(context(spec))
    prompts = [analyst_prompt(spec, k, db_answer(*db_args(spec, k))) for k in range(len(spec.aspects))]
    each = max(spec.db_s[k] * ts + llm(prompts[k], ctx, ANALYSIS_TOKENS) for k in range(len(prompts)))
    first = min(spec.db_s[k] * ts + llm(prompts[k], len(SYSTEM), ANALYSIS_TOKENS) for k in range(len(prompts)))
    t = max(each, first)
    s = summary_prompt(spec)
    t += llm(s, ctx, SUMMARY_TOKENS)
    prev = len(s)
    for j in range(len(spec.request.follow_ups)):
        f = followup_prompt(spec, j)
        t += llm(f, prev, ANSWER_TOKENS)
        prev = len(f)
    return t


def prompt_tokens(spec: FinanceSpec) -> int:
    """Prompt tokens the request sends in all (what the engines count as queries)."""
    return sum(len(c["prompt"]) for c in session_calls(spec))


def token_stats(specs: list[FinanceSpec]) -> dict:
    """Token statistics of the requests' prompts (printed under ``requests.tokens``)."""
    bs = ENGINE["block_size"]
    calls = prompt = reusable = out = fu_prompt = fu_reusable = 0
    for s in specs:
        for c in session_calls(s):
            n = len(c["prompt"])
            r = _cacheable(n, c["reusable"], bs)
            calls += 1
            prompt += n
            reusable += r
            out += c["max_tokens"]
            if c["role"] == "follow_up":
                fu_prompt += n
                fu_reusable += r
    n = max(len(specs), 1)
    return {"mean_llm_calls": calls / n, "mean_prompt_tokens_per_call": prompt / max(calls, 1),
            "mean_output_tokens_per_call": out / max(calls, 1),
            "reusable_share_perfect_cache": reusable / prompt if prompt else float("nan"),
            "reusable_share_follow_ups": fu_reusable / fu_prompt if fu_prompt else float("nan"),
            "fresh_prompt_tokens_per_request": (prompt - reusable) / n}


def describe_specs(specs: list[FinanceSpec]) -> dict:
    ideal = sorted(ideal_latency(s) for s in specs)
    n = max(len(specs), 1)
    return {"requests": len(specs), "analysts_per_request": len(specs[0].aspects) if specs else 0,
            "mean_follow_ups": sum(len(s.request.follow_ups) for s in specs) / n,
            "mean_think_s_per_request": sum(s.pause_s for s in specs) / n,
            "ideal_latency_mean_s": sum(ideal) / n,
            "ideal_latency_p99_s": percentile(ideal, 99) if ideal else None,
            "tokens": token_stats(specs)}


def _tokens(prompt: int, cached: int, output: int) -> dict:
    return {"prompt_tokens": int(prompt), "cached_tokens": int(cached), "output_tokens": int(output)}


def outcome(analyses: list[dict], summary: dict, follow_ups: list[dict], follow_up_s: list[float]) -> dict:
    """What every form returns: counts (checked against the spec) and per-role token counts."""
    def pc(rs: list[dict]) -> list[int]:
        return [sum(r["prompt_tokens"] for r in rs), sum(r["cached_tokens"] for r in rs)]

    return {"analyses": len(analyses), "summary": 1 if summary else 0, "follow_ups": len(follow_ups),
            "stats": {"analysis": pc(analyses), "summary": pc([summary]), "follow_up": pc(follow_ups),
                      "follow_up_s": list(follow_up_s)}}


# -- the dask-agents form (examples/finance/workflow.py's components, reading the spec) --------

@da.tool(kind="db_query")
def finance_db_query(query: str, emulated_s: float, time_scale: float, seed: int, k: int, n: int) -> str:
    """Query the facts database (EMULATED latency from the db_query prior; seeded answer)."""
    return db_query_body(query, emulated_s, time_scale, seed, k, n)


def _llm_tokens(r) -> dict:
    return _tokens(r.prompt_tokens, r.cached_tokens, r.output_tokens)


@da.agent(model=MODEL)
class FinanceAnalyst:
    """Studies one aspect of a report (a database query, then an LLM call), or answers a follow-up."""

    def analyze(self, spec: FinanceSpec, k: int) -> dict:
        rows = da.stub(finance_db_query)(db_query_text(spec, k), spec.db_s[k], spec.tool_time_scale,
                                         *db_args(spec, k)).value()
        return _llm_tokens(da.llm(MODEL).generate(analyst_prompt(spec, k, rows), max_tokens=ANALYSIS_TOKENS).value())

    def follow_up(self, spec: FinanceSpec, j: int) -> dict:
        return _llm_tokens(da.llm(MODEL).generate(followup_prompt(spec, j), max_tokens=ANSWER_TOKENS).value())


@da.agent(model=MODEL)
class FinanceSummarizer:
    """Combines the analysts' findings into one note."""

    def summarize(self, spec: FinanceSpec, analyses: list[dict]) -> dict:
        return _llm_tokens(da.llm(MODEL).generate(summary_prompt(spec), max_tokens=SUMMARY_TOKENS).value())


def solve_agents(client, spec: FinanceSpec) -> dict:
    """One request in its own session (examples/finance's ``analyze_company``): analysts in
    parallel, the summary, then each follow-up after the user's pause, in the same session."""
    analyst, summarizer = da.stub(FinanceAnalyst), da.stub(FinanceSummarizer)
    with da.session(client, name=spec.id):
        analyses = [analyst.analyze(spec, k) for k in range(len(spec.aspects))]
        summary = summarizer.summarize(spec, analyses).value()
        follow_ups, fu_s = [], []
        for j, think in enumerate(spec.request.think_s):
            time.sleep(think)  # the user reads the summary, then asks (same session)
            t = time.perf_counter()
            follow_ups.append(analyst.follow_up(spec, j).value())
            fu_s.append(time.perf_counter() - t)
        done = [a.value() for a in analyses]
    return outcome(done, summary, follow_ups, fu_s)


# -- the plain Dask form -------------------------------------------------------------------------

def db_task(query: str, emulated_s: float, time_scale: float, seed: int, k: int, n: int) -> str:
    return db_query_body(query, emulated_s, time_scale, seed, k, n)


def analyze_task(spec: FinanceSpec, k: int, llm_slots: int | None, worker: str | None = None) -> dict:
    from distributed import worker_client

    from benchmarks.legacy.e2e_baselines import _llm

    with worker_client() as c:  # secedes: the waits below hold no worker thread
        rows = c.submit(db_task, db_query_text(spec, k), spec.db_s[k], spec.tool_time_scale, *db_args(spec, k),
                        pure=False).result()
        r = _llm(c, analyst_prompt(spec, k, rows), ANALYSIS_TOKENS, llm_slots, worker)
    return _tokens(r["prompt_tokens"], r["cached_tokens"], r["output_tokens"])


def summarize_task(spec: FinanceSpec, analyses: list[dict], llm_slots: int | None, worker: str | None = None) -> dict:
    from distributed import worker_client

    from benchmarks.legacy.e2e_baselines import _llm

    with worker_client() as c:
        r = _llm(c, summary_prompt(spec), SUMMARY_TOKENS, llm_slots, worker)
    return _tokens(r["prompt_tokens"], r["cached_tokens"], r["output_tokens"])


def follow_up_task(spec: FinanceSpec, j: int, llm_slots: int | None, worker: str | None = None) -> dict:
    from distributed import worker_client

    from benchmarks.legacy.e2e_baselines import _llm

    with worker_client() as c:
        r = _llm(c, followup_prompt(spec, j), ANSWER_TOKENS, llm_slots, worker)
    return _tokens(r["prompt_tokens"], r["cached_tokens"], r["output_tokens"])


def solve_dask(client, spec: FinanceSpec, llm_slots: int | None = None, pinner=None) -> dict:
    """One request with plain Dask futures (the control flow of ``solve_agents``); with
    ``pinner`` (routing ``session_sticky``) every LLM task of the request runs on one engine
    worker, held through the user's pauses."""
    w = pinner.acquire() if pinner is not None else None
    try:
        analyses = [client.submit(analyze_task, spec, k, llm_slots, w, pure=False) for k in range(len(spec.aspects))]
        summary = client.submit(summarize_task, spec, analyses, llm_slots, w, pure=False).result()
        follow_ups, fu_s = [], []
        for j, think in enumerate(spec.request.think_s):
            time.sleep(think)  # the user's pause
            t = time.perf_counter()
            follow_ups.append(client.submit(follow_up_task, spec, j, llm_slots, w, pure=False).result())
            fu_s.append(time.perf_counter() - t)
        done = client.gather(analyses)
    finally:
        if w is not None:
            pinner.release(w)
    return outcome(done, summary, follow_ups, fu_s)


# -- peers (e2e_peers' machinery) -----------------------------------------------------------------

class _FinancePeer:
    """The finance logic as coroutines over a peer's ``llm`` and ``call_tool``."""

    async def analyze(self, spec: FinanceSpec, k: int) -> dict:
        rows = await self.call_tool(db_query_body, db_query_text(spec, k), spec.db_s[k], spec.tool_time_scale,
                                    *db_args(spec, k))
        r = await self.llm(spec, analyst_prompt(spec, k, rows), ANALYSIS_TOKENS)
        return _tokens(r["prompt_tokens"], r["cached_tokens"], r["output_tokens"])

    async def summarize(self, spec: FinanceSpec, analyses: list[dict]) -> dict:
        r = await self.llm(spec, summary_prompt(spec), SUMMARY_TOKENS)
        return _tokens(r["prompt_tokens"], r["cached_tokens"], r["output_tokens"])

    async def follow_up(self, spec: FinanceSpec, j: int) -> dict:
        r = await self.llm(spec, followup_prompt(spec, j), ANSWER_TOKENS)
        return _tokens(r["prompt_tokens"], r["cached_tokens"], r["output_tokens"])

    async def analysis(self, spec: FinanceSpec) -> tuple[list[dict], dict]:
        analyses = list(await asyncio.gather(*(self.analyze(spec, k) for k in range(len(spec.aspects)))))
        return analyses, await self.summarize(spec, analyses)

    async def solve(self, spec: FinanceSpec) -> dict:
        analyses, summary = await self.analysis(spec)
        follow_ups, fu_s = [], []
        for j, think in enumerate(spec.request.think_s):
            await asyncio.sleep(think)  # the user's pause
            t = time.perf_counter()
            follow_ups.append(await self.turn(spec, j))
            fu_s.append(time.perf_counter() - t)
        return outcome(analyses, summary, follow_ups, fu_s)

    async def turn(self, spec: FinanceSpec, j: int) -> dict:
        """One follow-up question after the user's pause (a framework may wrap it)."""
        return await self.follow_up(spec, j)


class FinanceRayPeer(_FinancePeer, RayPeer):
    """Ray: engine replicas in async actors, db_query on the threaded tool actors, the session's
    logic a coroutine in the driver."""


class FinanceState(TypedDict, total=False):
    """The analysis graph's state; ``analyses`` (aspect index -> tokens) merges parallel analysts."""

    spec: Any
    analyses: Annotated[dict, _merge]
    summary: Any


class FollowUpState(TypedDict, total=False):
    spec: Any
    turn: int
    answer: Any


class FinanceLangGraphPeer(_FinancePeer, LangGraphPeer):
    """LangGraph: analysis graph (``Send`` one analyst per aspect -> summarize) per session; one
    follow-up graph invocation per question, after the user's pause."""

    graph_description = ("StateGraph: Send(analyze) per aspect -> summarize; per follow-up, after the user's "
                         "pause, a one-node follow-up graph")

    def _build(self):
        from langgraph.graph import END, START, StateGraph
        from langgraph.types import Send

        def fan_out(state: FinanceState) -> list:
            return [Send("analyze", {"spec": state["spec"], "k": k}) for k in range(len(state["spec"].aspects))]

        async def analyze(job: dict) -> dict:
            return {"analyses": {job["k"]: await self.analyze(job["spec"], job["k"])}}

        async def summarize(state: FinanceState) -> dict:
            analyses = [state["analyses"][k] for k in sorted(state["analyses"])]
            return {"summary": await self.summarize(state["spec"], analyses)}

        g = StateGraph(FinanceState)
        g.add_node("analyze", analyze)
        g.add_node("summarize", summarize)
        g.add_conditional_edges(START, fan_out, ["analyze"])
        g.add_edge("analyze", "summarize")
        g.add_edge("summarize", END)

        async def answer(state: FollowUpState) -> dict:
            return {"answer": await self.follow_up(state["spec"], state["turn"])}

        f = StateGraph(FollowUpState)
        f.add_node("answer", answer)
        f.add_edge(START, "answer")
        f.add_edge("answer", END)
        self.followup_graph = f.compile()
        return g.compile()

    async def analysis(self, spec: FinanceSpec) -> tuple[list[dict], dict]:
        state = await self.graph.ainvoke({"spec": spec, "analyses": {}}, {"recursion_limit": 25})
        return [state["analyses"][k] for k in sorted(state["analyses"])], state["summary"]

    async def turn(self, spec: FinanceSpec, j: int) -> dict:
        return (await self.followup_graph.ainvoke({"spec": spec, "turn": j}))["answer"]


def make_peer(name: str, tool_threads: int = 32, routing: str = "least_loaded"):
    """A finance peer backend by name (``ray`` or ``langgraph``): 2 replicas of ``ENGINE``."""
    cls = {"ray": FinanceRayPeer, "langgraph": FinanceLangGraphPeer}[name]
    return cls(tool_threads=tool_threads, routing=routing, models={MODEL: ENGINE}, replicas=REPLICAS)


# -- the benchmark's pieces ----------------------------------------------------------------------

def run_metrics(records: list[dict], specs: list[FinanceSpec]) -> dict:
    """Per-run extras: prefix-cache hit rate (token-weighted) per role, as the engines reported
    it to the calls (follow-ups: did the session's KV survive the pause where the call ran?),
    and the mean follow-up latency (from its submission, after the pause)."""
    sums = {r: [0, 0] for r in ("analysis", "summary", "follow_up")}
    fu_s: list[float] = []
    for rec in records:
        st = rec.get("stats") if rec.get("ok") else None
        if not st:
            continue
        for role, (p, c) in ((k, st[k]) for k in sums):
            sums[role][0] += p
            sums[role][1] += c
        fu_s += st.get("follow_up_s", [])
    out = {f"{role}_kv_hit_rate": (c / p if p else float("nan")) for role, (p, c) in sums.items()}
    out["followup_kv_hit_rate"] = out.pop("follow_up_kv_hit_rate")
    out["followup_prompt_tokens"] = sums["follow_up"][0]
    out["followup_mean_s"] = statistics.fmean(fu_s) if fu_s else float("nan")
    return out


POLICIES = ("prioritize", "balance")  # one model, nothing batchable: reallocate/batching cannot act
VARIANTS = ["dask", "dask-agents"] + [f"dask-agents-no-{p}" for p in POLICIES] + ["ray", "langgraph"]

# Loads: the best static configurations (session-sticky) saturate near 4 requests/s (measured: at
# 4/s dask-agents and LangGraph sustained with mean ~4.2 s against an ideal ~1.6 s; at 5/s
# neither did), so the quick run's reference load is there, its lower one at half of it.
QUICK = {"loads": [2.0, 4.0], "requests": 20, "calibration_load": 4.0, "warmup": 4, "think_s": list(THINK_QUICK),
         "dask_sweep": [{"threads": 16, "llm_slots": None, "routing": "none"},
                        {"threads": 16, "llm_slots": None, "routing": "session_sticky"},
                        {"threads": 16, "llm_slots": 8, "routing": "none"},
                        {"threads": 16, "llm_slots": 8, "routing": "session_sticky"}],
         "peer_sweep": ["least_loaded", "session_sticky"]}
FULL = {"loads": [1.0, 2.0, 3.0, 4.0, 5.0], "requests": 60, "calibration_load": 4.0, "warmup": 8,
        "think_s": list(THINK_FULL),
        "dask_sweep": [{"threads": t, "llm_slots": s, "routing": r} for t in (8, 16, 32) for s in (None, 8)
                       for r in ("none", "session_sticky")],
        "peer_sweep": ["round_robin", "least_loaded", "session_sticky"]}


def workflow(preset: dict):
    """The :class:`benchmarks.e2e.Workflow` of this workflow under ``preset`` (its think times)."""
    from benchmarks.legacy import e2e

    think = tuple(preset.get("think_s", THINK_FULL))
    return e2e.Workflow(
        name="finance",
        make_specs=lambda n, seed: make_specs(n, seed, think),
        specs_for=specs_for,
        arrivals=swe.poisson_arrivals,
        dask_backend=lambda **cfg: e2e.DaskBackend(**cfg, engine=ENGINE, solve=solve_dask),
        agents_backend=lambda disabled=None: e2e.AgentsBackend(disabled=disabled, entry=swe.model_entry(ENGINE),
                                                               solve=solve_agents),
        make_peer=make_peer,
        policies=POLICIES,
        run_metrics=run_metrics,
    )


def run_benchmark(preset: dict, variants: list[str], seed: int = 0, log=print) -> tuple[dict, dict]:
    """Run the selected variants of the finance workflow; returns (variants, sweeps)."""
    from benchmarks.legacy import e2e

    return e2e.run_benchmark(preset, [v for v in variants if v in VARIANTS], seed, log, wf=workflow(preset))


def build_config(preset: dict, seed: int, variants: list[str]) -> dict:
    from benchmarks.legacy import e2e

    base = make_specs(preset["requests"], seed, tuple(preset.get("think_s", THINK_FULL)))
    return {
        "workflow": "finance", "variants": variants, "loads_rps": sorted(preset["loads"]),
        "requests_per_load": preset["requests"], "warmup_requests": preset["warmup"],
        "calibration_load_rps": preset["calibration_load"], "reference_load_rps": preset["calibration_load"],
        "think_s_range": list(preset.get("think_s", THINK_FULL)),
        "latency": "arrival to completion minus the user's think time before the follow-ups",
        "engine": {"replicas": REPLICAS, "model": MODEL, **ENGINE, "max_model_len": swe.MAX_MODEL_LEN,
                   "prefix_caching": True, "class": "dask_agents.worker_plugin.emulated.EmulatedEngineHost"},
        "tools": {"db_query": "db_query prior (P50/P95/P99 120/890/3500 ms)", "time_scale": TOOL_TIME_SCALE},
        "requests": describe_specs(base),
        "threads": {"dask-agents": f"2 workers x {e2e.THREADS_AGENTS}", "dask": "swept",
                    "peers_tool_threads": e2e.PEER_TOOL_THREADS},
        "policies_ablated": list(POLICIES),
        "dask_sweep": preset["dask_sweep"], "peer_sweep": preset["peer_sweep"],
    }
