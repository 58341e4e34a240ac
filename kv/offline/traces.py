"""Session traces for the KV simulator: three families, each validated strictly.

A trace is a sequence of LLM steps. Each :class:`Step` of a session arrives at ``at``, reads
its prompt (full blocks ``blocks`` plus ``tail_tokens`` past the last full block), runs for
``duration`` seconds, and is followed by a pause (a tool call, a user's think time) until the
session's next step arrives, or ends the session (``last``). Arrival times are fixed by the
trace: the simulator replays them open loop, so every policy (and the offline optimum) sees the
same block-access sequence.

Families
--------
``generate(GenParams(...))``
    Agent sessions shaped like the GitHub Copilot coding-agent dataset card (3.95 turns per
    session, 7.83 LLM calls and 7.3 tool calls per turn, 86% of prompt tokens cached) with tool
    latencies drawn from SAGA's per-kind priors (:mod:`dask_agents.kv.runtime.tool_latency`). Every parameter and its
    source is documented on :class:`GenParams`.
``load_telemetry(path_or_frame)``
    The call table of a dask-agents run (``da.telemetry(client)``, saved as CSV, JSON or parquet).
    Telemetry has token counts but no token ids; the assumptions that turn it into block chains
    are documented on :func:`load_telemetry`.
``load_mooncake(path)``
    ``../shared/traces/mooncake-synthetic/synthetic_trace.jsonl`` (Apache-2.0; the file is read in
    place, never copied): one request per line with ``timestamp`` (ms), ``input_length``,
    ``output_length`` and ``hash_ids`` (one id per 512-token block of the prompt, chained: equal ids
    mean equal prefixes). It has no session ids; how sessions and pauses are derived is documented
    on :func:`load_mooncake`.

Our own format (``save``/``load_steps``): JSON lines, a header object then one step per line.
Every loader raises ``ValueError`` naming the file and line of the first malformed record.
"""

from __future__ import annotations

import heapq
import json
import math
import os
import random
from collections import defaultdict
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

from dask_agents.kv.runtime.blocks import ROOT, block_hash, extend
from dask_agents.kv.runtime.tool_latency import PRIORS, ToolLatency, prior

ENV = "DASK_AGENTS_TRACES"
MOONCAKE_SUBDIR = "mooncake-synthetic"
MOONCAKE_FILE = "synthetic_trace.jsonl"
MOONCAKE_BLOCK = 512
MOONCAKE_DEPTH = 5  # steps from the 6th on share one AEG node
ROOT_FANOUT = 16  # a block with this many distinct next blocks is a shared prefix, not a session
FORMAT = "dask-agents-kv-trace"
FAMILIES = ("generated", "telemetry", "mooncake", "file")
MAX_TOKENS = 1 << 24
"""Most tokens one request of a telemetry file may claim (a garbage count must not make the
loader build millions of blocks)."""


@dataclass(frozen=True)
class Step:
    """One LLM call of a session (see the module docstring)."""

    session: str
    at: float
    blocks: tuple[int, ...]
    tail_tokens: int = 0
    output_tokens: int = 0
    duration: float = 0.0
    tool: str | None = None
    node: str = "llm"
    last: bool = False

    def prompt_tokens(self, block_size: int) -> int:
        """Prompt length in tokens."""
        return len(self.blocks) * block_size + self.tail_tokens

    @property
    def end(self) -> float:
        """When the step's LLM work finishes (its pause starts)."""
        return self.at + self.duration


