"""The client side of a call: build its metadata and key, tag it, submit it, return an AgentFuture."""

from __future__ import annotations

import time
import uuid
from typing import Any

import dask
from distributed import Client, Future

from dask_agents import config as agents_config
from dask_agents import context
from dask_agents.components import ComponentSpec
from dask_agents.errors import NoClientError, escape_error_in, where
from dask_agents.futures import AgentFuture, check_client_open, closed_client_error, waiting_elsewhere
from dask_agents.annotation import ANNOTATION, MAX_LABEL, sanitize_annotation  # noqa: F401  (also this module's)
from dask_agents.models import DRIVER, CallMeta

def new_key(component: str) -> str:
    """A unique Dask key that starts with the component name (per-component Dask statistics)."""
    return f"{component}-{uuid.uuid4().hex}"


def find_client(spec: ComponentSpec, method: str | None) -> Client:
    """The client of the active session, else Dask's current/default client (inside a component:
    the worker's own client, batching with the window ``da.install`` set)."""
    s = context.current_session.get()
    if s is not None and s.client is not None:
        return s.client
    try:
        from distributed import get_client

        return _with_install_window(get_client())
    except ValueError:
        raise NoClientError(
            f"{where(spec.name, method, context.session_id())} was called with no Dask client: "
            "create a distributed.Client first, or call it inside `with da.session(client):`"
        ) from None


def _with_install_window(client: Client) -> Client:
    """A client used inside a component, made ready for nested calls, once per client: the
    client -> scheduler batching window ``da.install`` set (Dask builds a worker's own client
    with its default 10 ms: every nested call's update-graph waited for it; the driver's client
    was tuned by ``da.install`` itself), and the fast path's hooks (``worker_plugin/local.py``:
    a graph or ``fire_and_forget`` from a component sends the calls it deferred first)."""
    if getattr(client, "_agents_on_worker", False):
        return client
    from distributed import get_worker

    from dask_agents.scheduler_plugin import dask_compat
    from dask_agents.worker_plugin import dask_compat as worker_compat

    try:
        plugin = get_worker().plugins.get("dask-agents")
    except ValueError:  # not on a worker: a client the user made, left as it is
        return client
    if plugin is not None:
        if not getattr(client, "_agents_keeps_interval", False):
            interval = getattr(plugin, "client_interval", None)
            dask_compat.set_client_stream_interval(
                client, interval if interval is not None else agents_config.seconds("client.batched-send-interval"))

        def escape_keys(keys: list, plugin: Any = plugin) -> None:
            if getattr(plugin, "local", None) is not None:
                plugin.local.escape_keys(keys)

        worker_compat.before_graph_submission(client, waiting_elsewhere, escape_keys)
        client._agents_on_worker = True
    return client


def _future_args(args: tuple, kwargs: dict) -> list[Future]:
    """The futures among the arguments, in the containers Dask looks into for them
    (``dask._task_spec.parse_input``: dicts' values, lists, sets and tuples)."""
    deps: list[Future] = []

    def scan(x: Any) -> None:
        if isinstance(x, Future):
            deps.append(x)
        elif isinstance(x, (list, set, tuple)):
            for y in x:
                scan(y)
        elif isinstance(x, dict):
            for y in x.values():
                scan(y)

    scan(args)
    scan(kwargs)
    return deps


