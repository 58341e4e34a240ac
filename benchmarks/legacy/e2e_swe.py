"""The Open-SWE workflow of ``benchmarks/e2e.py``: request specs, the prompts every variant sends,
the EMULATED resources, and the dask-agents form of the workflow.

This module is the single source of what a request does: plain Dask (``e2e_baselines.py``),
dask-agents (below), Ray and LangGraph (``e2e_peers.py``) all read the same
:class:`RequestSpec` and build every prompt with the functions here, so they send the same
prompts (byte for byte, up to the 8-character run digest in the request id that keeps one
run's prompts out of another run's prefix cache) in the same dependency order.

Control flow: ``examples/swe/workflow.py``'s. Planner (one LLM call) -> one developer per
subtask in parallel (doc-search tool, LLM call, code-exec tool) -> tester (LLM call, code-exec
tool) -> while the tester reports a failing subtask: that developer again with the feedback,
then the tester again (at most ``MAX_RETRIES`` rounds). The workflow's ``max_tokens`` (16, 24,
8), and a tester round fails by the workflow's own seeded rule (``random.Random(f"{seed}-{round}")``,
``FAIL_PROBABILITY``).

Prompts: the session's history (unlike examples/swe/workflow.py, whose prompts share only the
system prompt). Agent prompts carry the session's growing history (the repository context, the
plan, tool answers, earlier attempts), which is what makes an engine that already holds a
session's KV worth returning to. Each call's prompt, in this fixed order (one ASCII character
is one token of the byte tokenizer)::

    context        system prompt (420 tokens, shared by every session)
                   + "Issue <id>: <title>" + repository context (1500-3000 tokens, seeded per issue)
    planner        context + "Plan the subtasks."
    developer k    planner prompt + the plan + subtask k + its doc-search answer (150-450 tokens)
                   + "Write the patch."
      on a retry   its own previous prompt + its previous patch + the tester's failure log
                   (100-300 tokens) + a new doc-search answer + "Write the patch again."
    tester         planner prompt + the plan + every current patch (subtask order) + "Review."

Outputs come from the spec, not from the engine's (random) tokens: the plan and each patch are
seeded synthetic strings of the call's ``max_tokens`` characters, and the tools' answers and
failure logs are seeded synthetic text of drawn lengths, so the history is the same in every
variant. (The engine caches the blocks of the tokens *it* generated, which are not these
strings, so a generated output is never a cache hit: at most one or two blocks per call that a
real engine, detokenizing and retokenizing the same text, might reuse.)

Token statistics of these prompts (``token_stats``, printed with every run under
``requests.tokens``; seed 0): 5.8 LLM calls per request (quick run, 16 requests; 5.55 for the
full run's 60), 3,050 prompt tokens per call on average (2.1k-4.1k; planner 2.7k, developer
3.2k, tester 3.0k; 60 requests: 3,170), 18.5 output tokens per call, i.e. 165 prompt tokens
per output token (Copilot's coding-agent sessions: 631.4B / 4.91B = 129). Of the prompt
tokens, 75% are a block-aligned prefix of a prompt the same session sent before (a call it
depends on; a concurrent sibling's not counted), and 77% counting the system prompt that
every session shares as well; ~4,050 tokens per request are fresh. That 77% is the hit rate
of a perfect prefix cache (every session's history kept, every call on the replica holding
it). GitHub Copilot's coding-agent sessions have 86% of their prompt tokens cached (540.95B
of 631.4B): their sessions are far longer (3.95 turns x 7.83 calls, ~68k prompt tokens per
call), so the fresh context of a session's first call weighs less than in these ~6-call
sessions, where the first call's repository context alone is ~13% of all prompt tokens. So
this workload is somewhat less cache-friendly than Copilot's, not more: it does not overstate
what keeping a session on the replica that holds its KV can gain.

What else differs from ``examples/swe/workflow.py`` (on purpose, so every framework does the
same work): everything random about a request is drawn up front, once, from seeded RNGs into a
:class:`RequestSpec` (subtask count, which round fails and which subtask, every tool latency,
every synthetic text length), and every variant reads it from there. Tool latencies are drawn
from the SAGA priors of :mod:`dask_agents.kv.runtime.tool_latency` (file_io for doc search, code_exec for code
runs) and slept times ``tool_time_scale``.

Everything timed here is EMULATED: the engine is :class:`dask_agents.worker_plugin.emulated.EmulatedEngineHost`
(a cost model) and the tools sleep.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import time
from dataclasses import dataclass

import dask_agents as da
from dask_agents.stats import percentile
from examples.swe.workflow import (
    FAIL_PROBABILITY,
    MAX_RETRIES,
    SYSTEM,
    Issue,
    Patch,
    Report,
    _context,
    make_issues,
)
from dask_agents.kv.runtime.tool_latency import prior

MODEL = "coder"  # the model name the Open-SWE agents call (da.llm("coder"))
PLAN_TOKENS, PATCH_TOKENS, REVIEW_TOKENS = 16, 24, 8  # max_tokens of examples/swe/workflow.py

# Lengths (tokens = ASCII characters) of the synthetic text, drawn uniformly per request.
CONTEXT_TOKENS = (1500, 3000)  # repository context of an issue (the files the agents read)
DOC_TOKENS = (150, 450)  # one doc-search answer
LOG_TOKENS = (100, 300)  # the failure log of a failing tester round (beyond its first line)

# The EMULATED engine of every variant (costs in emulated seconds; x time_scale for wall time).
# - max_batch 8, decode 20 ms per iteration (+0.05 ms per running sequence): 8 calls batched
#   take about as long as one, so batching matters.
# - prefill 0.1 ms per non-cached prompt token (10k tokens/s per replica, an H100-class
#   prefill of an 8B model under batching), charged to the iteration that admits the call
#   (no chunked prefill: a long fresh prompt stalls the whole batch, as in vLLM without
#   chunking). A call of this workload (~3k prompt tokens) costs ~0.3 s of prefill when only
#   the system prompt is cached and ~0.02-0.05 s when its session's history is, against
#   0.16-0.48 s of decode (8-24 tokens): where a call runs matters as much as when. With
#   every reusable block hit, a request prefills ~4,050 tokens (0.4 s); when its calls are
#   spread over both replicas, ~6,000 (0.6 s).
# - KV: 2048 blocks of 16 tokens (32,768 tokens) per replica. A session's working set (the
#   prompt blocks only it has: context, plan, doc answers, patches, logs) is ~250 blocks
#   (~4,050 tokens; the 26 blocks of the system prompt are shared), so one replica holds the
#   histories of ~8 sessions (running sequences' reservations are part of them). At the
#   quick run's higher load (3 requests/s) 9-10 sessions are in flight (measured): a
#   replica that serves calls of every session cannot keep all of them, one that serves
#   about half of them (a session-affine router) can. (Measured: at 3072 blocks plain Dask's
#   hit rate was the same, i.e. what costs it cache hits is where its calls run.)
# - time_scale 0.5: the engine runs at twice the emulated speed in wall time (the tools are
#   compressed more, x0.1). With it, the best plain-Dask configuration saturated near 3
#   requests/s on the first emulated engine (full reservation at admission); on the faithful
#   one (issue 14: incremental allocation, preemption, chunked prefill) it sustains 5 and not
#   8 (benchmarks/e2e.py prints the derived capacity), a load two cores drive through Dask.
# - max_model_len 8192: a prompt is at most ~6k tokens (a developer's third retry; 4.7k in seed 0).
ENGINE = {
    "max_batch": 8,
    "decode_s_per_step": 0.02,
    "decode_s_per_seq": 5e-5,
    "prefill_s_per_token": 1e-4,
    "prefill_s_per_token_pos": 0.0,  # (the attention term came later: this regime keeps its costs)
    "kv_blocks": 2048,
    "block_size": 16,
    "time_scale": 0.5,
}
MAX_MODEL_LEN = 8192
TOOL_TIME_SCALE = 0.1  # wall seconds per emulated tool second (SAGA priors x 0.1)


def model_entry(engine: dict | None = None) -> dict:
    """The ``agents.llm.models.coder`` entry of the EMULATED engine (also used to build it by hand);
    ``engine`` a whole model entry (it has ``model``, e.g. a real vLLM engine's): that entry."""
    if engine is not None and "model" in engine:
        return dict(engine)
    return {"model": "emulated-swe", "engine": "emulated", "tokenizer": "byte",
            "max-model-len": MAX_MODEL_LEN, "enable-prefix-caching": True,
            "emulation": dict(ENGINE if engine is None else engine)}


def make_engine(name: str = MODEL, engine: dict | None = None):
    """One engine host, started and loaded: the class dask-agents' worker plugin hosts for the
    entry (EMULATED by default; a real vLLM engine for a real model entry, see ``model_entry``)."""
    from dask_agents.model_settings import ModelSettings
    from dask_agents.worker_plugin.engines import make_host

    entry = model_entry(engine)
    host = make_host(name, ModelSettings(**entry))
    host.start()
    host.wait_loaded(10 if entry.get("engine") == "emulated" else 600)
    return host


# -- requests ------------------------------------------------------------------------------

@dataclass(frozen=True)
class RequestSpec:
    """One Open-SWE request with all its random draws made (identical in every variant).

    ``failing[r]``: the subtask the tester reports failing in round ``r`` (None: passed);
    ``doc_s[k][a]`` / ``code_s[k][a]``: EMULATED latency (s, unscaled) of subtask ``k``'s
    doc search / code run at attempt ``a``; ``test_s[r]``: the tester's code run in round ``r``;
    ``context_tokens``: length of the issue's repository context; ``doc_tokens[k][a]``: length
    of subtask ``k``'s doc-search answer at attempt ``a``; ``log_tokens[r]``: length of round
    ``r``'s failure log.
    """

    issue: Issue
    failing: tuple
    doc_s: tuple
    code_s: tuple
    test_s: tuple
    context_tokens: int
    doc_tokens: tuple
    log_tokens: tuple
    tool_time_scale: float = TOOL_TIME_SCALE

    @property
    def id(self) -> str:
        return self.issue.id

    @property
    def retries(self) -> int:
        return len(self.failing) - 1


def failing_rounds(issue: Issue) -> tuple:
    """The tester's verdict per round, by examples/swe/workflow.py's rule (Tester.test)."""
    out = []
    for rnd in range(MAX_RETRIES + 1):
        rng = random.Random(f"{issue.seed}-{rnd}")
        if rnd < MAX_RETRIES and rng.random() < FAIL_PROBABILITY:
            out.append(rng.randrange(issue.n_subtasks))
        else:
            out.append(None)
            break
    return tuple(out)


def make_specs(n: int, seed: int, tool_time_scale: float = TOOL_TIME_SCALE, prefix: str = "") -> list[RequestSpec]:
    """``n`` reproducible requests (issues from examples/swe/workflow.py's ``make_issues``)."""
    file_io, code_exec = prior("file_io"), prior("code_exec")
    specs = []
    for issue in make_issues(n, seed):
        if prefix:
            issue = Issue(id=f"{prefix}{issue.id}", text=issue.text, seed=issue.seed, n_subtasks=issue.n_subtasks)
        rng = random.Random(f"e2e-tools-{issue.seed}")
        attempts = MAX_RETRIES + 1
        doc = tuple(tuple(file_io.sample(rng) for _ in range(attempts)) for _ in range(issue.n_subtasks))
        code = tuple(tuple(code_exec.sample(rng) for _ in range(attempts)) for _ in range(issue.n_subtasks))
        test = tuple(code_exec.sample(rng) for _ in range(MAX_RETRIES + 1))
        # Text lengths from their own stream: the tool draws above stay what they always were.
        trng = random.Random(f"e2e-text-{issue.seed}")
        ctx = trng.randint(*CONTEXT_TOKENS)
        doc_tok = tuple(tuple(trng.randint(*DOC_TOKENS) for _ in range(attempts)) for _ in range(issue.n_subtasks))
        log_tok = tuple(trng.randint(*LOG_TOKENS) for _ in range(MAX_RETRIES + 1))
        specs.append(RequestSpec(issue, failing_rounds(issue), doc, code, test, ctx, doc_tok, log_tok,
                                 tool_time_scale))
    return specs


def with_id(spec: RequestSpec, new_id: str) -> RequestSpec:
    """The same request under another id (same draws, same text lengths)."""
    i = spec.issue
    return dataclasses.replace(spec, issue=Issue(id=new_id, text=i.text, seed=i.seed, n_subtasks=i.n_subtasks))


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Arrival offsets (s) of ``n`` requests at ``rate``/s: the same unit-rate gaps at every rate."""
    rng = random.Random(f"e2e-arrivals-{seed}")
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(1.0) / rate
    return out


# -- scenarios: the arrival process and the requests' shape (benchmarks/e2e.py --scenarios) ---

MMPP_FACTORS = (2.0, 0.5)  # the bursty scenario's rates, x the nominal rate: high state, low state
# Mean state holding times (s), high and low: 1 : 2, so the time-average rate is the nominal one
# (2 x 1/3 + 0.5 x 2/3 = 1).
MMPP_HOLD_QUICK = (1.5, 3.0)
MMPP_HOLD_FULL = (5.0, 10.0)
PHASE_CONTEXT_FACTOR = 2.0  # the phase scenario: the second half's repository context, x the drawn length


def mmpp_arrivals(n: int, rate: float, seed: int, hold_s: tuple = MMPP_HOLD_QUICK, factors: tuple = MMPP_FACTORS,
                  with_states: bool = False):
    """Arrival offsets (s) of ``n`` requests from a two-state Markov-modulated Poisson process
    (the ``bursty`` scenario): the rate alternates between ``factors[0]`` and ``factors[1]`` x
    ``rate``, each state held for an exponential time of mean ``hold_s[0]`` / ``hold_s[1]`` s;
    the first state is drawn from the stationary distribution (high with probability
    hold_high / (hold_high + hold_low)). With the defaults (2x for 1:2 of the time, 0.5x the
    rest) the time-average rate is ``rate``. Seeded (``random.Random(f"e2e-mmpp-{seed}")``); the
    first arrival is at 0. ``with_states``: also return the state segments ``[(start, end,
    factor)]`` (the last one ends after the last arrival)."""
    if rate <= 0 or n < 0 or min(hold_s) <= 0 or min(factors) <= 0:
        raise ValueError(f"bad MMPP parameters: n={n} rate={rate} hold_s={hold_s} factors={factors}")
    rng = random.Random(f"e2e-mmpp-{seed}")
    state = 0 if rng.random() < hold_s[0] / (hold_s[0] + hold_s[1]) else 1
    t, start = 0.0, 0.0
    end = rng.expovariate(1.0 / hold_s[state])
    out: list[float] = []
    segments: list[tuple[float, float, float]] = []
    while len(out) < n:
        gap = rng.expovariate(rate * factors[state])
        if t + gap < end:
            t += gap
            out.append(t)
            continue
        # Memoryless: the state ends before the next arrival; draw afresh in the next state.
        segments.append((start, end, factors[state]))
        t = start = end
        state = 1 - state
        end = t + rng.expovariate(1.0 / hold_s[state])
    segments.append((start, end, factors[state]))
    shift = out[0] if out else 0.0
    out = [a - shift for a in out]
    if not with_states:
        return out
    return out, [(max(0.0, a - shift), b - shift, f) for a, b, f in segments if b > shift]


def max_prompt_tokens(spec: RequestSpec) -> int:
    """The longest prompt of the request (tokens)."""
    return max(len(c["prompt"].encode()) for c in session_calls(spec))


def phase_specs(specs: list[RequestSpec], factor: float = PHASE_CONTEXT_FACTOR) -> list[RequestSpec]:
    """The ``phase`` scenario's requests: the first half as drawn, the second half (in arrival
    order) with its repository context ``factor`` x longer (the same seeded text, longer), cut
    back where needed so that every prompt plus its output fits ``MAX_MODEL_LEN``.
    Deterministic: a pure function of the specs."""
    half = len(specs) // 2
    out = list(specs[:half])
    for s in specs[half:]:
        new = dataclasses.replace(s, context_tokens=int(round(s.context_tokens * factor)))
        over = max_prompt_tokens(new) + PATCH_TOKENS - MAX_MODEL_LEN
        if over > 0:
            new = dataclasses.replace(new, context_tokens=new.context_tokens - over)
        out.append(new)
    return out


# -- synthetic text (seeded; one ASCII character = one token) -------------------------------

_WORDS = ("def", "class", "return", "self", "if", "else", "for", "in", "import", "from", "None", "True",
          "False", "raise", "with", "as", "try", "except", "yield", "lambda", "async", "await", "assert",
          "cache", "parser", "config", "path", "buffer", "token", "line", "record", "export", "writer",
          "reader", "timezone", "offset", "lock", "thread", "queue", "encode", "decode", "utf8", "value",
          "result", "error", "index", "items", "keys", "len", "open", "close", "flush", "logger", "debug",
          "test_", "fixture", "mock", "expected", "actual", "==", "!=", "+=", "->", "(", ")", ":", ",",
          "[", "]", "{", "}", ".", "=", "0", "1", "-1", "'\\n'", "#", "TODO:", "FIXME")


@functools.lru_cache(maxsize=8192)
def synthetic_text(seed: str, n: int, words: tuple = _WORDS, newline: float = 0.08) -> str:
    """Exactly ``n`` ASCII characters of text drawn from ``words`` (code-like by default), a pure
    function of the arguments; ``newline``: chance of a line break after a word."""
    rng = random.Random(seed)
    out: list[str] = []
    size = 0
    while size < n:
        w = rng.choice(words)
        sep = "\n" if rng.random() < newline else " "
        out.append(w + sep)
        size += len(w) + 1
    return "".join(out)[:n]


def repo_context(spec: RequestSpec) -> str:
    """The issue's repository context (``context_tokens`` characters, seeded by the issue)."""
    return synthetic_text(f"ctx-{spec.issue.seed}", spec.context_tokens)


