"""The Open-SWE workflow: planner -> developers in parallel (each with doc-search and code-exec
tools) -> tester -> retry the failing subtask with feedback, up to ``MAX_RETRIES``.

Every agent thinks with a real LLM call (``da.llm("coder")``). Tools emulate their latency
(a seeded draw around SAGA's medians: file_io 45 ms, code_exec 180 ms); whether a test run
fails is drawn from the request's seed, so a run is reproducible.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import dask_agents as da

SYSTEM = (
    "You are part of a software engineering team working on a Python repository. "
    "Be precise, keep patches minimal, and explain failures briefly. "
) * 3
MAX_RETRIES = 3
FAIL_PROBABILITY = 0.35


@dataclass(frozen=True)
class Issue:
    """One request: an issue to fix, with the seed that decides its test outcomes."""

    id: str
    text: str
    seed: int
    n_subtasks: int = 3


@dataclass(frozen=True)
class Patch:
    """A developer's answer for one subtask."""

    subtask: str
    diff: str
    attempt: int
    tokens: int


@dataclass(frozen=True)
class Report:
    """The tester's verdict on a set of patches."""

    passed: bool
    failing: int | None
    log: str


@dataclass
class Outcome:
    """What the driver saw for one request."""

    issue: Issue
    session: str
    retries: int
    passed: bool
    latency: float
    patches: list[Patch] = field(default_factory=list)


def _context(issue: Issue) -> str:
    return f"{SYSTEM}\nIssue {issue.id}: {issue.text}\n"


def _tool_sleep(seed: str, median: float) -> float:
    delay = median * random.Random(seed).lognormvariate(0, 0.5)
    time.sleep(delay)  # emulated tool latency
    return delay


@da.tool(kind="file_io")
def doc_search(query: str) -> str:
    """Search the repository's docs (emulated latency, deterministic answer)."""
    _tool_sleep(query, 0.045)
    return f"[docs for {query[:40]!r}: see module reference]"


@da.tool(kind="code_exec")
def code_exec(code: str) -> str:
    """Run a snippet in a sandbox (emulated latency)."""
    _tool_sleep(code, 0.180)
    return f"exit 0 ({len(code)} bytes run)"


@da.agent(model="coder")
class Planner:
    """Splits an issue into subtasks."""

    def plan(self, issue: Issue) -> list[str]:
        """Ask the LLM for a plan; return one subtask per planned step."""
        da.llm("coder").generate(_context(issue) + "Plan the subtasks.", max_tokens=16).value()
        return [f"{issue.id} step {k}: {issue.text[:30]}" for k in range(issue.n_subtasks)]


@da.agent(model="coder")
class Developer:
    """Implements one subtask, looking things up and trying code with tools."""

    def implement(self, issue: Issue, subtasks: list[str], k: int, feedback: str | None = None,
                  attempt: int = 0) -> Patch:
        """Write a patch for ``subtasks[k]`` (using ``feedback`` on a retry)."""
        subtask = subtasks[k]
        docs = da.stub(doc_search)(subtask)
        prompt = _context(issue) + f"Subtask: {subtask}\nDocs: {docs.value()}\n"
        if feedback:
            prompt += f"Previous attempt failed: {feedback}\n"
        answer = da.llm("coder").generate(prompt + "Write the patch.", max_tokens=24).value()
        ran = da.stub(code_exec)(f"{subtask} attempt {attempt}").value()
        return Patch(subtask=subtask, diff=f"{answer.text[:16]!r} / {ran}", attempt=attempt,
                     tokens=answer.output_tokens)


@da.agent(model="coder")
class Tester:
    """Runs the tests on all patches; reports the first failing subtask."""

    def test(self, issue: Issue, patches: list[Patch], round: int) -> Report:
        """Review with the LLM, run the suite, and decide (seeded)."""
        summary = "\n".join(p.subtask for p in patches)
        da.llm("coder").generate(_context(issue) + f"Review these patches:\n{summary}\n", max_tokens=8).value()
        da.stub(code_exec)(f"pytest {issue.id} round {round}").value()
        rng = random.Random(f"{issue.seed}-{round}")
        if round < MAX_RETRIES and rng.random() < FAIL_PROBABILITY:
            failing = rng.randrange(len(patches))
            return Report(passed=False, failing=failing, log=f"test_{failing} failed in round {round}")
        return Report(passed=True, failing=None, log="all tests passed")


def solve(client, issue: Issue) -> Outcome:
    """Drive one request in its own session; returns its outcome."""
    planner, developer, tester = da.stub(Planner), da.stub(Developer), da.stub(Tester)
    t0 = time.time()
    with da.session(client, name=issue.id) as s:
        subtasks = planner.plan(issue)  # an AgentFuture, returned at once
        # len() materializes the plan; the developers then run in parallel
        patches = [developer.implement(issue, subtasks, k) for k in range(len(subtasks))]
        retries = 0
        report = tester.test(issue, patches, 0).value()  # waits for the tester only
        while not report.passed:
            retries += 1
            k = report.failing
            patches[k] = developer.implement(issue, subtasks, k, feedback=report.log, attempt=retries)
            report = tester.test(issue, patches, retries).value()
        done = [p.value() for p in patches]
        passed = report.passed
    return Outcome(issue=issue, session=s.id, retries=retries, passed=passed, latency=time.time() - t0, patches=done)


def make_issues(n: int, seed: int) -> list[Issue]:
    """``n`` reproducible issues."""
    rng = random.Random(seed)
    topics = ["parser drops the last line", "race in the cache", "wrong timezone in logs",
              "crash on empty input", "slow CSV export", "unicode path handling"]
    return [
        Issue(id=f"issue{i}", text=f"{rng.choice(topics)} (case {rng.randrange(1000)})",
              seed=rng.randrange(1 << 30), n_subtasks=rng.choice([2, 3, 3, 4]))
        for i in range(n)
    ]
