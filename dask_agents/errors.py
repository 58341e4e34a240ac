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


class NotInstalledError(AgentsError, RuntimeError):
    """The dask-agents plugins are missing where a call needs them."""


class CallTimeoutError(AgentsError, TimeoutError):
    """``AgentFuture.value(timeout=...)`` ran out of time."""


class CallFailedError(AgentsError, RuntimeError):
    """A component raised. The message names the call; ``original`` holds the exception when it pickles."""

    def __init__(self, message: str, original: BaseException | None = None):
        super().__init__(message)
        self.original = original

    def __reduce__(self):
        return (type(self), (self.args[0], self.original))


class EngineStoppedError(AgentsError, RuntimeError):
    """An LLM engine stopped while a call waited on it. ``crashed``: it died (a failing step, its
    thread ended) rather than being closed on purpose; a crashed engine is restarted by the
    worker plugin and the call is retried there up to ``agents.llm.engine-restarts`` times."""

    def __init__(self, message: str, crashed: bool = False):
        super().__init__(message)
        self.crashed = crashed

    def __reduce__(self):
        return (type(self), (self.args[0], self.crashed))


class InstanceLostError(CallFailedError):
    """A stateful call's instance was lost with its worker (the worker died or left).

    The call did not complete and will not be re-run on a fresh instance (the session's
    state is gone, so a silent re-run could give a different answer). The message names the
    session, component, method, worker and cause; a later call of the same session and
    component starts a fresh instance on another worker."""

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
