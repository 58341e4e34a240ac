"""The data behind the Agents dashboard page, computed from the scheduler plugin (no Bokeh).

One :class:`DashboardModel` per plugin serves every open page: it recomputes at most once per
refresh, whatever the number of open pages, and only redoes a session's row when the
session's version moved. Everything runs on the scheduler's event loop and is bounded:
O(live sessions + assigned tasks + calls finished in the window) per refresh.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import dask_agents.config as agents_config
from dask_agents.scheduler_plugin import dask_compat
from dask_agents.models import STATE_COLORS  # (the page's legend and node colours)
from dask_agents.scheduler_plugin.metrics import TIERS, engine_records, queue_counts

if TYPE_CHECKING:
    from dask_agents.scheduler_plugin.plugin import AgentsSchedulerPlugin

logger = logging.getLogger(__name__)

SESSION_COLORS = {"active": "#1e88e5", "closing": "#fb8c00", "completed": "#43a047"}
"""Colour of a session's progress bar by state."""

SESSION_COLUMNS = ["session", "tenant", "state", "age_s", "progress", "calls", "open", "pct", "current",
                   "retries", "failed", "color"]
COMPONENT_COLUMNS = ["component", "kind", "replicas", "slots", "queued", "per_replica", "running", "busy", "service_rate",
                     "throughput", "arrival_rate", "mean_queue_s", "mean_service_s", "capacity_x", "bottleneck"]
ENGINE_COLUMNS = ["worker", "model", "engine", "sessions", "running", "waiting", "held", "bound", "working_set",
                  "kv_device", "kv_capacity", "kv_referenced", "kv_retained", "kv_evictable", "kv_blocks",
                  "kv_host", "kv_disk", "hit_rate", "cached_tokens", "recomputed_tokens", "offloaded", "restored",
                  "evictions", "kv_control", "stats_age_s"]
DECISION_COLUMNS = ["time", "action", "policy", "details"]
ERROR_COLUMNS = ["time", "session", "call", "component", "worker", "error", "link"]
TIMELINE_COLUMNS = ["key", "lane", "component", "method", "start_ms", "end_ms", "duration", "state", "color",
                    "mark", "hatch", "line"]
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
           "#aec7e8")
"""Component colours of the timeline (Category10 less its red, kept for errors)."""
BOTTLENECK_MARGIN = 0.1
"""Another component becomes the bottleneck only when its capacity is this much lower than the
current one's (near-equal components do not make the label flip every refresh)."""


def short(address: str | None) -> str:
    """A worker address without the protocol (``127.0.0.1:40123``)."""
    if not address:
        return ""
    if not isinstance(address, str):
        return str(address)
    return address.split("://", 1)[-1]


def _duration(started: Any, finished: Any) -> float:
    """``finished - started`` rounded, NaN when either is unknown or not a finite number."""
    ok = all(isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) for t in (started, finished))
    return round(finished - started, 4) if ok else float("nan")


def fmt_bytes(n: float | None) -> str:
    """``1.5 MiB``; ``—`` for unknown (never a made-up zero)."""
    if n is None:
        return "—"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


@dataclass
class _Sample:
    time: float
    created: Counter  # component -> calls created so far (arrival rates)


@dataclass
class SessionsView:
    """The sessions shown now: creation order, versions, rows (``rows[sid] = (version, row)``)."""

    order: list[str]
    versions: dict[str, int]
    rows: dict[str, tuple[int, dict]]
    live: int = 0

    def row(self, sid: str) -> dict:
        """The table row of ``sid``."""
        return self.rows[sid][1]


