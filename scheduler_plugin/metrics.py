"""What the dashboard and Prometheus show: aggregates fed by the scheduler plugin, and the
collector that serves them on the scheduler's existing ``/metrics`` (prefix ``dask_agents_``).

:class:`Aggregates` is plain Python, fed on the scheduler's event loop in O(1) per event:
per-component queueing and service histograms (from the workers' exact start/finish reports),
session latencies, control-loop tick times, LLM token counters per (worker, model), the recent
completions the dashboard derives rates from, and the engines' latest stats (KV bytes per tier).

The collector is registered in ``prometheus_client``'s default registry (the one Dask's
``/metrics`` serves) once per process while at least one plugin is running, and unregistered
when the last one closes. With several schedulers in one process (tests), it reports the one
started last, as Dask's own collectors do.
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
import time
import weakref
from collections import Counter, deque
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

from dask_agents.scheduler_plugin import dask_compat, validate

if TYPE_CHECKING:
    from dask_agents.scheduler_plugin.plugin import AgentsSchedulerPlugin

logger = logging.getLogger(__name__)

PREFIX = "dask_agents"
TIERS = ("device", "host", "disk")
"""KV tiers: the engine's own cache (``device``: GPU memory, CPU memory for CPU engines), host
memory, disk. Only tiers an engine reports are shown: ``device`` from every engine with per-session
KV control (vLLM's and the emulated one), offload tiers from engines that have them (``kv_report()``)."""
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0, 600.0)
# vLLM's buckets for time to first token and time per output token (vllm/v1/metrics/loggers.py),
# with finer ones below for small models on CPUs
TTFT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
LLM_HISTOGRAMS = {"ttft": TTFT_BUCKETS, "tpot": TPOT_BUCKETS, "e2e": LATENCY_BUCKETS}
"""Per-model LLM latency histograms: time to first token (submitted to the engine -> first
token), time per output token (after the first), end to end (the call on its worker)."""
TICK_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class Histogram:
    """A cumulative histogram with fixed upper bounds (Prometheus semantics, ``+Inf`` implied)."""

    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS):
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, x: float) -> None:
        """Add one sample."""
        self.counts[bisect.bisect_left(self.bounds, x)] += 1
        self.sum += x
        self.count += 1

    def buckets(self) -> list[tuple[str, int]]:
        """``[(upper bound, cumulative count), ...]`` ending with ``+Inf``."""
        out, total = [], 0
        for b, c in zip(self.bounds + (math.inf,), self.counts):
            total += c
            out.append(("+Inf" if b == math.inf else repr(float(b)), total))
        return out

    def mean(self) -> float | None:
        """Mean of the samples (None when empty)."""
        return self.sum / self.count if self.count else None


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _whole(x: Any) -> bool:
    return _finite(x) and x >= 0 and int(x) == x


