"""What-if capacity planning: replay recorded telemetry on another allocation (``dask-agents whatif``).

A ``da.telemetry`` export records, per call, its session, component, creator, when it was
created, started and finished, and for LLM calls its model and prompt/cached/output tokens.
From it this module rebuilds each session as a script and replays every session in virtual
time on a chosen number of engine replicas per model:

- **Sessions** start when they started in the recording (times divided by ``load_scale``).
  A call is created a recorded gap after the latest finish of an earlier call of its session
  (or the session's start), and not before the same gap after the start of the call that
  created it: the driver's and the tools' own time is kept, the waits on engines are recomputed.
- Every call starts its recorded dispatch delay (created -> started: scheduling, a free
  thread) after its creation. **Calls that are not LLM calls** then take their recorded service
  time; one that created calls finishes its recorded tail after the last of its children
  finishes (an agent waits on its LLM calls).
- **LLM calls** run on the emulated engine's cost model (``dask_agents.worker_plugin.emulated``'s
  ``EmulatedScheduler``: continuous batching, prefill of non-cached tokens, prefix reuse in a
  bounded KV), stepped in virtual time, one per replica. Prompts are synthetic token streams
  with the recorded lengths: a session's calls share its growing history and every session
  shares a system prefix as long as first calls hit in the recording.
- **Default policies**: a session's first call to a model goes to the replica with the fewest
  live sessions, its later calls to the same replica (session affinity, the scheduler plugin's
  placement); engines admit by the session's progress (``prioritize``). Balance and
  reallocation are not modelled.

The engine's costs are **calibrated** from the recorded LLM calls by least squares,
``service = out * (decode_step + decode_seq * concurrency) + prefill_token * (prompt - cached)``,
with the concurrency each call saw on its worker. :func:`validate` replays the recording on its
own allocation and compares with what was measured: the error it reports is how far to trust a
prediction. Every number this produces is a prediction from an EMULATED engine.
"""

from __future__ import annotations

import heapq
import itertools
import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from dask_agents.stats import percentile

REQUIRED = ("key", "session", "component", "kind", "created", "started", "finished")


class WhatIfError(ValueError):
    """The telemetry cannot be replayed (missing columns, no finished calls, bad allocation)."""


@dataclass(frozen=True)
class Call:
    """One recorded call; times are seconds after its session's start."""

    key: str
    component: str
    kind: str
    creator: str | None
    created: float
    started: float
    finished: float
    model: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    worker: str | None = None


@dataclass(frozen=True)
class Script:
    """One recorded session: when it started (seconds after the first session) and its calls."""

    id: str
    start: float
    calls: tuple[Call, ...]

    @property
    def latency(self) -> float:
        """Recorded latency: first creation to last finish."""
        return max(c.finished for c in self.calls)


@dataclass(frozen=True)
class EngineFit:
    """Calibrated cost model of one model's engine (seconds; see the module docstring)."""

    decode_s_per_step: float
    decode_s_per_seq: float
    prefill_s_per_token: float
    calls: int
    r2: float  # share of the variance of recorded LLM call times the fit explains

    def params(self, max_batch: int, kv_blocks: int, block_size: int) -> Any:
        """EmulationParams for a replica with this fit."""
        from dask_agents.worker_plugin.emulated import EmulationParams

        return EmulationParams(max_batch=max_batch, prefill_s_per_token=self.prefill_s_per_token,
                               decode_s_per_step=self.decode_s_per_step, decode_s_per_seq=self.decode_s_per_seq,
                               kv_blocks=kv_blocks, block_size=block_size, time_scale=1.0,
                               # the fit has no context term: the emulated default's would add one
                               decode_s_per_ctx_token=0.0,
                               prefill_s_per_token_pos=0.0)


@dataclass
class Prediction:
    """What a replay predicts (EMULATED): session latencies and LLM call latencies."""

    replicas: dict[str, int]
    session_latency: list[float] = field(default_factory=list)
    llm_latency: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    makespan: float = 0.0

    def summary(self) -> dict[str, Any]:
        """Mean/P50/P95/P99 session latency, throughput, mean LLM call latency, hit rate."""
        return summarize(self.session_latency, self.llm_latency, self.makespan,
                         self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None)


