"""The component controller: a WorkerPlugin that hosts instances and engines and reports timings.

Lifecycle: ``setup`` creates the instance table and engine table, starts loading hosted
models in the background, then *announces readiness* to the scheduler plugin (an RPC, so a
scheduler without dask-agents only answers with an error and nothing breaks). Only after that
does it stream reports. ``transition`` records exact start/finish per call from the worker's
own state machine; reports go to the scheduler in batches every ``agents.worker.report-interval``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from distributed import Worker, WorkerPlugin
from distributed.worker import get_worker

import dask_agents.config as agents_config
from dask_agents.errors import NotInstalledError
from dask_agents.worker_plugin import dask_compat
from dask_agents.worker_plugin.batching import Batcher
from dask_agents.worker_plugin.engines import Engines
from dask_agents.worker_plugin.instances import Instances
from dask_agents.worker_plugin.local import LocalCalls

logger = logging.getLogger(__name__)

NAME = "dask-agents"
REPORT_OP = "agents-report"
REPRIORITIZE_OP = "agents-reprioritize"  # dask_agents.scheduler_plugin.enforce.REPRIORITIZE_OP
KV_HINT_OP = "agents-kv-hint"  # dask_agents.scheduler_plugin.kv_hints.HINT_OP
ROUTES_OP = "agents-routes"  # dask_agents.scheduler_plugin.plugin.ROUTES_OP
LEASE_OP = "agents-lease"  # dask_agents.scheduler_plugin.admission.LEASE_OP
SECRET_OP = "agents-secret"  # dask_agents.scheduler_plugin.roster.SECRET_OP
SECRET_WAIT = 30.0  # s a scheduler's call may wait for the secret its stream brings
_END = ("memory", "error", "released", "cancelled", "forgotten", "rescheduled")
_ARRIVED = ("waiting", "ready", "constrained", "executing")


def get_plugin(worker: Worker | None = None, wait: bool = True) -> "AgentsWorkerPlugin":
    """The plugin on this worker, once it is ready (raises NotInstalledError if absent).

    ``wait=False``: do not block for readiness (for code on the worker's event loop, which
    must not block the setup it would wait for); check ``plugin.ready`` yourself."""
    worker = worker or get_worker()
    plugin = worker.plugins.get(NAME)
    if not isinstance(plugin, AgentsWorkerPlugin):
        raise NotInstalledError(
            f"the dask-agents worker plugin is not installed on worker {worker.address}: "
            "call da.install(client), or start workers with --preload dask_agents.preload"
        )
    if wait and not plugin.ready.wait(timeout=60):
        raise NotInstalledError(f"the dask-agents worker plugin on {worker.address} did not become ready")
    return plugin


class AgentsWorkerPlugin(WorkerPlugin):
    """Hosts component instances and LLM engines on one worker; reports per-call timings.

    ``models``: model names (from ``agents.llm.models``) to load at start, either one list
    for every worker or a dict from worker name or address to a list (key ``"*"`` for the
    rest); default ``agents.worker.models``. Other models load lazily on their first call.
    The controller may swap a worker's models later (reallocation).
    """

    name = NAME
    idempotent = True

    def __init__(self, models: list[str] | dict[str, list[str]] | None = None, client_interval: float | None = None):
        self.models = models if isinstance(models, dict) else (list(models) if models is not None else None)
        # The batching window of this worker's own client (nested calls' update-graph), as
        # da.install read it on the driver; None: agents.client.batched-send-interval here.
        self.client_interval = client_interval
        self._init_runtime()

    def _init_runtime(self) -> None:
        self.ready = threading.Event()
        self.worker: Worker | None = None
        self.instances = Instances()
        self.batcher = Batcher()
        self.engines: Engines | None = None
        self.local: LocalCalls | None = None  # the fast path, once the scheduler plugin answered
        self.direct: Any = None  # drivers' direct calls (worker_plugin/direct.py), with the fast path
        self.scheduler_ok = False
        self._lock = threading.Lock()
        self._started: dict[Any, float] = {}
        self._metrics: dict[Any, dict] = {}
        self._reports: list[dict] = []
        self._engines_sent = 0.0  # when engine stats last went to the scheduler
        # what proves that a call of our mutating handlers comes from the scheduler: it sends
        # it on this worker's own stream (only the scheduler can), nobody else knows it
        self._secret: str | None = None
        self._secret_known = threading.Event()

    def __getstate__(self) -> dict:
        return {"models": self.models, "client_interval": self.client_interval}

    def __setstate__(self, state: dict) -> None:
        self.models = state["models"]
        self.client_interval = state.get("client_interval")
        self._init_runtime()

    async def setup(self, worker: Worker) -> None:
        self.worker = worker
        from dask_agents.worker_plugin.logs import filter_call_failures, quiet_engines

        quiet_engines()  # before any engine library is imported on this worker
        dask_compat.leave_sigint_to_nanny(worker)  # Ctrl-C stops the cluster through its nannies
        # a failed call's error reaches its caller, named: no traceback block in the worker's log
        self._log_filter = filter_call_failures(lambda key: self._agents_annotation(key) is not None)
        models = self._models_for(worker)
        self.engines = Engines(worker.address, models)
        self.engines.on_announce = self._announce
        self.engines.on_metrics = self.record_metrics
        # a streaming call's deltas: a Dask structured event on its caller's topic, sent from
        # the worker's loop (on the stream its result follows; hosts call this from their threads)
        self.engines.on_stream = lambda topic, msg: worker.loop.add_callback(worker.log_event, topic, msg)
        self.engines.stream_barrier = self._stream_barrier
        for m in models:
            self.engines.start(m)  # loads in its own thread; calls wait for it
        dask_compat.set_batched_send_interval(worker, agents_config.seconds("worker.batched-send-interval"))
        if agents_config.get("worker.switch-interval", None) is not None:
            import sys

            sys.setswitchinterval(agents_config.seconds("worker.switch-interval"))
        dask_compat.add_rpc_handler(worker, "agents_end_session", self._end_session_handler)
        dask_compat.add_rpc_handler(worker, "agents_worker_info", self._info_handler)
        dask_compat.add_rpc_handler(worker, "agents_swap_model", self._swap_handler)
        dask_compat.add_rpc_handler(worker, "agents_kv", self._kv_handler)
        dask_compat.add_rpc_handler(worker, "agents_direct", self._direct_handler)
        dask_compat.add_rpc_handler(worker, "agents_direct_forget", self._direct_forget_handler)
        # Registered before the hello: the scheduler only streams this op to workers that said hello.
        dask_compat.add_stream_handler(worker, REPRIORITIZE_OP, self._reprioritize)
        dask_compat.add_stream_handler(worker, KV_HINT_OP, self._kv_hint)
        dask_compat.add_stream_handler(worker, ROUTES_OP, self._routes)
        dask_compat.add_stream_handler(worker, LEASE_OP, self._lease)
        dask_compat.add_stream_handler(worker, SECRET_OP, self._secret_msg)
        self.ready.set()
        if dask_compat.registered(worker):
            await self._hello(models)
        else:  # a preload runs before the worker registers: the scheduler would not know it yet
            worker.loop.add_callback(self._hello_when_registered, models)
        dask_compat.add_periodic(worker, "dask-agents-report", self.flush, agents_config.seconds("worker.report-interval"))

    async def _hello_when_registered(self, models: list[str], timeout: float = 120.0) -> None:
        """Announce this worker once it has registered (without holding up its start-up)."""
        import asyncio

        deadline = time.monotonic() + timeout
        while not dask_compat.registered(self.worker):
            if time.monotonic() > deadline or self.worker.status.name in ("closing", "closed", "failed"):
                logger.warning("dask-agents: the worker did not register with its scheduler; telemetry is off")
                return
            await asyncio.sleep(0.05)
        await self._hello(self.engines.announced() if self.engines is not None else models)

    def _models_for(self, worker: Worker) -> list[str]:
        if isinstance(self.models, dict):
            for k in (worker.name, str(worker.name), worker.address, "*"):
                if k in self.models:
                    return list(self.models[k])
            return []
        if self.models is not None:
            return list(self.models)
        return list(agents_config.get("worker.models") or [])

    async def _hello(self, models: list[str] | None) -> None:
        """Announce this worker and the models it serves (``None``: what the engines serve at
        the moment the message goes: announcements may queue, the last one must be current)."""
        try:
            if not await dask_compat.scheduler_has_handler(self.worker, "agents_worker_hello"):
                logger.warning("dask-agents: the scheduler has no dask-agents plugin; per-call telemetry is off")
                return
            if models is None:
                models = self.engines.announced() if self.engines is not None else []
            if self.local is None and agents_config.get("worker.fast-path.enabled"):
                # only with a scheduler plugin to record what runs here (used once scheduler_ok)
                self.local = LocalCalls(self.worker, agents_config.seconds("worker.fast-path.max-wait"))
                self.local.take_metrics = self.take_metrics
                from dask_agents.worker_plugin.direct import DirectCalls

                self.direct = DirectCalls(self)
            await self.worker.scheduler.agents_worker_hello(worker=self.worker.address, models=models, pid=os.getpid())
            self.scheduler_ok = True
        except Exception as e:
            logger.warning("dask-agents: could not announce this worker to the scheduler (%s); telemetry is off", e)

    def _announce(self) -> None:
        """The models this worker serves changed (a model started lazily, an engine was given up
        or came back): say so to the scheduler, which places by them. Any thread."""
        worker = self.worker
        if worker is not None and self.scheduler_ok:
            worker.loop.add_callback(self._hello, None)

    async def _stream_barrier(self) -> None:
        """Return once the loop ran every callback scheduled before (a streaming call's last
        deltas and its end go out ahead of its result: callbacks run in order)."""
        import asyncio

        done = asyncio.get_running_loop().create_future()
        self.worker.loop.add_callback(done.set_result, None)
        await done

    async def teardown(self, worker: Worker) -> None:
        from dask_agents.worker_plugin.logs import unfilter_call_failures

        unfilter_call_failures(getattr(self, "_log_filter", None))
        dask_compat.remove_periodic(worker, "dask-agents-report")
        self.flush()
        if self.direct is not None:
            self.direct.close()
        if self.engines is not None:
            self.engines.close()

    # -- fast path: called by the worker state machine on its event loop -------------
    def transition(self, key: Any, start: str, finish: str, **kwargs: Any) -> None:
        if finish in _ARRIVED:
            ann = self._agents_annotation(key)
            if ann is None:
                return
            if ann.get("stateful"):  # a ticket in submission order as soon as the call is here
                self.instances.ticket(ann["component"], ann.get("session"), key, ann.get("created"))
            if finish == "executing":
                self._started[key] = time.time()
        elif finish in _END:
            local = self.local
            if local is not None and start in ("executing", "long-running"):
                # what it deferred and never waited for goes on (the scheduler path); what ran
                # here is reported now, on this stream ahead of its end: its session cannot
                # complete before they are recorded
                if local.has_deferred(key):
                    self.worker.loop.add_callback(local.caller_ended, key)
                if local.has_records():
                    self._send({"op": REPORT_OP, "worker": self.worker.address, "reports": [],
                                "calls": local.pending_records()})
            ann = self._agents_annotation(key) or {}
            if ann.get("stateful"):  # idempotent: also for calls released before they started
                self.instances.done(ann["component"], ann.get("session"), key)
            # released while it ran (the hook sees "released"; the task waits in "cancelled" for
            # its coroutine to end): nobody wants its tokens, so the engine stops the request
            if (finish in ("released", "cancelled") and start in ("executing", "long-running")
                    and ann.get("kind") == "llm" and self.engines is not None):
                self.engines.abort_call(key)
            t0 = self._started.pop(key, None)
            if t0 is None or start not in ("executing", "long-running"):
                return
            report = {"key": key, "started": t0, "finished": time.time(), "state": finish}
            m = self._metrics.pop(key, None)
            if m:
                report["metrics"] = m
                # An LLM call that waited for its engine to load (a lazily started model, a
                # restarted engine) started when the engine was there: the load is its queueing
                # (queue_s, and engine_load_s says how much), never its service time.
                ready = m.pop("engine_ready_at", None)  # (not a metric: it moves the start)
                if isinstance(ready, (int, float)) and ready > t0:
                    report["started"] = min(ready, report["finished"])
            self._reports.append(report)

    def _agents_annotation(self, key: Any) -> dict | None:
        if self.worker is None:
            return None
        return dask_compat.task_annotations(self.worker, key).get("agents")

    def record_metrics(self, key: Any, **metrics: Any) -> None:
        """Attach metrics (LLM tokens...) to a call; they travel with its finish report."""
        with self._lock:
            self._metrics.setdefault(key, {}).update(metrics)

    def take_metrics(self, key: Any) -> dict | None:
        """The metrics a fast-path call recorded (they travel with its record, not a report)."""
        with self._lock:
            m = self._metrics.pop(key, None)
        if m:
            m.pop("engine_ready_at", None)  # (not a metric; a local call has no queueing to move)
        return m or None

    def flush(self) -> None:
        """Send pending reports to the scheduler plugin (one batched message); every
        ``agents.dashboard.engine-stats-interval`` the engines' stats ride along."""
        if not self.scheduler_ok or self.worker is None:
            return
        msg: dict[str, Any] = {"op": REPORT_OP, "worker": self.worker.address}
        now = time.monotonic()
        if self.engines is not None and now - self._engines_sent >= agents_config.seconds("dashboard.engine-stats-interval"):
            self._engines_sent = now
            engines = self.engine_stats()
            if engines:
                msg["engines"] = engines
        calls = self.local.pending_records() if self.local is not None else []
        if calls:
            msg["calls"] = calls
        if not self._reports and "engines" not in msg and not calls:
            return
        msg["reports"], self._reports = self._reports, []
        self._send(msg)

    def _send(self, msg: dict) -> None:
        try:
            dask_compat.send_to_scheduler(self.worker, msg)
        except Exception as e:  # disconnected: these reports are lost, the calls are not
            logger.debug("dask-agents: could not send reports: %s", e)

    def engine_stats(self) -> dict[str, dict]:
        """model -> :func:`engine_report` of each loaded engine on this worker."""
        out = {}
        for model in self.engines.loaded_models() if self.engines is not None else ():
            host = self.engines._hosts.get(model)  # noqa: SLF001 (no public accessor yet)
            if host is not None:
                try:
                    out[model] = engine_report(host)
                    out[model]["restarts"] = self.engines.restarts.get(model, 0)
                except Exception as e:  # stats are best effort: never break the reports
                    logger.debug("dask-agents: stats of engine %s failed: %s", model, e)
        return out

    # -- handlers ---------------------------------------------------------------------
    async def _direct_handler(self, comm: Any = None, **msg: Any) -> dict:
        """A driver's call straight to this worker (``worker_plugin/direct.py``)."""
        if self.direct is None:
            return {"status": "busy", "why": "not ready"}
        return await self.direct.handle(**msg)

    def _direct_forget_handler(self, comm: Any = None, key: Any = None, client: Any = None, token: Any = None) -> None:
        if self.direct is not None:
            self.direct.forget(key=key, client=client, token=token)

    def _secret_msg(self, secret: Any = None, **kw: Any) -> None:
        """The scheduler's secret, on this worker's stream (after each hello)."""
        if isinstance(secret, str) and secret:
            self._secret = secret
            self._secret_known.set()

    async def _from_scheduler(self, op: str, secret: Any) -> None:
        """Raise PermissionError unless ``secret`` is the one the scheduler sent on this
        worker's stream: ending sessions, swapping engines and KV directives change what every
        driver relies on, so only the scheduler may ask for them (a client calling the worker
        directly is refused). A call that arrives before the stream's message waits for it."""
        import asyncio
        import hmac

        if self._secret is None:
            await asyncio.to_thread(self._secret_known.wait, SECRET_WAIT)
        if not isinstance(secret, str) or self._secret is None or not hmac.compare_digest(secret, self._secret):
            addr = self.worker.address if self.worker is not None else "?"
            raise PermissionError(f"dask-agents: {op} on worker {addr} refused: only the scheduler may call it")

    async def _end_session_handler(self, session: str | None = None, sessions: list | None = None,
                                   secret: Any = None) -> int:
        """Sessions ended: drop their KV and release their stateful instances. The scheduler
        batches the sessions that end together (``sessions``): one RPC per worker, not one per
        session, when thousands end at once. Returns the instances released."""
        await self._from_scheduler("agents_end_session", secret)
        ended = ([session] if session is not None else []) + list(sessions or ())
        n = 0
        for sid in ended:
            if self.engines is not None:
                self.engines.end_session(sid)  # drop its KV at once (engines apply it between steps)
            n += self.instances.end_session(sid)
        return n

    async def _kv_handler(self, model: str, directive: str, session: str, args: dict | None = None,
                          secret: Any = None) -> dict:
        """A KV directive from the controller (``Engines.kv_directive``); errors go back to it.
        (``directive``, not ``op``: Dask's RPC message carries its own ``op``.)"""
        import asyncio

        await self._from_scheduler("agents_kv", secret)
        if not isinstance(args, (dict, type(None))):
            from dask_agents.kv.runtime.engine_kv import KVDirectiveError

            raise KVDirectiveError(f"KV directive arguments must be a dict, got {args!r}")
        return await asyncio.to_thread(self.engines.kv_directive, model, directive, session, **(args or {}))

    def _kv_hint(self, session: str | None = None, state: str | None = None, node: str | None = None,
                 wait_key: str | None = None, at: float | None = None, **kw: Any) -> None:
        """A session's workflow state from the scheduler, for the engines' KV managers."""
        if self.engines is None or not session:
            return
        try:
            self.engines.kv_hint(session, state, node, wait_key, at)
        except Exception as e:  # a hint only informs a policy: never break the stream
            logger.debug("dask-agents: KV hint for %s ignored: %s", session, e)

    def _routes(self, routes: dict | None = None, **kw: Any) -> None:
        """The control plane's routes (component -> workers): a routed component's calls made
        here take the fast path only if this worker is one of its workers."""
        if self.local is None or not isinstance(routes, dict):
            return
        self.local.routes = {c: tuple(w) for c, w in routes.items() if isinstance(c, str) and isinstance(w, (list, tuple))}

    def _lease(self, leases: dict | None = None, **kw: Any) -> None:
        """The scheduler's admission lease (model -> sessions admitted to this worker's engine
        of it while nothing of the model is short): their LLM calls made here may take the
        fast path. A model left out has no lease."""
        if self.local is None or not isinstance(leases, dict):
            return
        self.local.set_leases({m: frozenset(x for x in v if isinstance(x, str))
                               for m, v in leases.items() if isinstance(m, str) and isinstance(v, (list, tuple))})

    def _reprioritize(self, priorities: dict | None = None, **kw: Any) -> None:
        try:
            dask_compat.reprioritize(self.worker, priorities if isinstance(priorities, dict) else {})
        except TypeError as e:  # a malformed message changes nothing and never closes the stream
            logger.warning("dask-agents: priorities ignored: %s", e)

    async def _swap_handler(self, remove: str | None = None, add: str | None = None, secret: Any = None) -> list[str]:
        import asyncio

        await self._from_scheduler("agents_swap_model", secret)
        return await asyncio.to_thread(self.engines.swap, remove, add, 600)

    def _info_handler(self) -> dict:
        return {
            "models": self.engines.announced() if self.engines else [],  # not the engines given up
            "loaded": self.engines.loaded_models() if self.engines else [],
            "stateful_instances": self.instances.stateful_count(),
        }