@dataclass(frozen=True)
class Trace:
    """Steps of many sessions sorted by arrival (ties keep their order); ``meta`` says where
    they came from. Construction checks consistency (see :meth:`validate`)."""

    name: str
    family: str
    block_size: int
    steps: tuple[Step, ...]
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "steps", tuple(sorted(self.steps, key=lambda s: s.at)))
        self.validate()

    def validate(self) -> None:
        """ValueError unless: block size >= 1; times finite and >= 0; a session's steps do not
        overlap (each arrives after the previous one's end); only its final step is ``last``."""
        if self.block_size < 1:
            raise ValueError(f"trace {self.name}: block_size must be >= 1")
        open_: dict[str, Step] = {}
        for i, s in enumerate(self.steps):
            where = f"trace {self.name}: step {i} (session {s.session!r})"
            if not (math.isfinite(s.at) and s.at >= 0 and math.isfinite(s.duration) and s.duration >= 0):
                raise ValueError(f"{where}: at and duration must be finite and >= 0")
            if s.tail_tokens < 0 or s.tail_tokens >= self.block_size or s.output_tokens < 0:
                raise ValueError(f"{where}: need 0 <= tail_tokens < block_size and output_tokens >= 0")
            prev = open_.get(s.session)
            if prev is not None:
                if prev.last:
                    raise ValueError(f"{where}: arrives after the session's last step")
                if s.at + 1e-9 < prev.end:
                    raise ValueError(f"{where}: arrives at {s.at} before its previous step ends at {prev.end}")
            open_[s.session] = s

    def __len__(self) -> int:
        return len(self.steps)

    def __iter__(self) -> Iterator[Step]:
        return iter(self.steps)

    def sessions(self) -> dict[str, list[Step]]:
        """Steps per session, in order."""
        out: dict[str, list[Step]] = defaultdict(list)
        for s in self.steps:
            out[s.session].append(s)
        return dict(out)

    def accesses(self) -> list[int]:
        """The block-access sequence: every step's full blocks, in chain order, steps by arrival."""
        return [b for s in self.steps for b in s.blocks]

    def prompt_tokens(self) -> int:
        """All prompt tokens of all steps."""
        return sum(s.prompt_tokens(self.block_size) for s in self.steps)

    def tail_tokens(self) -> int:
        """Prompt tokens past the last full block of each step (recomputed under every policy)."""
        return sum(s.tail_tokens for s in self.steps)

    def distinct_blocks(self) -> int:
        """Distinct full blocks (each is computed at least once by any policy)."""
        return len(set(self.accesses()))

    def peak_footprint(self) -> int:
        """Most distinct blocks the live sessions' latest prompts hold at once (a session is live
        from its first arrival to its last step's end): the accelerator size at which no policy
        needs to evict anything but finished sessions. Benchmarks size memory relative to it.
        Computed once per trace (a replay asks for it per memory size)."""
        cached = self.__dict__.get("_peak_footprint")
        if cached is not None:
            return cached
        events = []  # (time, order, kind, step): arrivals before ends at equal times
        for i, s in enumerate(self.steps):
            events.append((s.at, 1, i))
            if s.last:
                events.append((s.end, 0, i))
        events.sort()
        ref: dict[int, int] = defaultdict(int)
        current: dict[str, tuple[int, ...]] = {}
        peak = 0
        for _, kind, i in events:
            s = self.steps[i]
            old = current.pop(s.session, ())
            for b in old:
                ref[b] -= 1
                if not ref[b]:
                    del ref[b]
            if kind == 1:
                current[s.session] = s.blocks
                for b in s.blocks:
                    ref[b] += 1
                peak = max(peak, len(ref))
        object.__setattr__(self, "_peak_footprint", peak)  # (frozen: set past it; not a field)
        return peak

    def timeline(self) -> list[tuple[float, bool, int]]:
        """``(time, is_arrival, step index)`` of every arrival and step end, in the order the
        simulator processes them: by time, ends before arrivals at equal times, and a step's end
        after its own arrival (a step of duration 0 ends right after it arrives)."""
        ends = [s.end for s in self.steps]
        prev: dict[str, int] = {}
        for i, s in enumerate(self.steps):
            j = prev.get(s.session)
            if j is not None and ends[j] > s.at:
                ends[j] = s.at  # rounding: a step ends before its session's next one arrives
            prev[s.session] = i
        heap = [(s.at, 1, i, i) for i, s in enumerate(self.steps)]
        heapq.heapify(heap)
        seq = len(heap)
        out = []
        while heap:
            t, kind, _, i = heapq.heappop(heap)
            out.append((t, kind == 1, i))
            if kind == 1:
                heapq.heappush(heap, (ends[i], 0, seq, i))
                seq += 1
        return out

    def without_session_ends(self) -> "Trace":
        """The same steps with no session's end known (``last`` False everywhere): a session's
        KV is never garbage by signal, only by what a policy infers. On derived traces (Mooncake,
        telemetry) the end is hindsight (the last request seen under a tree), so results are
        reported both ways; family and name say which."""
        steps = tuple(replace(s, last=False) if s.last else s for s in self.steps)
        return Trace(f"{self.name} without session ends", f"{self.family}-no-ends", self.block_size, steps,
                     {**self.meta, "session_ends": False})

    def prefix_closed(self) -> bool:
        """Whether every block of the trace always follows the same parent (the block before it
        in a prompt; none for a first block): true of prefix-hashed ids, where a block names its
        whole prefix. Then whoever holds a block holds every block before it, and a chain's
        blocks are never read before their parents. Computed once per trace."""
        cached = self.__dict__.get("_prefix_closed")
        if cached is not None:
            return cached
        parent: dict[int, int | None] = {}
        closed = True
        for s in self.steps:
            prev = None
            for b in s.blocks:
                if parent.setdefault(b, prev) != prev:
                    closed = False
                    break
                prev = b
            if not closed:
                break
        object.__setattr__(self, "_prefix_closed", closed)
        return closed

    def peak_running(self) -> int:
        """Most distinct blocks the running steps' prompts hold at once (they are pinned on the
        accelerator). With less accelerator than this, some steps cannot keep their prompt
        whatever the policy. Computed once per trace."""
        cached = self.__dict__.get("_peak_running")
        if cached is not None:
            return cached
        ref: dict[int, int] = defaultdict(int)
        peak = 0
        for _, arrival, i in self.timeline():
            for b in self.steps[i].blocks:
                if arrival:
                    ref[b] += 1
                else:
                    ref[b] -= 1
                    if not ref[b]:
                        del ref[b]
            peak = max(peak, len(ref))
        object.__setattr__(self, "_peak_running", peak)
        return peak

    def head(self, n_sessions: int) -> "Trace":
        """Only the first ``n_sessions`` sessions (by first arrival)."""
        keep = set(list(dict.fromkeys(s.session for s in self.steps))[:n_sessions])
        return replace(self, steps=tuple(s for s in self.steps if s.session in keep))

    def summary(self) -> dict[str, Any]:
        """Counts a report prints: sessions, steps, tokens, blocks, reuse under an unlimited cache."""
        acc = self.accesses()
        distinct = len(set(acc))
        prompt = self.prompt_tokens()
        reusable = (len(acc) - distinct) * self.block_size
        return {"name": self.name, "family": self.family, "block_size": self.block_size,
                "sessions": len(self.sessions()), "steps": len(self.steps), "prompt_tokens": prompt,
                "block_accesses": len(acc), "distinct_blocks": distinct,
                "unlimited_cache_hit_rate": reusable / prompt if prompt else 0.0,
                "peak_footprint_blocks": self.peak_footprint(), "peak_running_blocks": self.peak_running(),
                "span_s": (max(s.end for s in self.steps) - self.steps[0].at) if self.steps else 0.0}