def plan_text(spec: RequestSpec) -> str:
    """The planner's output (PLAN_TOKENS characters), from the spec."""
    return synthetic_text(f"plan-{spec.issue.seed}", PLAN_TOKENS)


def patch_text(spec: RequestSpec, k: int, attempt: int) -> str:
    """Developer ``k``'s output at ``attempt`` (PATCH_TOKENS characters), from the spec."""
    return synthetic_text(f"patch-{spec.issue.seed}-{k}-{attempt}", PATCH_TOKENS)


def doc_answer(seed: int, k: int, attempt: int, n: int) -> str:
    """The doc-search tool's answer (``n`` characters): what the tool returns, in every variant."""
    return synthetic_text(f"docs-{seed}-{k}-{attempt}", n)


def doc_args(spec: RequestSpec, k: int, attempt: int) -> tuple:
    """The doc-search tool's arguments beyond the query: (answer seed, subtask, attempt, length)."""
    return spec.issue.seed, k, attempt, spec.doc_tokens[k][attempt]


# -- the steps and their prompts, shared by every variant -----------------------------------

def subtasks_of(spec: RequestSpec) -> list[str]:
    """The planner's answer (as in examples/swe/workflow.py)."""
    issue = spec.issue
    return [f"{issue.id} step {k}: {issue.text[:30]}" for k in range(issue.n_subtasks)]


