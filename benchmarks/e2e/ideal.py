"""Each request's ideal latency: its critical path with no queueing, no framework overhead, a
perfect prefix cache and single-sequence engine steps, from the EMULATED engine's own cost model.

The workflow's program runs here in virtual time (:class:`IdealRuntime`): agents run one after
the other but each on its own clock starting when it was started; a gather moves the program's
clock to the latest of them; a tool call takes its emulated latency; a user's pause its think
time (left out of the latency, as the runner leaves it out of measured latencies). An LLM call
takes what the engine's cost model charges one sequence alone on the engine:

- prefill of the prompt tokens not cached, in chunks of ``max_num_batched_tokens``, each step
  costing the fixed step cost, one sequence, the context it reads and the prefill term;
- one decode step per further output token, reading the context so far.

The perfect cache holds every block of every prompt of the same model the session sent before
this call started (a sibling's too: KV is registered as it is computed, so this is optimistic,
as a lower bound must be) and what every session's prompts begin with (the shared system
prompt): a call's cached tokens are the full blocks of its longest common prefix with any of
them (the last prompt token is always computed, as in the engine). Outputs are never cached
(the engine's generated tokens are not the program's text), the same in every variant.
"""

from __future__ import annotations

from typing import Any, Callable

from benchmarks.e2e import profile
from benchmarks.e2e.profile import decode_step_cost, params, prefill_cost
from benchmarks.e2e.program import LLMCall, LLMOut, ToolCall


def common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix (binary search over C-level slice comparisons)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def llm_seconds(p: Any, prompt: int, cached: int, max_tokens: int) -> float:
    """Emulated seconds one call takes alone on an engine with parameters ``p`` (EmulationParams,
    or a dict of its fields; missing ones take the engine's defaults): the cost model's own
    step functions, applied to this sequence's steps only."""
    p = params(p)
    t, c = 0.0, min(cached, prompt - 1)
    while c < prompt:  # prefill chunks; the last one samples the first token
        e = min(c + p.max_num_batched_tokens, prompt)
        t += decode_step_cost(p, 1, e) + prefill_cost(p, c, e)
        c = e
    n = max_tokens - 1  # decode steps, reading prompt + 1 .. prompt + max_tokens - 1 tokens
    t += n * decode_step_cost(p, 1, 0) + p.decode_s_per_ctx_token * (n * prompt + n * (n + 1) / 2)
    return t


class _Ctx:
    def __init__(self, rt: "IdealRuntime", start: float):
        self.rt, self.t, self.session = rt, start, rt.session

    def llm(self, call: LLMCall) -> LLMOut:
        cached = self.rt.cached(call.model, call.prompt, self.t)
        self.rt.prefill_tokens += len(call.prompt) - cached
        self.rt.record(call.model, call.prompt, self.t)
        self.t += llm_seconds(self.rt.params, len(call.prompt), cached, call.max_tokens)
        return LLMOut(len(call.prompt), cached, call.max_tokens)

    def tool(self, call: ToolCall) -> str:
        self.t += call.emulated_s
        return call.answer