def summarize(sessions: list[float], llm: list[float], makespan: float, hit_rate: float | None) -> dict[str, Any]:
    """The numbers a prediction and a recording are compared on."""
    return {"sessions": len(sessions), "mean_s": statistics.fmean(sessions) if sessions else float("nan"),
            "p50_s": percentile(sessions, 50), "p95_s": percentile(sessions, 95), "p99_s": percentile(sessions, 99),
            "throughput_per_s": len(sessions) / makespan if makespan > 0 else float("nan"),
            "llm_mean_s": statistics.fmean(llm) if llm else float("nan"), "hit_rate": hit_rate}


# -- reading telemetry ---------------------------------------------------------------------------

def scripts_from_frame(df: Any) -> list[Script]:
    """Session scripts from a ``da.telemetry`` calls frame (only finished calls of sessions
    whose calls all finished are kept: a replay needs whole sessions)."""
    import pandas as pd

    from dask_agents.client_api import posix_seconds

    missing = [c for c in REQUIRED if c not in df.columns]
    if missing:
        raise WhatIfError(f"telemetry lacks column(s) {', '.join(missing)} (a da.telemetry(client) calls table has them)")
    rows = posix_seconds(df[df["session"].notna()])
    out: list[Script] = []
    origin = None
    for sid, g in rows.groupby("session", sort=False):
        if g[["created", "started", "finished"]].isna().any(axis=None):
            continue  # unfinished or failed before it ran: the session is not whole
        t0 = float(g["created"].min())
        calls = []
        for r in g.sort_values("created").itertuples(index=False):
            d = r._asdict()

            def num(name: str) -> int:
                v = d.get(name)
                return 0 if v is None or pd.isna(v) else int(v)
            model = d.get("model") if d.get("kind") == "llm" else None
            calls.append(Call(
                key=str(d["key"]), component=str(d["component"]), kind=str(d["kind"]),
                creator=d.get("creator") if isinstance(d.get("creator"), str) else None,
                created=float(d["created"]) - t0, started=float(d["started"]) - t0, finished=float(d["finished"]) - t0,
                model=model if isinstance(model, str) else None, prompt_tokens=num("prompt_tokens"),
                cached_tokens=num("cached_tokens"), output_tokens=num("output_tokens"),
                worker=d.get("worker") if isinstance(d.get("worker"), str) else None))
        if any(c.finished < c.started or c.started < c.created - 1e-6 for c in calls):
            raise WhatIfError(f"session {sid}: a call finishes before it starts or starts before it is created")
        out.append(Script(str(sid), t0, tuple(calls)))
        origin = t0 if origin is None else min(origin, t0)
    if not out:
        raise WhatIfError("telemetry has no session whose calls all finished: nothing to replay")
    out = [Script(s.id, s.start - origin, s.calls) for s in out]
    out.sort(key=lambda s: s.start)
    for s in out:
        if any(c.kind == "llm" and (c.model is None or c.output_tokens < 1 or c.prompt_tokens < 1) for c in s.calls):
            raise WhatIfError(f"session {s.id}: an LLM call has no model or no token counts (telemetry from "
                              "before the engines reported them?)")
    return out


def load(path: str) -> list[Script]:
    """Session scripts from a telemetry file (parquet or csv, as ``dask-agents report`` reads)."""
    from dask_agents.report import _read

    try:
        df = _read(path)
    except (OSError, ValueError, RuntimeError) as e:  # RuntimeError: no parquet engine
        raise WhatIfError(f"{path}: cannot read telemetry: {e}") from e
    return scripts_from_frame(df)


def recorded_replicas(scripts: Iterable[Script]) -> dict[str, int]:
    """Engine replicas per model in the recording: the workers that served its calls."""
    hosts: dict[str, set] = {}
    for s in scripts:
        for c in s.calls:
            if c.model is not None:
                hosts.setdefault(c.model, set()).add(c.worker)
    return {m: max(1, len(w - {None})) for m, w in hosts.items()}


# -- calibration ---------------------------------------------------------------------------------

