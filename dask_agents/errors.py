"""Errors raised by dask-agents. Each names the component, method and session it concerns."""

from __future__ import annotations


def where(component: str, method: str | None, session: str | None) -> str:
    """Format ``Component.method (session S)`` for error messages."""
    target = f"{component}.{method}" if method else component
    return f"{target} (session {session})" if session else target


class AgentsError(Exception):
    """Base class of dask-agents errors."""


class HintError(AgentsError, ValueError):
    """A component was declared with unknown hint keys or hint values of the wrong type."""


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
