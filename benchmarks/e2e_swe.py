"""The Open-SWE workflow of ``benchmarks/e2e.py``: request specs, the EMULATED resources, and the
dask-agents form of the workflow.

One request is one Open-SWE session, exactly the logic of ``examples/swe/workflow.py``:
planner (one LLM call) -> one developer per subtask in parallel (doc-search tool, LLM call,
code-exec tool) -> tester (LLM call, code-exec tool) -> while the tester reports a failing
subtask: that developer again with the feedback, then the tester again (at most
``MAX_RETRIES`` rounds). Prompts are built with the workflow's own ``_context`` (its system
prompt and the issue line), with the same ``max_tokens`` (16, 24, 8), and a tester round fails
by the workflow's own seeded rule (``random.Random(f"{seed}-{round}")``, ``FAIL_PROBABILITY``).

What differs from ``examples/swe/workflow.py`` (on purpose, so every framework does the same
work): everything random about a request is drawn up front, once, from a seeded RNG into a
:class:`RequestSpec` (subtask count, which round fails and which subtask, every tool latency),
and every variant reads it from there. Tool latencies are drawn from the SAGA priors of
:mod:`kv.tool_latency` (file_io for doc search, code_exec for code runs) and slept times
``tool_time_scale`` (the workflow's own tools sleep a log-normal around the medians instead).

Everything timed here is EMULATED: the engine is :class:`worker_plugin.emulated.EmulatedEngineHost`
(a cost model) and the tools sleep.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

import dask_agents as da
from examples.swe.workflow import FAIL_PROBABILITY, MAX_RETRIES, SYSTEM, Issue, Patch, Report, _context, make_issues
from kv.tool_latency import prior

MODEL = "coder"  # the model name the Open-SWE agents call (da.llm("coder"))
PLAN_TOKENS, PATCH_TOKENS, REVIEW_TOKENS = 16, 24, 8  # max_tokens of examples/swe/workflow.py

# The EMULATED engine of every variant. Engine costs are wall seconds (time_scale 1.0).
# - max_batch 8, decode 20 ms per iteration (+0.05 ms per running sequence), prefill 0.2 ms
#   per non-cached prompt token: one call of the workflow (~500-650 prompt tokens, 8-24 output
#   tokens) takes 0.2-0.6 s alone; 8 calls batched take about as long as one, so batching
#   matters (a replica serves ~8x more decode tokens per second when its batch is full).
# - the workflow's system prompt is 420 tokens = 26 full 16-token blocks shared by every
#   prompt: with prefix reuse a call prefills ~100-200 tokens instead of ~500-650, i.e. the
#   prefill share of a call drops from ~0.1 s to ~0.03 s (prefix reuse matters).
# - KV: 256 blocks of 16 tokens (4096 tokens) per replica: a full batch of 8 prompts sharing
#   the system prompt needs ~26 + 8 x 14 blocks, so the batch fits and the rest of the KV
#   keeps recent sessions' blocks as prefix cache (LRU).
# Two replicas saturate at about 4-4.5 requests/s of this workflow (measured: the peers, which
# add the least overhead, complete ~4.4 requests/s at 6/s offered), a load 2 cores can drive
# through Dask with CPU to spare (~20 tasks per request).
ENGINE = {
    "max_batch": 8,
    "decode_s_per_step": 0.02,
    "decode_s_per_seq": 5e-5,
    "prefill_s_per_token": 2e-4,
    "kv_blocks": 256,
    "block_size": 16,
    "time_scale": 1.0,
}
MAX_MODEL_LEN = 4096
TOOL_TIME_SCALE = 0.1  # wall seconds per emulated tool second (SAGA priors x 0.1)


def model_entry(engine: dict | None = None) -> dict:
    """The ``agents.llm.models.coder`` entry of the EMULATED engine (also used to build it by hand)."""
    return {"model": "emulated-swe", "engine": "emulated", "tokenizer": "byte",
            "max-model-len": MAX_MODEL_LEN, "enable-prefix-caching": True,
            "emulation": dict(ENGINE if engine is None else engine)}


def make_engine(name: str = MODEL, engine: dict | None = None):
    """One EMULATED engine host, started: the same class dask-agents' worker plugin hosts."""
    from worker_plugin.emulated import EmulatedEngineHost
    from worker_plugin.engine import ModelSettings

    host = EmulatedEngineHost(name, ModelSettings(**model_entry(engine)))
    host.start()
    host.wait_loaded(10)
    return host


# -- requests ------------------------------------------------------------------------------

@dataclass(frozen=True)
class RequestSpec:
    """One Open-SWE request with all its random draws made (identical in every variant).

    ``failing[r]``: the subtask the tester reports failing in round ``r`` (None: passed);
    ``doc_s[k][a]`` / ``code_s[k][a]``: EMULATED latency (s, unscaled) of subtask ``k``'s
    doc search / code run at attempt ``a``; ``test_s[r]``: the tester's code run in round ``r``.
    """

    issue: Issue
    failing: tuple
    doc_s: tuple
    code_s: tuple
    test_s: tuple
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
        specs.append(RequestSpec(issue, failing_rounds(issue), doc, code, test, tool_time_scale))
    return specs


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Arrival offsets (s) of ``n`` requests at ``rate``/s: the same unit-rate gaps at every rate."""
    rng = random.Random(f"e2e-arrivals-{seed}")
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(1.0) / rate
    return out


# -- the steps, shared by every variant -----------------------------------------------------

def subtasks_of(spec: RequestSpec) -> list[str]:
    """The planner's answer (as in examples/swe/workflow.py)."""
    issue = spec.issue
    return [f"{issue.id} step {k}: {issue.text[:30]}" for k in range(issue.n_subtasks)]