def submit_call(
    spec: ComponentSpec,
    method: str | None,
    runner: Any,
    target: Any,
    args: tuple,
    kwargs: dict,
    extra: dict | None = None,
) -> AgentFuture:
    """Submit ``runner(header, target, args, kwargs)`` as one call of ``spec``; return its future.

    ``header`` is the metadata the worker runtime needs (component, method, session, key).
    Futures anywhere in ``args``/``kwargs`` become Dask dependencies of the call. The user's
    arguments travel as one tuple and one dict so that none of them collides with
    ``client.submit``'s own keywords (``key``, ``priority``, ``resources``...).
    """
    client = find_client(spec, method)
    s = context.current_session.get()
    sid = s.id if s is not None else None
    check_client_open(client, spec.name, method, sid)
    if sid is None and spec.hints.stateful:
        from dask_agents.errors import NoSessionError

        raise NoSessionError(
            f"{where(spec.name, method, None)}: {spec.name} is stateful (its state lives in a session, one "
            "instance per session): call it inside `with da.session(client):`")
    key = new_key(spec.name)
    creator = context.creator()
    depth = context.current_depth.get() + 1
    if depth > _max_depth():
        from dask_agents.errors import CallDepthError

        raise CallDepthError(
            f"{where(spec.name, method, sid)}: this call would be nested {depth} deep, past "
            f"agents.client.max-call-depth ({_max_depth()}): a component calling itself without end? "
            f"(made by call {creator})")
    futures = _future_args(args, kwargs)
    deps = [f.key for f in futures]
    # Trusted values built right here: skip pydantic validation on the hot path (~10 us a call).
    meta = CallMeta.model_construct(
        call_id=key, component=spec.name, method=method, kind=spec.kind, session=sid,
        creator=creator, dependencies=deps, consumers=[], executor=None, state="pending",
        created=time.time(), ready=None, started=None, finished=None,
    )
    hints = spec.hints
    ann = {
        "call": key, "component": spec.name, "method": method, "kind": spec.kind,
        "session": sid, "tenant": s.tenant if s is not None else None, "creator": creator,
        "deps": deps, "created": meta.created, "stateful": hints.stateful,
        "model": hints.model, "tool_kind": getattr(hints, "kind", None),
    }
    if extra:
        ann.update(extra)
    if hints.batching is not None:
        ann["batching"] = {"max_batch": hints.batching.max_batch, "max_wait": hints.batching.max_wait}
    if hints.timeout is not None:
        ann["timeout"] = hints.timeout
    if hints.max_replicas is not None:  # a bounded component: the reallocate policy routes it
        ann["min_replicas"], ann["max_replicas"] = hints.min_replicas, hints.max_replicas
    if s is not None:  # which scheduler the session lives on: see scheduler_plugin.sessions
        if s.opened_on is None and client.status == "running":  # (not while reconnecting: unknown)
            s.opened_on = _scheduler_id(client)
        if s.opened_on is not None:
            ann["opened_on"] = s.opened_on
    header = (spec.name, method, sid, key, hints.stateful, ann.get("batching"), depth)
    resources = dict(hints.resources) or None
    local = _local_calls(client, spec, creator, ann) if creator != DRIVER else None
    if local is not None:
        deps_here = [c for f in futures if (c := f.__dict__.get("_agents_local")) is not None]
        if len(deps_here) == len(deps) and all(d.state == "finished" for d in deps_here):
            from dask_agents.runtime import run_llm_here

            here = run_llm_here if spec.kind == "llm" else runner  # (the engine, in this thread)
            return _defer(local, client, runner, header, target, args, kwargs, ann, meta, here)
        for d in deps_here:  # the scheduler must know them before this call depends on them
            local.escape(d)
    if creator == DRIVER:
        fut = _direct(client, spec, header, runner, target, args, kwargs, ann, meta, deps, sid)
        if fut is not None:
            return fut
    fut = AgentFuture.adopt(_submit(client, runner, header, target, args, kwargs, ann, resources), meta)
    if creator == DRIVER:  # which scheduler it went to: a restart loses it (AgentFuture._reattach)
        fut.__dict__["_agents_scheduler"] = _scheduler_id(client)
    return fut


def _scheduler_id(client: Client) -> str | None:
    from dask_agents.worker_plugin import dask_compat as worker_compat

    return worker_compat.scheduler_id(client)


def _max_depth() -> int:
    return int(dask.config.get("agents.client.max-call-depth", 64))


def _submit(client: Client, runner: Any, header: tuple, target: Any, args: tuple, kwargs: dict, ann: dict,
            resources: dict | None, deferred: bool = False) -> Future:
    """The scheduler path: ``client.submit`` under the call's annotation (``deferred``: a
    fast-path call's, whose future exists already)."""
    component, method, sid, key = header[:4]
    with dask.annotate(**{ANNOTATION: ann}):
        try:
            if deferred:
                from dask_agents.worker_plugin import dask_compat as worker_compat

                return worker_compat.submit_key(client, runner, header, target, args, kwargs, key=key)
            return client.submit(runner, header, target, args, kwargs, key=key, pure=False, resources=resources)
        except Exception as e:
            closed = closed_client_error(e, client, component, method, sid)
            if closed is not None:
                raise closed from None
            escaped = escape_error_in(e)
            if escaped is not None:  # (Dask's serializers wrap it in a TypeError of their own)
                raise escaped from None
            bad = _unserializable(args, kwargs)
            if bad is None:
                raise
            raise TypeError(
                f"{where(component, method, sid)}: argument {bad} cannot be sent to the cluster "
                f"(it does not pickle: {e})"
            ) from e