class Aggregates:
    """Counters and histograms behind the dashboard and ``/metrics``; fed by the plugin."""

    def __init__(self, recent: int = 50_000, kv_samples: int = 100_000):
        self.queue: dict[str, Histogram] = {}  # component -> ready -> started
        self.service: dict[str, Histogram] = {}  # component -> started -> finished
        self.session_latency = Histogram()
        self.tick = Histogram(TICK_BUCKETS)
        self._ticks_seen = 0
        # (worker, model) -> [calls, prompt tokens, cached (hit) tokens, output tokens]
        self.tokens: dict[tuple[str, str], list[int]] = {}
        self.llm: dict[str, dict[str, Histogram]] = {}  # model -> {"ttft"|"tpot"|"e2e": histogram}
        # (component, worker, ready, started, finished) of recent reports: rates over a window
        self.recent: deque[tuple[str, str | None, float | None, float, float]] = deque(maxlen=recent)
        self.reports = 0  # appended to ``recent`` so far (readers keep a cursor)
        self.engines: dict[str, dict] = {}  # worker -> {"time": t, "models": {model: stats}}
        # (time, worker, model, tier, bytes, capacity bytes or None)
        self.kv_samples: deque[tuple[float, str, str, str, int, int | None]] = deque(maxlen=kv_samples)
        # KV directives the engines' KV managers applied (evict/trim/prefetch/drop), as decision
        # records for the dashboard: one per (worker, model, kind) that moved between two reports
        self.kv_decisions: deque[dict] = deque(maxlen=200)
        self.kv_decisions_total = 0  # appended to ``kv_decisions`` so far (readers keep a cursor)
        self._kv_actions: dict[tuple[str, str], dict[str, int]] = {}  # last counts per engine
        # what the plugin's endpoints refused (scheduler_plugin/validate.py): /metrics shows it
        self.rejected = validate.Rejections()
        self.skipped = 0  # records a page or /metrics could not render (and left out)

    def forget_before(self, t: float) -> int:
        """Drop per-call reports that finished before ``t`` (older than any rate window): once
        the load ends, the ring empties instead of holding its last 50,000 calls for good.
        Readers take the newest entries by count (``reports``), so dropping old ones is safe."""
        n = 0
        recent = self.recent
        while recent and recent[0][4] < t:
            recent.popleft()
            n += 1
        return n

    # -- events (scheduler event loop) -------------------------------------------------------
    def on_report(self, rec: Any) -> None:
        """A worker reported a call's exact start/finish (``rec``: the call's CallRecord).

        A record whose times or token counts are not plain finite numbers is left out (and
        counted in ``rejected``): the histograms and the window of ``recent`` feed every
        page refresh and scrape, so one bad value there would break them all."""
        if rec is None or rec.started is None or rec.finished is None:
            return
        if not (_finite(rec.started) and _finite(rec.finished)
                and (rec.ready is None or _finite(rec.ready))):
            self.rejected.add("report", "call times are not finite numbers", rec.worker)
            return
        m = rec.metrics if isinstance(rec.metrics, dict) else {}
        tokens = [m.get(k) for k in ("prompt_tokens", "cached_tokens", "output_tokens")]
        if m.get("prompt_tokens") is not None and not all(t is None or _whole(t) for t in tokens):
            self.rejected.add("report", "token counts are not whole numbers", rec.worker)
            return
        comp = rec.component
        self.service.setdefault(comp, Histogram()).observe(max(rec.finished - rec.started, 0.0))
        if rec.ready is not None:
            self.queue.setdefault(comp, Histogram()).observe(max(rec.started - rec.ready, 0.0))
        self.recent.append((comp, rec.worker, rec.ready, rec.started, rec.finished))
        self.reports += 1
        if m.get("prompt_tokens") is not None:
            model = rec.model or m.get("model") or ""
            if not isinstance(model, str):
                model = str(model)
            t = self.tokens.setdefault((rec.worker or "", model), [0, 0, 0, 0])
            t[0] += 1
            t[1] += int(m.get("prompt_tokens") or 0)
            t[2] += int(m.get("cached_tokens") or 0)
            t[3] += int(m.get("output_tokens") or 0)
            hists = self.llm.get(model)
            if hists is None:
                hists = self.llm[model] = {k: Histogram(b) for k, b in LLM_HISTOGRAMS.items()}
            hists["e2e"].observe(max(rec.finished - rec.started, 0.0))
            for k in ("ttft", "tpot"):
                v = m.get(f"{k}_s")
                if _finite(v) and v >= 0:
                    hists[k].observe(v)

    def on_session_completed(self, session: Any) -> None:
        """A session completed (``session``: its SessionRecord)."""
        if session.completed_at is not None:
            self.session_latency.observe(max(session.completed_at - session.created, 0.0))

    def on_engine_stats(self, worker: str, engines: dict, now: float) -> None:
        """A worker's engines reported (model -> stats, see ``dask_agents.worker_plugin.plugin.engine_report``).

        Checked before anything is stored (:func:`validate.engine_stats`): a bad model record
        is dropped and counted in ``rejected``, the worker's other engines are kept. (Stored
        unchecked, one bad entry made ``/agents`` and ``/metrics`` fail until restart.)"""
        engines = validate.engine_stats(engines, None, self.rejected, worker)
        if engines is None:
            return
        self.engines[worker] = {"time": now, "models": engines}
        for model, st in engines.items():
            self._kv_directives(worker, model, st, now)
            caps = st.get("kv_capacity_bytes") or {}
            for tier, b in (st.get("kv_bytes") or {}).items():
                self.kv_samples.append((now, worker, model, tier, int(b), caps.get(tier)))

    def _kv_directives(self, worker: str, model: str, st: dict, now: float) -> None:
        counts = st.get("kv_actions")
        if not isinstance(counts, dict):
            return
        before = self._kv_actions.get((worker, model), {})
        self._kv_actions[(worker, model)] = dict(counts)
        for kind, n in sorted(counts.items()):
            # a restarted engine counts from zero again: everything it reports is new
            delta = int(n) - int(before.get(kind, 0)) if int(n) >= int(before.get(kind, 0)) else int(n)
            if delta > 0:
                self.kv_decisions.append({"time": now, "action": f"kv {kind}", "policy": f"kv:{st.get('kv_policy')}",
                                          "worker": worker, "model": model, "count": delta})
                self.kv_decisions_total += 1

    def forget_worker(self, worker: str) -> None:
        """The worker left: its engines no longer hold anything."""
        self.engines.pop(worker, None)
        for k in [k for k in self._kv_actions if k[0] == worker]:
            del self._kv_actions[k]

    def fold_ticks(self, control: Any) -> None:
        """Move control-loop tick times measured since the last fold into the tick histogram.

        The loop keeps its last 1000 tick times; folding every second keeps this exact."""
        if control is None:
            return
        new = control.ticks - self._ticks_seen
        if new <= 0:
            return
        window = list(control.tick_seconds)
        for dt in window[-min(new, len(window)):]:
            self.tick.observe(dt)
        self._ticks_seen = control.ticks

    # -- derived -----------------------------------------------------------------------------
    def kv_rows(self) -> list[dict]:
        """KV residency samples as telemetry rows (``da.telemetry(client, table="kv")``)."""
        return [{"time": t, "worker": w, "model": m, "tier": tier, "bytes": b, "capacity_bytes": c}
                for t, w, m, tier, b, c in self.kv_samples]


