"""What runs inside a Dask task for each call (the worker side of a stub call).

Sets the session/creator context so nested calls inherit them, finds the component instance
through the worker plugin, and turns a component's exception into a CallFailedError that
names the component, method and session.
"""

from __future__ import annotations

import pickle
from contextlib import contextmanager
from typing import Any, Iterator

import dask

from dask_agents import context
from dask_agents.calls import ANNOTATION
from dask_agents.errors import CallFailedError, where

Header = tuple  # (component, method, session, key, stateful, batching or None)


@contextmanager
def call_context(header: Header) -> Iterator[None]:
    """Make ``header``'s session and call current for the code that runs inside."""
    sid, key = header[2], header[3]
    tok_s = context.current_session.set(context.SessionContext(sid) if sid else None)
    tok_c = context.current_call.set(key)
    try:
        with dask.annotate(**{ANNOTATION: {"session": sid, "creator": key}}):
            yield
    finally:
        context.current_call.reset(tok_c)
        context.current_session.reset(tok_s)


def _fail(header: Header, exc: Exception) -> CallFailedError:
    component, method, sid, key = header[:4]
    try:
        pickle.dumps(exc)
        original: BaseException | None = exc
    except Exception:
        original = None
    return CallFailedError(
        f"{where(component, method, sid)} raised {type(exc).__name__}: {exc} (call {key})", original
    )


def _plugin():
    from worker_plugin.plugin import get_plugin

    return get_plugin()


def run_method(header: Header, cls: type, args: tuple, kwargs: dict) -> Any:
    """Run ``cls.<method>(*args, **kwargs)`` on the instance the worker plugin hosts."""
    component, method, sid, key, stateful, batching = header
    plugin = _plugin()
    with call_context(header):
        if stateful:
            with plugin.instances.turn(component, sid, key, cls) as instance:
                return _invoke(header, getattr(instance, method), args, kwargs)
        instance = plugin.instances.shared(component, cls)
        if batching:
            return _batched(plugin, header, getattr(instance, method),
                            getattr(instance, f"{method}_batch", None), args, kwargs)
        return _invoke(header, getattr(instance, method), args, kwargs)


def run_function(header: Header, fn: Any, args: tuple, kwargs: dict) -> Any:
    """Run a function component."""
    plugin = _plugin()
    with call_context(header):
        if header[5]:
            return _batched(plugin, header, fn, getattr(fn, "__dask_agents_batch__", None), args, kwargs)
        return _invoke(header, fn, args, kwargs)


def _batched(plugin: Any, header: Header, fn: Any, batch_fn: Any, args: tuple, kwargs: dict) -> Any:
    """Run the call coalesced with others of its component on this worker."""
    component, method, batching = header[0], header[1], header[5]
    try:
        return plugin.batcher.run(
            (component, method), batching["max_batch"], batching["max_wait"],
            lambda a, k: fn(*a, **k), batch_fn, args, kwargs,
        )
    except Exception as e:
        raise _fail(header, e) from e


def _invoke(header: Header, fn: Any, args: tuple, kwargs: dict) -> Any:
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        raise _fail(header, e) from e


async def run_llm(header: Header, model: str, args: tuple, kwargs: dict) -> Any:
    """Generate with the engine this worker hosts for ``model``.

    A coroutine: Dask runs it on the worker's event loop, where it leaves the worker's slots
    and awaits the engine (no thread per waiting call; the engine batches them all). An LLM
    call submits nothing itself, so it needs no session context, only the worker plugin."""
    import asyncio

    from dask_agents.errors import NotInstalledError
    from worker_plugin.plugin import get_plugin

    plugin = get_plugin(wait=False)
    if not plugin.ready.is_set() and not await asyncio.to_thread(plugin.ready.wait, 60):
        raise NotInstalledError("the dask-agents worker plugin did not become ready")
    return await plugin.engines.agenerate(header, model, *args, **kwargs)