def _local_calls(client: Client, spec: ComponentSpec, creator: str, ann: dict) -> Any:
    """This worker's fast path (``worker_plugin/local.py``) if a call of ``spec`` made here by
    call ``creator``, through ``client``, may take it; else None (the scheduler path). An LLM
    call needs the scheduler's lease on its session for an engine of its model here."""
    hints = spec.hints
    if hints.stateful or hints.batching is not None or hints.resources or client.asynchronous:
        return None
    from distributed import get_worker

    try:
        worker = get_worker()
    except ValueError:
        return None
    plugin = worker.plugins.get("dask-agents")
    local = getattr(plugin, "local", None)
    if (local is None or not plugin.scheduler_ok or client.loop is not worker.loop
            or local.routed_away(spec.name)):
        return None  # (a client of its own, in another loop: its futures are not this worker's)
    if hints.model is not None and (plugin.engines is None or hints.model not in plugin.engines.hosted):
        return None  # an agent placed beside its engine: elsewhere
    if spec.kind == "llm":
        if ann.get("stream"):  # its deltas go out through the scheduler to its client's topic
            return None
        model = ann.get("llm_model")
        if (not local.leased(model, ann.get("session")) or plugin.engines is None
                or not plugin.engines.is_loaded(model)):
            return None
    from dask_agents.worker_plugin import dask_compat as worker_compat

    def running(key: str) -> bool:
        return worker_compat.task_running(worker, key)

    if not (running(creator) or local.runs_here(creator, running)):
        # its caller (or the task that made it, for a call that runs here itself) was cancelled
        # (its session ended with cancel=True) or released, and its thread runs on: the
        # scheduler path, which knows why, decides (here it would run unseen)
        return None
    return local


def _defer(local: Any, client: Client, runner: Any, header: tuple, target: Any, args: tuple, kwargs: dict,
           ann: dict, meta: CallMeta, here: Any) -> AgentFuture:
    """A future for a call that runs in its caller's thread when the caller waits for it
    (``worker_plugin/local.py``; ``here`` runs it there, ``runner`` on the scheduler path);
    creating it sends nothing."""
    from dask_agents.runtime import reraise
    from dask_agents.worker_plugin.local import LocalCall, substitute

    key = header[3]

    def run() -> Any:
        return here(header, target, substitute(args), substitute(kwargs))

    def submit() -> Future:
        return _submit(client, runner, header, target, args, kwargs, ann, None, deferred=True)

    def submit_error() -> Future:
        from dask_agents.worker_plugin import dask_compat as worker_compat

        return worker_compat.submit_key(client, reraise, call.error, key=key)

    call = LocalCall(key=key, creator=meta.creator, ann=ann, run=run, submit=submit, submit_error=submit_error,
                     client=client, controller=local)
    fut = AgentFuture.adopt(Future(key, client), meta)
    fut._agents_local = call
    local.defer(call)
    return fut


def _direct(client: Client, spec: ComponentSpec, header: tuple, runner: Any, target: Any, args: tuple,
            kwargs: dict, ann: dict, meta: CallMeta, deps: list, sid: str | None) -> AgentFuture | None:
    """A driver's call sent straight to the worker its session is routed to
    (``dask_agents/direct.py``), or None: the scheduler path."""
    from dask_agents import direct

    routes = direct.routes_of(client)
    if routes is None or not direct.eligible(client, spec, ann, deps, sid) or _on_a_worker():
        return None
    where = routes.target(sid, spec.name, spec.hints.model) or routes.unrouted(sid, spec.name, spec.hints.model)
    if where is None:
        return None

    def resubmit(lost: bool) -> None:  # refused, or its worker lost: the scheduler path, same key
        _submit(client, runner, header, target, args, kwargs, ann, None, deferred=True)

    def pin() -> None:  # answered: its key gets the call as its task (recomputed if its worker is lost)
        _submit(client, runner, header, target, args, kwargs, {**ann, "call": None}, None, deferred=True)

    payload = direct.pack(runner, target, header, args, kwargs)
    if payload is None:  # something in it does not pickle: the scheduler path names it
        return None
    fut = AgentFuture.adopt(Future(header[3], client), meta)  # before the answer can come
    fut.__dict__["_agents_direct"] = direct.send(client, routes, where, header, payload, ann, resubmit, pin)
    fut.__dict__["_agents_scheduler"] = _scheduler_id(client)
    return fut


def _on_a_worker() -> bool:
    from distributed import get_worker

    try:
        get_worker()
    except ValueError:
        return False
    return True


def _unserializable(args: tuple, kwargs: dict) -> str | None:
    """Name (``#0``, ``'name'``) and type of the first argument that does not pickle, else None."""
    from distributed.protocol.pickle import dumps

    named = [(f"#{i}", a) for i, a in enumerate(args)] + [(repr(k), v) for k, v in kwargs.items()]
    for name, value in named:
        if isinstance(value, Future):
            continue
        try:
            dumps(value)
        except Exception:
            return f"{name} ({type(value).__name__})"
    return None