def queue_counts(plugin: "AgentsSchedulerPlugin") -> tuple[Counter, Counter, Counter]:
    """Agents calls by (component, worker) now: waiting on the worker (assigned, not started),
    running there, and (component,) held back on the scheduler. O(assigned tasks)."""
    s = plugin.scheduler
    calls = plugin.state.calls
    waiting: Counter = Counter()
    running: Counter = Counter()
    held: Counter = Counter()
    for ws in dask_compat.workers(s):
        address = dask_compat.worker_summary(ws)[0]
        for ts in dask_compat.running_on_worker(ws):
            rec = calls.get(dask_compat.task_key(ts))
            if rec is not None:
                running[(rec.component, address)] += 1
        for ts in dask_compat.waiting_on_worker(ws):
            rec = calls.get(dask_compat.task_key(ts))
            if rec is not None:
                waiting[(rec.component, address)] += 1
    for (comp, st), n in plugin.state.open_by_state.items():
        if st == "queued" and n > 0:
            held[comp] += n
    return waiting, running, held


# -- Prometheus ------------------------------------------------------------------------------

def _name(n: str) -> str:
    return f"{PREFIX}_{n}"


def families(plugin: "AgentsSchedulerPlugin") -> Iterator[Any]:
    """The ``dask_agents_*`` metric families of one scheduler plugin.

    Built section by section: a section that fails (a record no check caught) is left out,
    logged and counted in ``dask_agents_render_skipped_total``, and the others are still
    served. A collector that raises would fail the whole ``/metrics`` page, Dask's own series
    included."""
    agg: Aggregates = plugin.aggregates
    agg.fold_ticks(plugin.control)
    for section in _SECTIONS:
        try:
            out = list(section(plugin))
        except Exception:
            agg.skipped += 1
            first = section.__name__ not in _failed
            _failed.add(section.__name__)  # logged in full once: a scrape every few seconds would flood the log
            (logger.exception if first else logger.debug)("dask-agents: /metrics left out %s", section.__name__,
                                                         exc_info=True)
            continue
        yield from out
    yield from _health_families(agg)


