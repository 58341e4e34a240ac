"""What runs inside a Dask task for each call (the worker side of a stub call).

Sets the session/creator context so nested calls inherit them, finds the component instance
through the worker plugin, and turns a component's exception into a CallFailedError that
names the component, method and session.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, NoReturn

from dask_agents import context
from dask_agents.errors import CallFailedError, where

Header = tuple  # (component, method, session, key, stateful, batching or None, depth)


@contextmanager
def call_context(header: Header) -> Iterator[None]:
    """Make ``header``'s session and call current for the code that runs inside."""
    sid, key = header[2], header[3]
    tok_s = context.current_session.set(context.SessionContext(sid) if sid else None)
    tok_c = context.current_call.set(key)
    tok_d = context.current_depth.set(header[6] if len(header) > 6 else 1)
    try:  # only stub and LLM calls made here carry these (calls.submit_call): plain work is left alone
        yield
    finally:
        context.current_depth.reset(tok_d)
        context.current_call.reset(tok_c)
        context.current_session.reset(tok_s)


MESSAGE_TEXT_LIMIT = 2000
"""Characters of a component's error text that a CallFailedError's message carries. Dask
replaces an exception whose text is longer than ``distributed.admin.max-error-length``
(10,000) by ``type(e)("Long error message", ...)``, which would lose the call's name."""
TRACEBACK_NOTE_LIMIT = 8000
"""Characters of the traceback text noted on a CallFailedError whose original cannot travel."""


def _error_text(exc: BaseException) -> str:
    """``str(exc)`` cut to :data:`MESSAGE_TEXT_LIMIT`; a broken ``__str__`` does not hide the call."""
    try:
        text = str(exc)
    except Exception:
        text = f"<{type(exc).__name__}: str() failed>"
    return text if len(text) <= MESSAGE_TEXT_LIMIT else text[: MESSAGE_TEXT_LIMIT - 3] + "..."


def _chain(exc: BaseException, limit: int = 32) -> list[BaseException]:
    """The causes and contexts below ``exc`` (each once, at most ``limit``)."""
    out: list[BaseException] = []
    todo = [exc.__cause__, exc.__context__]
    while todo and len(out) < limit:
        e = todo.pop()
        if e is not None and all(e is not o for o in out) and e is not exc:
            out.append(e)
            todo += [e.__cause__, e.__context__]
    return out


def _travels(exc: BaseException) -> bool:
    """True if ``exc`` survives the trip Dask gives a task's exception: pickled with its
    traceback, causes and contexts (Dask installs ``tblib``'s pickling for the exception and
    its causes), then unpickled. Only on the error path: the cost is one round trip."""
    from distributed.protocol import pickle as dask_pickle
    from tblib import pickling_support

    try:
        pickling_support.install(exc, *_chain(exc))
        dask_pickle.loads(dask_pickle.dumps(exc))
    except Exception:
        return False
    return True


def _fail(header: Header, exc: BaseException) -> CallFailedError:
    """The CallFailedError for ``exc`` raised by the call ``header``: its message names the
    component, method, session and key. ``original`` (and the cause it is raised from) is
    ``exc`` only when ``exc`` travels (:func:`_travels`): one that does not (an attribute that
    does not pickle, a class that does not unpickle, a cause of its own that does not) made
    Dask send a bare ``Exception(repr(...))`` instead, losing the error's type. Its type and
    traceback then travel as text, in a note."""
    import traceback

    component, method, sid, key = header[:4]
    original = exc if _travels(exc) else None
    err = CallFailedError(
        f"{where(component, method, sid)} raised {type(exc).__name__}: {_error_text(exc)} (call {key})", original
    )
    if original is None:
        try:
            tb = "".join(traceback.format_exception(exc))
        except Exception:
            tb = f"{type(exc).__name__} (its traceback could not be formatted)\n"
        if len(tb) > TRACEBACK_NOTE_LIMIT:
            tb = "...\n" + tb[-TRACEBACK_NOTE_LIMIT:]
        err.add_note(f"{type(exc).__module__}.{type(exc).__qualname__} does not pickle, so only its text "
                     f"reached the caller (original=None):\n{tb}")
    return err