def engine_report(host: Any) -> dict:
    """What the scheduler shows of one engine (dashboard, ``/metrics``): never invented numbers.

    ``engine`` (``vllm``/``emulated``), ``emulated``, ``steps``; with the emulated engine's
    counters also ``running``, ``waiting``, ``evictions``, ``hit_tokens``/``query_tokens``
    and ``kv_bytes``/``kv_capacity_bytes`` per tier (``device`` only). An engine with a
    ``kv_report()`` (per-session KV tiers) adds ``kv_bytes``/``kv_capacity_bytes`` for its
    tiers, ``kv_traffic_bytes`` (cumulative bytes ``offloaded``/``spilled``/``restored``),
    ``kv_policy`` and ``kv_actions`` (cumulative count of the KV policy's directives by kind).
    Always ``kv_control`` (whether per-session KV directives work on this engine) and
    ``kv_control_reason`` (why not, e.g. vLLM or a KV layout ``kv/runtime/vllm_compat.py`` rejects;
    None when they work)."""
    settings = host.settings
    out: dict[str, Any] = {"engine": settings.engine, "emulated": settings.engine == "emulated",
                           "steps": int(host.steps), "kv_control": bool(host.kv_control),
                           "kv_control_reason": host.kv_control_reason}
    st = host.stats()
    if st:
        out.update(running=st.get("running"), waiting=st.get("waiting"), evictions=st.get("evictions"),
                   hit_tokens=st.get("hits"), query_tokens=st.get("queries"))
        # batch slots and KV blocks: what the scheduler's admission binds calls against
        # capacity; used (holding KV); pinned (referenced: running requests or retained);
        # retained (by KV directives); free (allocatable); cached (free, holding KV: evictable)
        blocks = {k: int(st[f"{k}_blocks"]) for k in ("capacity", "used", "pinned", "retained", "free", "cached")
                  if st.get(f"{k}_blocks") is not None}
        if blocks:
            out["kv_blocks"] = blocks
        params = getattr(host, "params", None)  # the emulated engine's
        for k in ("max_batch", "block_size"):
            v = st.get(k, getattr(params, k, None))
            if v is not None:
                out[k] = int(v)
        geometry = host.geometry
        if geometry is not None and st.get("used_blocks") is not None:
            out["kv_bytes"] = {"device": int(st["used_blocks"]) * geometry.bytes_per_block}
            out["kv_capacity_bytes"] = {"device": int(st["capacity_blocks"]) * geometry.bytes_per_block}
    kv = host.kv_report()
    if kv:
        for k in ("kv_bytes", "kv_capacity_bytes", "kv_traffic_bytes"):
            if kv.get(k):
                out[k] = {**out.get(k, {}), **kv[k]}
        if kv.get("kv_policy") is not None:
            out["kv_policy"] = kv["kv_policy"]
            out["kv_actions"] = dict(kv.get("kv_actions") or {})
    return out