def context(spec: RequestSpec) -> str:
    """System prompt + issue line (examples/swe/workflow.py's ``_context``) + repository context."""
    return _context(spec.issue) + "Repository context:\n" + repo_context(spec) + "\n"


def plan_prompt(spec: RequestSpec) -> str:
    return context(spec) + "Plan the subtasks.\n"


def _after_plan(spec: RequestSpec) -> str:
    """The history every later call starts with: the planner's prompt and its plan."""
    return plan_prompt(spec) + "Plan: " + plan_text(spec) + "\n"


def attempts_of(spec: RequestSpec, k: int, attempt: int) -> list[int]:
    """Subtask ``k``'s attempts up to ``attempt``: 0, then ``r + 1`` for each round ``r`` it failed."""
    out = [0]
    for rnd, failing in enumerate(spec.failing):
        if failing == k and rnd + 1 <= attempt:
            out.append(rnd + 1)
    if out[-1] != attempt:
        raise ValueError(f"{spec.id}: subtask {k} has no attempt {attempt} (attempts {out})")
    return out


def patch_prompt(spec: RequestSpec, subtasks: list[str], k: int, attempt: int, docs: str,
                 feedback: str | None) -> str:
    """Developer ``k``'s prompt at ``attempt``, with ``docs`` (this attempt's doc-search answer)
    and ``feedback`` (the failure log that caused it; None at attempt 0). Its earlier attempts
    (prompts, patches, logs, doc answers) are rebuilt from the spec, in attempt order."""
    chain = attempts_of(spec, k, attempt)
    prompt = _after_plan(spec) + f"Subtask: {subtasks[k]}\n"
    for i, a in enumerate(chain):
        if i == 0:
            d = docs if a == attempt else doc_answer(*doc_args(spec, k, a))
            prompt += f"Docs: {d}\nWrite the patch.\n"
        else:
            prev = chain[i - 1]
            log = feedback if a == attempt else tester_report(spec, a - 1).log
            d = docs if a == attempt else doc_answer(*doc_args(spec, k, a))
            prompt += (f"Patch: {patch_text(spec, k, prev)}\nPrevious attempt failed: {log}\n"
                       f"Docs: {d}\nWrite the patch again.\n")
    return prompt