class BusyTime:
    """Busy call-seconds per component over the last ``seconds``, from the workers' exact
    start/finish reports: each call is split across the ``width``-second buckets it spans, so
    a short call counts as much as it ran (page-refresh samples never saw it), and the window's
    sum is O(buckets) however many calls finished in it.

    A call is O(1) to add however many buckets it spans (hundreds of reports a second at
    1,000 live sessions): its two end buckets get their partial seconds, the buckets between
    them a +1/-1 change of the count of calls covering a bucket whole; :meth:`total` sums the
    changes forward."""

    def __init__(self, seconds: float, width: float = 1.0):
        self.seconds = seconds
        self.width = width
        self.keep = int(math.ceil(seconds / width)) + 2
        self.partial: dict[str, dict[int, float]] = {}  # component -> bucket -> seconds
        self.cover: dict[str, dict[int, int]] = {}  # component -> bucket -> change of whole-bucket calls
        self.base: dict[str, int] = {}  # component -> whole-bucket calls at its oldest kept bucket
        self.last: dict[str, int] = {}  # component -> newest bucket written

    def add(self, component: str, started: float, finished: float) -> None:
        """One call ran from ``started`` to ``finished``."""
        if not finished > started:
            return
        w = self.width
        b0, b1 = int(started // w), int(finished // w)
        if b0 < b1 - self.keep:  # older than the window: never read
            b0, started = b1 - self.keep, (b1 - self.keep) * w
        part = self.partial.get(component)
        if part is None:
            part = self.partial[component] = {}
            self.cover[component] = {}
            self.base[component] = 0
            self.last[component] = b1
        if b1 > self.last[component]:
            self.last[component] = b1
        if b0 == b1:
            part[b0] = part.get(b0, 0.0) + (finished - started)
            return
        part[b0] = part.get(b0, 0.0) + ((b0 + 1) * w - started)
        part[b1] = part.get(b1, 0.0) + (finished - b1 * w)
        if b1 > b0 + 1:  # whole buckets b0+1 .. b1-1
            cover = self.cover[component]
            cover[b0 + 1] = cover.get(b0 + 1, 0) + 1
            cover[b1] = cover.get(b1, 0) - 1

    def total(self, component: str, now: float) -> float:
        """Busy seconds of ``component`` within ``[now - seconds, now]`` (the oldest bucket in
        proportion to its overlap). ``now`` may only grow from call to call: buckets before the
        window are dropped (their coverage changes folded into the count carried forward)."""
        part = self.partial.get(component)
        if part is None:
            return 0.0
        cover = self.cover[component]
        w = self.width
        horizon = now - self.seconds
        first = int(horizon // w)
        for b in [b for b in part if b < first]:
            del part[b]
        old = [b for b in cover if b <= first]
        if old:
            self.base[component] += sum(cover.pop(b) for b in old)
        count = self.base[component]  # calls covering bucket `first` whole
        total = 0.0
        for b in range(first, self.last[component] + 1):
            if b > first:
                count += cover.get(b, 0)
            x = part.get(b, 0.0) + count * w
            total += x * ((b + 1) * w - horizon) / w if b == first else x
        return total


class _Window:
    """Per-component sums over the workers' reports of the last ``seconds`` (incremental)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.busy = BusyTime(seconds)
        self.seen = 0
        self.entries: deque[tuple[float, str, str | None, float | None, float]] = deque()
        self.done: Counter = Counter()
        self.q_sum: Counter = Counter()
        self.q_n: Counter = Counter()
        self.s_sum: Counter = Counter()
        self.workers: dict[str, Counter] = {}

    def advance(self, agg: Any, now: float) -> None:
        """Take the reports that arrived since the last call; drop those out of the window."""
        new = min(agg.reports - self.seen, len(agg.recent))
        self.seen = agg.reports
        if new > 0:
            for comp, w, ready, started, finished in itertools.islice(agg.recent, len(agg.recent) - new, None):
                q = max(started - ready, 0.0) if ready is not None else None
                self.entries.append((finished, comp, w, q, finished - started))
                self._add(comp, w, q, finished - started, 1)
                self.busy.add(comp, started, finished)
        horizon = now - self.seconds
        while self.entries and self.entries[0][0] < horizon:
            _, comp, w, q, svc = self.entries.popleft()
            self._add(comp, w, q, svc, -1)

    def _add(self, comp: str, w: str | None, q: float | None, svc: float, sign: int) -> None:
        self.done[comp] += sign
        self.s_sum[comp] += sign * svc
        if q is not None:
            self.q_sum[comp] += sign * q
            self.q_n[comp] += sign
        if w:
            ws = self.workers.get(comp)
            if ws is None:  # (not setdefault(comp, Counter()): a Counter built per report)
                ws = self.workers[comp] = Counter()
            n = ws.get(w, 0) + sign
            if n > 0:
                ws[w] = n
            else:
                ws.pop(w, None)


def pick_bottleneck(candidates: dict[str, dict], current: str | None,
                    margin: float = BOTTLENECK_MARGIN) -> str | None:
    """The component with the lowest ``capacity_x`` among ``candidates`` (rows with waiting
    work), except that ``current`` stays while it is a candidate and no other is lower by more
    than ``margin`` (a fraction of its capacity)."""
    if not candidates:
        return None
    low = min(candidates, key=lambda c: (candidates[c]["capacity_x"], c))
    if current in candidates and candidates[low]["capacity_x"] >= candidates[current]["capacity_x"] * (1 - margin):
        return current
    return low


def _depths(keys: list[str], parents_of: dict[str, list[str]]) -> dict[str, int]:
    """Each call's depth: the longest chain of dependencies and creators before it (0: none),
    whatever the order of ``keys``; an edge that would close a cycle is left out."""
    depth: dict[str, int] = {}
    for root in keys:
        if root in depth:
            continue
        stack, on_path = [(root, iter(parents_of[root]))], {root}
        while stack:
            node, parents = stack[-1]
            for p in parents:
                if p not in depth and p not in on_path:
                    stack.append((p, iter(parents_of[p])))
                    on_path.add(p)
                    break
            else:
                stack.pop()
                on_path.discard(node)
                depth[node] = 1 + max((depth[p] for p in parents_of[node] if p in depth), default=-1)
    return depth


class DashboardModel:
    """Snapshots of one plugin for the page(s); shared by every open page."""

    def __init__(self, plugin: "AgentsSchedulerPlugin"):
        self.plugin = plugin
        self.interval = agents_config.seconds("dashboard.update-interval")
        self.max_sessions = int(agents_config.get("dashboard.max-sessions"))
        self.completed_rows = int(agents_config.get("dashboard.completed-sessions"))
        self.max_graph_nodes = int(agents_config.get("dashboard.max-graph-nodes"))
        self.decisions = int(agents_config.get("dashboard.decisions"))
        self.window = agents_config.seconds("dashboard.window")
        self._rows: dict[str, tuple[int, dict]] = {}  # session -> (version, row)
        self._sessions: tuple[float, SessionsView] | None = None
        self._components: tuple[float, list[dict]] | None = None
        self._engines: tuple[float, list[dict]] | None = None
        self._samples: deque[_Sample] = deque()
        self._graphs: dict[str, tuple[int, dict]] = {}
        self._kinds: dict[str, str] = {}
        self._window = _Window(self.window)
        self._bad_rows: set[tuple[Any, Any]] = set()  # engine rows that failed to render (logged once)
        self.since = time.time()

    _bottleneck: str | None = None

    def _fresh(self, cached: tuple[float, Any] | None, now: float) -> bool:
        return cached is not None and now - cached[0] < self.interval / 2

    # -- sessions ------------------------------------------------------------------------------
    def sessions(self, now: float | None = None) -> SessionsView:
        """Live sessions (newest ``max-sessions``) and the most recently completed ones."""
        now = time.time() if now is None else now
        if self._fresh(self._sessions, now):
            return self._sessions[1]
        state = self.plugin.state
        live = [sid for sid, s in state.sessions.items() if s.state != "completed"]
        n_live = len(live)
        if len(live) > self.max_sessions:
            live = live[-self.max_sessions:]
        done = set(itertools.islice(reversed(state.completed), self.completed_rows))
        shown = set(live) | done
        order = [sid for sid in state.sessions if sid in shown] if done else live
        versions = {}
        rows = self._rows  # kept between refreshes: a row is redone only when its session moved
        sessions = state.sessions
        for sid in order:
            v = versions[sid] = sessions[sid].version
            cached = rows.get(sid)
            if cached is None or cached[0] != v:
                rows[sid] = (v, self.session_row(sid, now))
        if len(rows) > len(order) + 256:  # forget rows of sessions no longer shown
            self._rows = rows = {sid: rows[sid] for sid in order}
        view = SessionsView(order, versions, rows, n_live)
        self._sessions = (now, view)
        return view

    def session_row(self, sid: str, now: float) -> dict:
        """One row of the sessions table."""
        d = self.plugin.state.session_summary(sid, now)
        calls = d["calls"]
        return {
            "session": sid, "tenant": d["tenant"] or "", "state": d["state"], "age_s": round(d["age_s"], 2),
            "progress": d["progress"], "calls": calls, "open": d["open"],
            "pct": round(100.0 * d["progress"] / calls, 1) if calls else 0.0, "current": d["current"],
            "retries": d["retries"], "failed": d["failed"], "color": SESSION_COLORS.get(d["state"], "#9e9e9e"),
            "created": d["created"], "completed": d["completed"],  # for the ages (not columns)
        }

    # -- components ----------------------------------------------------------------------------
    def components(self, now: float | None = None) -> list[dict]:
        """One row per component: replicas, queues, utilization, rates, bottleneck.

        ``busy`` (utilization): the fraction of the component's capacity in use over the
        window, from the workers' exact timings: call-seconds run (reports of finished calls,
        plus the executing time the workers report for running ones) over capacity x window.
        Capacity: the threads of the workers running the component (a call holds a thread),
        for an LLM component the batch slots of its engines."""
        now = time.time() if now is None else now
        if self._fresh(self._components, now):
            return self._components[1]
        p = self.plugin
        state = p.state
        calls = state.calls
        waiting, running, held = queue_counts(p)
        threads: dict[str, int] = {}
        running_s: Counter = Counter()  # call-seconds within the window of calls running now
        for ws in dask_compat.workers(p.scheduler):
            address, nthreads = dask_compat.worker_summary(ws)[:2]
            threads[address] = nthreads
            for ts, elapsed in dask_compat.executing(ws):
                rec = calls.get(dask_compat.task_key(ts))
                if rec is not None and rec.started is None:  # not reported finished (counted above)
                    running_s[rec.component] += min(max(elapsed, 0.0), self.window)
        workers_of: dict[str, set[str]] = {}
        for (comp, w), _n in itertools.chain(running.items(), waiting.items()):
            workers_of.setdefault(comp, set()).add(w)
        self._samples.append(_Sample(now, Counter(state.calls_per_component)))
        while len(self._samples) > 2 and now - self._samples[0].time > self.window:
            self._samples.popleft()
        first = self._samples[0]
        span = now - first.time
        win_ = self._window
        win_.advance(p.aggregates, now)
        done, q_sum, q_n, s_sum = win_.done, win_.q_sum, win_.q_n, win_.s_sum
        win = max(min(self.window, now - self.since), 1e-9)
        model_of = {p.component_of(m): m for m in p.model_workers}
        slots_of = self._engine_slots()
        bottleneck_policy = self._policy_bottleneck()
        rows = []
        for comp in sorted(state.calls_per_component):
            model = model_of.get(comp)
            if model is not None:
                hosts = sorted(p.model_workers.get(model) or ())
                replicas = len(hosts)
                slots = sum(slots_of.get((w, model)) or threads.get(w, 1) for w in hosts)
                kind = f"llm ({model})"
            else:
                hosts = sorted(workers_of.get(comp, set()) | set(win_.workers.get(comp, ())))
                replicas = len(hosts)
                slots = sum(threads.get(w, 1) for w in hosts)
                kind = self._kind(comp)
            per = {w: waiting.get((comp, w), 0) for w in sorted(workers_of.get(comp, ()))}
            queued = sum(per.values()) + held.get(comp, 0)
            arrivals = state.calls_per_component[comp] - first.created.get(comp, 0) if span > 0 else 0
            lam = arrivals / span if span > 0 else None
            busy_s = win_.busy.total(comp, now) + running_s[comp]
            busy_frac = busy_s / (slots * win) if slots else None
            mu = done[comp] / busy_s if busy_s > 0 and done[comp] else None
            x = slots * mu / max(lam, 1e-3) if mu is not None and lam is not None and slots else None
            rows.append({
                "component": comp, "kind": kind, "replicas": replicas, "slots": slots, "queued": queued,
                "per_replica": " ".join(f"{short(w)}:{n}" for w, n in per.items())
                + (f" scheduler:{held[comp]}" if held.get(comp) else ""),
                "running": sum(n for (c, _w), n in running.items() if c == comp),
                "busy": None if busy_frac is None else round(min(busy_frac, 1.0), 3),
                "service_rate": None if mu is None else round(mu, 3),
                "throughput": round(done[comp] / win, 3) if done[comp] else 0.0,
                "arrival_rate": None if lam is None else round(lam, 3),
                "mean_queue_s": round(q_sum[comp] / q_n[comp], 4) if q_n[comp] else None,
                "mean_service_s": round(s_sum[comp] / done[comp], 4) if done[comp] else None,
                "capacity_x": None if x is None else round(x, 3),
                "bottleneck": "",
            })
        # Nalar's bottleneck: the smallest normalized capacity among components with waiting
        # work; the current one keeps the label unless another is clearly lower (hysteresis)
        candidates = {r["component"]: r for r in rows if r["capacity_x"] is not None and r["queued"] > 0}
        self._bottleneck = pick_bottleneck(candidates, self._bottleneck)
        if self._bottleneck is not None:
            candidates[self._bottleneck]["bottleneck"] = "lowest capacity"
        if bottleneck_policy is not None:
            comp, streak = bottleneck_policy
            for r in rows:
                if r["component"] == comp:
                    r["bottleneck"] = f"reallocate policy ({streak} ticks)"
        self._components = (now, rows)
        return rows

    def _engine_slots(self) -> dict[tuple[str, str], int]:
        """(worker, model) -> the engine's batch slots, where it reports them."""
        out = {}
        for w, m, st in engine_records(self.plugin.aggregates):
            if isinstance(st.get("max_batch"), int) and st["max_batch"] > 0:
                out[(w, m)] = st["max_batch"]
        return out

    def _kind(self, component: str) -> str:
        kind = self._kinds.get(component)
        if kind is None:  # once per component: the newest call of it says its kind
            kind = next((r.kind for r in reversed(self.plugin.state.calls.values()) if r.component == component), "")
            self._kinds[component] = kind
        return kind

    def _policy_bottleneck(self) -> tuple[str, int] | None:
        """(component, consecutive ticks) the reallocation policy names as bottleneck now."""
        control = self.plugin.control
        if control is None:
            return None
        for policy in control.policies.values():
            streak = getattr(policy, "streak", None)
            if isinstance(streak, tuple) and len(streak) == 2 and streak[0]:
                return self.plugin.component_of(streak[0]), int(streak[1])
        return None

    # -- engines and KV --------------------------------------------------------------------------
    def engines(self, now: float | None = None) -> list[dict]:
        """One row per (worker, model) engine: sessions, queue, KV bytes per tier, hit rate.

        Only stats that pass :func:`validate.engine_record` are shown; an engine whose stored
        stats do not shows ``invalid stats`` (and ``—`` for its numbers) instead of breaking
        the page for every engine."""
        now = time.time() if now is None else now
        if self._fresh(self._engines, now):
            return self._engines[1]
        p = self.plugin
        agg = p.aggregates
        sessions: Counter = Counter()
        for (_sid, what), w in p.bindings.items():
            if isinstance(what, str) and what.startswith("llm:"):
                sessions[(w, what[4:])] += 1
        stats = {(w, m): st for w, m, st in engine_records(agg)}
        times: dict[str, float] = {}
        raw: set[tuple[str, str]] = set()  # (worker, model) pairs with stored stats, valid or not
        for w, rep in agg.engines.items():
            if not isinstance(w, str) or not isinstance(rep, dict):
                continue
            t = rep.get("time")
            if isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t):
                times[w] = float(t)
            models = rep.get("models")
            if isinstance(models, dict):
                raw |= {(w, m) for m in models if isinstance(m, str)}
        pairs = {(w, m) for m, ws in p.model_workers.items() for w in ws}
        pairs |= raw
        held = p.admission.held_by_model
        pairs |= {(w, m) for (w, m) in agg.tokens if m}
        rows = []
        for w, m in sorted(pairs, key=lambda wm: (str(wm[0]), str(wm[1]))):
            try:
                row = self._engine_row(w, m, stats.get((w, m)), (w, m) in raw, times.get(w),
                                       sessions.get((w, m), 0), agg, now)
                row.update(self._admission(w, m, held))
                rows.append(row)
            except Exception:  # a record no check caught: left out, the other engines shown
                agg.skipped += 1
                first = (w, m) not in self._bad_rows  # in full once: the page refreshes twice a second
                self._bad_rows.add((w, m))
                (logger.exception if first else logger.debug)("dask-agents: the engines table left out %s %s",
                                                             w, m, exc_info=True)
        self._engines = (now, rows)
        return rows

    def _admission(self, w: str, m: str, held: Counter) -> dict:
        """What admission holds for the engine's model, what it bound there, and the admitted
        live sessions' working sets against the KV they may fill (blocks)."""
        adm = self.plugin.admission
        r = adm.engines.get((w, m))
        if r is None:
            return {"held": held.get(m, 0), "bound": None, "working_set": None}
        cap = "?" if r.capacity is None else f"{r.capacity:,}"
        return {"held": held.get(m, 0), "bound": len(r.inflight),
                "working_set": f"{adm.resident(r):,} / {cap} blocks ({len(r.sessions)} sessions)"}

    @staticmethod
    def _engine_row(w: str, m: str, st: dict | None, stored: bool, at: float | None, bound: int, agg: Any,
                    now: float) -> dict:
        invalid = st is None and stored
        st = st or {}
        kv = st.get("kv_bytes") or {}
        cap = st.get("kv_capacity_bytes") or {}
        moved = st.get("kv_traffic_bytes") or {}
        blocks = st.get("kv_blocks") or {}
        n, prompt, cached, _out = agg.tokens.get((w, m), (0, 0, 0, 0))
        engine = "invalid stats" if invalid else (st.get("engine") or "?") + (" (EMULATED)" if st.get("emulated") else "")
        return {
            "worker": short(w), "model": m, "engine": engine, "sessions": bound,
            "running": st.get("running"), "waiting": st.get("waiting"),
            "kv_device": fmt_bytes(kv.get(TIERS[0])), "kv_capacity": fmt_bytes(cap.get(TIERS[0])),
            # the device's KV blocks as the engine reports them (None: not reported)
            "kv_referenced": blocks.get("pinned"), "kv_retained": blocks.get("retained"),
            "kv_evictable": blocks.get("cached"), "kv_blocks": blocks.get("capacity"),
            "kv_host": fmt_bytes(kv.get(TIERS[1])), "kv_disk": fmt_bytes(kv.get(TIERS[2])),
            "hit_rate": round(cached / prompt, 3) if prompt else None,
            "cached_tokens": cached, "recomputed_tokens": prompt - cached,
            "offloaded": fmt_bytes(moved.get("offloaded")), "restored": fmt_bytes(moved.get("restored")),
            "evictions": st.get("evictions"),
            # per-session KV control on, or off with the reason (plain prefix caching then)
            "kv_control": ("on" if st["kv_control"] else f"off: {st.get('kv_control_reason') or '?'}")
            if "kv_control" in st else None,
            "stats_age_s": round(now - at, 1) if at is not None else None,
        }

    # -- control loop ----------------------------------------------------------------------------
    def control_summary(self) -> dict:
        """Tick times and decision counters of the control loop (empty if there is none)."""
        control = self.plugin.control
        if control is None:
            return {}
        st = control.stats()
        st.pop("recent", None)
        return st

    def new_ticks(self, seen: int) -> tuple[int, list[tuple[int, float]]]:
        """Tick times after tick number ``seen``: (ticks now, [(tick, seconds), ...])."""
        control = self.plugin.control
        if control is None:
            return seen, []
        total = control.ticks
        window = list(control.tick_seconds)
        new = min(total - seen, len(window))
        if new <= 0:
            return total, []
        return total, [(total - new + i + 1, dt) for i, dt in enumerate(window[-new:])]

    def new_decisions(self, seen: tuple[int, int]) -> tuple[tuple[int, int], list[dict]]:
        """Decisions after the ``seen`` ones, oldest first: the control loop's (migrations,
        priorities, reallocations...) and the engines' KV directives. ``seen``/the returned
        cursor: (control-loop decisions, KV decision records) so far."""
        control_seen, kv_seen = seen
        recs: list[dict] = []
        control = self.plugin.control
        if control is not None:
            enf = control.enforcer
            total = sum(enf.applied.values())
            new = min(total - control_seen, len(enf.recent), self.decisions)
            control_seen = total
            if new > 0:
                recs.extend(list(enf.recent)[-new:])
        agg = self.plugin.aggregates
        new = min(agg.kv_decisions_total - kv_seen, len(agg.kv_decisions), self.decisions)
        kv_seen = agg.kv_decisions_total
        if new > 0:
            recs.extend(list(agg.kv_decisions)[-new:])
        rows = []
        for rec in sorted(recs, key=lambda r: r.get("time", 0))[-self.decisions:]:
            details = " ".join(f"{k}={_brief(v)}" for k, v in rec.items() if k not in ("action", "policy", "time"))
            rows.append({"time": time.strftime("%H:%M:%S", time.localtime(rec.get("time", 0))),
                         "action": rec.get("action", ""), "policy": rec.get("policy", ""), "details": details})
        return (control_seen, kv_seen), rows

    # -- a session's graph -----------------------------------------------------------------------
    def pick_session(self) -> str | None:
        """The session a page follows by default: the live one running longest (the slowest:
        the newest has always just started), else the newest."""
        sessions = self.plugin.state.sessions
        for sid in sessions:  # creation order
            if sessions[sid].state != "completed":
                return sid
        return next(reversed(sessions), None)

    def graph(self, sid: str | None) -> tuple[int, dict] | None:
        """(version, layout) of a session's live call graph; None if unknown.

        Layout: x = depth (longest chain of dependencies/creators before the call), y = order
        within its depth; only the newest ``max-graph-nodes`` calls."""
        s = self.plugin.state.sessions.get(sid) if sid else None
        if s is None:
            return None
        cached = self._graphs.get(sid)
        if cached is not None and cached[0] == s.version:
            return cached
        recs = list(s.calls.values())[-self.max_graph_nodes:]
        keys = {r.key for r in recs}
        parents_of: dict[str, list[str]] = {}
        for r in recs:
            parents = [d for d in r.dependencies if d in keys]
            if r.creator in keys:
                parents.append(r.creator)
            parents_of[r.key] = parents
        # not in one pass over the records: a call's record may come before its creator's (a
        # driver's direct call is recorded by its worker, its nested calls' records often first)
        depth = _depths([r.key for r in recs], parents_of)
        levels: dict[int, list[str]] = {}
        for r in recs:
            levels.setdefault(depth[r.key], []).append(r.key)
        pos: dict[str, tuple[float, float]] = {}
        order = {r.key: i for i, r in enumerate(recs)}
        for d in sorted(levels):  # children sit next to their parents (fewer crossing edges)
            ks = levels[d]
            if d > 0:
                def mean_y(k: str, d: int = d) -> float:
                    ys = [pos[q][1] for q in parents_of[k] if depth[q] < d]
                    return sum(ys) / len(ys) if ys else 0.0

                ks.sort(key=lambda k: (-mean_y(k), order[k]))
            for i, k in enumerate(ks):
                pos[k] = (float(d), (len(ks) - 1) / 2.0 - i)
        nodes = {c: [] for c in ("key", "component", "method", "state", "color", "x", "y", "worker", "duration",
                                 "retry")}
        for r in recs:
            x, y = pos[r.key]
            nodes["key"].append(r.key)
            nodes["component"].append(r.component)
            nodes["method"].append(r.method or "")
            nodes["state"].append(r.state)
            nodes["color"].append(STATE_COLORS.get(r.state, "#9e9e9e"))
            nodes["x"].append(x)
            nodes["y"].append(y)
            nodes["worker"].append(short(r.worker))
            nodes["duration"].append(_duration(r.started, r.finished))  # NaN, not an error, for odd times
            nodes["retry"].append("retry" if r.retry else "")
        edges = {"xs": [], "ys": [], "kind": [], "color": [], "dash": []}
        for r in recs:
            for src, kind in [(d, "dependency") for d in r.dependencies] + [(r.creator, "created")]:
                if src in pos:
                    (x0, y0), (x1, y1) = pos[src], pos[r.key]
                    edges["xs"].append([x0, x1])
                    edges["ys"].append([y0, y1])
                    edges["kind"].append(kind)
                    edges["color"].append("#555555" if kind == "dependency" else "#aaaaaa")
                    edges["dash"].append("solid" if kind == "dependency" else "dashed")
        counts = Counter(nodes["state"])
        layout = {"session": sid, "state": s.state, "progress": s.progress, "calls": len(s.calls),
                  "shown": len(recs), "nodes": nodes, "edges": edges, "counts": dict(counts)}
        if len(self._graphs) > 64:
            self._graphs.clear()
        self._graphs[sid] = (s.version, layout)
        return self._graphs[sid]

    # -- errors ----------------------------------------------------------------------------------
    def errors(self, seen: int) -> tuple[int, list[dict]]:
        """Calls that erred after the first ``seen`` (oldest first) as rows of the errors panel:
        when, session, call, component, worker, the error's text, and the path of Dask's page
        for the task (``/info/task/<key>.html``, under the dashboard's prefix)."""
        from tornado.escape import url_escape

        state = self.plugin.state
        new = min(state.calls_erred - seen, len(state.errors))
        if new <= 0:
            return state.calls_erred, []
        prefix = (dask_compat.dashboard_prefix(self.plugin.scheduler) or "/").rstrip("/")
        rows = []
        for rec in itertools.islice(state.errors, len(state.errors) - new, None):
            t = rec.finished if rec.finished is not None else rec.created
            rows.append({"time": time.strftime("%H:%M:%S", time.localtime(t)), "session": rec.session or "",
                         "call": rec.key, "component": f"{rec.component}.{rec.method}" if rec.method else rec.component,
                         "worker": short(rec.worker), "error": _brief(rec.error, 240),
                         "link": f"{prefix}/info/task/{url_escape(str(rec.key), plus=False)}.html"})
        return state.calls_erred, rows

    # -- a session's timeline --------------------------------------------------------------------
    def timeline(self, sid: str | None, now: float | None = None) -> tuple[int, dict] | None:
        """(version, columns) of a session's timeline: one bar per call that reached a worker,
        from its start to its finish (a call still running: from when it was handed to the
        worker until now), on the lane of its worker (LLM calls: the worker's engine),
        coloured by component; ``mark`` is ``retry`` for a re-visit, ``erred`` for a failed
        call (hatched). Only the newest ``max-graph-nodes`` calls. None if unknown."""
        s = self.plugin.state.sessions.get(sid) if sid else None
        if s is None:
            return None
        now = time.time() if now is None else now
        colors: dict[str, str] = {}
        cols: dict[str, list] = {c: [] for c in TIMELINE_COLUMNS}
        label = self._worker_label()
        for r in list(s.calls.values())[-self.max_graph_nodes:]:
            if r.worker is None:
                continue
            start = r.started if r.started is not None else r.ready
            if start is None:
                continue
            end = r.finished if r.finished is not None else now
            lane = label(r.worker) + (f" · engine {r.model}" if r.kind == "llm" and r.model else "")
            mark = "erred" if r.state == "erred" else "retry" if r.retry else ""
            color = colors.setdefault(r.component, PALETTE[len(colors) % len(PALETTE)])
            for c, v in (("key", r.key), ("lane", lane), ("component", r.component), ("method", r.method or ""),
                         ("start_ms", start * 1000), ("end_ms", max(end, start) * 1000),
                         ("duration", _duration(start, end)), ("state", r.state), ("color", color),
                         ("mark", mark), ("hatch", {"erred": "x", "retry": "/"}.get(mark, " ")),
                         ("line", "#e53935" if mark else "#333333")):
                cols[c].append(v)
        return (s.version, cols)

    def _worker_label(self) -> Any:
        """Address -> the worker's name (as ``/metrics`` labels it), else the short address
        (memoized for one use: a timeline asks once per call)."""
        from dask_agents.scheduler_plugin.metrics import worker_label

        name = worker_label(self.plugin)
        memo: dict[str, str] = {}

        def label(address: str) -> str:
            out = memo.get(address)
            if out is None:
                out = memo[address] = short(name(address))
            return out
        return label

    def session_choices(self, limit: int = 200) -> list[tuple[str, str]]:
        """(id, label) of the newest sessions, live ones first, for the graph's selector."""
        sessions = self.plugin.state.sessions
        live, done = [], []
        for sid in reversed(sessions):
            s = sessions[sid]
            (live if s.state != "completed" else done).append((sid, f"{sid} ({s.state})"))
            if len(live) >= limit:
                break
        return (live + done)[:limit]


def _brief(v: Any, width: int = 48) -> str:
    s = str(v)
    return s if len(s) <= width else s[:width - 3] + "..."
