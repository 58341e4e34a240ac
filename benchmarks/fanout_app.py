"""The fan-out research workflow of ``benchmarks/fanout.py``, written twice: as a new user writes
it on dask-agents and as a careful user writes it on plain Dask.

One request: a researcher plans with the LLM, runs 3 searches (a 3 ms tool, 3 documents each),
9 readers each summarize one document with the LLM (~300-token prompts, 16 output tokens), a
writer drafts from the notes, and a stateful critic reviews the draft, sending it back to the
writer 0-3 times (decided by the question, so both versions do the same work). Every LLM call is
on the worker's real vLLM engine (the shipped tiny model). The two versions share every prompt
builder, so they send the engines the same token counts.

- dask-agents: the researcher, readers, writer and critic are components (``@da.agent``, the
  critic ``stateful=True``), the search a ``@da.tool``; every call is a stub call and every LLM
  call ``da.llm(MODEL).generate``, made inside the researcher (nested calls).
- plain Dask: the researcher is a task; it calls the search inline (a plain function), submits
  the 9 readers as tasks through ``worker_client()`` (which secedes while it waits), and calls
  the engine of its own worker inline for its own LLM calls; the critic is an object living in
  the researcher's task. Each reader task calls the engine of the worker it runs on. Every
  worker hosts the same engine class dask-agents' worker plugin hosts, from the same settings,
  behind its stepping thread (:class:`EngineHostPlugin`).
"""

from __future__ import annotations

import hashlib
import random
import time
import uuid
from typing import Any

from distributed import WorkerPlugin, get_worker, worker_client

import dask_agents as da

MODEL = "tiny"
# The engine every worker of both variants hosts: the shipped tiny model (dummy weights, byte
# tokenizer), vLLM's prefix cache, 64 MiB of KV (the package's default ``coder`` entry).
ENTRY = {"model": "builtin:tiny-llama", "load-format": "dummy", "tokenizer": "byte", "dtype": "bfloat16",
         "max-model-len": 2048, "kv-cache-memory-bytes": "64 MiB", "enable-prefix-caching": True}
PROMPT_TOKENS = 300  # a source document (bytes = tokens with the byte tokenizer)
OUT_TOKENS = 16
SEARCHES = 3
DOCS_PER_SEARCH = 3
TOOL_S = 0.003  # one search
MAX_SEND_BACKS = 3
WORDS = ("agent cache tensor graph session worker engine prefix token batch queue future plan "
         "search reader writer critic draft source claim result latency memory schedule").split()


def text(seed: str, n: int) -> str:
    """About ``n`` bytes of words, the same for the same seed (in any process)."""
    rng = random.Random(hashlib.sha256(seed.encode()).digest())
    out: list[str] = []
    size = 0
    while size < n:
        w = rng.choice(WORDS)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n]


def send_backs(question: str) -> int:
    """How many times the critic sends this question's draft back (0-3)."""
    return hashlib.sha256(question.encode()).digest()[0] % (MAX_SEND_BACKS + 1)


def search_docs(query: str) -> list[str]:
    """The search tool's body: 3 ms, then 3 documents of ~300 tokens."""
    time.sleep(TOOL_S)
    return [text(f"{query}/doc{k}", PROMPT_TOKENS) for k in range(DOCS_PER_SEARCH)]


def plan_prompt(question: str) -> str:
    return f"Plan {SEARCHES} searches for the question.\nQuestion: {question}\nSearches:"


def queries_of(question: str, plan: str) -> list[str]:
    return [f"{question[:80]} | aspect {k} | {plan[:12]!r}" for k in range(SEARCHES)]


def read_prompt(question: str, doc: str) -> str:
    return f"Question: {question[:80]}\nSource:\n{doc}\nNote on what the source says:"


def draft_prompt(question: str, notes: list[str]) -> str:
    body = "\n".join(f"- {n[:40]!r}" for n in notes)
    return f"{text(question + '/style', 120)}\nQuestion: {question}\nNotes:\n{body}\nDraft:"


def review_prompt(question: str, draft: str, history: list[str]) -> str:
    past = "\n".join(f"round {i}: {h[:40]!r}" for i, h in enumerate(history))
    return f"{text('critic rubric', 200)}\nQuestion: {question[:80]}\nEarlier:\n{past}\nDraft: {draft[:60]!r}\nVerdict:"


def revise_prompt(question: str, draft: str, feedback: str) -> str:
    return f"{text(question + '/style', 120)}\nQuestion: {question}\nDraft: {draft[:60]!r}\nFeedback: {feedback[:60]!r}\nRevised:"