def _session_families(plugin: "AgentsSchedulerPlugin") -> Iterator[Any]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    state = plugin.state
    g = GaugeMetricFamily(_name("sessions"), "Sessions by state (completed: still retained)", labels=["state"])
    by_state = Counter(s.state for s in state.sessions.values())
    for st in ("active", "closing", "completed"):
        g.add_metric([st], by_state.get(st, 0))
    yield g
    yield CounterMetricFamily(_name("sessions_started"), "Sessions seen", value=state.sessions_seen)
    yield CounterMetricFamily(_name("sessions_completed"), "Sessions completed", value=state.sessions_completed)


def _call_families(plugin: "AgentsSchedulerPlugin") -> Iterator[Any]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    state = plugin.state
    g = GaugeMetricFamily(_name("calls"), "Calls not finished yet, by component and state", labels=["component", "state"])
    for (comp, st), n in sorted(state.open_by_state.items()):
        if n > 0:
            g.add_metric([comp, st], n)
    yield g
    c = CounterMetricFamily(_name("calls_created"), "Calls created, by component", labels=["component"])
    for comp, n in sorted(state.calls_per_component.items()):
        c.add_metric([comp], n)
    yield c
    c = CounterMetricFamily(_name("calls_ended"), "Calls that ended, by component and final state",
                            labels=["component", "state"])
    for (comp, st), n in sorted(state.terminal_per_component.items()):
        c.add_metric([comp, st], n)
    yield c


def worker_label(plugin: "AgentsSchedulerPlugin") -> Callable[[str], str]:
    """Address -> the ``worker`` label: the worker's name, which survives a restart (an
    address does not); the address of a worker the scheduler no longer knows."""
    scheduler = getattr(plugin, "scheduler", None)

    def label(address: str) -> str:
        name = dask_compat.worker_name(scheduler, address) if scheduler is not None else address
        return str(name if name is not None else address)
    return label


def _summed(family: Any, items: Iterable[tuple[tuple, float]]) -> Any:
    """Add ``(labels, value)`` to ``family``, summing values whose labels coincide (two
    addresses of one worker name: before and after a restart)."""
    total: dict[tuple, float] = {}
    for labels, v in items:
        total[labels] = total.get(labels, 0) + v
    for labels, v in sorted(total.items()):
        family.add_metric(list(labels), v)
    return family


def _queue_families(plugin: "AgentsSchedulerPlugin") -> Iterator[Any]:
    from prometheus_client.core import GaugeMetricFamily

    waiting, running, held = queue_counts(plugin)
    name = worker_label(plugin)
    g = GaugeMetricFamily(_name("calls_queued"), "Calls waiting to start, by component and worker name "
                          "(worker=\"scheduler\": held back on the scheduler)", labels=["component", "worker"])
    yield _summed(g, [((comp, name(w)), n) for (comp, w), n in waiting.items()]
                  + [((comp, "scheduler"), n) for comp, n in held.items()])
    g = GaugeMetricFamily(_name("calls_running"), "Calls running, by component and worker name",
                          labels=["component", "worker"])
    yield _summed(g, [((comp, name(w)), n) for (comp, w), n in running.items()])