# -- (a) generated agent sessions ------------------------------------------------------------

@dataclass(frozen=True)
class GenParams:
    """Shape of generated coding-agent sessions. Published values, with their source:

    - ``turns_mean`` 3.95 turns per session, ``calls_per_turn`` 7.83 LLM calls and
      ``tools_per_turn`` 7.3 tool calls per turn, ``cached_share`` 0.86 of prompt tokens cached,
      ``output_tokens_mean`` 527 (4.91B completion tokens / (301,026 sessions x 3.95 x 7.83
      calls)): GitHub Copilot coding-agent dataset card (June 2026).
    - tool latencies: SAGA's P50/P95/P99 per kind (:data:`dask_agents.kv.runtime.tool_latency.PRIORS`).

    Our choices (not published; change them freely):

    - turns: geometric with mean ``turns_mean``; LLM calls per turn: 1 + Poisson(mean - 1);
      every call but a turn's last is followed by tool calls: 1, plus a second one in parallel
      with the probability that makes the mean ``tools_per_turn`` (the pause is the longer one).
    - ``kind_mix``: which tool kind a call is (file reads and code runs dominate a coding agent).
    - ``think``: the user's think time between turns (P50/P95/P99 seconds: a user reviews the
      agent's work between turns, minutes rather than seconds).
    - prompt growth: a session's first prompt is the shared system prompt plus ``task_tokens``;
      each further call appends its predecessor's output and tool results (a new turn also the
      user's message), so that ``cached_share`` of a call's prompt is its predecessor's prompt
      (the dataset's cached share is measured under real evictions, so taking it as the
      reusable share makes these traces *less* cache-friendly than the real workload). When a
      prompt would pass ``max_context`` tokens the agent compacts: the next prompt is the system
      prompt plus a ``summary_tokens`` summary (a new chain after the system prompt).
    - ``hints``: whether steps carry their tool's kind (else the AEG learns per step label).
    - arrivals: sessions start as a Poisson process of ``arrival_rate`` per second.

    Under an unlimited cache about 84.5% of the prompt tokens of a default trace are prefix hits
    (measured: the first prompt of a session and the prompts after compaction miss more than
    ``cached_share``).
    """

    sessions: int = 100
    seed: int = 0
    arrival_rate: float = 0.1
    turns_mean: float = 3.95
    calls_per_turn: float = 7.83
    tools_per_turn: float = 7.3
    cached_share: float = 0.86
    output_tokens_mean: float = 527.0
    system_tokens: int = 8192
    task_tokens: int = 4096
    user_tokens: int = 512
    summary_tokens: int = 4096
    max_context: int = 65536
    kind_mix: tuple[tuple[str, float], ...] = (
        ("file_io", 0.40), ("code_exec", 0.35), ("web_api", 0.10), ("db_query", 0.05), ("custom", 0.10))
    think: tuple[float, float, float] = (60.0, 600.0, 1800.0)
    hints: bool = True
    block_size: int = 512
    prefill_tokens_per_s: float = 10_000.0
    decode_s_per_token: float = 0.02

    def __post_init__(self) -> None:
        if self.sessions < 1 or self.arrival_rate <= 0 or self.turns_mean < 1 or self.calls_per_turn < 1:
            raise ValueError("need sessions >= 1, arrival_rate > 0, turns_mean >= 1, calls_per_turn >= 1")
        if not 0 < self.cached_share < 1:
            raise ValueError(f"cached_share must be in (0, 1), got {self.cached_share}")
        for kind, _ in self.kind_mix:
            prior(kind)  # ValueError for an unknown kind


def _poisson(rng: random.Random, lam: float) -> int:
    # Knuth's method: fine for the small means used here.
    limit, k, p = math.exp(-lam), 0, rng.random()
    while p > limit:
        k += 1
        p *= rng.random()
    return k