def _concurrency(calls: list[Call]) -> list[float]:
    """Mean number of calls in service on the same worker during each call (itself included):
    the integral of the in-service count over the call's span, over its duration (a sweep over
    the sorted starts and finishes: O(n log n))."""
    import numpy as np

    starts = np.array([c.started for c in calls], dtype=float)
    ends = np.array([c.finished for c in calls], dtype=float)
    times = np.unique(np.concatenate([starts, ends]))
    # calls in service on [times[k], times[k+1]): started at or before, not finished by then
    count = np.searchsorted(np.sort(starts), times, side="right") - np.searchsorted(np.sort(ends), times, side="right")
    area = np.concatenate([[0.0], np.cumsum(count[:-1] * np.diff(times))])  # integral up to times[k]
    at = dict(zip(times.tolist(), area.tolist()))
    out = []
    for c, s0, e0 in zip(calls, starts, ends):
        dur = e0 - s0
        out.append(1.0 if dur <= 0 else max(1.0, (at[float(e0)] - at[float(s0)]) / dur))
    return out


def calibrate(scripts: Iterable[Script]) -> dict[str, EngineFit]:
    """Fit each model's engine costs from its recorded LLM calls (see the module docstring)."""
    import numpy as np

    per_model: dict[str, dict[str | None, list[Call]]] = {}
    for s in scripts:
        for c in s.calls:
            if c.model is not None:
                # on one timeline per worker: shift by the session start
                shifted = Call(c.key, c.component, c.kind, c.creator, c.created + s.start, c.started + s.start,
                               c.finished + s.start, c.model, c.prompt_tokens, c.cached_tokens, c.output_tokens,
                               c.worker)
                per_model.setdefault(c.model, {}).setdefault(c.worker, []).append(shifted)
    fits = {}
    for model, by_worker in per_model.items():
        rows, y = [], []
        for calls in by_worker.values():
            for c, conc in zip(calls, _concurrency(calls)):
                rows.append([c.output_tokens, c.output_tokens * conc, max(c.prompt_tokens - c.cached_tokens, 0)])
                y.append(c.finished - c.started)
        a, b = np.asarray(rows, dtype=float), np.asarray(y, dtype=float)
        if len(b) < 3:
            raise WhatIfError(f"model {model!r}: {len(b)} finished LLM call(s); calibration needs at least 3")
        coef = _nnls(a, b)
        pred = a @ coef
        var = float(((b - b.mean()) ** 2).sum())
        r2 = 1.0 - float(((b - pred) ** 2).sum()) / var if var > 0 else 1.0
        fits[model] = EngineFit(float(coef[0]), float(coef[1]), float(coef[2]), len(b), r2)
    return fits


def _nnls(a: Any, b: Any) -> Any:
    """Least squares with non-negative coefficients (active set over 3 columns: exhaustive)."""
    import numpy as np

    best, best_err = np.zeros(a.shape[1]), float(((b) ** 2).sum())
    for mask in itertools.product((0, 1), repeat=a.shape[1]):
        cols = [i for i, m in enumerate(mask) if m]
        if not cols:
            continue
        coef, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
        if (coef < 0).any():
            continue
        full = np.zeros(a.shape[1])
        full[cols] = coef
        err = float(((a @ full - b) ** 2).sum())
        if err < best_err:
            best, best_err = full, err
    return best


# -- the replay ----------------------------------------------------------------------------------

@dataclass
class _Replica:
    sched: Any
    busy: bool = False
    sessions: int = 0


