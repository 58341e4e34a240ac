"""Checks for everything the scheduler plugin's endpoints receive, before any of it is stored.

The plugin's RPC handlers and its ``agents-report`` stream op are reachable by every
authenticated peer: workers, but also any client (Dask dispatches client and worker streams
through one handler table). A value that is stored unchecked can break a later reader (one
bad ``engines`` entry made ``/agents`` and ``/metrics`` fail until restart) or grow the
scheduler without bound (100 MB of session ids cost 107 MB). So every value is checked here
for type, finiteness and size, and against what the scheduler itself knows: a report is kept
only for a call placed on, processing at or run by the worker whose stream delivered it; a
hello only from the worker it names.

Validators raise :class:`Invalid` (a ``ValueError``: an RPC caller sees it) naming the field;
the bulk ones (reports, engine stats) drop the bad records, keep the rest and count what they
dropped in a :class:`Rejections` (shown on ``/metrics`` as ``dask_agents_rejected_total``).
Everything is O(size of the input) and runs on the scheduler's event loop.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections import Counter, deque
from typing import TYPE_CHECKING, Any, Iterable, Iterator

from dask_agents.models import DRIVER, CallReport
from dask_agents.scheduler_plugin import dask_compat

if TYPE_CHECKING:
    from dask_agents.scheduler_plugin.plugin import AgentsSchedulerPlugin

logger = logging.getLogger(__name__)

MAX_SESSION_ID = 256
"""Longest session id accepted (``da.session`` makes at most 128 + 17 characters)."""
MAX_SESSIONS = 10_000
"""Most session ids one request may name (``agents_progress``)."""
MAX_LABEL = 256
"""Longest model name, metric text or engine label."""
MAX_KEY = 1024
"""Longest call key in a report (``<component>-<32 hex>``: at most 256 + 33)."""
MAX_ADDRESS = 512
"""Longest worker address."""
MAX_MODELS = 64
"""Most models one worker may say it hosts, or report engine stats for."""
MAX_REPORTS = 100_000
"""Most call reports one message may carry (a worker sends its reports every
``agents.worker.report-interval``; more than this in one is not a worker's)."""
MAX_METRICS = 32
"""Most metrics one call report may carry."""
MAX_ENTRIES = 16
"""Most entries of one engine-stats mapping (KV tiers, traffic directions, directive kinds)."""
MAX_COUNT = 2**63 - 1
"""Largest count or byte size accepted (Prometheus and numpy int64)."""
INTERVAL = (0.05, 60.0)
"""The scale-request interval a cluster link may state is clamped into this range (seconds)."""
HELLO_WAIT = 2.0
"""Seconds a hello waits for its worker's registration to land (a preloaded plugin may say
hello a moment before)."""
HELLO_CONFIRM_TIMEOUT = 10.0
"""Seconds the scheduler waits for a worker to confirm its hello (its ``agents_worker_info``)."""
HELLO_CONFIRM_LATER_TIMEOUT = 60.0
"""Seconds a first hello's confirmation may take (the worker answers once it has started)."""


class Invalid(ValueError):
    """A value one of the plugin's endpoints received was refused; the message names it.

    ``reason``: the same without the value (what :class:`Rejections` counts by, so the label
    set of ``dask_agents_rejected_total`` stays small whatever peers send)."""

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        self.reason = reason or message


def _text(value: Any, limit: int = 80) -> str:
    """A short, safe rendering of a refused value for messages and logs."""
    from dask_agents.errors import short_repr

    return short_repr(value, limit)


# -- scalars -------------------------------------------------------------------------------------

def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def finite(value: Any, what: str, reason: str | None = None) -> float:
    """``value`` as a float: an int or float (not a bool), finite. ``reason``: see :class:`Invalid`
    (default ``bad <what>``; pass one when ``what`` holds a peer's text)."""
    if not _number(value) or not math.isfinite(value):
        raise Invalid(f"{what} must be a finite number, got {_text(value)}", reason or f"bad {what}")
    return float(value)


def count(value: Any, what: str, reason: str | None = None) -> int:
    """``value`` as a non-negative int (an integral float is accepted) up to :data:`MAX_COUNT`."""
    if not _number(value) or not math.isfinite(value) or value < 0 or value > MAX_COUNT or int(value) != value:
        raise Invalid(f"{what} must be a whole number >= 0, got {_text(value)}", reason or f"bad {what}")
    return int(value)


def label(value: Any, what: str, limit: int = MAX_LABEL, reason: str | None = None) -> str:
    """``value``: a non-empty string of at most ``limit`` characters."""
    if not isinstance(value, str) or not value or len(value) > limit:
        raise Invalid(f"{what} must be a non-empty string of at most {limit} characters, got {_text(value)}",
                      reason or f"bad {what}")
    return value


# -- sessions --------------------------------------------------------------------------------------

def _session_pattern() -> re.Pattern:
    # the label rule of da.session(name=...) (dask_agents/session.py), then "-" and 16 hex digits
    from dask_agents.annotation import SESSION_LABEL as _LABEL

    return re.compile(rf"(?:{_LABEL.pattern})-[0-9a-f]{{16}}")


_SESSION_ID = _session_pattern()


def session_id(value: Any, what: str = "session") -> str:
    """A session id as ``da.session`` makes them: ``<name>-<16 hex digits>``, the name 1-128
    letters, digits and ``_ . : + @ -`` (not starting with a symbol); at most
    :data:`MAX_SESSION_ID` characters."""
    if not isinstance(value, str) or len(value) > MAX_SESSION_ID or not _SESSION_ID.fullmatch(value):
        raise Invalid(f"{what} must be a session id (<name>-<16 hex digits>, at most {MAX_SESSION_ID} "
                      f"characters), got {_text(value)}")
    return value


def sessions(value: Any, what: str = "sessions", limit: int = MAX_SESSIONS) -> list[str]:
    """A list (or tuple) of at most ``limit`` session ids (None: none)."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise Invalid(f"{what} must be a list of session ids, got {_text(value)}")
    if len(value) > limit:
        raise Invalid(f"{what}: at most {limit} sessions per request, got {len(value)}")
    return [session_id(v, f"{what}[{i}]") for i, v in enumerate(value)]


# -- models ----------------------------------------------------------------------------------------

def known_models(plugin: "AgentsSchedulerPlugin") -> set[str]:
    """Models the scheduler knows: those of its ``agents.llm.models`` and those a worker hosts."""
    import dask_agents.config as agents_config

    configured = agents_config.get("llm.models") or {}
    known = set(configured) if isinstance(configured, dict) else set()
    known.update(m for m, ws in getattr(plugin, "model_workers", {}).items() if ws)
    return known


def model_name(value: Any, known: Iterable[str], what: str = "model") -> str:
    """``value``: the name of a known model (see :func:`known_models`)."""
    name = label(value, what)
    known = known if isinstance(known, (set, frozenset, dict)) else set(known)
    if name not in known:
        raise Invalid(f"{what}: unknown model {_text(name)} (known: {', '.join(sorted(known)) or 'none'})",
                      "unknown model")
    return name


def models(value: Any, known: Iterable[str] | None, what: str = "models", limit: int = MAX_MODELS) -> list[str]:
    """A list (or tuple) of at most ``limit`` model names, without repeats (None: none); each a
    known one (:func:`model_name`), or with ``known=None`` any short name."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise Invalid(f"{what} must be a list of model names, got {_text(value)}")
    if len(value) > limit:
        raise Invalid(f"{what}: at most {limit} models, got {len(value)}")
    known = set(known) if known is not None else None
    out: list[str] = []
    for i, v in enumerate(value):
        name = label(v, f"{what}[{i}]") if known is None else model_name(v, known, f"{what}[{i}]")
        if name not in out:
            out.append(name)
    return out


# -- the cluster link --------------------------------------------------------------------------------

def interval(value: Any, what: str = "interval") -> float:
    """A scale-request polling interval in seconds: a finite number > 0, clamped into
    :data:`INTERVAL`. (Clamped, not refused: it only sizes the window in which the link counts
    as alive, and a link that polls every 10 ms must not be cut off.)"""
    seconds = finite(value, what)
    if seconds <= 0:
        raise Invalid(f"{what} must be > 0 seconds, got {_text(value)}")
    return min(max(seconds, INTERVAL[0]), INTERVAL[1])


# -- rejections --------------------------------------------------------------------------------------

class Rejections:
    """What the plugin's endpoints refused or dropped, by endpoint and reason.

    The first refusal of each (endpoint, reason) is logged as a warning, later ones at debug
    level: a peer that keeps sending junk must not flood the scheduler's log."""

    def __init__(self, recent: int = 50) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()
        self.recent: deque[dict] = deque(maxlen=recent)

    def add(self, what: str, why: str, source: Any = None, n: int = 1) -> None:
        """Count ``n`` refusals of ``what`` (an endpoint: ``agents-report``, ``engines``...)."""
        key = (what, why)
        first = key not in self.counts
        self.counts[key] += n
        self.recent.append({"time": time.time(), "what": what, "why": why, "source": _text(source, 120)})
        (logger.warning if first else logger.debug)(
            "dask-agents: %s from %s refused: %s (later ones are logged at debug level)", what, _text(source, 120), why)

    def stream_refused(self, op: str, origin: dict) -> None:
        """A worker-only stream op arrived on another stream (``dask_compat.add_worker_stream_handler``)."""
        self.add(op, "not sent on a worker's stream", origin.get("client") or origin.get("worker") or origin)

    def client_stream_refused(self, op: str, origin: dict) -> None:
        """A client-only stream op arrived on a worker's stream, or from no stream we can name
        (``dask_compat.add_client_stream_handler``)."""
        self.add(op, "not sent on a client's stream", origin.get("worker") or origin.get("client") or origin)

    def total(self) -> int:
        """Everything refused so far."""
        return sum(self.counts.values())


# -- worker reports --------------------------------------------------------------------------------

def ran_on(plugin: "AgentsSchedulerPlugin", key: str, worker: str) -> bool:
    """True if the call ``key`` was placed on, processes at, or ran on ``worker`` as far as the
    scheduler knows: the only worker whose report of it may be stored. O(1)."""
    rec = plugin.state.calls.get(key)
    if rec is None:
        return False
    if rec.worker == worker:  # set when the call went to processing there (or a migration)
        return True
    where = plugin.placed.get(key)
    if where is not None and where[0] == worker:
        return True
    moved = plugin.migrating.get(key)
    if moved is not None and worker in moved[1:]:  # a move the source may have refused
        return True
    ts = dask_compat.task(plugin.scheduler, key) if plugin.scheduler is not None else None
    if ts is None:
        return False
    try:
        return (dask_compat.processing_on(ts) == worker or worker in dask_compat.task_holders(ts)
                or worker in dask_compat.task_erred_on(ts))
    except AttributeError:  # an emulated scheduler's task (benchmarks/control_scale.py)
        return False


_TOKEN_METRICS = ("prompt_tokens", "cached_tokens", "output_tokens")
UNKNOWN_CALL = "no such call"
"""The reason of a report whose key the plugin does not record (see :func:`reports`)."""


def metrics(value: Any) -> dict:
    """A call's metrics (``record_metrics``): at most :data:`MAX_METRICS` entries keyed by
    short strings; token counts and ``kv_bytes`` whole numbers >= 0 (``kv_bytes`` may be None),
    ``cached_tokens`` at most ``prompt_tokens``, ``model`` a label, ``emulated`` a bool, any
    other entry None, a bool, a finite number or a string of at most :data:`MAX_LABEL`."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise Invalid(f"metrics must be a mapping, got {_text(value)}", "bad metrics")
    if len(value) > MAX_METRICS:
        raise Invalid(f"metrics: at most {MAX_METRICS} entries, got {len(value)}", "too many metrics")
    out: dict[str, Any] = {}
    for k, v in value.items():
        k = label(k, "a metric name", 64, "bad metric name")
        if k in _TOKEN_METRICS:
            out[k] = None if v is None else count(v, f"metrics[{k!r}]")
        elif k == "kv_bytes":
            out[k] = None if v is None else count(v, "metrics['kv_bytes']")
        elif k == "model":
            out[k] = None if v is None else label(v, "metrics['model']")
        elif k in ("ttft_s", "tpot_s", "engine_load_s"):
            if v is not None and not (_number(v) and finite(v, f"metrics[{k!r}]", "bad metric value") >= 0):
                raise Invalid(f"metrics[{k!r}] must be None or a finite number >= 0, got {_text(v)}", "bad metric value")
            out[k] = None if v is None else float(v)
        elif k == "emulated":
            if not isinstance(v, bool):
                raise Invalid(f"metrics['emulated'] must be a bool, got {_text(v)}")
            out[k] = v
        elif v is None or isinstance(v, bool):
            out[k] = v
        elif _number(v):
            out[k] = finite(v, f"metrics[{k!r}]", "bad metric value")
        elif isinstance(v, str) and len(v) <= MAX_LABEL:
            out[k] = v
        else:
            raise Invalid(f"metrics[{k!r}] must be None, a bool, a finite number or a short string, got {_text(v)}",
                          "bad metric value")
    prompt, cached = out.get("prompt_tokens"), out.get("cached_tokens")
    if prompt is not None and cached is not None and cached > prompt:
        raise Invalid(f"metrics: cached_tokens ({cached}) > prompt_tokens ({prompt})", "cached_tokens > prompt_tokens")
    return out


def report(plugin: "AgentsSchedulerPlugin", worker: str, value: Any) -> dict:
    """One call report from ``worker``'s stream, checked: ``{"key", "started", "finished",
    "state", "metrics"}`` (``state``: the worker's state of the task after it ran, or None). ``key`` names a call the plugin records that was placed on, processes at or
    ran on ``worker`` (:func:`ran_on`); ``started <= finished``, both finite and >= 0."""
    if not isinstance(value, dict):
        raise Invalid(f"a report must be a mapping, got {_text(value)}", "report is not a mapping")
    key = value.get("key")
    if not isinstance(key, str) or len(key) > MAX_KEY:
        raise Invalid(f"report key must be a call key (a string), got {_text(key)}", "bad report key")
    if key not in plugin.state.calls:
        raise Invalid(f"report of {_text(key)}: no such call", UNKNOWN_CALL)
    if not ran_on(plugin, key, worker):
        raise Invalid(f"report of {_text(key)}: the call was not placed on, processing at or run by {worker}",
                      "call not on this worker")
    started = finite(value.get("started"), "report 'started'")
    finished = finite(value.get("finished"), "report 'finished'")
    if started < 0 or finished < started:
        raise Invalid(f"report of {_text(key)}: needs 0 <= started <= finished, got {started}, {finished}",
                      "bad report times")
    state = value.get("state")
    if state is not None:
        label(state, "report 'state'", 32)
    return {"key": key, "started": started, "finished": finished, "state": state,
            "metrics": metrics(value.get("metrics"))}


def reports(plugin: "AgentsSchedulerPlugin", worker: str, value: Any, rejections: Rejections | None = None) -> list[dict]:
    """The valid reports of one ``agents-report`` message (see :func:`report`); the others are
    dropped and counted. None: no reports."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        if rejections is not None:
            rejections.add("agents-report", "reports is not a list", worker)
        return []
    if len(value) > MAX_REPORTS:
        if rejections is not None:
            rejections.add("agents-report", f"more than {MAX_REPORTS} reports in one message", worker, len(value))
        return []
    out = []
    for r in value:
        try:
            out.append(report(plugin, worker, r))
        except Invalid as e:
            # a report of a call the plugin no longer (or never) records is routine: a session
            # past retention, plain Dask work with an ``agents`` annotation. Dropped, not counted.
            if rejections is not None and e.reason != UNKNOWN_CALL:
                rejections.add("agents-report", e.reason, worker)
    return out


LOCAL_STATES = ("processing", "memory", "erred", "cancelled")
"""The states a fast-path record may report (Dask's task states)."""


def local_call(plugin: "AgentsSchedulerPlugin", worker: str, value: Any) -> CallReport:
    """One record of a call that ran on ``worker``'s fast path (``worker_plugin/local.py``),
    checked: ``{"key", "ann", "state", "started", "finished", "error", "metrics"}``. The
    annotation is sanitized; only a tool or stateless agent call, or an LLM call on an engine
    ``worker`` hosts (under admission's lease), may run there; its creator is a call the
    plugin records that runs on ``worker`` (where else could it have made a local call?) and
    the call is in the creator's session. A key already recorded must be ``worker``'s."""
    from dask_agents.annotation import sanitize_annotation

    if not isinstance(value, dict):
        raise Invalid(f"a local call record must be a mapping, got {_text(value)}", "record is not a mapping")
    key = value.get("key")
    if not isinstance(key, str) or len(key) > MAX_KEY:
        raise Invalid(f"local call key must be a string, got {_text(key)}", "bad report key")
    ann = sanitize_annotation(value.get("ann"))
    if ann is None or ann.get("call") != key:
        raise Invalid(f"local call {_text(key)}: its annotation does not name it", "bad local annotation")
    component = ann.get("component")
    if not component or not key.startswith(component + "-"):
        raise Invalid(f"local call {_text(key)}: not a call of {_text(component)}", "bad local annotation")
    kind = ann.get("kind")
    if kind == "llm":  # under an admission lease: the worker hosts an engine of its model
        if worker not in plugin.model_workers.get(ann.get("llm_model"), ()):
            raise Invalid(f"local call {_text(key)}: {worker} hosts no engine of model {_text(ann.get('llm_model'))}",
                          "not local")
    elif kind not in ("agent", "tool") or ann.get("llm_model"):
        raise Invalid(f"local call {_text(key)}: only tool, stateless agent and leased LLM calls run locally",
                      "not local")
    if ann.get("stateful") or ann.get("batching"):
        raise Invalid(f"local call {_text(key)}: stateful and batched calls never run locally", "not local")
    calls = plugin.state.calls
    if key in calls:
        if not ran_on(plugin, key, worker):
            raise Invalid(f"local call {_text(key)}: recorded on another worker", "call not on this worker")
    elif ann.get("creator") == DRIVER:  # a driver's direct call (its worker checked its token)
        client, sid = value.get("client"), ann.get("session")
        # its session may not be known yet: the driver's open travels on its own stream, batched,
        # the call went by RPC. A completed one: a record this late has nothing to join.
        s = plugin.state.sessions.get(sid) if isinstance(sid, str) else None
        if kind == "llm" or not isinstance(client, str) or not isinstance(sid, str) or (
                s is not None and s.state == "completed"):
            raise Invalid(f"direct call {_text(key)}: not in an open session of client {_text(client)}",
                          "direct call not in an open session")
        if s is not None:
            ann["tenant"] = s.tenant
    else:
        creator = calls.get(ann.get("creator"))
        if creator is None or not ran_on(plugin, creator.key, worker):
            raise Invalid(f"local call {_text(key)}: its creator {_text(ann.get('creator'))} does not run on {worker}",
                          "creator not on this worker")
        if ann.get("session") != creator.session:
            raise Invalid(f"local call {_text(key)}: not in its creator's session", "session is not the creator's")
        ann["tenant"] = creator.tenant
    state = value.get("state")
    if state not in LOCAL_STATES:
        raise Invalid(f"local call {_text(key)}: state must be one of {LOCAL_STATES}, got {_text(state)}",
                      "bad report state")
    started, finished = value.get("started"), value.get("finished")
    started = None if started is None else finite(started, "record 'started'")
    finished = None if finished is None else finite(finished, "record 'finished'")
    if state in ("memory", "erred") and (started is None or finished is None or not 0 <= started <= finished):
        raise Invalid(f"local call {_text(key)}: needs 0 <= started <= finished, got {started}, {finished}",
                      "bad report times")
    error = value.get("error")
    error = error[:2000] if isinstance(error, str) else None
    out = CallReport(key=key, ann=ann, state=state, started=started, finished=finished, error=error,
                     metrics=metrics(value.get("metrics")) if value.get("metrics") is not None else None)
    if ann.get("creator") == DRIVER and isinstance(value.get("client"), str):
        out["client"] = value["client"]
    return out


def local_calls(plugin: "AgentsSchedulerPlugin", worker: str, value: Any,
                rejections: Rejections | None = None) -> Iterator[CallReport]:
    """The valid records of one ``agents-report`` message's ``calls`` (see :func:`local_call`),
    checked one at a time as the caller applies them: a record may name a creator that an
    earlier record of the same message recorded. The others are dropped and counted."""
    if value is None:
        return
    if not isinstance(value, (list, tuple)) or len(value) > MAX_REPORTS:
        if rejections is not None:
            rejections.add("agents-report", f"calls is not a list of at most {MAX_REPORTS}", worker)
        return
    for r in value:
        try:
            checked = local_call(plugin, worker, r)
        except Invalid as e:
            if rejections is not None:
                rejections.add("agents-report", e.reason, worker)
            continue
        yield checked


# -- engine stats ------------------------------------------------------------------------------------

_ENGINE_COUNTS = ("steps", "running", "waiting", "evictions", "hit_tokens", "query_tokens", "max_batch", "block_size",
                  "restarts")
_ENGINE_MAPS = ("kv_bytes", "kv_capacity_bytes", "kv_traffic_bytes", "kv_actions", "kv_blocks")


def engine_record(value: Any) -> dict:
    """One engine's stats (``dask_agents.worker_plugin.plugin.engine_report``), checked: ``engine`` and
    ``kv_policy`` labels, ``emulated`` a bool, the counters whole numbers >= 0 or None, the
    per-tier, per-direction and per-kind mappings at most :data:`MAX_ENTRIES` entries of
    whole numbers >= 0 keyed by short strings. Unknown fields are dropped."""
    if not isinstance(value, dict):
        raise Invalid(f"engine stats must be a mapping, got {_text(value)}", "engine stats not a mapping")
    out: dict[str, Any] = {}
    engine = value.get("engine")
    out["engine"] = None if engine is None else label(engine, "engine", 64)
    emulated = value.get("emulated", False)
    if not isinstance(emulated, bool):
        raise Invalid(f"engine 'emulated' must be a bool, got {_text(emulated)}", "bad engine 'emulated'")
    out["emulated"] = emulated
    for k in _ENGINE_COUNTS:
        if k in value:
            out[k] = None if value[k] is None else count(value[k], f"engine {k!r}")
    for k in _ENGINE_MAPS:
        if k not in value or value[k] is None:
            continue
        m = value[k]
        if not isinstance(m, dict) or len(m) > MAX_ENTRIES:
            raise Invalid(f"engine {k!r} must be a mapping of at most {MAX_ENTRIES} entries, got {_text(m)}",
                          f"bad engine {k!r}")
        out[k] = {label(t, f"a key of engine {k!r}", 64, f"bad engine {k!r}"):
                  count(b, f"engine {k}[{t!r}]", f"bad engine {k!r}") for t, b in m.items()}
    if value.get("kv_policy") is not None:
        out["kv_policy"] = label(value["kv_policy"], "engine 'kv_policy'", 64)
    if "kv_control" in value:  # per-session KV control on (True) or off, and why
        if not isinstance(value["kv_control"], bool):
            raise Invalid(f"engine 'kv_control' must be a bool, got {_text(value['kv_control'])}", "bad engine 'kv_control'")
        out["kv_control"] = value["kv_control"]
        reason = value.get("kv_control_reason")
        out["kv_control_reason"] = None if reason is None else str(reason)[:500]
    return out


def engine_stats(value: Any, known: Iterable[str] | None = None, rejections: Rejections | None = None,
                 worker: str | None = None) -> dict[str, dict] | None:
    """A worker's engine stats (model -> :func:`engine_record`) with the bad records dropped
    (and counted); None when ``value`` is absent or not a mapping of at most
    :data:`MAX_MODELS` entries. ``known``: model names to accept (None: any short name)."""
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > MAX_MODELS:
        if rejections is not None:
            rejections.add("engines", f"not a mapping of at most {MAX_MODELS} models", worker)
        return None
    known = set(known) if known is not None else None
    out: dict[str, dict] = {}
    for model, st in value.items():
        try:
            name = label(model, "engine model name") if known is None else model_name(model, known)
            out[name] = engine_record(st)
        except Invalid as e:
            if rejections is not None:
                rejections.add("engines", e.reason, worker)
    return out


# -- hello ---------------------------------------------------------------------------------------------

def same_host(peer: Any, address: Any) -> bool:
    """True if the two Dask addresses are on one host (the ports differ: an RPC comes from an
    ephemeral port, not from the caller's listening address)."""
    a, b = dask_compat.address_host(peer), dask_compat.address_host(address)
    return a is not None and a == b


async def hello(plugin: "AgentsSchedulerPlugin", comm: Any, worker: Any, models_: Any = None,
                pid: Any = None) -> tuple[str, list[str], int | None]:
    """A worker plugin's hello (``agents_worker_hello``), checked; returns (worker, models, pid)
    to register.

    Only a worker may say hello, and only for itself:

    - ``worker`` is a running worker of this scheduler (waiting :data:`HELLO_WAIT` for its
      registration to land);
    - the RPC comes from that worker's host: the host of ``comm``'s peer is the host of the
      worker's own stream comm (an RPC's peer port is ephemeral, so ports cannot match);
    - ``models`` a list of at most :data:`MAX_MODELS` model names; ``pid`` None or the process
      id the worker registered with (the registered one is recorded);
    - the worker confirms: the scheduler asks it (``agents_worker_info``, on its own address,
      where only it answers) which models it hosts, and those are registered, so a hello in
      its name cannot change what it is said to host. (Its models need not be in the
      scheduler's ``agents.llm.models``: workers may be configured on their own, and the
      worker is the authority on what it hosts; once registered they are "hosted", hence
      known, for :func:`engine_stats`.) For a worker that said hello before,
      the answer is awaited (none within :data:`HELLO_CONFIRM_TIMEOUT`: refused). A first
      hello may come from the worker's start-up (a plugin set up while its worker starts), and
      a worker answers RPCs only once started: asking then would wait for itself. So a first
      hello registers what it claims and the worker is asked right after (:func:`confirm`):
      its answer replaces the claim, and no answer unregisters it.

    Raises :class:`Invalid` otherwise (the caller gets the error; nothing is registered)."""
    import asyncio

    if not isinstance(worker, str) or len(worker) > MAX_ADDRESS:
        raise Invalid(f"agents_worker_hello: worker must be a worker address, got {_text(worker)}")
    claimed = models(models_, None, "agents_worker_hello: models")
    if pid is not None and (not isinstance(pid, int) or isinstance(pid, bool) or not 0 < pid <= 2**31):
        raise Invalid(f"agents_worker_hello: pid must be None or a process id, got {_text(pid)}")
    scheduler = plugin.scheduler
    deadline = time.monotonic() + HELLO_WAIT
    while not dask_compat.has_worker(scheduler, worker):
        if time.monotonic() > deadline:
            raise Invalid(f"agents_worker_hello: {_text(worker)} is not a worker of this scheduler")
        await asyncio.sleep(0.05)
    peer = dask_compat.comm_peer(comm)
    own = dask_compat.worker_stream_peer(scheduler, worker) or worker
    if peer is None or not same_host(peer, own):
        raise Invalid(f"agents_worker_hello: only {worker} may say hello for itself (this call came from "
                      f"{_text(peer)})")
    registered = dask_compat.worker_pid(scheduler, worker)
    if pid is not None and registered is not None and pid != registered:
        raise Invalid(f"agents_worker_hello: pid {pid} is not that of {worker} ({registered})")
    pid = registered if registered is not None else pid
    if worker in plugin.ready_workers:
        return worker, await hosted_models(plugin, worker, HELLO_CONFIRM_TIMEOUT), pid
    task = asyncio.get_running_loop().create_task(confirm(plugin, worker))
    _confirming.add(task)  # referenced until done (the loop keeps only weak references)
    task.add_done_callback(_confirming.discard)
    return worker, claimed, pid


_confirming: set = set()  # first-hello confirmations in flight (see hello)


async def hosted_models(plugin: "AgentsSchedulerPlugin", worker: str, timeout: float) -> list[str]:
    """The models ``worker`` itself says it hosts (its ``agents_worker_info``); raises
    :class:`Invalid` if it does not answer within ``timeout`` seconds or answers nonsense."""
    import asyncio

    try:
        info = await asyncio.wait_for(dask_compat.call_worker(plugin.scheduler, worker, "agents_worker_info"), timeout)
    except Exception as e:
        raise Invalid(f"agents_worker_hello: {worker} did not confirm its hello ({_text(e, 200)})") from None
    hosted = info.get("models") if isinstance(info, dict) else None
    try:
        if not isinstance(hosted, (list, tuple)):  # None: no dask-agents plugin answered (Dask replies None)
            raise Invalid("no list")
        hosted = models(hosted, None, f"agents_worker_hello: {worker} reported models")
    except Invalid:
        raise Invalid(f"agents_worker_hello: {worker} reported no list of models ({_text(info)})") from None
    # its dask-agents plugin answered, so it registered the secret's stream op (an op it does
    # not know would close its stream): the scheduler's calls to it may carry the secret now
    plugin.roster.tell_secret(worker)
    return hosted


async def confirm(plugin: "AgentsSchedulerPlugin", worker: str, timeout: float | None = None) -> bool:
    """Ask a worker registered by its first hello what it hosts: its answer replaces what the
    hello claimed; no answer (not a worker with the dask-agents plugin, or gone) unregisters
    it (``ready_workers``, ``model_workers``). Returns True if it answered. ``timeout``:
    default :data:`HELLO_CONFIRM_LATER_TIMEOUT`."""
    try:
        hosted = await hosted_models(plugin, worker, HELLO_CONFIRM_LATER_TIMEOUT if timeout is None else timeout)
    except Invalid as e:
        if worker in plugin.ready_workers:
            logger.warning("dask-agents: %s is no longer a ready worker: %s", worker, e)
            plugin.set_worker_models(worker, [])
            plugin.ready_workers.pop(worker, None)
        return False
    info = plugin.ready_workers.get(worker)
    if info is not None and set(info.get("models") or ()) != set(hosted):
        logger.info("dask-agents: %s said hello hosting %s but hosts %s: registered with what it hosts",
                    worker, info.get("models"), hosted)
        plugin.set_worker_models(worker, hosted)
    return True