def generate(params: GenParams = GenParams(), name: str | None = None) -> Trace:
    """Generated agent sessions (see :class:`GenParams`); deterministic for ``params.seed``."""
    p = params
    rng = random.Random(p.seed)
    bs = p.block_size
    kinds, weights = zip(*p.kind_mix)
    think = ToolLatency(*p.think)
    p_turn_end = 1.0 / p.turns_mean
    tool_calls = p.calls_per_turn - 1
    p_parallel = min(1.0, max(0.0, (p.tools_per_turn - tool_calls) / tool_calls)) if tool_calls > 0 else 0.0
    growth = (1 - p.cached_share) / p.cached_share
    mu_out = math.log(p.output_tokens_mean) - 0.5  # lognormal, sigma 1: mean = exp(mu + 1/2)
    system = extend((), (("system", i) for i in range(p.system_tokens // bs)))
    steps: list[Step] = []
    t0 = 0.0
    for sno in range(p.sessions):
        t0 += rng.expovariate(p.arrival_rate)
        sid = f"g{sno}"
        turns = 1
        while rng.random() > p_turn_end:
            turns += 1
        epoch, tokens, out = 0, p.system_tokens + p.task_tokens, 0
        blocks: tuple[int, ...] = ()
        t = t0
        for turn in range(turns):
            calls = 1 + _poisson(rng, p.calls_per_turn - 1)
            for c in range(calls):
                base = blocks
                new_tokens = tokens
                if blocks:  # the predecessor's output and tool results (and a user message) are appended
                    add = max(out + 1, round(tokens * growth * rng.uniform(0.5, 1.5)))
                    if c == 0:
                        add += p.user_tokens
                    if tokens + add > p.max_context:  # compaction: system prompt + summary, a new chain
                        epoch += 1
                        base = blocks[:len(system)]
                        tokens, add = p.system_tokens, p.summary_tokens
                    tokens += add
                    new_tokens = add
                # Full blocks: the system prompt's, then this epoch's own. Block i of an epoch always
                # holds the same content, so a longer prompt extends the shorter one's chain.
                n_full = tokens // bs
                own = list(base[:n_full])
                parent = own[-1] if own else ROOT
                for i in range(len(own), n_full):
                    parent = block_hash(parent, ("system", i) if i < len(system) else (sid, epoch, i))
                    own.append(parent)
                blocks = tuple(own)
                out = max(1, min(8192, round(rng.lognormvariate(mu_out, 1.0))))
                last_of_turn = c == calls - 1
                node = "answer" if last_of_turn else ("plan" if c == 0 else "act")
                duration = new_tokens / p.prefill_tokens_per_s + out * p.decode_s_per_token
                last = last_of_turn and turn == turns - 1
                if last_of_turn:
                    kind, pause = None, think.sample(rng)
                else:
                    kind = rng.choices(kinds, weights)[0]
                    pause = prior(kind).sample(rng)
                    if rng.random() < p_parallel:
                        other = rng.choices(kinds, weights)[0]
                        extra = prior(other).sample(rng)
                        if extra > pause:
                            kind, pause = other, extra
                steps.append(Step(sid, round(t, 6), blocks, tokens - n_full * bs, out, round(duration, 6),
                                  kind if p.hints else None, node, last))
                t += duration + pause
    meta = {"params": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(p).items()}}
    return Trace(name or f"generated(sessions={p.sessions},seed={p.seed})", "generated", bs, tuple(steps), meta)


# -- our own file format -----------------------------------------------------------------------

def save(trace: Trace, path: str | os.PathLike) -> Path:
    """Write ``trace`` as JSON lines: a header, then one step per line (see :func:`load_steps`)."""
    path = Path(path)
    with open(path, "w") as f:
        f.write(json.dumps({"format": FORMAT, "version": 1, "name": trace.name, "family": trace.family,
                            "block_size": trace.block_size}) + "\n")
        for s in trace.steps:
            f.write(json.dumps({"session": s.session, "at": s.at, "blocks": list(s.blocks),
                                "tail_tokens": s.tail_tokens, "output_tokens": s.output_tokens,
                                "duration": s.duration, "tool": s.tool, "node": s.node, "last": s.last}) + "\n")
    return path


def _text_lines(path: Path) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of every line (UTF-8); ValueError naming the line that is not."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                yield n, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path.name}: line {n}: not UTF-8 text (byte {e.start + 1} of the line)") from None


def _json_lines(path: Path) -> Iterator[tuple[int, Any]]:
    """``(line number, parsed object)`` of every non-blank line; ValueError at the first bad one."""
    for n, text in _text_lines(path):
        if not text.strip():
            continue
        try:
            yield n, json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path.name}: line {n}: not valid JSON ({e.msg} at column {e.colno})") from None
        except RecursionError:
            raise ValueError(f"{path.name}: line {n}: JSON nested too deeply") from None


def _int(obj: Mapping, key: str, where: str, minimum: int = 0) -> int:
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"{where}: {key} must be an integer >= {minimum}, got {v!r}")
    return v


def _num(obj: Mapping, key: str, where: str) -> float:
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ValueError(f"{where}: {key} must be a finite number >= 0, got {v!r}")
    return float(v)