def _raise(err: CallFailedError) -> NoReturn:
    """Raise ``err``, from its original when that travels. Called *after* the ``except``
    block that caught the original: raised inside it, ``err.__context__`` would be the
    original whatever ``from`` says, and Dask pickles the context too."""
    if err.original is not None:
        raise err from err.original
    raise err


def reraise(err: BaseException) -> NoReturn:
    """The task of a fast-path call that erred and then escaped (``worker_plugin/local.py``):
    what depends on it fails with its error, as on the scheduler path."""
    raise err


def _plugin():
    from dask_agents.worker_plugin.plugin import get_plugin

    return get_plugin()


PIN_ANNOTATION = "agents_pin"  # dask_agents.scheduler_plugin.dask_compat.PIN_ANNOTATION


def _check_pinned(plugin: Any, header: Header) -> None:
    """A session's stateful call runs only where the scheduler plugin pinned it (the task's
    pin annotation names this worker): one that reached a worker unpinned (the plugin's
    ``update_graph`` failed for it) could otherwise start a fresh instance here while the
    session's state lives elsewhere, a silently wrong answer. It fails clearly instead."""
    from dask_agents.worker_plugin import dask_compat

    component, method, sid, key = header[:4]
    worker = plugin.worker
    pinned = dask_compat.task_annotations(worker, key).get(PIN_ANNOTATION) if worker is not None else None
    if worker is not None and pinned != worker.address:
        raise CallFailedError(
            f"{where(component, method, sid)}: the scheduler did not pin this stateful call to its session's "
            f"instance ({'pinned to ' + str(pinned) if pinned else 'no pin'}; the scheduler plugin may have failed "
            f"while it was submitted); it was not run here, where its instance may not be (call {key})")


def run_method(header: Header, cls: type, args: tuple, kwargs: dict) -> Any:
    """Run ``cls.<method>(*args, **kwargs)`` on the instance the worker plugin hosts."""
    component, method, sid, key, stateful, batching = header[:6]
    plugin = _plugin()
    with call_context(header):
        if stateful:
            if sid is not None:
                _check_pinned(plugin, header)
            with plugin.instances.turn(component, sid, key, cls, method) as instance:
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
        err = _fail(header, e)
    _raise(err)


def _invoke(header: Header, fn: Any, args: tuple, kwargs: dict) -> Any:
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        err = _fail(header, e)
    _raise(err)


def run_llm_here(header: Header, model: str, args: tuple, kwargs: dict) -> Any:
    """:func:`run_llm` in the calling thread, for an LLM call on the worker's fast path (its
    caller's thread waits for the engine here, as it would wait for the call's future)."""
    from dask_agents.worker_plugin import dask_compat
    from dask_agents.worker_plugin.plugin import get_plugin

    with dask_compat.unprofiled():  # the thread waits for the engine: nothing for Dask's profiler
        return get_plugin(wait=False).engines.generate(header, model, *args, **kwargs)


async def run_llm(header: Header, model: str, args: tuple, kwargs: dict) -> Any:
    """Generate with the engine this worker hosts for ``model``.

    A coroutine: Dask runs it on the worker's event loop, where it leaves the worker's slots
    and awaits the engine (no thread per waiting call; the engine batches them all). An LLM
    call submits nothing itself, so it needs no session context, only the worker plugin."""
    import asyncio

    from dask_agents.errors import NotInstalledError
    from dask_agents.worker_plugin.plugin import get_plugin

    plugin = get_plugin(wait=False)
    if not plugin.ready.is_set() and not await asyncio.to_thread(plugin.ready.wait, 60):
        raise NotInstalledError("the dask-agents worker plugin did not become ready")
    return await plugin.engines.agenerate(header, model, *args, **kwargs)
