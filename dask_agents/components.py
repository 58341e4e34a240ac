"""Component declarations: ``@agent`` classes and ``@tool`` functions stay plain Python.

The decorators validate hints and attach a :class:`ComponentSpec`; the class or function is
returned unchanged, so it still runs and tests locally. Remote calls go through stubs.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, TypeVar

from dask_agents.errors import NotAComponentError
from dask_agents.hints import ComponentHints, ToolHints, validate_hints

T = TypeVar("T")
Kind = Literal["agent", "tool", "llm"]
SPEC_ATTR = "__dask_agents__"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]{0,199}")  # fullmatch: no trailing newline


@dataclass(frozen=True)
class ComponentSpec:
    """What the runtime needs to know about a component."""

    name: str
    kind: Kind
    target: Any  # the class (agents) or function (tools)
    hints: ComponentHints
    methods: tuple[str, ...] = field(default=())

    @property
    def is_class(self) -> bool:
        """True for class components (instances are hosted on workers)."""
        return inspect.isclass(self.target)


def _public_methods(cls: type) -> tuple[str, ...]:
    return tuple(
        n for n, v in inspect.getmembers(cls, callable) if not n.startswith("_")
    )


def _check_name(name: str, what: Any) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise NotAComponentError(
            f"component name {name!r} for {what!r} must be an identifier (letters, digits, _ and .)"
        )
    return name


def _declare(target: Any, kind: Kind, name: str | None, hints: dict) -> ComponentSpec:
    if not callable(target):
        raise NotAComponentError(
            f"{target!r} is not a class or a function and cannot be a dask-agents {kind}"
        )
    cname = _check_name(name or getattr(target, "__name__", ""), target)
    hint_cls = ToolHints if kind == "tool" else ComponentHints
    spec = ComponentSpec(
        name=cname,
        kind=kind,
        target=target,
        hints=validate_hints(hint_cls, cname, hints),
        methods=_public_methods(target) if inspect.isclass(target) else (),
    )
    return spec  # functions declared as agents behave as stateless single-call components


def agent(cls: T | None = None, *, name: str | None = None, **hints: Any) -> Any:
    """Declare an agent (usually a class). ``@agent`` or ``@agent(model="coder", stateful=True)``."""

    def wrap(target: T) -> T:
        setattr(target, SPEC_ATTR, _declare(target, "agent", name, hints))
        return target

    return wrap(cls) if cls is not None else wrap


def tool(fn: T | None = None, *, name: str | None = None, **hints: Any) -> Any:
    """Declare a tool (a function or a class). ``@tool(kind="code_exec")``."""

    def wrap(target: T) -> T:
        setattr(target, SPEC_ATTR, _declare(target, "tool", name, hints))
        return target

    return wrap(fn) if fn is not None else wrap


def spec_of(target: Any) -> ComponentSpec:
    """The spec of a declared component; an undecorated class/function gets default agent hints."""
    spec = getattr(target, SPEC_ATTR, None)
    # getattr on a subclass of a decorated class returns the parent's spec: only trust our own.
    if isinstance(spec, ComponentSpec) and spec.target is target:
        return spec
    return _declare(target, "agent", None, {})


def make_spec(target: Callable, kind: Kind, name: str, hints: ComponentHints) -> ComponentSpec:
    """Build a spec directly (used for LLM endpoints)."""
    return ComponentSpec(name=_check_name(name, target), kind=kind, target=target, hints=hints)
