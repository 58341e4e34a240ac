"""Stubs: call a component like local Python, get an :class:`AgentFuture` back at once.

``da.stub(Developer).implement(task)`` submits ``Developer.implement(task)`` to the cluster.
``dask-agents stubgen`` writes the same thing as an importable module (see ``stubgen.py``).
"""

from __future__ import annotations

import functools
from typing import Any

from dask_agents import runtime
from dask_agents.calls import submit_call
from dask_agents.components import ComponentSpec, spec_of
from dask_agents.errors import NotAComponentError
from dask_agents.futures import AgentFuture


class Stub:
    """A proxy for a class component: each public method returns an AgentFuture."""

    __slots__ = ("_spec", "__dict__")

    def __init__(self, spec: ComponentSpec):
        self._spec = spec

    def _call(self, method: str, /, *args: Any, **kwargs: Any) -> AgentFuture:
        """Submit ``method(*args, **kwargs)`` on the component's instance."""
        if method not in self._spec.methods:
            raise AttributeError(
                f"component {self._spec.name!r} has no public method {method!r} "
                f"(methods: {', '.join(self._spec.methods) or 'none'})"
            )
        return submit_call(self._spec, method, runtime.run_method, self._spec.target, args, kwargs)

    def __getattr__(self, method: str):
        if method.startswith("_"):
            raise AttributeError(method)
        if method not in self._spec.methods:
            raise AttributeError(
                f"component {self._spec.name!r} has no public method {method!r} "
                f"(methods: {', '.join(self._spec.methods) or 'none'})"
            )
        call = functools.partial(self._call, method)
        functools.update_wrapper(call, getattr(self._spec.target, method))
        self.__dict__[method] = call  # cache: the next lookup skips __getattr__
        return call

    def __repr__(self) -> str:
        return f"<Stub {self._spec.kind} {self._spec.name}>"


class FunctionStub:
    """A proxy for a function component (a tool): calling it returns an AgentFuture."""


    def __init__(self, spec: ComponentSpec):
        self._spec = spec
        self.__wrapped__ = spec.target
        self.__doc__ = spec.target.__doc__
        self.__name__ = spec.name

    def __call__(self, /, *args: Any, **kwargs: Any) -> AgentFuture:
        return submit_call(self._spec, None, runtime.run_function, self._spec.target, args, kwargs)

    def __repr__(self) -> str:
        return f"<Stub {self._spec.kind} {self._spec.name}>"


def stub(component: Any) -> Stub | FunctionStub:
    """A stub for a component class or function (declared with ``@agent``/``@tool`` or plain)."""
    if isinstance(component, (Stub, FunctionStub)):
        return component
    if not callable(component):
        raise NotAComponentError(
            f"da.stub() needs a class or a function, got {type(component).__name__} {component!r}"
        )
    spec = spec_of(component)
    return Stub(spec) if spec.is_class else FunctionStub(spec)
