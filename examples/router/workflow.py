"""The Router workflow (Nalar's Router evaluation): a light classifier agent routes each request to
a chat branch (LLM calls on the chat model) or a coding branch (LLM calls on the code model plus
an EMULATED ``code_exec`` tool). Arrivals, branch mix and request sizes follow the Azure LLM
inference trace 2023 (:mod:`examples.router.trace`): a ``code`` row becomes a coding request, a
``conversation`` row a chat request, with the row's context and generated token counts (capped)
as prompt length and ``max_tokens``.

The trace has no prompt text, so the text is synthetic and deterministic in the seed: a coding
request carries a fenced code block (```), a chat request never does. The classifier asks its
(small) model to route the request with a short prompt, but the route itself is the fence rule:
a tiny dummy-weight or emulated model does not answer meaningfully. So a request's branch always
matches its trace label, and what the experiment varies is the load on each branch.

Models are parameters (:class:`Models`): by default the classifier and the coding branch use
``coder`` and the chat branch ``chat``; with a single real engine map them all to ``coder``.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import dask_agents as da
from dask_agents.emulation import code_exec_tool

ROUTER_SYSTEM = "Route the user's request: answer 'code' for programming work, 'chat' for anything else.\n"
CHAT_SYSTEM = ("You are a friendly, concise assistant. Answer the user's message helpfully and ask a "
               "clarifying question when the request is ambiguous.\n")
CODE_SYSTEM = ("You are a senior software engineer. Write correct, idiomatic Python, explain briefly, "
               "and make sure the code runs.\n")
FENCE = "```"
BRANCH = {"code": "code", "conversation": "chat"}  # trace label -> branch
CLASSIFIER_CHARS = 256  # how much of the request the classifier reads

_WORDS = ("weather", "holiday", "recipe", "garden", "music", "history", "travel", "budget", "movie", "coffee",
          "exercise", "poem", "letter", "meeting", "birthday", "novel", "science", "language", "ocean", "city")
_CODE_TASKS = ("Complete this Python function", "Fix the bug in this code", "Add type hints and a docstring to",
               "Write unit tests for", "Refactor this loop")


@dataclass(frozen=True)
class Models:
    """Which model each role uses."""

    router: str = "coder"
    chat: str = "chat"
    code: str = "coder"


@dataclass(frozen=True)
class RouterRequest:
    """One request of the replay.

    ``at``: when it arrives, wall seconds from the start of the replay; ``label``: the trace
    label (``code``/``conversation``); ``context_tokens``/``generated_tokens``: the trace's
    counts; ``max_tokens``: the capped generated count every LLM call of the branch asks for."""

    id: str
    label: str
    text: str
    at: float
    max_tokens: int
    context_tokens: int
    generated_tokens: int
    seed: int
    phase: int = 0
    source: str = ""
    line: int = 0


@dataclass(frozen=True)
class Reply:
    """A branch's answer."""

    branch: str
    text: str
    llm_calls: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    emulated: bool


@dataclass
class RouterOutcome:
    """What the driver saw for one request."""

    request: RouterRequest
    session: str
    branch: str
    latency: float  # from the scheduled arrival to the answer
    start_lag: float  # how late the driver started the request after its scheduled arrival
    reply: Reply

    @property
    def emulated(self) -> bool:
        """True if the branch's LLM answers came from the EMULATED engine."""
        return self.reply.emulated


def route_of(text: str) -> str:
    """The branch for ``text``: ``code`` if it holds a code fence, else ``chat``."""
    return "code" if FENCE in text[:CLASSIFIER_CHARS] else "chat"


def _reply(branch: str, text: str, results: list[da.LLMResult]) -> Reply:
    return Reply(branch=branch, text=text, llm_calls=len(results),
                 prompt_tokens=sum(r.prompt_tokens for r in results),
                 cached_tokens=sum(r.cached_tokens for r in results),
                 output_tokens=sum(r.output_tokens for r in results),
                 emulated=any(r.emulated for r in results))


@da.agent(model="coder")
class Classifier:
    """A light classifier: one short LLM call, then the route."""

    def classify(self, request: RouterRequest, model: str = "coder") -> str:
        """``code`` or ``chat`` for ``request``."""
        head = request.text[:CLASSIFIER_CHARS]
        da.llm(model).generate(f"{ROUTER_SYSTEM}Request: {head}\nRoute:", max_tokens=1, seed=request.seed).value()
        return route_of(head)