def review_prompt(spec: RequestSpec, patches: list[Patch]) -> str:
    """The tester's prompt: the plan's history and every current patch, in subtask order."""
    body = "".join(f"Subtask: {p.subtask}\nPatch: {p.diff}\n" for p in patches)
    return _after_plan(spec) + "Review these patches:\n" + body + "Review.\n"


def make_patch(spec: RequestSpec, subtasks: list[str], k: int, attempt: int, output_tokens: int) -> Patch:
    """A developer's result: its (spec-derived) patch text; ``output_tokens`` from the engine."""
    return Patch(subtask=subtasks[k], diff=patch_text(spec, k, attempt), attempt=attempt, tokens=output_tokens)


def tester_report(spec: RequestSpec, rnd: int) -> Report:
    """The tester's verdict in round ``rnd`` (drawn up front by the workflow's rule); a failing
    round's log is its first line plus a seeded failure log of ``log_tokens[rnd]`` characters."""
    failing = spec.failing[rnd]
    if failing is None:
        return Report(passed=True, failing=None, log="all tests passed")
    trace = synthetic_text(f"log-{spec.issue.seed}-{rnd}", spec.log_tokens[rnd])
    return Report(passed=False, failing=failing, log=f"test_{failing} failed in round {rnd}\n{trace}")


