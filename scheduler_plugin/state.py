"""Workflow state the global controller keeps: every call, each session's live graph, and the
flattened workflow graph. Plain Python, no Dask: the plugin feeds it events, tests can too.

All ``on_*`` methods are O(1) (amortized) because they run on the scheduler's event loop.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from typing import Iterable

from dask_agents.models import CallMeta, ComponentStats, GraphEdge, SessionGraph, WorkflowGraph

TERMINAL = frozenset({"finished", "erred", "cancelled"})
# scheduler task state -> call state
_STATE = {
    "waiting": "waiting",
    "queued": "queued",
    "no-worker": "queued",
    "processing": "processing",
    "memory": "finished",
    "erred": "erred",
}


@dataclass(slots=True)
class CallRecord:
    """One call as the scheduler sees it."""

    key: str
    component: str
    method: str | None
    kind: str
    session: str | None
    creator: str
    dependencies: list[str]
    created: float
    consumers: list[str] = field(default_factory=list)
    state: str = "pending"
    ready: float | None = None
    started: float | None = None
    finished: float | None = None
    worker: str | None = None
    metrics: dict = field(default_factory=dict)
    stateful: bool = False
    model: str | None = None  # for LLM calls: the model
    tool_kind: str | None = None  # for tools: their kind hint (code_exec, file_io, ...)
    migrations: int = 0
    priority_changes: int = 0
    batch_max: int | None = None  # the component's batching hint
    tenant: str | None = None
    retry: bool = False  # a re-visit: see SessionRecord.retries
    children: list[str] = field(default_factory=list)  # calls it created (cancelled if it fails)
    client: str | None = None  # the Dask client that submitted it
    error: str | None = None  # why it erred (the exception's text, as Dask's task page shows it)
    local: bool = False  # ran on its caller's worker's fast path (recorded from the worker's report)
    ran_to: str | None = None  # the worker's state of the task after it ran (memory, error), from its report
    timeout: float | None = None  # its own timeout (the component's hint), s; None: the default

    def meta(self) -> CallMeta:
        """As the shared pydantic model."""
        return CallMeta(
            call_id=self.key, component=self.component, method=self.method, kind=self.kind,
            session=self.session, creator=self.creator, dependencies=list(self.dependencies),
            consumers=list(self.consumers), executor=self.worker, state=self.state,
            created=self.created, ready=self.ready, started=self.started, finished=self.finished,
        )

    def row(self) -> dict:
        """One telemetry row."""
        m = self.metrics
        return {
            "key": self.key, "session": self.session, "component": self.component,
            "method": self.method, "kind": self.kind, "creator": self.creator, "state": self.state,
            "worker": self.worker, "created": self.created, "ready": self.ready,
            "started": self.started, "finished": self.finished,
            "n_dependencies": len(self.dependencies),
            "prompt_tokens": m.get("prompt_tokens"), "cached_tokens": m.get("cached_tokens"),
            "output_tokens": m.get("output_tokens"), "kv_bytes": m.get("kv_bytes"),
            "emulated": m.get("emulated"),
            "migrations": self.migrations, "priority_changes": self.priority_changes,
            "tenant": self.tenant, "model": self.model or m.get("model"), "retry": self.retry,
            "queue_s": self.started - self.ready if self.started is not None and self.ready is not None else None,
            "service_s": self.finished - self.started if self.finished is not None and self.started is not None else None,
            "ttft_s": m.get("ttft_s"), "tpot_s": m.get("tpot_s"), "engine_load_s": m.get("engine_load_s"),
            "error": self.error, "fast_path": self.local,
        }


@dataclass(slots=True)
class SessionRecord:
    """One session: its calls in creation order and its lifecycle."""

    id: str
    tenant: str | None
    created: float
    calls: dict[str, CallRecord] = field(default_factory=dict)
    state: str = "active"  # active -> closing (driver done) -> completed (no open calls)
    open_calls: int = 0
    # calls its driver made straight on their workers (dask_agents/direct.py) and named at
    # its end whose records have not come yet: it completes only after them
    awaiting: set[str] = field(default_factory=set)
    progress: int = 0
    completed_at: float | None = None
    # Bumped on every change of the session or one of its calls: views (the dashboard) redo
    # only the sessions whose version moved.
    version: int = 0
    # Re-visits: calls of a component created after a finished call consumed that component's
    # result in this session (a loop back in the workflow: a developer re-run after a failed
    # test, a planner asked again). Counted from the graph; the scheduler cannot see intent.
    retries: int = 0
    failed: int = 0  # calls that erred (the session went on)
    consumed: set[str] = field(default_factory=set)  # components a finished call consumed
    # model -> tokens of the session's context there after its last call (prompt + output):
    # what an engine that does not hold the session's KV would recompute (balance prices it).
    context_tokens: dict[str, int] = field(default_factory=dict)
    # The client that opened the session (its driver's ``da.session`` block): only its
    # disconnect orphans the session. Workers' own clients (nested calls) never own one.
    owner: str | None = None
    last_active: float = 0.0  # last call created, finished or reported (idle timeout)
    # stateful component -> why its instance is gone (worker lost, released at session end):
    # later calls of that component in this session fail instead of running on a fresh one
    lost: dict[str, str] = field(default_factory=dict)
    # why every stateful instance of the session is gone (it was opened on a scheduler that
    # stopped: its workers closed with it): its stateful calls here fail, never run fresh
    outlived: str | None = None
    # The component of its first call (its root: "Planner", "Router", ...): the workflow it
    # runs, whose own history gives its fair completion time (Agent Fair Share per workflow)
    workflow: str | None = None
    timed: bool = False  # its completion time went into its workflow's history
    closed_reason: str | None = None  # why the scheduler closed it (driver gone, idle), if it did
    ended: bool = False  # its completion was handled (KV dropped, instances scheduled for release)


@dataclass(slots=True)
class _Running:
    """Running mean/variance (Welford)."""

    n: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def add(self, x: float) -> None:
        """Add one sample."""
        self.n += 1
        d = x - self.mean
        self.mean += d / self.n
        self.m2 += d * (x - self.mean)

    def std(self) -> float | None:
        """Sample standard deviation (None with fewer than two samples)."""
        return math.sqrt(self.m2 / (self.n - 1)) if self.n > 1 else None


WORKFLOW_HISTORY = 64  # completed sessions per workflow its expected time is taken from
WORKFLOW_MIN_SESSIONS = 3  # completed sessions before a workflow's own time is used
WORKFLOWS_MAX = 1024  # workflows whose history is kept (the oldest seen goes first)


class WorkflowState:
    """Calls, sessions and the flattened workflow graph."""

    def __init__(self, max_loose_calls: int = 100_000):
        self.calls: dict[str, CallRecord] = {}
        self.sessions: dict[str, SessionRecord] = {}
        self.completed: OrderedDict[str, float] = OrderedDict()  # session -> completed_at
        self.loose: OrderedDict[str, None] = OrderedDict()  # calls outside any session
        self.max_loose_calls = max_loose_calls
        self.calls_per_component: Counter[str] = Counter()
        self.open_per_component: Counter[str] = Counter()
        # client -> its calls not yet terminal (agents.scheduler.max-live-calls-per-client);
        # an entry goes at zero
        self.open_per_client: Counter[str] = Counter()
        self.completed_per_component: Counter[str] = Counter()
        # bounded component -> (min_replicas, max_replicas) from its calls' hints (the first
        # seen: one component class, one set of hints) for the reallocate policy, and the model
        # its ``model=`` hint names (its replicas then go beside that model's engines first)
        self.component_bounds: dict[str, tuple[int, int]] = {}
        self.component_models: dict[str, str] = {}
        # component -> the models its own LLM calls used, learnt from the call graph: an agent
        # without a ``model=`` hint is placed beside the engine of the model it calls
        # (``called_model``), so its LLM calls take the worker's fast path, not a hop
        self.llm_calls_of: dict[str, Counter[str]] = {}
        self.sessions_seen = 0
        self.durations: dict[str, _Running] = {}
        self.edges: Counter[tuple[str, str]] = Counter()
        # (component, state) -> calls in that non-terminal state now; terminal ones cumulative
        self.open_by_state: Counter[tuple[str, str]] = Counter()
        self.terminal_per_component: Counter[tuple[str, str]] = Counter()
        self.sessions_completed = 0
        self.calls_of_completed = 0  # calls the completed sessions made, in all
        # Sessions changed since the control loop's view index last looked (it drains this):
        # the view redoes only these, not every live session each tick.
        self.touched: set[str] = set()
        # Open (not completed) sessions, least recently active first: the idle timeout pops
        # from the front, so finding idle sessions is O(idle ones), not a scan.
        self.activity: OrderedDict[str, None] = OrderedDict()
        # Expired sessions whose stateful instances are gone: session -> {component: cause}
        # (bounded, oldest dropped: ~0.4 KB each). A late call of one of them must not find a
        # blank record and a fresh instance; past the bound it would (twice max-retained-sessions
        # expired since: the worker's own guard still refuses it on the instance's worker).
        self.tombstones: OrderedDict[str, dict[str, str]] = OrderedDict()
        self.max_tombstones = 20_000
        # The latest calls that erred (newest last, bounded: the dashboard's errors panel) and
        # how many ever did; sessions that completed with at least one failed call.
        self.errors: deque[CallRecord] = deque(maxlen=200)
        self.calls_erred = 0
        self.sessions_failed = 0
        # workflow (a session's root component) -> how long its latest completed sessions took
        self.workflow_times: dict[str, deque[float]] = {}
        self._expected: dict[str, float] | None = {}  # their medians (None: to redo)

    def expected_times(self) -> dict[str, float]:
        """Workflow -> the median time its latest completed sessions took (those with at least
        ``WORKFLOW_MIN_SESSIONS``): a session's fair completion time. Redone only after a session
        completed (the control loop asks every tick)."""
        if self._expected is None:
            self._expected = {w: sorted(t)[len(t) // 2] for w, t in self.workflow_times.items()
                              if len(t) >= WORKFLOW_MIN_SESSIONS}
        return self._expected

    # -- events -----------------------------------------------------------------------
    def session(self, sid: str, tenant: str | None, now: float) -> SessionRecord:
        """The record of ``sid``, created on first sight."""
        s = self.sessions.get(sid)
        if s is None:
            s = self.sessions[sid] = SessionRecord(sid, tenant, now, last_active=now)
            self.sessions_seen += 1
            self.activity[sid] = None
            lost = self.tombstones.pop(sid, None)
            if lost:
                s.lost.update(lost)
        return s

    def active(self, s: SessionRecord, now: float) -> None:
        """``s`` did something now (a call created, finished or reported): O(1)."""
        s.last_active = now
        if s.state != "completed":
            self.activity[s.id] = None
            self.activity.move_to_end(s.id)

    def idle(self, now: float, timeout: float, limit: int = 1000) -> list[str]:
        """Open sessions with no activity for ``timeout`` seconds (at most ``limit``), oldest first."""
        out: list[str] = []
        for sid in self.activity:
            s = self.sessions.get(sid)
            if s is not None and now - s.last_active < timeout:
                break
            out.append(sid)
            if len(out) >= limit:
                break
        return out

    def add_call(self, key: str, ann: dict, dependency_keys: Iterable[str], now: float,
                 client: str | None = None) -> CallRecord | None:
        """Record a call from its ``agents`` annotation (plain submits carry only the session),
        submitted by ``client`` (None: reported by a worker, made on its fast path)."""
        if key in self.calls:
            return None
        sid = ann.get("session")
        deps = [d for d in dependency_keys if d in self.calls]
        for d in ann.get("deps") or ():
            if d not in deps and d in self.calls:
                deps.append(d)
        from dask.utils import key_split

        rec = CallRecord(
            key=key, component=ann.get("component") or key_split(key), method=ann.get("method"),
            kind=ann.get("kind") or "task", session=sid, creator=ann.get("creator") or "driver",
            dependencies=deps, created=ann.get("created") or now,
            stateful=bool(ann.get("stateful")), model=ann.get("llm_model"), tool_kind=ann.get("tool_kind"),
            batch_max=(ann.get("batching") or {}).get("max_batch"), tenant=ann.get("tenant"),
            timeout=ann.get("timeout"), client=client,
        )
        self.calls[key] = rec
        if client is not None:
            self.open_per_client[client] += 1
        self.calls_per_component[rec.component] += 1
        self.open_per_component[rec.component] += 1
        if ann.get("max_replicas") is not None and rec.component not in self.component_bounds:
            self.component_bounds[rec.component] = (ann.get("min_replicas") or 0, ann["max_replicas"])
            if ann.get("model"):
                self.component_models[rec.component] = ann["model"]
        self.open_by_state[(rec.component, rec.state)] += 1
        for d in deps:
            dep = self.calls[d]
            dep.consumers.append(key)
            self.edges[(dep.component, rec.component)] += 1
        parent = self.calls.get(rec.creator)
        if parent is not None:
            self.edges[(parent.component, rec.component)] += 1
            self._learn_model(parent, rec)
        if sid is None:
            self.loose[key] = None
            while len(self.loose) > self.max_loose_calls:
                old, _ = self.loose.popitem(last=False)
                gone = self.calls.pop(old, None)
                if gone is not None and gone.state not in TERMINAL:
                    self.open_per_component[gone.component] -= 1
                    self.open_by_state[(gone.component, gone.state)] -= 1
                    self._client_done(gone)
        else:
            s = self.session(sid, ann.get("tenant"), now)
            if s.workflow is None:
                s.workflow = rec.component
            s.calls[key] = rec
            s.open_calls += 1
            if s.awaiting:
                s.awaiting.discard(key)
            s.version += 1
            self.touched.add(sid)
            if rec.component in s.consumed:
                rec.retry = True
                s.retries += 1
            if s.state == "completed":  # a late call reopens a completed session
                s.state = "closing"
                s.completed_at = None
                s.ended = False
                self.completed.pop(sid, None)
            self.active(s, now)
        return rec

    def drop_open(self, key: str) -> None:
        """Forget an open call as if it had never been recorded (a driver's direct call lost
        with its worker, about to be recorded again under its key from the scheduler path)."""
        rec = self.calls.get(key)
        if rec is None or rec.state in TERMINAL:
            return
        del self.calls[key]
        self.open_by_state[(rec.component, rec.state)] -= 1
        self.open_per_component[rec.component] -= 1
        self.calls_per_component[rec.component] -= 1
        self._client_done(rec)
        self.loose.pop(key, None)
        s = self.sessions.get(rec.session) if rec.session is not None else None
        if s is not None and s.calls.pop(key, None) is not None:
            s.open_calls -= 1
            s.version += 1
            self.touched.add(rec.session)

    def link(self, parent: CallRecord, child: CallRecord) -> None:
        """``parent`` created ``child``, learnt after both were recorded (a fast-path call's
        record came after a call it made on the scheduler path)."""
        parent.children.append(child.key)
        self.edges[(parent.component, child.component)] += 1
        self._learn_model(parent, child)
        self._touch(child)

    def _learn_model(self, parent: CallRecord, child: CallRecord) -> None:
        if child.model is not None and child.kind == "llm":
            self.llm_calls_of.setdefault(parent.component, Counter())[child.model] += 1

    def called_model(self, component: str) -> str | None:
        """The model more than half of ``component``'s own LLM calls used so far (None: none
        seen, or no majority). O(models)."""
        seen = self.llm_calls_of.get(component)
        if not seen:
            return None
        model, n = seen.most_common(1)[0]
        return model if 2 * n > seen.total() else None

    def on_transition(self, key: str, finish: str, now: float, worker: str | None = None,
                      error: str | None = None) -> bool:
        """Apply a scheduler transition; returns True if the call became terminal.
        ``error``: why it erred (for ``finish == "erred"``)."""
        rec = self.calls.get(key)
        if rec is None or rec.state in TERMINAL:
            return False
        state = _STATE.get(finish)
        if state is None:
            if finish not in ("released", "forgotten"):
                return False
            state = "cancelled"
        if state in ("queued", "processing") and rec.ready is None:
            rec.ready = now
        if worker is not None:
            rec.worker = worker
        if rec.state == "running" and state == "processing":
            return False  # the worker's start report arrived first
        self._set_state(rec, state)
        if state == "erred":
            rec.error = error or rec.error or "unknown error"
            self.errors.append(rec)
            self.calls_erred += 1
        if state in TERMINAL:
            if rec.finished is None and state != "cancelled":
                rec.finished = now
            self._terminal(rec, now)
            return True
        return False

    def on_report(self, key: str, started: float, finished: float, worker: str, metrics: dict | None) -> None:
        """Apply a worker's exact start/finish report."""
        rec = self.calls.get(key)
        if rec is None:
            return
        rec.started = started
        rec.finished = finished
        rec.worker = worker
        if metrics:
            rec.metrics.update(metrics)
            if rec.model is not None and metrics.get("prompt_tokens") is not None and rec.session in self.sessions:
                self.sessions[rec.session].context_tokens[rec.model] = (
                    int(metrics["prompt_tokens"]) + int(metrics.get("output_tokens") or 0))
        self.durations.setdefault(rec.component, _Running()).add(finished - started)
        self._touch(rec)

    def forget_kv(self, sid: str, model: str) -> None:
        """The session's KV for ``model`` is no longer where its binding points (the engine died,
        or the session moved): nothing to recompute there until its next call reports."""
        s = self.sessions.get(sid)
        if s is not None and s.context_tokens.pop(model, None) is not None:
            self.touched.add(sid)

    def on_priority(self, key: str, priority: tuple) -> None:
        """A policy changed the call's priority."""
        rec = self.calls.get(key)
        if rec is not None:
            rec.priority_changes += 1

    def on_migrated(self, key: str, target: str) -> None:
        """A policy moved the call to another worker."""
        rec = self.calls.get(key)
        if rec is not None:
            rec.migrations += 1
            rec.worker = target
            self._touch(rec)

    def _set_state(self, rec: CallRecord, state: str) -> None:
        """Change a call's state, keeping the per-state counters and the session version."""
        self.open_by_state[(rec.component, rec.state)] -= 1
        rec.state = state
        if state not in TERMINAL:
            self.open_by_state[(rec.component, state)] += 1
        self._touch(rec)

    def _touch(self, rec: CallRecord) -> None:
        if rec.session is not None:
            s = self.sessions.get(rec.session)
            if s is not None:
                s.version += 1
                self.touched.add(rec.session)

    def _client_done(self, rec: CallRecord) -> None:
        c = rec.client
        if c is not None:
            n = self.open_per_client[c] - 1
            if n > 0:
                self.open_per_client[c] = n
            else:
                del self.open_per_client[c]

    def _terminal(self, rec: CallRecord, now: float) -> None:
        self._client_done(rec)
        self.open_per_component[rec.component] -= 1
        self.terminal_per_component[(rec.component, rec.state)] += 1
        if rec.state == "finished":
            self.completed_per_component[rec.component] += 1
        if rec.session is None:
            return
        s = self.sessions.get(rec.session)
        if s is None:
            return
        s.open_calls -= 1
        self.active(s, now)
        if rec.state == "finished":
            s.progress += 1
            calls = s.calls
            for d in rec.dependencies:  # the components whose results this call consumed
                dep = calls.get(d)
                if dep is not None and dep.component != rec.component:
                    s.consumed.add(dep.component)
        elif rec.state == "erred":
            s.failed += 1
        self._maybe_complete(s, now)

    def close_session(self, sid: str, now: float) -> SessionRecord:
        """The driver left the session: it completes once its last call is terminal."""
        s = self.session(sid, None, now)
        if s.state == "active":
            s.state = "closing"
            s.version += 1
        self.touched.add(sid)
        self._maybe_complete(s, now)
        return s

    def _maybe_complete(self, s: SessionRecord, now: float) -> None:
        if s.state == "closing" and s.open_calls <= 0 and not s.awaiting:
            s.state = "completed"
            s.completed_at = now
            s.version += 1
            self.touched.add(s.id)
            self.sessions_completed += 1
            if s.failed:
                self.sessions_failed += 1
            self.calls_of_completed += len(s.calls)
            self.completed[s.id] = now
            # its time teaches its workflow's fair time: once (a reopened session completes
            # again), and only if it ran as meant (not failed, not closed by the scheduler)
            if s.workflow is not None and not s.timed and not s.failed and s.closed_reason is None:
                s.timed = True
                times = self.workflow_times.get(s.workflow)
                if times is None:
                    times = self.workflow_times[s.workflow] = deque(maxlen=WORKFLOW_HISTORY)
                times.append(now - s.created)
                self._expected = None
                if len(self.workflow_times) > WORKFLOWS_MAX:  # root names come from clients: a bound
                    del self.workflow_times[next(iter(self.workflow_times))]
            self.completed.move_to_end(s.id)
            self.activity.pop(s.id, None)

    def expire(self, now: float, retention: float, max_retained: int) -> list[str]:
        """Drop completed sessions older than ``retention`` or beyond ``max_retained``."""
        dropped = []
        while self.completed:
            sid, t = next(iter(self.completed.items()))
            if now - t < retention and len(self.completed) <= max_retained:
                break
            self.completed.popitem(last=False)
            s = self.sessions.pop(sid, None)
            if s is not None:
                for k in s.calls:
                    self.calls.pop(k, None)
                if s.lost:
                    self.tombstones[sid] = dict(s.lost)
                    while len(self.tombstones) > self.max_tombstones:
                        self.tombstones.popitem(last=False)
            self.activity.pop(sid, None)
            dropped.append(sid)
        return dropped

    # -- views --------------------------------------------------------------------------
    def session_graph(self, sid: str) -> SessionGraph:
        """The live graph of one session (KeyError if unknown or expired)."""
        s = self.sessions[sid]
        nodes = [r.meta() for r in s.calls.values()]
        edges = []
        for r in s.calls.values():
            edges.extend(GraphEdge(src=d, dst=r.key, kind="dependency") for d in r.dependencies)
            if r.creator in s.calls:
                edges.append(GraphEdge(src=r.creator, dst=r.key, kind="created"))
        return SessionGraph(session=sid, state=s.state, progress=s.progress, nodes=nodes, edges=edges)

    def component_stats(self) -> dict[str, tuple[float | None, int, float, int, int]]:
        """component -> (mean duration or None, calls, visits per session, open, completed)."""
        n = max(self.sessions_seen, 1)
        out = {}
        for c, count in self.calls_per_component.items():
            d = self.durations.get(c)
            out[c] = (d.mean if d and d.n else None, count, count / n,
                      self.open_per_component[c], self.completed_per_component[c])
        return out

    def workflow_graph(self) -> WorkflowGraph:
        """The flattened graph: visits per session per component, component edges, durations."""
        n = max(self.sessions_seen, 1)
        comps = []
        for c, count in sorted(self.calls_per_component.items()):
            d = self.durations.get(c)
            comps.append(ComponentStats(
                component=c, calls=count, visits_per_session=count / n,
                mean_duration=d.mean if d and d.n else None, std_duration=d.std() if d else None,
            ))
        return WorkflowGraph(
            sessions=self.sessions_seen, components=comps,
            edges={f"{a}->{b}": k for (a, b), k in self.edges.items()},
        )

    def session_summary(self, sid: str, now: float) -> dict | None:
        """One session as the dashboard, ``da.progress`` and telemetry show it (None if unknown).

        ``current``: components of its calls assigned to a worker now (processing or running).
        Cheap: open calls are the newest, so the scan from the newest stops after them."""
        s = self.sessions.get(sid)
        if s is None:
            return None
        current: list[str] = []
        left = s.open_calls
        if left > 0:
            for rec in reversed(s.calls.values()):
                if rec.state not in TERMINAL:
                    left -= 1
                    if rec.state in ("processing", "running") and rec.component not in current:
                        current.append(rec.component)
                    if left <= 0:
                        break
        end = s.completed_at if s.completed_at is not None else now
        return {
            "session": sid, "tenant": s.tenant, "state": s.state, "created": s.created,
            "completed": s.completed_at, "age_s": end - s.created, "calls": len(s.calls),
            "progress": s.progress, "open": s.open_calls, "failed": s.failed, "retries": s.retries,
            "current": ", ".join(sorted(current)), "version": s.version,
        }

    def expected_calls(self) -> int | None:
        """Calls a session makes in all, as the completed ones did (the mean; None before any
        completed): what a live session's progress is measured against while its graph grows."""
        if not self.sessions_completed:
            return None
        return round(self.calls_of_completed / self.sessions_completed)

    def session_rows(self, now: float) -> list[dict]:
        """One row per retained session (telemetry's sessions table)."""
        return [self.session_summary(sid, now) for sid in self.sessions]

    def rows(self, session: str | None = None) -> list[dict]:
        """Telemetry rows for every retained call (or one session's)."""
        if session is not None:
            s = self.sessions.get(session)
            return [r.row() for r in s.calls.values()] if s else []
        return [r.row() for r in self.calls.values()]
