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
from dask_agents.errors import NoClientError, where
from dask_agents.futures import AgentFuture, check_client_open, closed_client_error
from dask_agents.annotation import ANNOTATION, MAX_LABEL, sanitize_annotation  # noqa: F401  (also this module's)
from dask_agents.models import CallMeta

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
    """A worker's own client with the client -> scheduler batching window ``da.install`` set
    (Dask builds it with its default 10 ms: every nested call's update-graph waited for it).
    Once per client; the driver's client was tuned by ``da.install`` itself."""
    if getattr(client, "_agents_keeps_interval", False):
        return client
    from distributed import get_worker

    from dask_agents.scheduler_plugin import dask_compat

    try:
        plugin = get_worker().plugins.get("dask-agents")
    except ValueError:  # not on a worker: a client the user made, left as it is
        return client
    if plugin is not None:
        interval = getattr(plugin, "client_interval", None)
        dask_compat.set_client_stream_interval(
            client, interval if interval is not None else agents_config.seconds("client.batched-send-interval"))
    return client


def _dependencies(args: tuple, kwargs: dict) -> list[str]:
    deps: list[str] = []

    def scan(x: Any) -> None:
        if isinstance(x, Future):
            deps.append(x.key)
        elif type(x) in (list, tuple, set, frozenset):
            for y in x:
                scan(y)
        elif type(x) is dict:
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
    key = new_key(spec.name)
    creator = context.creator()
    deps = _dependencies(args, kwargs)
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
    header = (spec.name, method, sid, key, hints.stateful, ann.get("batching"))
    with dask.annotate(**{ANNOTATION: ann}):
        try:
            fut = client.submit(
                runner, header, target, args, kwargs, key=key, pure=False,
                resources=dict(hints.resources) or None,
            )
        except Exception as e:
            closed = closed_client_error(e, client, spec.name, method, sid)
            if closed is not None:
                raise closed from None
            bad = _unserializable(args, kwargs)
            if bad is None:
                raise
            raise TypeError(
                f"{where(spec.name, method, sid)}: argument {bad} cannot be sent to the cluster "
                f"(it does not pickle: {e})"
            ) from e
    return AgentFuture.adopt(fut, meta)


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