def _histogram_families(plugin: "AgentsSchedulerPlugin") -> Iterator[Any]:
    from prometheus_client.core import HistogramMetricFamily

    agg: Aggregates = plugin.aggregates
    for metric, hists, doc in (
        ("call_queue_seconds", agg.queue, "Time from runnable to started on the worker, by component"),
        ("call_service_seconds", agg.service, "Time from started to finished on the worker, by component"),
    ):
        h = HistogramMetricFamily(_name(metric), doc, labels=["component"])
        for comp, hist in sorted(hists.items()):
            h.add_metric([comp], hist.buckets(), hist.sum)
        yield h
    h = HistogramMetricFamily(_name("session_latency_seconds"), "Session latency: created to completed")
    h.add_metric([], agg.session_latency.buckets(), agg.session_latency.sum)
    yield h
    h = HistogramMetricFamily(_name("control_tick_seconds"), "Event-loop time of control-loop passes (policies run in threads, not counted)")
    h.add_metric([], agg.tick.buckets(), agg.tick.sum)
    yield h


def _llm_families(plugin: "AgentsSchedulerPlugin") -> Iterator[Any]:
    """Per-model LLM latency histograms, as vLLM names them (``time_to_first_token_seconds``,
    ``time_per_output_token_seconds``, ``e2e_request_latency_seconds``)."""
    from prometheus_client.core import HistogramMetricFamily

    agg: Aggregates = plugin.aggregates
    for key, metric, doc in (
        ("ttft", "llm_time_to_first_token_seconds", "Time from an LLM request reaching its engine to its first "
         "token, by model"),
        ("tpot", "llm_time_per_output_token_seconds", "Time per output token after the first, by model"),
        ("e2e", "llm_e2e_request_latency_seconds", "LLM calls from start to finish on their worker, by model"),
    ):
        h = HistogramMetricFamily(_name(metric), doc, labels=["model"])
        for model, hists in sorted(agg.llm.items()):
            h.add_metric([model], hists[key].buckets(), hists[key].sum)
        yield h


def _fault_families(plugin: "AgentsSchedulerPlugin") -> Iterator[Any]:
    """What went wrong, counted: faults the recovery handled, engine restarts, policy errors,
    failed calls and sessions, LLM calls that waited for engine room."""
    from prometheus_client.core import CounterMetricFamily

    c = CounterMetricFamily(_name("faults"), "Faults handled: workers lost, calls re-placed after one "
                            "(rerouted) or failed because of one", labels=["kind"])
    counts = plugin.recovery.counts if getattr(plugin, "recovery", None) is not None else {}
    for kind in ("workers_lost", "rerouted", "failed"):
        c.add_metric([kind], counts.get(kind, 0))
    yield c
    c = CounterMetricFamily(_name("engine_restarts"), "Engines restarted after a crash, by worker name and "
                            "model", labels=["worker", "model"])
    name = worker_label(plugin)
    yield _summed(c, [((name(w), m), st["restarts"]) for w, m, st in engine_records(plugin.aggregates)
                      if st.get("restarts") is not None])
    c = CounterMetricFamily(_name("policy_errors"), "Control-loop policy passes that raised or timed out, by "
                            "policy", labels=["policy"])
    control = plugin.control
    for policy, n in sorted((control.policy_error_counts if control is not None else {}).items()):
        c.add_metric([policy], n)
    yield c
    state = plugin.state
    yield CounterMetricFamily(_name("calls_failed"), "Calls that erred", value=state.calls_erred)
    yield CounterMetricFamily(_name("sessions_failed"), "Sessions that completed with at least one failed call",
                              value=state.sessions_failed)
    c = CounterMetricFamily(_name("admission_waits"), "LLM calls held in the scheduler until an engine had room, "
                            "by model", labels=["model"])
    for model, n in sorted(plugin.admission.waits_by_model.items()):
        c.add_metric([model], n)
    yield c


