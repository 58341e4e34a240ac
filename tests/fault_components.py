"""Components for tests/test_faults.py, importable by worker subprocesses.

Each call leaves a marker file ``<dir>/<what>-<key>-<pid>`` when it starts, so a test can see
where it ran and whether it ran twice; ``hold`` makes a call wait for ``<dir>/release``.
"""

from __future__ import annotations

import os
import time

import dask_agents as da


def _mark(marker_dir: str, what: str) -> None:
    key = da.current_call() or "driver"
    with open(os.path.join(marker_dir, f"{what}-{key}-{os.getpid()}"), "w"):
        pass


def _hold(marker_dir: str, hold: bool, limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    while hold and not os.path.exists(os.path.join(marker_dir, "release")) and time.monotonic() < deadline:
        time.sleep(0.02)


@da.agent(stateful=True)
class Counter:
    """A stateful agent: its count is the session's state."""

    def __init__(self) -> None:
        self.n = 0

    def bump(self, marker_dir: str, hold: bool = False) -> tuple[int, int]:
        _mark(marker_dir, "bump")
        self.n += 1
        _hold(marker_dir, hold)
        return self.n, os.getpid()


@da.tool(kind="code_exec")
def slow_double(x: int, marker_dir: str, hold: bool = False) -> tuple[int, int]:
    """A stateless tool that can be held mid-run."""
    _mark(marker_dir, "slow")
    _hold(marker_dir, hold)
    return 2 * x, os.getpid()


@da.tool(kind="code_exec")
def relay_bump(marker_dir: str) -> tuple[int, int]:
    """Bumps the session's Counter from wherever this tool runs: a nested call, made by this
    worker's own client, into the caller's session."""
    return da.stub(Counter).bump(marker_dir).value(timeout=60)


@da.tool
def echo(x: int) -> int:
    return x


@da.tool
def nested_window() -> tuple[int, float]:
    """A nested call from this worker's own client, then that client's client -> scheduler
    batching window (seconds)."""
    from distributed import get_client

    return da.stub(echo)(7).value(timeout=60), get_client().scheduler_comm.interval


@da.tool
def nested_results(n: int) -> list:
    """``n`` nested calls read back here, each result the object stored in this worker's memory
    when the call ran here."""
    from distributed import get_worker

    out = []
    for i in range(n):
        f = da.stub(echo)(i)
        value = f.value(timeout=60)
        out.append((value, f.key in get_worker().data))
    return out


# -- benchmarks/faults.py: an Open-SWE-shaped workflow whose answer depends on session state ------
# Planner -> Developers (in parallel, each with a doc-search and a code-exec tool and an LLM call)
# -> Tester, retrying the failing subtask. Every agent records its step in the session's stateful
# ``Trajectory``; the request's answer is the trajectory's digest, so a call silently run on a
# fresh instance (missing the earlier steps) shows as a wrong answer. Everything is deterministic
# in the issue's seed: ``swe_expected`` computes the same answer locally, without Dask.
import hashlib  # noqa: E402
import random  # noqa: E402

SWE_MAX_RETRIES = 2
SWE_FAIL_PROBABILITY = 0.4


def swe_digest(value: object) -> str:
    """A short, process-independent digest of ``repr(value)``."""
    return hashlib.sha256(repr(value).encode()).hexdigest()[:16]


def swe_plan(issue_id: str, seed: int) -> list[str]:
    """The planner's subtasks (2-4, from the seed)."""
    n = random.Random(f"{seed}-plan").choice([2, 3, 3, 4])
    return [f"{issue_id} step {k}" for k in range(n)]


def swe_patch(subtask: str, attempt: int, feedback: str | None) -> str:
    """A developer's patch for ``subtask`` (its ``attempt``-th, after ``feedback``)."""
    return f"patch[{swe_digest((subtask, attempt, feedback))}]"


def swe_verdict(seed: int, round: int, n: int) -> tuple[bool, int | None]:
    """The tester's verdict in ``round`` on ``n`` patches: (passed, failing subtask)."""
    rng = random.Random(f"{seed}-test-{round}")
    if round < SWE_MAX_RETRIES and rng.random() < SWE_FAIL_PROBABILITY:
        return False, rng.randrange(n)
    return True, None


def swe_feedback(k: int, round: int) -> str:
    """What the driver tells the developer retrying subtask ``k`` after test ``round`` failed."""
    return f"subtask {k} failed in round {round}"


def swe_sleep(what: str, median: float, time_scale: float) -> None:
    """An emulated tool/think latency: lognormal around ``median`` x ``time_scale``, seeded."""
    time.sleep(median * time_scale * random.Random(what).lognormvariate(0, 0.4))


@da.agent(stateful=True)
class Trajectory:
    """The session's memory: every agent records its step here (one instance per session).

    ``record`` is idempotent for the same (step, value) (a stateless agent that Dask re-runs
    after its worker died records its step again): the repeats are counted, not added."""

    def __init__(self) -> None:
        self.steps: dict[str, str] = {}
        self.repeats = 0

    def record(self, step: str, value: str) -> int:
        old = self.steps.get(step)
        if old is not None:
            if old != value:
                raise ValueError(f"step {step} recorded twice with different values: {old!r} then {value!r}")
            self.repeats += 1
        self.steps[step] = value
        return len(self.steps)

    def summary(self) -> dict:
        return {"digest": swe_digest(sorted(self.steps.items())), "steps": len(self.steps),
                "repeats": self.repeats, "pid": os.getpid()}


@da.tool(kind="file_io")
def swe_doc_search(query: str, time_scale: float = 1.0) -> str:
    swe_sleep(query, 0.045, time_scale)
    return f"docs[{swe_digest(query)}]"


@da.tool(kind="code_exec")
def swe_code_exec(code: str, time_scale: float = 1.0) -> str:
    swe_sleep(code, 0.18, time_scale)
    return f"ran[{swe_digest(code)}]"


def _swe_think(model: str | None, prompt: str, time_scale: float) -> int:
    """One LLM call (EMULATED engine ``model``), or an emulated think time without a model."""
    if model is None:
        swe_sleep(prompt, 0.1, time_scale)
        return 8
    return da.llm(model).generate(prompt, max_tokens=8).value().output_tokens


@da.agent
class SWEPlanner:
    def plan(self, issue_id: str, seed: int, model: str | None = None, time_scale: float = 1.0) -> list[str]:
        _swe_think(model, f"{issue_id}: plan the subtasks", time_scale)
        subtasks = swe_plan(issue_id, seed)
        da.stub(Trajectory).record("plan", swe_digest(subtasks)).value()
        return subtasks


@da.agent
class SWEDeveloper:
    def implement(self, subtasks: list[str], k: int, attempt: int = 0, feedback: str | None = None,
                  model: str | None = None, time_scale: float = 1.0) -> str:
        subtask = subtasks[k]
        docs = da.stub(swe_doc_search)(subtask, time_scale).value()
        tokens = _swe_think(model, f"{subtask}\n{docs}\n{feedback or ''}\nwrite the patch", time_scale)
        ran = da.stub(swe_code_exec)(f"{subtask} attempt {attempt}", time_scale).value()
        patch = swe_patch(subtask, attempt, feedback)
        da.stub(Trajectory).record(f"dev{k}.a{attempt}", swe_digest((patch, docs, ran, tokens))).value()
        return patch


@da.agent
class SWETester:
    def test(self, seed: int, patches: list[str], round: int, model: str | None = None,
             time_scale: float = 1.0) -> tuple[bool, int | None]:
        _swe_think(model, f"review round {round}: {' '.join(patches)}", time_scale)
        da.stub(swe_code_exec)(f"pytest {seed} round {round}", time_scale).value()
        verdict = swe_verdict(seed, round, len(patches))
        da.stub(Trajectory).record(f"test.r{round}", swe_digest((patches, verdict))).value()
        return verdict


def swe_combine(patches: list[str]) -> str:
    """Plain Dask work inside the session (not a recorded call): the final patch set's digest."""
    return swe_digest(patches)


def swe_expected(issue_id: str, seed: int) -> dict:
    """The answer a correct run gives, computed locally without Dask (the same code, no calls)."""
    steps: dict[str, str] = {}
    subtasks = swe_plan(issue_id, seed)
    steps["plan"] = swe_digest(subtasks)

    def implement(k: int, attempt: int, feedback: str | None) -> str:
        subtask = subtasks[k]
        docs = f"docs[{swe_digest(subtask)}]"
        ran = f"ran[{swe_digest(f'{subtask} attempt {attempt}')}]"
        patch = swe_patch(subtask, attempt, feedback)
        steps[f"dev{k}.a{attempt}"] = swe_digest((patch, docs, ran, 8))
        return patch

    patches = [implement(k, 0, None) for k in range(len(subtasks))]
    round = 0
    while True:
        verdict = swe_verdict(seed, round, len(patches))
        steps[f"test.r{round}"] = swe_digest((patches, verdict))
        if verdict[0]:
            break
        round += 1
        k = verdict[1]
        patches[k] = implement(k, round, swe_feedback(k, round - 1))
    return {"trajectory": swe_digest(sorted(steps.items())), "steps": len(steps), "patches": swe_digest(patches),
            "retries": round}