def _ids(obj: Mapping, key: str, where: str) -> tuple[int, ...]:
    v = obj.get(key)
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
        raise ValueError(f"{where}: {key} must be a list of non-negative integers")
    if len(set(v)) != len(v):  # a block names its prefix: it cannot come twice in one prompt
        seen: set[int] = set()
        twice = next(x for x in v if x in seen or seen.add(x))
        raise ValueError(f"{where}: {key} holds block {twice} twice (one prompt's blocks are distinct)")
    return tuple(v)


def _record(obj: Any, where: str, required: Iterable[str]) -> Mapping:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in required if k not in obj]
    if missing:
        raise ValueError(f"{where}: missing field(s) {', '.join(missing)}")
    return obj


def _wrap(path: Path, build):
    """Run ``build()``; a consistency error of the whole trace names the file."""
    try:
        return build()
    except ValueError as e:
        if str(e).startswith(path.name):
            raise
        raise ValueError(f"{path.name}: {e}") from None


def load_steps(path: str | os.PathLike) -> Trace:
    """A trace written by :func:`save`. ValueError naming the file and line of a malformed record."""
    path = Path(path)
    lines = _json_lines(path)
    first = next(lines, None)
    if first is None:
        raise ValueError(f"{path.name}: line 1: empty file (expected a {FORMAT} header)")
    n, head = first
    head = _record(head, f"{path.name}: line {n}", ("format", "block_size"))
    if head["format"] != FORMAT:
        raise ValueError(f"{path.name}: line {n}: format is {head['format']!r}, expected {FORMAT!r}")
    block_size = _int(head, "block_size", f"{path.name}: line {n}", 1)
    steps = []
    for n, obj in lines:
        where = f"{path.name}: line {n}"
        r = _record(obj, where, ("session", "at", "blocks"))
        if not isinstance(r["session"], str) or not r["session"]:
            raise ValueError(f"{where}: session must be a non-empty string")
        tool = r.get("tool")
        if tool is not None and not isinstance(tool, str):
            raise ValueError(f"{where}: tool must be a string or null")
        tail = _int(r, "tail_tokens", where) if "tail_tokens" in r else 0
        if tail >= block_size:
            raise ValueError(f"{where}: tail_tokens {tail} must be below the block size {block_size}")
        steps.append(Step(r["session"], _num(r, "at", where), _ids(r, "blocks", where), tail,
                          _int(r, "output_tokens", where) if "output_tokens" in r else 0,
                          _num(r, "duration", where) if "duration" in r else 0.0, tool,
                          str(r.get("node", "llm")), bool(r.get("last", False))))
    if not steps:
        raise ValueError(f"{path.name}: line {n + 1}: no steps after the header")
    return _wrap(path, lambda: Trace(str(head.get("name") or path.stem), str(head.get("family") or "file"),
                                     block_size, tuple(steps), {"source": str(path)}))


# -- (c) Mooncake ------------------------------------------------------------------------------

def mooncake_path(directory: str | os.PathLike | None = None) -> Path:
    """The Mooncake trace file: in ``directory``, else ``$DASK_AGENTS_TRACES``, else the copy the
    package ships (``dask_agents/data/traces``); a directory may be the trace directory itself or
    one holding ``mooncake-synthetic``. FileNotFoundError saying where it looked."""
    if directory is None:
        from dask_agents.data import traces_dir

        directory = traces_dir()
    base = Path(directory).expanduser()
    if base.is_file():
        return base
    for cand in (base, base / MOONCAKE_SUBDIR):
        if (cand / MOONCAKE_FILE).is_file():
            return cand / MOONCAKE_FILE
    raise FileNotFoundError(f"Mooncake trace {MOONCAKE_FILE} not found in {base} or {base / MOONCAKE_SUBDIR}; "
                            f"pass a path or set {ENV}")