def sleep_tool(kind: str, payload: str, emulated_s: float, time_scale: float, answer: tuple = ()) -> str:
    """The body of every EMULATED tool: sleep ``emulated_s * time_scale``; a deterministic answer
    (a doc search answers ``doc_answer(*answer)``)."""
    slept = emulated_s * time_scale
    if slept > 0:
        time.sleep(slept)
    if kind == "file_io":
        return doc_answer(*answer)
    return f"exit 0 ({len(payload)} bytes run)"


def engine_call(host, prompt: str, max_tokens: int, request_id: str):
    """Submit one generation to an engine host; a concurrent Future of its RequestOutput."""
    ids = host.tokenizer.encode(prompt)
    return host.submit(request_id, ids, host.sampling_params(max_tokens, 0.0, None), None)


# -- the session's LLM calls, offline (statistics and the ideal latency) ----------------------

def session_calls(spec: RequestSpec) -> list[dict]:
    """Every LLM call of the request in dependency order: ``{"role", "stage", "prompt",
    "max_tokens"}``; calls of a lower ``stage`` finish before a call starts, calls of one stage
    (the first developers) run concurrently."""
    subtasks = subtasks_of(spec)
    calls = [{"role": "planner", "stage": 0, "prompt": plan_prompt(spec), "max_tokens": PLAN_TOKENS}]
    latest = [0] * len(subtasks)
    for k in range(len(subtasks)):
        calls.append({"role": "developer", "stage": 1, "max_tokens": PATCH_TOKENS,
                      "prompt": patch_prompt(spec, subtasks, k, 0, doc_answer(*doc_args(spec, k, 0)), None)})
    stage = 2
    for rnd, failing in enumerate(spec.failing):
        patches = [make_patch(spec, subtasks, k, latest[k], PATCH_TOKENS) for k in range(len(subtasks))]
        calls.append({"role": "tester", "stage": stage, "prompt": review_prompt(spec, patches),
                      "max_tokens": REVIEW_TOKENS})
        stage += 1
        if failing is not None:
            a = rnd + 1
            calls.append({"role": "developer", "stage": stage, "max_tokens": PATCH_TOKENS,
                          "prompt": patch_prompt(spec, subtasks, failing, a, doc_answer(*doc_args(spec, failing, a)),
                                                 tester_report(spec, rnd).log)})
            latest[failing] = a
            stage += 1
    return calls