def _control_families(plugin: "AgentsSchedulerPlugin") -> Iterator[Any]:
    from prometheus_client.core import CounterMetricFamily

    c = CounterMetricFamily(_name("control_decisions"), "Control-plane actions by kind and outcome",
                            labels=["kind", "outcome"])
    if plugin.control is not None:
        enf = plugin.control.enforcer
        for outcome, counter in (("applied", enf.applied), ("rejected", enf.rejected)):
            for kind, n in sorted(counter.items()):
                c.add_metric([kind, outcome], n)
    yield c


def _admission_families(plugin: "AgentsSchedulerPlugin") -> Iterator[Any]:
    """LLM calls the scheduler holds for engine room, and what admission decided."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    adm = plugin.admission
    waiting = GaugeMetricFamily(_name("admission_waiting"), "LLM calls held in the scheduler until an engine "
                                "has room (a batch slot; KV room for a new session's working set), by model",
                                labels=["model"])
    for model, n in sorted(Counter(h.model for h in adm.held.values()).items()):
        waiting.add_metric([model], n)
    yield waiting
    decisions = CounterMetricFamily(_name("admission_decisions"), "Admission decisions by kind (admitted: a "
                                    "session given an engine; waited_out: admitted after max-wait without room; "
                                    "rebound: a waiting call moved to another engine; bound: calls bound; "
                                    "admitted_parked: a session admitted into the room of sessions parked on tools)",
                                    labels=["kind"])
    for kind in ("admitted", "bound", "held", "waited_out", "rebound", "policy_targets", "engines_started",
                 "admitted_parked"):
        decisions.add_metric([kind], adm.counts.get(kind, 0))
    yield decisions
    resident = GaugeMetricFamily(_name("admission_resident_blocks"), "Estimated KV blocks of the live sessions "
                                 "admitted to an engine (their working sets), by worker and model",
                                 labels=["worker", "model"])
    inflight = GaugeMetricFamily(_name("admission_calls_bound"), "LLM calls bound to an engine and not ended, "
                                 "by worker and model", labels=["worker", "model"])
    parked = GaugeMetricFamily(_name("admission_parked_sessions"), "Admitted sessions paused on a tool long "
                               "enough for their KV to wait in the host tier, left out of the resident blocks, "
                               "by worker and model", labels=["worker", "model"])
    name = worker_label(plugin)
    engines = list(adm.engines.values())
    now = time.time()
    yield _summed(parked, [((name(r.worker), r.model), len(adm.parked(r, now))) for r in engines])
    yield _summed(resident, [((name(r.worker), r.model), adm.resident(r)) for r in engines])
    yield _summed(inflight, [((name(r.worker), r.model), len(r.inflight)) for r in engines])


def _engine_families(plugin: "AgentsSchedulerPlugin") -> Iterator[Any]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    agg: Aggregates = plugin.aggregates
    kv = GaugeMetricFamily(_name("kv_bytes"), "KV cache bytes resident, by worker, model and tier",
                           labels=["worker", "model", "tier"])
    cap = GaugeMetricFamily(_name("kv_capacity_bytes"), "KV cache capacity, by worker, model and tier",
                            labels=["worker", "model", "tier"])
    traffic = CounterMetricFamily(_name("kv_traffic_bytes"), "KV bytes moved between tiers (offloaded: device "
                                  "to host, spilled: host to disk, restored: back to device)",
                                  labels=["worker", "model", "direction"])
    emulated = GaugeMetricFamily(_name("engine_emulated"), "1 if the engine is the emulated cost model",
                                 labels=["worker", "model"])
    kv_actions = CounterMetricFamily(_name("kv_directives"), "KV directives the engine's KV policy applied "
                                     "(evict, trim, prefetch, drop), by worker, model and kind",
                                     labels=["worker", "model", "kind"])
    kv_control = GaugeMetricFamily(_name("kv_control"), "1 if the engine has per-session KV control, 0 if "
                                   "it runs with plain prefix caching (the reason is in the engine's log and "
                                   "on the Agents page)", labels=["worker", "model"])
    running = GaugeMetricFamily(_name("engine_requests_running"), "Requests the engine runs now (its batch), "
                                "by worker and model", labels=["worker", "model"])
    waiting = GaugeMetricFamily(_name("engine_requests_waiting"), "Requests queued inside the engine (admitted by "
                                "the scheduler, not yet scheduled by the engine), by worker and model",
                                labels=["worker", "model"])
    name = worker_label(plugin)
    rows: dict[str, list] = {k: [] for k in ("kv", "cap", "traffic", "emulated", "kv_actions", "kv_control",
                                             "running", "waiting")}
    for w, model, st in engine_records(agg):
        w = name(w)
        if "kv_control" in st:
            rows["kv_control"].append(((w, model), 1 if st["kv_control"] else 0))
        for tier, b in (st.get("kv_bytes") or {}).items():
            rows["kv"].append(((w, model, tier), b))
        for tier, b in (st.get("kv_capacity_bytes") or {}).items():
            rows["cap"].append(((w, model, tier), b))
        for direction, b in (st.get("kv_traffic_bytes") or {}).items():
            rows["traffic"].append(((w, model, direction), b))
        rows["emulated"].append(((w, model), 1 if st.get("emulated") else 0))
        for kind, n in (st.get("kv_actions") or {}).items():
            rows["kv_actions"].append(((w, model, kind), n))
        for k in ("running", "waiting"):
            if st.get(k) is not None:
                rows[k].append(((w, model), st[k]))
    for fam, key in ((kv, "kv"), (cap, "cap"), (traffic, "traffic"), (emulated, "emulated"),
                     (kv_actions, "kv_actions"), (kv_control, "kv_control"), (running, "running"),
                     (waiting, "waiting")):
        _summed(fam, rows[key])
    yield running
    yield waiting
    yield kv
    yield kv_actions
    yield kv_control
    yield cap
    yield traffic
    yield emulated


def engine_records(agg: Aggregates) -> list[tuple[str, str, dict]]:
    """(worker, model, stats) of every stored engine record that passes
    :func:`validate.engine_record`, sorted; a record that does not is left out and counted in
    ``agg.skipped`` (stored records are checked on arrival: this only catches what reached
    ``agg.engines`` another way)."""
    out = []
    for w, rep in sorted(agg.engines.items(), key=lambda kv: str(kv[0])):
        models = rep.get("models") if isinstance(rep, dict) else None
        if not isinstance(w, str) or not isinstance(models, dict):
            agg.skipped += 1
            continue
        for model, st in sorted(models.items(), key=lambda kv: str(kv[0])):
            try:
                out.append((w, validate.label(model, "engine model name"), validate.engine_record(st)))
            except validate.Invalid:
                agg.skipped += 1
    return out


def _token_families(plugin: "AgentsSchedulerPlugin") -> Iterator[Any]:
    from prometheus_client.core import CounterMetricFamily

    agg: Aggregates = plugin.aggregates
    fams = {k: CounterMetricFamily(_name(f"llm_{k}"), doc, labels=["worker", "model"]) for k, doc in (
        ("calls", "LLM calls finished, by worker and model"),
        ("prompt_tokens", "Prompt tokens of LLM calls"),
        ("cached_tokens", "Prompt tokens served from the prefix cache (hits)"),
        ("recomputed_tokens", "Prompt tokens computed by prefill (prompt - cached)"),
        ("output_tokens", "Generated tokens"),
    )}
    name = worker_label(plugin)
    rows = [((name(w), model), t) for (w, model), t in agg.tokens.items()]
    for i, key in enumerate(("calls", "prompt_tokens", "cached_tokens")):
        _summed(fams[key], [(labels, t[i]) for labels, t in rows])
    _summed(fams["recomputed_tokens"], [(labels, max(t[1] - t[2], 0)) for labels, t in rows])
    _summed(fams["output_tokens"], [(labels, t[3]) for labels, t in rows])
    yield from fams.values()


def _dashboard_families(plugin: "AgentsSchedulerPlugin") -> Iterator[Any]:
    from prometheus_client.core import CounterMetricFamily

    dash = getattr(plugin, "dashboard", None)
    if dash is not None:
        st = dash.stats()
        yield CounterMetricFamily(_name("dashboard_updates"), "Dashboard page updates", value=st["updates"])
        yield CounterMetricFamily(_name("dashboard_update_seconds"), "Event-loop seconds spent updating the "
                                  "dashboard page", value=st["update_seconds"])
        yield CounterMetricFamily(_name("dashboard_update_cpu_seconds"), "CPU seconds the dashboard page's "
                                  "updates used on the event-loop thread", value=st["update_cpu_seconds"])


def _health_families(agg: Aggregates) -> Iterator[Any]:
    """What the endpoints refused and what could not be rendered (last: never left out)."""
    from prometheus_client.core import CounterMetricFamily

    c = CounterMetricFamily(_name("rejected"), "Messages and records the plugin's endpoints refused, by "
                            "endpoint and reason", labels=["what", "reason"])
    for (what, why), n in sorted(agg.rejected.counts.items()):
        c.add_metric([what, why], n)
    yield c
    yield CounterMetricFamily(_name("render_skipped"), "Records or sections the Agents page and /metrics left "
                              "out because they could not be rendered (counted each time)", value=agg.skipped)


_failed: set[str] = set()  # sections that failed at least once (see families)
_SECTIONS: tuple[Callable[[Any], Iterator[Any]], ...] = (
    _session_families, _call_families, _queue_families, _histogram_families, _llm_families, _control_families,
    _engine_families, _token_families, _dashboard_families, _admission_families, _fault_families,
)


class AgentsCollector:
    """The process's ``dask_agents_*`` collector: reports the most recently started live plugin."""

    def __init__(self) -> None:
        self._plugins: list[weakref.ref] = []

    def add(self, plugin: "AgentsSchedulerPlugin") -> None:
        """Report ``plugin`` (from now on, until it is removed)."""
        self._plugins.append(weakref.ref(plugin))

    def remove(self, plugin: "AgentsSchedulerPlugin") -> bool:
        """Stop reporting ``plugin``; True when no plugin is left."""
        self._plugins = [r for r in self._plugins if r() is not None and r() is not plugin]
        return not self._plugins

    def current(self) -> Any:
        """The plugin reported now (None if none)."""
        for r in reversed(self._plugins):
            p = r()
            if p is not None and p.scheduler is not None:
                return p
        return None

    def describe(self) -> list:
        """Nothing up front (the series depend on what ran); keeps registration cheap."""
        return []

    def collect(self) -> Iterator[Any]:
        """The metric families of the current plugin."""
        p = self.current()
        if p is not None:
            yield from families(p)


_lock = threading.Lock()
_collector: AgentsCollector | None = None


def register(plugin: "AgentsSchedulerPlugin") -> bool:
    """Serve ``plugin``'s metrics on ``/metrics``; False if prometheus_client is absent."""
    global _collector
    try:
        import prometheus_client
    except ImportError:
        return False
    with _lock:
        if _collector is None:
            _collector = AgentsCollector()
            prometheus_client.REGISTRY.register(_collector)
        _collector.add(plugin)
    return True


def unregister(plugin: "AgentsSchedulerPlugin") -> None:
    """Stop serving ``plugin``'s metrics; the collector leaves the registry with the last plugin."""
    global _collector
    with _lock:
        if _collector is None:
            return
        if _collector.remove(plugin):
            import prometheus_client

            try:
                prometheus_client.REGISTRY.unregister(_collector)
            except KeyError:
                pass
            _collector = None


def registered() -> bool:
    """True while the collector is in prometheus_client's default registry."""
    return _collector is not None