def plan_prompt(spec: RequestSpec) -> str:
    return _context(spec.issue) + "Plan the subtasks."


def patch_prompt(spec: RequestSpec, subtask: str, docs: str, feedback: str | None) -> str:
    prompt = _context(spec.issue) + f"Subtask: {subtask}\nDocs: {docs}\n"
    if feedback:
        prompt += f"Previous attempt failed: {feedback}\n"
    return prompt + "Write the patch."


def review_prompt(spec: RequestSpec, subtasks: list[str]) -> str:
    return _context(spec.issue) + "Review these patches:\n" + "\n".join(subtasks) + "\n"


def tester_report(spec: RequestSpec, rnd: int) -> Report:
    """The tester's verdict in round ``rnd`` (drawn up front by the workflow's rule)."""
    failing = spec.failing[rnd]
    if failing is None:
        return Report(passed=True, failing=None, log="all tests passed")
    return Report(passed=False, failing=failing, log=f"test_{failing} failed in round {rnd}")


def sleep_tool(kind: str, payload: str, emulated_s: float, time_scale: float) -> str:
    """The body of every EMULATED tool: sleep ``emulated_s * time_scale``; a deterministic answer."""
    slept = emulated_s * time_scale
    if slept > 0:
        time.sleep(slept)
    if kind == "file_io":
        return f"[docs for {payload[:40]!r}: see module reference]"
    return f"exit 0 ({len(payload)} bytes run)"


def engine_call(host, prompt: str, max_tokens: int, request_id: str):
    """Submit one generation to an engine host; a concurrent Future of its RequestOutput."""
    ids = host.tokenizer.encode(prompt)
    return host.submit(request_id, ids, host.sampling_params(max_tokens, 0.0, None), None)


def ideal_latency(spec: RequestSpec, engine: dict | None = None) -> float:
    """A lower bound of the request's latency: critical path, no queueing, no framework overhead,
    one sequence per engine iteration, and every prompt block already cached except the ones
    that hold request-specific text."""
    p = ENGINE if engine is None else engine
    bs = p["block_size"]
    step = p["decode_s_per_step"] + p["decode_s_per_seq"]
    ctx_blocks = len(SYSTEM.encode()) // bs  # the blocks every prompt shares

    def llm(prompt: str, max_tokens: int) -> float:
        n = len(prompt.encode())
        cached = min(ctx_blocks * bs, ((n - 1) // bs) * bs)
        return (n - cached) * p["prefill_s_per_token"] + max_tokens * step

    ts = spec.tool_time_scale
    subtasks = subtasks_of(spec)

    def dev(k: int, attempt: int, feedback: str | None) -> float:
        d = f"[docs for {subtasks[k][:40]!r}: see module reference]"
        return ((spec.doc_s[k][attempt] + spec.code_s[k][attempt]) * ts
                + llm(patch_prompt(spec, subtasks[k], d, feedback), PATCH_TOKENS))

    t = llm(plan_prompt(spec), PLAN_TOKENS)
    t += max(dev(k, 0, None) for k in range(len(subtasks)))
    for rnd, failing in enumerate(spec.failing):
        t += llm(review_prompt(spec, subtasks), REVIEW_TOKENS) + spec.test_s[rnd] * ts
        if failing is not None:  # the retry's attempt number is the retry count (as in the workflow)
            t += dev(failing, rnd + 1, tester_report(spec, rnd).log)
    return t


def engine_work(spec: RequestSpec) -> dict:
    """LLM calls and decode tokens of one request (for sizing the load)."""
    calls = 1 + spec.issue.n_subtasks + len(spec.failing) + spec.retries
    tokens = PLAN_TOKENS + PATCH_TOKENS * (spec.issue.n_subtasks + spec.retries) + REVIEW_TOKENS * len(spec.failing)
    return {"llm_calls": calls, "decode_tokens": tokens,
            "tool_calls": 2 * (spec.issue.n_subtasks + spec.retries) + len(spec.failing)}


# -- the dask-agents form (examples/swe/workflow.py's components, reading the spec) -----------

@da.tool(kind="file_io")
def doc_search(query: str, emulated_s: float, time_scale: float) -> str:
    """Search the repository's docs (EMULATED latency from the file_io prior)."""
    return sleep_tool("file_io", query, emulated_s, time_scale)


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
        docs = da.stub(doc_search)(subtask, spec.doc_s[k][attempt], spec.tool_time_scale)
        prompt = patch_prompt(spec, subtask, docs.value(), feedback)
        answer = da.llm(MODEL).generate(prompt, max_tokens=PATCH_TOKENS).value()
        ran = da.stub(code_exec)(f"{subtask} attempt {attempt}", spec.code_s[k][attempt], spec.tool_time_scale).value()
        return Patch(subtask=subtask, diff=f"{answer.text[:16]!r} / {ran}", attempt=attempt,
                     tokens=answer.output_tokens)


@da.agent(model=MODEL)
class Tester:
    """Runs the tests on all patches; reports the first failing subtask."""

    def test(self, spec: RequestSpec, patches: list[Patch], round: int) -> Report:
        summary = [p.subtask for p in patches]
        da.llm(MODEL).generate(review_prompt(spec, summary), max_tokens=REVIEW_TOKENS).value()
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
    """Totals of a request set (for the configuration printout)."""
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
        "ideal_latency_p99_s": ideal[min(len(ideal) - 1, math.ceil(0.99 * len(ideal)) - 1)] if ideal else float("nan"),
    }