class _Replay:
    """One virtual-time replay (see :func:`predict`)."""

    def __init__(self, scripts: list[Script], fits: Mapping[str, EngineFit], replicas: Mapping[str, int],
                 load_scale: float, max_batch: int, kv_blocks: int, block_size: int, system_tokens: int):
        from dask_agents.worker_plugin.emulated import EmulatedScheduler

        self.scripts = scripts
        self.load_scale = load_scale
        self.system_tokens = system_tokens
        self.engines = {m: [_Replica(EmulatedScheduler(fits[m].params(max_batch, kv_blocks, block_size), kv_blocks))
                            for _ in range(n)] for m, n in replicas.items()}
        self.events: list[tuple[float, int, str, Any]] = []
        self._seq = itertools.count()
        self.pending_children: dict[tuple[int, str], int] = {}
        self.children_done: dict[tuple[int, str], float] = {}
        self.binding: dict[tuple[int, str], _Replica] = {}
        self.live_calls = [len(s.calls) for s in scripts]
        self.progress = [0] * len(scripts)
        self.session_end = [0.0] * len(scripts)
        self.llm_latency: list[float] = []
        self.prompt = self.cached = 0
        self.calls = [{c.key: c for c in s.calls} for s in scripts]
        self.inflight: dict[str, tuple[int, str, float]] = {}  # request id -> (session, call, submitted)
        self._plan()

    def _plan(self) -> None:
        """For each call: the events it waits for and the gap after each (see the module docstring)."""
        self.triggers: dict[tuple[int, str], list[tuple[tuple[str, str] | None, float]]] = {}
        self.children: dict[tuple[int, str], list[str]] = {}
        self.tail: dict[tuple[int, str], float] = {}
        self.waiters: dict[tuple[int, tuple[str, str]], list[tuple[str, float]]] = {}
        self.need: dict[tuple[int, str], int] = {}  # events a call still waits for
        self.ready_at: dict[tuple[int, str], float] = {}  # the latest time its fired events allow
        for i, s in enumerate(self.scripts):
            by_key = self.calls[i]
            for c in s.calls:
                if c.creator in by_key:
                    self.children.setdefault((i, c.creator), []).append(c.key)
            for c in s.calls:
                after: tuple[str, str] | None = None
                gap, best_t = c.created, 0.0  # after the session start
                for o in s.calls:
                    if o is not c and o.finished <= c.created + 1e-9 and o.finished >= best_t:
                        after, gap, best_t = ("finish", o.key), c.created - o.finished, o.finished
                triggers = [(after, gap)]
                if c.creator in by_key:  # and never before its creator runs, whatever finished first
                    triggers.append((("start", c.creator), max(0.0, c.created - by_key[c.creator].started)))
                self.triggers[(i, c.key)] = triggers
                self.need[(i, c.key)] = sum(1 for ev, _ in triggers if ev is not None)
                for ev, g in triggers:
                    if ev is not None:
                        self.waiters.setdefault((i, ev), []).append((c.key, g))
                kids = self.children.get((i, c.key))
                if kids:
                    self.tail[(i, c.key)] = max(0.0, c.finished - max(by_key[k].finished for k in kids))
                    self.pending_children[(i, c.key)] = len(kids)

    def _push(self, t: float, kind: str, payload: Any) -> None:
        heapq.heappush(self.events, (t, next(self._seq), kind, payload))

    def run(self) -> tuple[list[float], float]:
        for i, s in enumerate(self.scripts):
            t0 = s.start / self.load_scale
            for c in s.calls:
                ev, gap = self.triggers[(i, c.key)][0]
                if ev is None:  # after the session's start
                    self.ready_at[(i, c.key)] = t0 + gap
                    if not self.need[(i, c.key)]:
                        self._push(t0 + gap, "create", (i, c.key))
        now = 0.0
        while self.events:
            now, _, kind, payload = heapq.heappop(self.events)
            if kind == "create":
                self._create(now, *payload)
            elif kind == "start":
                self._start(now, *payload)
            elif kind == "done":
                self._done(now, *payload)
            elif kind == "step":
                self._step(now, payload)
        stuck = [self.scripts[i].id for i, n in enumerate(self.live_calls) if n]
        if stuck:  # a replay that cannot finish a session is a bug here, never a prediction
            raise RuntimeError(f"what-if replay left {len(stuck)} session(s) unfinished, e.g. {stuck[0]}")
        latencies = [self.session_end[i] - s.start / self.load_scale for i, s in enumerate(self.scripts)]
        return latencies, now

    def _call(self, i: int, key: str) -> Call:
        return self.calls[i][key]

    def _create(self, now: float, i: int, key: str) -> None:
        c = self._call(i, key)
        self._push(now + max(0.0, c.started - c.created), "start", (i, key))

    def _start(self, now: float, i: int, key: str) -> None:
        c = self._call(i, key)
        self._fire(now, i, ("start", key))
        if c.model is not None:
            self._submit(now, i, c)
        elif (i, key) not in self.pending_children:
            self._push(now + (c.finished - c.started), "done", (i, key))
        else:  # it waits on its children; its own work before them is in their gaps, after them in its tail
            self.children_done[(i, key)] = now

    def _replica(self, i: int, model: str) -> _Replica:
        rep = self.binding.get((i, model))
        if rep is None:
            pool = self.engines.get(model)
            if not pool:
                raise WhatIfError(f"no replica of model {model!r} in the allocation")
            rep = min(pool, key=lambda r: (r.sessions, len(r.sched.running) + len(r.sched.waiting)))
            rep.sessions += 1
            self.binding[(i, model)] = rep
        return rep

    def _submit(self, now: float, i: int, c: Call) -> None:
        from dask_agents.worker_plugin.emulated import Sequence

        rep = self._replica(i, c.model)
        try:
            rep.sched.check(c.key, c.prompt_tokens, c.output_tokens)
        except ValueError as e:  # the allocation's engines cannot hold this call at all
            raise WhatIfError(f"session {self.scripts[i].id}: {e} (raise --kv-blocks)") from None
        tokens = self._tokens(i, c.prompt_tokens)
        seq = Sequence(f"{i}:{c.key}", tokens, c.output_tokens, priority=(-self.progress[i],))
        self.inflight[seq.request_id] = (i, c.key, now)
        rep.sched.add(seq)
        if not rep.busy:
            rep.busy = True
            self._push(now, "step", rep)

    def _tokens(self, i: int, n: int) -> list[int]:
        # a shared system prefix, then the session's own stream: prompts of a session extend
        # each other (its history), as the recorded agents' prompts do
        shared = min(n, self.system_tokens)
        return [3 + (j * 7) % 1000 for j in range(shared)] + [3 + (i * 7919 + j * 131) % 1000 for j in range(shared, n)]

    def _step(self, now: float, rep: _Replica) -> None:
        cost, done = rep.sched.step()
        if not done and not rep.sched.running:  # nothing admitted or running: idle until a submit
            rep.busy = False
            return
        t = now + cost
        for seq in done:
            i, key, submitted = self.inflight.pop(seq.request_id)
            self.llm_latency.append(t - submitted)
            self.prompt += len(seq.prompt)
            self.cached += seq.cached_tokens
            self._push(t, "done", (i, key))
        self._push(t, "step", rep)

    def _done(self, now: float, i: int, key: str) -> None:
        self.progress[i] += 1
        self.live_calls[i] -= 1
        self.session_end[i] = max(self.session_end[i], now)
        if self.live_calls[i] == 0:
            for model in list(self.engines):
                rep = self.binding.pop((i, model), None)
                if rep is not None:
                    rep.sessions -= 1
        self._fire(now, i, ("finish", key))
        parent = self._call(i, key).creator
        if parent is not None and (i, parent) in self.pending_children:
            self.pending_children[(i, parent)] -= 1
            if self.pending_children[(i, parent)] == 0:
                t = max(self.children_done[(i, parent)], now + self.tail[(i, parent)])
                self._push(t, "done", (i, parent))

    def _fire(self, now: float, i: int, event: tuple[str, str]) -> None:
        for key, gap in self.waiters.get((i, event), ()):
            t = max(self.ready_at.get((i, key), now), now + gap)
            self.ready_at[(i, key)] = t
            self.need[(i, key)] -= 1
            if not self.need[(i, key)]:
                self._push(t, "create", (i, key))