class IdealRuntime:
    """A :class:`~benchmarks.e2e.program.Runtime` in virtual time (see the module docstring).

    The perfect cache: a call hits every full block of its longest common prefix with a prompt of
    the same model sent before it started (at the same instant: sent by an agent listed before
    it; the first of two simultaneous siblings computes what they share), and with ``shared``
    (what every session's prompts begin with). Parallel agents run one after another here, so an
    agent cannot see a sibling listed after it that started earlier in virtual time; ``earlier``
    (the previous pass's prompts, by call order) closes that gap: :func:`ideal` runs passes
    until the result stops changing."""

    def __init__(self, session: str, params: Any, shared: str = "", block_size: int = 16,
                 earlier: list | None = None):
        self.session, self.params, self.bs, self.shared = session, params, block_size, shared
        self.now = 0.0
        self.think_s = 0.0
        self.prefill_tokens = 0  # what a perfect cache prefills: the floor
        self.sent: list[tuple[float, int, str, str]] = []  # (start, call order, model, prompt)
        self.thinks: list[tuple[float, float]] = []  # (start, seconds) of each user's pause
        self.earlier = earlier or []

    def record(self, model: str, prompt: str, at: float) -> None:
        self.sent.append((at, len(self.sent), model, prompt))

    def cached(self, model: str, prompt: str, at: float) -> int:
        me = len(self.sent)
        seen = [p for t, o, m, p in self.sent if m == model and t <= at]
        seen += [p for t, o, m, p in self.earlier if o > me and m == model and t < at]
        best = max((common_prefix(prompt, p) for p in seen + [self.shared]), default=0)
        return min(best, len(prompt) - 1) // self.bs * self.bs

    def agent(self, role: str, fn: Callable, *args: Any) -> tuple[Any, float]:
        ctx = _Ctx(self, self.now)
        return fn(ctx, *args), ctx.t

    def gather(self, handles: list) -> list:
        self.now = max([self.now] + [t for _, t in handles])
        return [v for v, _ in handles]

    @property
    def latency(self) -> float:
        """The request's latency so far: its clock less its users' pauses."""
        return self.now - self.think_s

    def think(self, seconds: float) -> None:
        self.thinks.append((self.now, seconds))
        self.now += seconds
        self.think_s += seconds


def ideal(workflow: Any, spec: Any, params: Any, shared: str | None = None) -> tuple[float, int]:
    """The request's ideal latency (emulated seconds, think time left out) and the prompt tokens
    a perfect cache prefills for it (the floor); checks the program's outcome on the way.
    ``shared``: what every session's prompts begin with (default the workflow's
    ``shared_prefix``)."""
    rt = ideal_run(workflow, spec, params, shared)
    return rt.latency, rt.prefill_tokens


def ideal_run(workflow: Any, spec: Any, params: Any, shared: str | None = None) -> IdealRuntime:
    """The :class:`IdealRuntime` of the request's last pass (:func:`ideal`): its calls' start
    times (``sent``), its pauses (``thinks``), its end (``now``)."""
    shared = getattr(workflow, "shared_prefix", "") if shared is None else shared
    earlier: list = []
    result = rt = None
    for _ in range(4):  # passes until a sibling's prompts are seen where they started first
        rt = IdealRuntime(getattr(spec, "id", "ideal"), params, shared, block_size=profile.params(params).block_size,
                          earlier=earlier)
        workflow.check(spec, workflow.program(rt, spec))
        out = (rt.latency, rt.prefill_tokens)
        if out == result:
            break
        result, earlier = out, rt.sent
    return rt


def run_shared(workflow: Any, specs: list) -> str:
    """What every request's prompts begin with: the workflow's shared prefix and the start of
    the session header its prompts carry next (``"\nSession <id>"``, the ids' common start)."""
    import os

    base = getattr(workflow, "shared_prefix", "")
    return os.path.commonprefix([f"{base}\nSession {s.id}" for s in specs]) if specs else base


def kv_footprint(workflow: Any, spec: Any, params: Any, shared: str | None = None) -> int:
    """Tokens of KV the request holds at its peak when nothing of it is evicted: the prefix tree
    of its prompts (each prompt's tokens past its longest common prefix with an earlier, shorter
    one), less the prefix every session shares (held once per engine)."""
    shared = getattr(workflow, "shared_prefix", "") if shared is None else shared
    rt = IdealRuntime(getattr(spec, "id", "footprint"), params, shared)
    workflow.check(spec, workflow.program(rt, spec))
    seen, total = [shared], 0
    for prompt in sorted((p for _, _, _, p in rt.sent), key=len):
        total += len(prompt) - max(common_prefix(prompt, q) for q in seen)
        seen.append(prompt)
    return total