def _common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix (binary search on C-speed slice comparisons)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _reuse(calls: list[dict], bs: int) -> list[tuple[int, int, int]]:
    """Per call: (prompt tokens, tokens reusable from the session's earlier calls, tokens
    reusable from those or from the system prompt every session shares), block-aligned and at
    most all but the last token (the engine always computes it)."""
    sys_len = len(SYSTEM.encode())
    out = []
    for c in calls:
        n = len(c["prompt"].encode())
        cap = ((n - 1) // bs) * bs
        earlier = max((_common_prefix(c["prompt"], e["prompt"]) for e in calls if e["stage"] < c["stage"]), default=0)
        own = min(cap, (earlier // bs) * bs)
        out.append((n, own, max(own, min(cap, (sys_len // bs) * bs))))
    return out


@functools.lru_cache(maxsize=4096)
def _call_costs(spec: RequestSpec, engine_items: tuple) -> tuple:
    """Per call, in session_calls' order: (stage, prompt tokens, cached tokens at best, max_tokens)."""
    calls = session_calls(spec)
    reuse = _reuse(calls, dict(engine_items)["block_size"])
    return tuple((c["stage"], n, cached, c["max_tokens"]) for c, (n, _, cached) in zip(calls, reuse))


def ideal_latency(spec: RequestSpec, engine: dict | None = None) -> float:
    """A lower bound of the request's latency: critical path, no queueing, no framework overhead,
    one sequence per engine iteration, and every prompt block the session's earlier calls (or
    the system prompt) hold already cached."""
    p = ENGINE if engine is None else engine
    scale = p.get("time_scale", 1.0)  # wall seconds per emulated second
    step = p["decode_s_per_step"] + p["decode_s_per_seq"]
    costs = _call_costs(spec, tuple(sorted(p.items())))  # in session_calls' order

    def llm(i: int) -> float:
        _, n, cached, max_tokens = costs[i]
        return ((n - cached) * p["prefill_s_per_token"] + max_tokens * step) * scale

    ts = spec.tool_time_scale
    n_sub = spec.issue.n_subtasks
    # planner, then the slowest first developer (doc search, its call, code run), then the rounds
    t = llm(0) + max((spec.doc_s[k][0] + spec.code_s[k][0]) * ts + llm(1 + k) for k in range(n_sub))
    i = 1 + n_sub
    for rnd, failing in enumerate(spec.failing):
        t += llm(i) + spec.test_s[rnd] * ts
        i += 1
        if failing is not None:  # the retry's attempt number is the retry count (as in the workflow)
            a = rnd + 1
            t += (spec.doc_s[failing][a] + spec.code_s[failing][a]) * ts + llm(i)
            i += 1
    return t


def token_stats(specs: list[RequestSpec], block_size: int | None = None) -> dict:
    """Token statistics of the requests' prompts (see the module docstring)."""
    bs = ENGINE["block_size"] if block_size is None else block_size
    n = prompt = own = shared = out = calls = 0
    per_call = []
    for s in specs:
        cs = session_calls(s)
        for c, (tok, o, sh) in zip(cs, _reuse(cs, bs)):
            prompt += tok
            own += o
            shared += sh
            out += c["max_tokens"]
            per_call.append(tok)
        calls += len(cs)
        n += 1
    return {
        "mean_llm_calls": calls / max(n, 1),
        "mean_prompt_tokens_per_call": prompt / max(calls, 1),
        "max_prompt_tokens": max(per_call, default=0),
        "mean_output_tokens_per_call": out / max(calls, 1),
        "prompt_per_output_token": prompt / out if out else float("nan"),
        "reusable_share_from_session": own / prompt if prompt else float("nan"),
        "reusable_share_with_system_prompt": shared / prompt if prompt else float("nan"),
        "fresh_prompt_tokens_per_request": (prompt - shared) / max(n, 1),
        "copilot_cached_share": 540.95 / 631.4,
    }


def engine_work(spec: RequestSpec) -> dict:
    """LLM calls and decode tokens of one request (for sizing the load)."""
    calls = 1 + spec.issue.n_subtasks + len(spec.failing) + spec.retries
    tokens = PLAN_TOKENS + PATCH_TOKENS * (spec.issue.n_subtasks + spec.retries) + REVIEW_TOKENS * len(spec.failing)
    return {"llm_calls": calls, "decode_tokens": tokens,
            "tool_calls": 2 * (spec.issue.n_subtasks + spec.retries) + len(spec.failing)}


def prompt_tokens(spec: RequestSpec) -> int:
    """Prompt tokens the request sends in all (what the engines count as queries)."""
    return sum(len(c["prompt"].encode()) for c in session_calls(spec))


# -- the dask-agents form (examples/swe/workflow.py's components, reading the spec) -----------

@da.tool(kind="file_io")
def doc_search(query: str, emulated_s: float, time_scale: float, answer: tuple) -> str:
    """Search the repository's docs (EMULATED latency from the file_io prior; seeded answer)."""
    return sleep_tool("file_io", query, emulated_s, time_scale, answer)


@da.tool(kind="code_exec")
def code_exec(code: str, emulated_s: float, time_scale: float) -> str:
    """Run a snippet in a sandbox (EMULATED latency from the code_exec prior)."""
    return sleep_tool("code_exec", code, emulated_s, time_scale)


@da.agent(model=MODEL)
class Planner:
    """Splits an issue into subtasks."""

    def plan(self, spec: RequestSpec) -> list[str]:
        da.llm(MODEL).generate(plan_prompt(spec), max_tokens=PLAN_TOKENS).value()
        return subtasks_of(spec)


@da.agent(model=MODEL)
class Developer:
    """Implements one subtask, looking things up and trying code with tools."""

    def implement(self, spec: RequestSpec, subtasks: list[str], k: int, feedback: str | None = None,
                  attempt: int = 0) -> Patch:
        subtask = subtasks[k]
        docs = da.stub(doc_search)(subtask, spec.doc_s[k][attempt], spec.tool_time_scale, doc_args(spec, k, attempt))
        prompt = patch_prompt(spec, subtasks, k, attempt, docs.value(), feedback)
        answer = da.llm(MODEL).generate(prompt, max_tokens=PATCH_TOKENS).value()
        da.stub(code_exec)(f"{subtask} attempt {attempt}", spec.code_s[k][attempt], spec.tool_time_scale).value()
        return make_patch(spec, subtasks, k, attempt, answer.output_tokens)


@da.agent(model=MODEL)
class Tester:
    """Runs the tests on all patches; reports the first failing subtask."""

    def test(self, spec: RequestSpec, patches: list[Patch], round: int) -> Report:
        da.llm(MODEL).generate(review_prompt(spec, patches), max_tokens=REVIEW_TOKENS).value()
        da.stub(code_exec)(f"pytest {spec.id} round {round}", spec.test_s[round], spec.tool_time_scale).value()
        return tester_report(spec, round)


def solve_agents(client, spec: RequestSpec) -> dict:
    """Drive one request in its own session (examples/swe/workflow.py's ``solve``)."""
    planner, developer, tester = da.stub(Planner), da.stub(Developer), da.stub(Tester)
    with da.session(client, name=spec.id):
        subtasks = planner.plan(spec)
        patches = [developer.implement(spec, subtasks, k) for k in range(len(subtasks))]
        retries = 0
        report = tester.test(spec, patches, 0).value()
        while not report.passed:
            retries += 1
            k = report.failing
            patches[k] = developer.implement(spec, subtasks, k, feedback=report.log, attempt=retries)
            report = tester.test(spec, patches, retries).value()
        done = [p.value() for p in patches]
    return {"retries": retries, "passed": report.passed, "patches": len(done)}


def check_outcome(spec: RequestSpec, out: dict) -> None:
    """Every variant must do exactly the request's work: same retries, passed at the end."""
    if out.get("retries") != spec.retries or not out.get("passed") or out.get("patches") != spec.issue.n_subtasks:
        raise AssertionError(f"{spec.id}: outcome {out} differs from the spec "
                             f"(retries {spec.retries}, {spec.issue.n_subtasks} patches)")


def describe_specs(specs: list[RequestSpec]) -> dict:
    """Totals of a request set (for the configuration printout), with the prompts' token statistics."""
    w = [engine_work(s) for s in specs]
    ideal = sorted(ideal_latency(s) for s in specs)
    n = max(len(specs), 1)
    return {
        "requests": len(specs),
        "mean_subtasks": sum(s.issue.n_subtasks for s in specs) / n,
        "mean_retries": sum(s.retries for s in specs) / n,
        "mean_llm_calls": sum(x["llm_calls"] for x in w) / n,
        "mean_tool_calls": sum(x["tool_calls"] for x in w) / n,
        "mean_decode_tokens": sum(x["decode_tokens"] for x in w) / n,
        "ideal_latency_mean_s": sum(ideal) / n,
        "ideal_latency_p99_s": percentile(ideal, 99),
        "tokens": token_stats(specs),
    }
