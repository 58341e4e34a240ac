"""Errors raised by dask-agents. Each names the component, method and session it concerns."""

from __future__ import annotations

SHORT_REPR_LIMIT = 80
"""Characters of a value's ``repr`` that error messages show (see :func:`short_repr`)."""


def short_repr(value: object, limit: int = SHORT_REPR_LIMIT) -> str:
    """``repr(value)`` cut to ``limit`` characters (ending in ``...`` when cut).

    Error messages quote the bad value with this, so they stay readable for huge inputs; a
    broken ``__repr__`` shows as ``<TypeName>`` instead of hiding the real problem."""
    try:
        text = repr(value)
    except Exception:
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: max(0, limit - 3)] + "..."


def where(component: str, method: str | None, session: str | None) -> str:
    """Format ``Component.method (session S)`` for error messages."""
    target = f"{component}.{method}" if method else component
    return f"{target} (session {session})" if session else target


class AgentsError(Exception):
    """Base class of dask-agents errors."""


class HintError(AgentsError, ValueError):
    """A component was declared with unknown hint keys or hint values of the wrong type."""


class ConfigError(AgentsError, ValueError):
    """An ``agents.*`` configuration value is invalid; the message names the key and the value."""


class NotAComponentError(AgentsError, TypeError):
    """Something that is not a class or a callable was used as a component."""


class NoClientError(AgentsError, RuntimeError):
    """A stub was called with no Dask client in reach."""


class UnknownModelError(AgentsError, LookupError):
    """An LLM call named a model that no worker hosts and the registry does not know."""


class PromptTooLongError(AgentsError, ValueError):
    """A prompt (plus the requested output) does not fit in the model's context."""


class NoSessionError(AgentsError, RuntimeError):
    """A stateful component was called outside a session: its state lives in one (one instance
    per session), so there is nothing to keep it in."""


class NotInstalledError(AgentsError, RuntimeError):
    """The dask-agents plugins are missing where a call needs them."""


class CallTimeoutError(AgentsError, TimeoutError):
    """``AgentFuture.value(timeout=...)`` ran out of time, or the call itself did: it was still
    open its ``timeout`` hint (or ``agents.scheduler.call-timeout``) after being sent to a
    worker, and was failed. The message names the call, its session and the timeout."""


class CallEscapeError(AgentsError, RuntimeError):
    """The future of a call still running (on a worker's fast path, or sent straight to a
    worker by its driver) was sent (pickled inside an object, or in a result) from where waiting
    for the call to end could never end: the thread that runs it, or an event loop the call's
    end must pass through. The message names the call and says how to pass it instead."""


def escape_error(component: str, method: str | None, session: str | None, key: str, place: str) -> CallEscapeError:
    """The :class:`CallEscapeError` for call ``key`` whose future was sent from ``place``."""
    return CallEscapeError(
        f"the future of {where(component, method, session)} (key {key}) was sent while the call runs, from {place}, "
        "where waiting for it would never end: wait for it first, or pass the future itself as an argument (not "
        "inside an object) so Dask sees it")