def load_mooncake(path: str | os.PathLike | None = None, limit: int | None = None,
                  decode_s_per_token: float = 0.02, root_fanout: int = ROOT_FANOUT) -> Trace:
    """The Mooncake synthetic trace (or the first ``limit`` requests of it) as sessions.

    Every line must be an object with ``timestamp`` (ms, integer >= 0), ``input_length`` and
    ``output_length`` (integers >= 0) and ``hash_ids`` (non-negative integers, exactly
    ``ceil(input_length / 512)`` of them); the first bad line raises ValueError with its number.

    Sessions (the trace has none): requests whose prompts start with the same *root* block form
    one session (a conversation or document the requests continue: in this file every id has
    one parent, so ids form prefix trees, and a tree is a session). The root is the first
    block, unless that block is a prefix shared by many unrelated requests (a system prompt):
    a block with ``root_fanout`` or more distinct next blocks in the file is such a prefix, and
    the root is the first block below the longest run of them (otherwise a file whose requests
    all begin with one system prompt would be one session). In the shipped file no block has
    more than 13 distinct next blocks, so at the default (16) its roots are its first blocks. The steps of a session are
    its requests in time order; a step's duration is ``output_length * decode_s_per_token``
    (capped at the gap to the session's next request) and the pause after it lasts until the
    session's next request. A session's last request ends it: we take that as the application
    closing the session, a signal real agent frameworks give (the simulator treats it as known
    when the step ends, not before). No tool kinds (``tool`` None: the AEG learns the pauses).
    A step's label (its AEG node) is its position in the session, ``llm#0`` ... ``llm#5`` (5 and
    later): known online, and the pauses differ by it (in this file the median gap after a
    session's first request is 143 s, after its sixth and later 11 s).
    The tokens past the last full block (a partial block with its own id in the file) are not
    cached, as in vLLM; this loses 213 of the file's ~78,000 block reuses.
    """
    path = mooncake_path(path) if path is None or Path(path).is_dir() else Path(path)
    rows: list[tuple[float, tuple[int, ...], int, int]] = []
    for n, obj in _json_lines(path):
        where = f"{path.name}: line {n}"
        r = _record(obj, where, ("timestamp", "input_length", "output_length", "hash_ids"))
        ts = _int(r, "timestamp", where)
        length = _int(r, "input_length", where)
        out = _int(r, "output_length", where)
        ids = _ids(r, "hash_ids", where)
        need = math.ceil(length / MOONCAKE_BLOCK)
        if len(ids) != need:
            raise ValueError(f"{where}: hash_ids has {len(ids)} ids but input_length {length} "
                             f"needs {need} blocks of {MOONCAKE_BLOCK} tokens")
        if not ids:
            raise ValueError(f"{where}: empty prompt (input_length 0)")
        rows.append((ts / 1000.0, ids, length, out))
        if limit is not None and len(rows) >= limit:
            break
    if not rows:
        raise ValueError(f"{path.name}: line 1: no requests")
    if isinstance(root_fanout, bool) or not isinstance(root_fanout, int) or root_fanout < 2:
        raise ValueError(f"root_fanout must be an integer >= 2, got {root_fanout!r}")
    children: dict[int, set[int]] = defaultdict(set)
    for _, ids, _, _ in rows:
        for a, b in zip(ids, ids[1:]):
            children[a].add(b)

    def root(ids: tuple[int, ...]) -> int:
        i = 0
        while i + 1 < len(ids) and len(children[ids[i]]) >= root_fanout:
            i += 1
        return ids[i]

    by_root: dict[int, list[int]] = defaultdict(list)
    for i, (_, ids, _, _) in enumerate(rows):
        by_root[root(ids)].append(i)
    steps = []
    for root, idx in by_root.items():
        idx.sort(key=lambda i: rows[i][0])
        for k, i in enumerate(idx):
            at, ids, length, out = rows[i]
            full = length // MOONCAKE_BLOCK
            gap = rows[idx[k + 1]][0] - at if k + 1 < len(idx) else math.inf
            steps.append(Step(f"m{root}", at, ids[:full], length - full * MOONCAKE_BLOCK, out,
                              min(out * decode_s_per_token, gap), None, f"llm#{min(k, MOONCAKE_DEPTH)}",
                              k == len(idx) - 1))
    name = f"mooncake({len(rows)} requests)"
    return _wrap(path, lambda: Trace(name, "mooncake", MOONCAKE_BLOCK, tuple(steps),
                                     {"source": str(path), "license": "Apache-2.0 (see LICENSE beside the file)"}))


# -- (b) dask-agents telemetry ----------------------------------------------------------------

TELEMETRY_COLUMNS = ("session", "component", "kind", "started", "finished", "prompt_tokens", "output_tokens")