def system_prefix(scripts: Iterable[Script]) -> int:
    """Tokens every session shares: the median hit of sessions' first LLM calls."""
    firsts = []
    for s in scripts:
        llm = [c for c in s.calls if c.model is not None]
        if llm:
            firsts.append(llm[0].cached_tokens)
    return int(statistics.median(firsts)) if firsts else 0


def predict(scripts: list[Script], fits: Mapping[str, EngineFit], replicas: Mapping[str, int],
            load_scale: float = 1.0, max_batch: int = 256, kv_blocks: int = 1 << 20, block_size: int = 16) -> Prediction:
    """Replay ``scripts`` on ``replicas`` engines per model (see the module docstring)."""
    if load_scale <= 0:
        raise WhatIfError(f"load scale must be > 0, got {load_scale}")
    models = {c.model for s in scripts for c in s.calls if c.model is not None}
    for m in models:
        if replicas.get(m, 0) < 1:
            raise WhatIfError(f"model {m!r} needs at least one replica (got {replicas.get(m, 0)})")
        if m not in fits:
            raise WhatIfError(f"model {m!r} has no calibration")
    unknown = set(replicas) - models
    if unknown:
        raise WhatIfError(f"replicas for model(s) the telemetry never called: {', '.join(sorted(unknown))} "
                          f"(known: {', '.join(sorted(models)) or 'none'})")
    replay = _Replay(scripts, fits, {m: int(replicas[m]) for m in models}, load_scale, max_batch, kv_blocks,
                     block_size, system_prefix(scripts))
    lat, end = replay.run()
    first = min(s.start for s in scripts) / load_scale
    return Prediction(dict(replicas), lat, replay.llm_latency, replay.prompt, replay.cached, end - first)