def escape_error_in(e: BaseException | None) -> CallEscapeError | None:
    """The :class:`CallEscapeError` behind ``e`` (itself, its causes and contexts), if any:
    Dask's serializers wrap what a ``__reduce__`` raised in errors of their own."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, CallEscapeError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


class CallFailedError(AgentsError, RuntimeError):
    """A component raised. The message names the call; ``original`` holds the exception when it pickles."""

    def __init__(self, message: str, original: BaseException | None = None):
        super().__init__(message)
        self.original = original

    def __reduce__(self):
        return (type(self), (self.args[0], self.original))

    @property
    def root(self) -> BaseException | None:
        """The exception the failing component itself raised, through nested calls: an agent
        that lets its tool's failure escape fails with a CallFailedError whose ``original`` is
        the tool's, and so on down; ``root`` is the first ``original`` that is not one (None
        where it did not travel)."""
        e = self.original
        while isinstance(e, CallFailedError):
            e = e.original
        return e


class EngineStoppedError(AgentsError, RuntimeError):
    """An LLM engine stopped while a call waited on it. ``crashed``: it died (a failing step, its
    thread ended) rather than being closed on purpose; a crashed engine is restarted by the
    worker plugin and the call is retried there up to ``agents.llm.engine-restarts`` times."""

    def __init__(self, message: str, crashed: bool = False):
        super().__init__(message)
        self.crashed = crashed

    def __reduce__(self):
        return (type(self), (self.args[0], self.crashed))


class EngineLoadError(AgentsError, RuntimeError):
    """An LLM engine failed to load: the message names the model and the cause, and says how
    to install vLLM when it is missing."""


INSTALL_HINT = ("install an engine: on CPU machines `pip install 'dask-agents[cpu]' --extra-index-url "
                "https://download.pytorch.org/whl/cpu` (vLLM's CPU build and torch's CPU wheel), on GPU "
                "machines `pip install 'dask-agents[gpu]'` (the two exclude each other)")


class InstanceLostError(CallFailedError):
    """A stateful call's instance is gone: its worker died, left or was retired, or the
    instance was released when its session completed.

    The call is not run on a fresh instance (the session's state is gone, so a silent run
    could give a different answer), and neither is any later call of the same session and
    component: start a new session. The message names the session, component, method,
    worker and cause."""

    def __init__(self, message: str, original: BaseException | None = None, *, session: str | None = None,
                 component: str | None = None, worker: str | None = None):
        super().__init__(message, original)
        self.session = session
        self.component = component
        self.worker = worker

    def __reduce__(self):
        return (_instance_lost, (self.args[0], self.session, self.component, self.worker))


def _instance_lost(message: str, session: str | None, component: str | None, worker: str | None) -> InstanceLostError:
    return InstanceLostError(message, session=session, component=component, worker=worker)


class SessionClosedError(CallFailedError):
    """A call's session was closed by the scheduler while the call was open: its driver
    disconnected and did not reconnect within ``agents.scheduler.session-grace``, or the
    driver left its ``da.session`` block with an exception. The message names the call,
    session and cause."""

    def __init__(self, message: str, original: BaseException | None = None, *, session: str | None = None):
        super().__init__(message, original)
        self.session = session

    def __reduce__(self):
        return (_session_closed, (self.args[0], self.session))


def _session_closed(message: str, session: str | None) -> SessionClosedError:
    return SessionClosedError(message, session=session)


class InvalidRequestError(AgentsError, ValueError):
    """An LLM call's inputs cannot be served by its model: a token id outside the vocabulary, a
    prompt text that cannot be encoded, a sampling parameter of the wrong type or out of range.
    Checked before the request reaches the engine (where it could crash a step and fail every
    call in flight); the message names the call, its session and the bad value."""


class EngineStepError(EngineStoppedError):
    """An engine step failed in the step that first scheduled this call: the call is the likely
    cause, so it fails (named, with the step's error) instead of being retried on a restarted
    engine, where it would crash it again. The other calls in flight are retried as for any
    crash. ``crashed`` is True (the engine did die), but this error is never retried."""

    def __init__(self, message: str, crashed: bool = True):
        super().__init__(message, crashed)


class ResultNotSerializableError(CallFailedError):
    """A call finished, but its result cannot leave the worker that computed it: it does not
    pickle (a lock, an open file or socket, a generator...). The message names the call
    (component, method, session, key) and the result's type. Return plain data instead, or
    keep such objects inside a stateful component's instance."""


class CallLostError(CallFailedError):
    """The driver's connection dropped while it held this call's future, and the call was
    gone when it asked again: it did not reconnect within ``agents.scheduler.session-grace``
    or the session was closed meanwhile. The message names the call, session and cause."""


class CallDepthError(AgentsError, RecursionError):
    """A call would nest deeper than ``agents.client.max-call-depth`` (a component calling
    itself without end): raised where it is made, naming the call and its creator."""


class LimitError(AgentsError, RuntimeError):
    """A call was refused because a configured limit was reached (the message names the
    setting, the call and its session): e.g. ``agents.scheduler.max-calls-per-session``."""


class NotAllowedError(AgentsError, PermissionError):
    """The scheduler refused a client's request: a cluster-wide change its configuration keeps
    from clients (``agents.control.client-actions``). The message names the setting."""


from distributed.client import ClosedClientError as _DaskClosedClientError  # noqa: E402


class ClientClosedError(NoClientError, _DaskClosedClientError):
    """A stub or LLM call was made with a Dask client that is closing or closed
    (``client.close()``, or the session's client went away). The message names the call.
    Also a ``distributed.client.ClosedClientError``, which Dask raised here before."""