def _read_frame(path: Path):
    """``(frame, line offset)`` of a telemetry file; ValueError naming the file (and the line
    when it is known) for anything that is not a readable table."""
    suffix = path.suffix.lower()
    if suffix in (".csv", ".json", ".jsonl", ".ndjson"):
        for _ in _text_lines(path):  # the first line that is not UTF-8, by number
            pass
    try:
        return _read_frame_unchecked(path, suffix)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path.name}: line {e.lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
    except ValueError as e:
        if str(e).startswith(path.name):
            raise
        raise ValueError(f"{path.name}: not a telemetry table ({_first_line(e)})") from None
    except (TypeError, OverflowError, RecursionError, UnicodeError, IndexError, KeyError) as e:
        raise ValueError(f"{path.name}: not a telemetry table ({type(e).__name__}: {_first_line(e)})") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    line = text[0] if text else type(e).__name__
    return line if len(line) <= 200 else line[:197] + "..."


def _read_frame_unchecked(path: Path, suffix: str):
    import pandas as pd

    if suffix == ".csv":
        return pd.read_csv(path), 2  # line 1 is the header
    if suffix == ".parquet":
        try:
            return pd.read_parquet(path), 1
        except ImportError as e:
            raise ValueError(f"{path.name}: reading parquet needs pyarrow or fastparquet ({e}); "
                             "save the frame as CSV") from None
    if suffix in (".jsonl", ".ndjson"):  # parsed here, so a bad record is named by its line
        records, lines = [], []
        for n, obj in _json_lines(path):
            records.append(_record(obj, f"{path.name}: line {n}", ()))
            lines.append(n)
        frame = pd.DataFrame.from_records(records)
        if lines and lines != list(range(1, len(lines) + 1)):  # blank lines: keep the file's numbering
            frame.attrs["lines"] = lines
        return frame, 1
    if suffix == ".json":
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if isinstance(data, dict) and "columns" in data and "data" in data:  # orient="split"
            return pd.DataFrame(data["data"], columns=data["columns"]), 1
        return pd.DataFrame(data), 1
    raise ValueError(f"{path.name}: unknown telemetry format {suffix!r} (use .csv, .json, .jsonl or .parquet)")


def _kind_of(tool_component: str) -> str | None:
    """The tool kind a tool's name starts with (``code_exec_tool`` -> ``code_exec``), else None."""
    name = tool_component.lower()
    return next((k for k in PRIORS if name.startswith(k)), None)


def _lanes(calls: list[tuple]) -> list[tuple[int, int | None]]:
    """Per call (sorted by start): its lane and the index of the lane's next call (None: the
    lane's last). Calls of one session that overlap in time (parallel branches: the developers
    of a plan) go to separate lanes, a call to the first lane free when it starts."""
    ends: list[float] = []
    out: list[list] = []
    last_of: list[int] = []
    for k, c in enumerate(calls):
        lane = next((i for i, e in enumerate(ends) if e <= c[0]), len(ends))
        if lane == len(ends):
            ends.append(c[1])
            last_of.append(k)
        else:
            out[last_of[lane]][1] = k
            ends[lane], last_of[lane] = c[1], k
        out.append([lane, None])
    return [(a, b) for a, b in out]


def load_telemetry(source: Any, block_size: int = 512, time_scale: float = 1.0, name: str | None = None) -> Trace:
    """Steps from a dask-agents call table (``da.telemetry(client)``): a DataFrame, or a file
    (``.csv``, ``.json``/``.jsonl``, ``.parquet``) holding one.

    Rows used: finished LLM calls (``kind == "llm"`` or component ``llm.<model>``) that belong to
    a session; each needs numeric ``started <= finished`` and integer ``prompt_tokens`` and
    ``output_tokens`` >= 0, else ValueError naming the file and line (CSV: line 1 is the header;
    JSON lines: the line; a frame: the row index). Tool rows (``kind == "tool"``) only name the
    pause they fall in. ``time_scale``: wall seconds per emulated second of the recorded run
    (durations and pauses are divided by it).

    Assumptions (telemetry has token counts, not token ids):

    - The LLM calls of one session and model form one growing history: a call's prompt starts
      with its predecessor's prompt (the session's latest call of that model that finished
      before it started) when it is at least as long (agents append outputs and tool results).
      When it is shorter, it shares only the ``cached_tokens`` the engine reported (at most the
      predecessor's length) and continues as a new chain from there.
    - Calls of one session that overlap in time (parallel branches) are steps of separate trace
      sessions, ``<session>#1``, ``#2``, ... beside ``<session>`` (a trace session's steps do
      not overlap); a call goes to the first that is free when it starts, and the last call of
      each ends it. Branches share their prefix through the rule above.
    - A session's first call shares its ``cached_tokens`` with every other session (a common
      system prompt: the engine can only have cached them from other sessions).
    - The pause after a call lasts until its branch's next LLM call starts; its tool kind is
      the kind the longest tool call started in that gap is named after (``code_exec_tool`` ->
      ``code_exec``), else None (the AEG then learns it per step label).
    - A step's label (AEG node) is the component that created the call when the frame has
      ``creator`` (its key's prefix), else the LLM component.
    """
    import pandas as pd

    if isinstance(source, pd.DataFrame):
        frame, where_of, label = source, (lambda i: f"telemetry: row {i}"), "telemetry"
    else:
        path = Path(source)
        frame, offset = _read_frame(path)
        numbers = frame.attrs.get("lines")
        where_of, label = ((lambda i: f"{path.name}: line {numbers[i]}") if numbers
                           else (lambda i: f"{path.name}: line {i + offset}")), path.name
    missing = [c for c in TELEMETRY_COLUMNS if c not in frame.columns]
    if missing:
        raise ValueError(f"{label}: missing column(s) {', '.join(missing)} (a da.telemetry frame has them)")
    if isinstance(time_scale, bool) or not isinstance(time_scale, (int, float)) or not (
            math.isfinite(time_scale) and time_scale > 0):
        raise ValueError(f"time_scale must be a finite number > 0, got {time_scale!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
    from dask.utils import key_split

    def number(row, col, i, integer=False):
        v = row[col]
        try:
            f = float(v)
        except (TypeError, ValueError):
            f = math.nan
        if not math.isfinite(f) or f < 0 or (integer and (f != int(f) or f > MAX_TOKENS)):
            what = "a finite number >= 0"
            if integer:
                what = f"an integer >= 0 (at most {MAX_TOKENS})" if f > MAX_TOKENS else "an integer >= 0"
            # imported here: kv itself does not load the dask_agents package
            from dask_agents.errors import short_repr

            raise ValueError(f"{where_of(i)}: {col} must be {what}, got {short_repr(v)}")
        return int(f) if integer else f

    llm: dict[str, list[tuple]] = defaultdict(list)
    tools: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    has_state, has_creator = "state" in frame.columns, "creator" in frame.columns
    for i, row in enumerate(frame.to_dict("records")):
        session = row["session"]
        if session is None or (isinstance(session, float) and math.isnan(session)):
            continue  # calls outside sessions
        if has_state and row["state"] not in ("finished", "memory"):
            continue  # erred or cancelled calls, and calls still open when the frame was taken
        component = str(row["component"])
        if row["kind"] == "tool":
            tools[str(session)].append((number(row, "started", i), number(row, "finished", i), component))
            continue
        if row["kind"] != "llm" and not component.startswith("llm."):
            continue
        started, finished = number(row, "started", i), number(row, "finished", i)
        if finished < started:
            raise ValueError(f"{where_of(i)}: finished {finished} is before started {started}")
        cached = row.get("cached_tokens")
        missing = cached is None or (isinstance(cached, float) and math.isnan(cached))
        cached = 0 if missing else number(row, "cached_tokens", i, True)
        node = component
        if has_creator and isinstance(row["creator"], str) and row["creator"] not in ("", "driver"):
            node = key_split(row["creator"])
        llm[str(session)].append((started, finished, number(row, "prompt_tokens", i, True),
                                  number(row, "output_tokens", i, True), cached, component, node))
    if not llm:
        raise ValueError(f"{label}: no finished LLM calls in sessions")
    t0 = min(c[0] for calls in llm.values() for c in calls)
    shared_root: tuple[int, ...] = ()
    steps = []
    for session, calls in llm.items():
        calls.sort()
        lanes = _lanes(calls)
        made: list[tuple[int, tuple[int, ...]]] = []  # per call: (prompt tokens, blocks)
        for k, (started, finished, prompt, out, cached, component, node) in enumerate(calls):
            # The call's predecessor: the latest call of its model that finished before it started
            # (a concurrent sibling is not: its prompt is not a prefix of this one's).
            prev = max((j for j in range(k) if calls[j][5] == component and calls[j][1] <= started),
                       key=lambda j: calls[j][1], default=None)
            if prev is None:
                shared = min(cached, prompt) // block_size
                if shared > len(shared_root):
                    shared_root = extend(shared_root, (("shared", j) for j in range(len(shared_root), shared)))
                base = shared_root[:shared]
            elif prompt >= made[prev][0]:
                base = made[prev][1]
            else:
                base = made[prev][1][:min(cached, prompt) // block_size]
            n_full = prompt // block_size
            blocks = extend(base[:n_full], ((session, component, k, j) for j in range(min(len(base), n_full), n_full)))
            made.append((prompt, blocks))
            lane, nxt = lanes[k]
            kind = None
            if nxt is not None:
                inside = [(f - s, c) for s, f, c in tools.get(session, ()) if finished <= s < calls[nxt][0]]
                if inside:
                    kind = _kind_of(max(inside)[1])
            sid = session if lane == 0 else f"{session}#{lane}"
            steps.append(Step(sid, (started - t0) / time_scale, blocks, prompt - n_full * block_size, out,
                              (finished - started) / time_scale, kind, node, nxt is None))
    return Trace(name or f"telemetry({label})", "telemetry", block_size, tuple(steps), {"source": label})


def _head_object(path: Path) -> Any:
    """The first line of a JSON-lines file as an object, or None."""
    with open(path, "rb") as f:
        first = f.readline()
    try:
        return json.loads(first.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return None  # the loader that reads the whole file names the bad line


def is_mooncake(source: str | os.PathLike) -> bool:
    """Whether ``source`` is a directory (searched for the Mooncake file) or a Mooncake JSON-lines
    file (``hash_ids`` on its first line)."""
    path = Path(source)
    if path.is_dir():
        return True
    if not path.is_file() or path.suffix.lower() not in (".jsonl", ".ndjson", ".json"):
        return False
    head = _head_object(path)
    return isinstance(head, dict) and "hash_ids" in head


def load(source: str | os.PathLike, **kwargs: Any) -> Trace:
    """Any trace file: our format (header line), a Mooncake file (``hash_ids`` on its first line),
    or a telemetry frame (``.csv``, ``.json``, ``.jsonl``, ``.parquet``); a directory is searched
    for the Mooncake file."""
    path = Path(source)
    if path.is_dir():
        return load_mooncake(path, **kwargs)
    if not path.is_file():
        raise FileNotFoundError(f"no trace file {path}")
    if path.suffix.lower() in (".jsonl", ".ndjson", ".json"):
        head = _head_object(path)
        if isinstance(head, dict) and head.get("format") == FORMAT:
            return load_steps(path)
        if isinstance(head, dict) and "hash_ids" in head:
            return load_mooncake(path, **kwargs)
    return load_telemetry(path, **kwargs)