class CriticState:
    """The critic's state for one request: its past feedback (its prompt grows with it)."""

    def __init__(self) -> None:
        self.history: list[str] = []

    def verdict(self, question: str, feedback: str) -> tuple[bool, str]:
        self.history.append(feedback)
        return len(self.history) > send_backs(question), feedback


def summary(notes: list[str], rounds: int, draft: str) -> dict:
    return {"notes": len(notes), "send_backs": rounds, "draft_chars": len(draft)}


# --- dask-agents -----------------------------------------------------------------------------

def _generate(prompt: str) -> str:
    return da.llm(MODEL).generate(prompt, max_tokens=OUT_TOKENS).value().text


@da.tool(kind="web_api")
def search(query: str) -> list[str]:
    """A search tool (3 ms)."""
    return search_docs(query)


@da.agent(model=MODEL)
class Reader:
    """Summarizes one source document."""

    def read(self, question: str, doc: str) -> str:
        return _generate(read_prompt(question, doc))


@da.agent(model=MODEL)
class Writer:
    """Drafts an answer from the notes; revises it on feedback."""

    def draft(self, question: str, notes: list[str]) -> str:
        return _generate(draft_prompt(question, notes))

    def revise(self, question: str, draft: str, feedback: str) -> str:
        return _generate(revise_prompt(question, draft, feedback))


@da.agent(model=MODEL, stateful=True)
class Critic:
    """Reviews drafts; remembers its earlier feedback for the session."""

    def __init__(self) -> None:
        self.state = CriticState()

    def review(self, question: str, draft: str) -> tuple[bool, str]:
        feedback = _generate(review_prompt(question, draft, self.state.history))
        return self.state.verdict(question, feedback)


@da.agent(model=MODEL)
class Researcher:
    """One request: plan, search, read, draft, review until the critic accepts."""

    def answer(self, question: str) -> dict:
        plan = _generate(plan_prompt(question))
        hits = [da.stub(search)(q) for q in queries_of(question, plan)]
        docs = [d for h in hits for d in h.value()]
        reader, writer, critic = da.stub(Reader), da.stub(Writer), da.stub(Critic)
        notes = [n.value() for n in [reader.read(question, d) for d in docs]]
        draft = writer.draft(question, notes).value()
        rounds = 0
        while True:
            ok, feedback = critic.review(question, draft).value()
            if ok:
                return summary(notes, rounds, draft)
            rounds += 1
            draft = writer.revise(question, draft, feedback).value()


# --- plain Dask ------------------------------------------------------------------------------

PLUGIN = "fanout-engine"


class EngineHostPlugin(WorkerPlugin):
    """One engine per worker: the class dask-agents' worker plugin hosts, from :data:`ENTRY`."""

    name = PLUGIN

    def __init__(self) -> None:
        self.host: Any = None

    def setup(self, worker: Any) -> None:
        from dask_agents.model_settings import ModelSettings
        from dask_agents.worker_plugin.engines import make_host

        self.host = make_host(MODEL, ModelSettings(**ENTRY))
        self.host.start()
        self.host.wait_loaded(600)

    def teardown(self, worker: Any) -> None:
        if self.host is not None:
            self.host.close()


def generate_here(prompt: str) -> str:
    """One LLM call on this worker's engine, waited for in this thread."""
    host = get_worker().plugins[PLUGIN].host
    params = host.sampling_params(OUT_TOKENS, 0.0, None)
    out = host.submit(uuid.uuid4().hex, host.tokenizer.encode(prompt), params, None).result()
    return host.tokenizer.decode(list(out.outputs[0].token_ids))


def read_task(question: str, doc: str) -> str:
    """A reader as a task."""
    return generate_here(read_prompt(question, doc))


def research_task(question: str) -> dict:
    """One request as a task (the researcher), its readers as nested tasks."""
    plan = generate_here(plan_prompt(question))
    docs = [d for q in queries_of(question, plan) for d in search_docs(q)]
    with worker_client() as c:
        notes = c.gather(c.map(read_task, [question] * len(docs), docs, pure=False))
    draft = generate_here(draft_prompt(question, notes))
    critic, rounds = CriticState(), 0
    while True:
        ok, feedback = critic.verdict(question, generate_here(review_prompt(question, draft, critic.history)))
        if ok:
            return summary(notes, rounds, draft)
        rounds += 1
        draft = generate_here(revise_prompt(question, draft, feedback))