@da.agent(model="chat")
class ChatAgent:
    """The chat branch: one LLM call on the chat model."""

    def reply(self, request: RouterRequest, model: str = "chat") -> Reply:
        """Answer a conversational request."""
        r = da.llm(model).generate(f"{CHAT_SYSTEM}User: {request.text}\nAssistant:", max_tokens=request.max_tokens,
                                   seed=request.seed).value()
        return _reply("chat", r.text, [r])


@da.agent(model="coder")
class CodeAgent:
    """The coding branch: write code (LLM), run it (EMULATED code_exec), then answer (LLM)."""

    def solve(self, request: RouterRequest, model: str = "coder") -> Reply:
        """Answer a coding request; the second call shares the first one's prompt prefix."""
        prompt = f"{CODE_SYSTEM}User: {request.text}\n"
        draft = da.llm(model).generate(prompt + "Code:", max_tokens=request.max_tokens, seed=request.seed).value()
        ran = da.stub(code_exec_tool)(f"{request.id}:{draft.text[:64]}", seed=request.seed).value()
        final = da.llm(model).generate(
            prompt + f"Code ran in {ran['latency_s'] * 1000:.0f} ms, exit 0.\nFinal answer:",
            max_tokens=max(1, min(request.max_tokens, 8)), seed=request.seed).value()
        return _reply("code", final.text, [draft, final])


def handle(client, request: RouterRequest, models: Models = Models(), arrival: float | None = None) -> RouterOutcome:
    """Drive one request in its own session: classify, then run the chosen branch.

    ``arrival``: the request's scheduled arrival (``time.time()`` clock) that latency counts
    from; default now."""
    t_start = time.time()
    arrival = t_start if arrival is None else arrival
    classifier = da.stub(Classifier)
    with da.session(client, name=request.id) as s:
        branch = classifier.classify(request, model=models.router).value()
        if branch == "code":
            reply = da.stub(CodeAgent).solve(request, model=models.code).value()
        else:
            reply = da.stub(ChatAgent).reply(request, model=models.chat).value()
    return RouterOutcome(request=request, session=s.id, branch=branch, latency=time.time() - arrival,
                         start_lag=max(0.0, t_start - arrival), reply=reply)


def replay(client, requests: list[RouterRequest], models: Models = Models(), max_concurrency: int = 512) -> list[RouterOutcome]:
    """Run ``requests`` open-loop: each starts at its ``at`` (seconds after the replay starts),
    whether or not earlier ones are done. Outcomes in the order of ``requests``."""
    t0 = time.time() + 0.05  # a moment to start the threads

    def one(r: RouterRequest) -> RouterOutcome:
        delay = t0 + r.at - time.time()
        if delay > 0:
            time.sleep(delay)  # open-loop arrival process
        return handle(client, r, models, arrival=t0 + r.at)

    if not requests:
        return []
    with ThreadPoolExecutor(max(1, min(len(requests), max_concurrency))) as pool:
        return list(pool.map(one, requests))


def _text(rng: random.Random, label: str, n_bytes: int) -> str:
    if label == "code":
        head = f"{rng.choice(_CODE_TASKS)}:\n{FENCE}python\n"
        body, k = [], 0
        while len(head) + sum(map(len, body)) < n_bytes - 4:
            k += 1
            body.append(f"def step_{k}(x, y={rng.randrange(100)}):\n    return x * {rng.randrange(2, 9)} + y\n")
        return (head + "".join(body))[:max(0, n_bytes - 4)] + f"\n{FENCE}"
    words, size = [], -1
    while size < n_bytes:
        words.append(rng.choice(_WORDS))
        size += len(words[-1]) + 1
    return " ".join(words)[:n_bytes]  # the words hold no code fence


def make_requests(arrivals, seed: int = 0, max_prompt_tokens: int = 4096, max_output_tokens: int = 256,
                  min_prompt_tokens: int = 24) -> list[RouterRequest]:
    """Requests for trace ``arrivals`` (an iterable of :class:`~examples.router.trace.Arrival`):
    text of ``clip(context_tokens, min_prompt_tokens, max_prompt_tokens)`` bytes (one byte-tokenizer
    token each), ``max_tokens = clip(generated_tokens, 1, max_output_tokens)``."""
    rng = random.Random(seed)
    out = []
    for i, a in enumerate(arrivals):
        n = min(max(a.context_tokens, min_prompt_tokens), max_prompt_tokens)
        out.append(RouterRequest(
            id=f"r{i}-{BRANCH[a.label]}", label=a.label, text=_text(rng, a.label, n), at=a.at,
            max_tokens=min(max(a.generated_tokens, 1), max_output_tokens), context_tokens=a.context_tokens,
            generated_tokens=a.generated_tokens, seed=rng.randrange(1 << 30), phase=a.phase,
            source=a.source, line=a.line,
        ))
    return out