def recorded(scripts: list[Script]) -> dict[str, Any]:
    """What the recording measured, summarized like a prediction."""
    lat = [s.latency for s in scripts]
    llm = [c.finished - c.started for s in scripts for c in s.calls if c.model is not None]
    end = max(s.start + s.latency for s in scripts) - min(s.start for s in scripts)
    prompt = sum(c.prompt_tokens for s in scripts for c in s.calls if c.model is not None)
    cached = sum(c.cached_tokens for s in scripts for c in s.calls if c.model is not None)
    return summarize(lat, llm, end, cached / prompt if prompt else None)


MIN_R2 = 0.5  # a calibration explaining less of the recorded LLM call times is not trusted
MAX_SELF_CHECK_ERROR = 0.25  # nor a replay of the recording off by more than this on any measure
RECORDING_HINT = ("record a run whose LLM calls vary: several concurrent sessions, prompts from hundreds to "
                  "thousands of tokens and a range of output lengths, after the engines have loaded (the "
                  "calibration fits decode per step, per sequence and prefill per token; one prompt shape "
                  "or calls one at a time leave those apart undetermined)")


def warnings_for(fits: Mapping[str, EngineFit], check: Mapping[str, Any]) -> list[str]:
    """Why the predictions should not be trusted: a poor calibration fit (R^2 below ``MIN_R2``)
    or a self-check (the recording replayed on its own allocation) off by more than
    ``MAX_SELF_CHECK_ERROR``; empty when neither."""
    out = [f"the calibration of {m} explains {f.r2:.0%} of the recorded LLM call times (R^2 {f.r2:.2f} < {MIN_R2})"
           for m, f in fits.items() if not f.r2 >= MIN_R2]
    off = {k: v for k, v in (check.get("errors") or {}).items() if abs(v) > MAX_SELF_CHECK_ERROR}
    if off:
        out.append("replayed on its own allocation, the recording is predicted "
                   + ", ".join(f"{k} {v:+.0%}" for k, v in off.items())
                   + f" off (more than {MAX_SELF_CHECK_ERROR:.0%})")
    return out


def validate(scripts: list[Script], fits: Mapping[str, EngineFit], **kw: Any) -> dict[str, Any]:
    """Replay the recording on its own allocation: measured, predicted and relative errors."""
    measured = recorded(scripts)
    predicted = predict(scripts, fits, recorded_replicas(scripts), **kw).summary()
    errors = {k: (predicted[k] - measured[k]) / measured[k]
              for k in ("mean_s", "p95_s", "throughput_per_s", "llm_mean_s")
              if isinstance(measured.get(k), float) and measured[k] and math.isfinite(measured[k])}
    return {"replicas": recorded_replicas(scripts), "measured": measured, "predicted": predicted, "errors": errors}


def parse_replicas(items: Iterable[str], gpus: int | None, scripts: list[Script]) -> dict[str, int]:
    """``model=N`` items, and ``gpus`` split over the rest in proportion to their recorded work."""
    out: dict[str, int] = {}
    for item in items:
        name, sep, n = item.partition("=")
        if not sep or not n.strip().isdigit() or int(n) < 1:
            raise WhatIfError(f"--replicas takes MODEL=N with N >= 1, got {item!r}")
        out[name.strip()] = int(n)
    base = recorded_replicas(scripts)
    rest = [m for m in base if m not in out]
    if gpus is not None:
        left = gpus - sum(out.values())
        if left < len(rest):
            raise WhatIfError(f"--gpus {gpus} leaves {left} for {len(rest)} model(s) that need one each")
        # one each, then the rest by recorded LLM work (largest remainder): exactly --gpus in all
        work = {m: sum(c.finished - c.started for s in scripts for c in s.calls if c.model == m) for m in rest}
        total = sum(work.values()) or 1.0
        extra = left - len(rest)
        quota = {m: extra * work[m] / total for m in rest}
        shares = {m: 1 + int(quota[m]) for m in rest}
        for m in sorted(rest, key=lambda m: quota[m] - int(quota[m]), reverse=True)[:left - sum(shares.values())]:
            shares[m] += 1
        out.update(shares)
    else:
        out.update({m: base[m] for m in rest})
    return out
