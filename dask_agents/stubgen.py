"""``dask-agents stubgen``: write importable stub modules for a file of components.

The generator reads a component source file with :mod:`ast` (it never imports or runs it)
and writes a module with the same names and call syntax, where every call submits to Dask
and returns an :class:`~dask_agents.AgentFuture`::

    # agents.py                                  # stubs/agents.py (generated)
    @da.agent(model="coder")                     class Developer(_da.Stub):
    class Developer:                                 def implement(self, subtask, retries=_DEFAULT)
        def implement(self, subtask,                     -> _da.AgentFuture: ...
                      retries=RETRIES): ...
    @da.tool(kind="code_exec")                   def run_tests(patch, *, timeout=_DEFAULT)
    def run_tests(patch, *, timeout=60): ...         -> _da.AgentFuture: ...

Defaults are replaced by the sentinel ``_DEFAULT`` (so names from the source module are
never evaluated) and an omitted argument is not forwarded: the component's own default
applies on the worker. Annotations are left out of the stub signatures for the same reason;
each stub's docstring quotes the component's full signature instead. The real component is
imported lazily, by its module path, the first time a stub is created or called.
"""

from __future__ import annotations

import ast
import keyword
import os
import tokenize
from dataclasses import dataclass, field

__all__ = ["generate_stub_source", "module_name_for", "write_stubs"]

_DECORATOR_KINDS = ("agent", "tool")
_DEFAULT_MODULE_ALIASES = frozenset({"da", "dask_agents", "dask_agents.components"})
_PROPERTY_DECORATORS = frozenset({"property", "cached_property", "abstractproperty"})
_PROPERTY_ATTRS = frozenset({"setter", "getter", "deleter"})
_RESERVED = frozenset({"_DEFAULT", "_da"})
_RESERVED_PREFIX = "_da_"


# -- parsing ------------------------------------------------------------------------------


@dataclass
class _Param:
    name: str  # as written in the source
    kind: str  # "posonly" | "regular" | "varargs" | "kwonly" | "varkw"
    has_default: bool = False
    annotation: str | None = None  # source text, for the docstring only
    default: str | None = None  # source text, for the docstring only


@dataclass
class _Callable:
    name: str
    params: list[_Param]
    returns: str | None
    doc: str | None
    lineno: int
    static: bool = False
    owner: str | None = None  # the class that defines it (for ``__x`` name mangling)


@dataclass
class _Component:
    kind: str  # "agent" | "tool"
    name: str
    lineno: int
    doc: str | None
    is_class: bool
    methods: list[_Callable] = field(default_factory=list)
    function: _Callable | None = None


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base is not None else None
    return None


class _Aliases:
    """How the source refers to ``dask_agents`` and its ``agent``/``tool`` decorators."""

    def __init__(self, tree: ast.Module):
        self.modules: set[str] = set(_DEFAULT_MODULE_ALIASES)
        self.names: dict[str, str] = {k: k for k in _DECORATOR_KINDS}
        for node in tree.body:
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in ("dask_agents", "dask_agents.components"):
                        self.modules.add(a.asname or a.name)
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                if node.module in ("dask_agents", "dask_agents.components"):
                    for a in node.names:
                        if a.name in _DECORATOR_KINDS:
                            self.names[a.asname or a.name] = a.name

    def kind_of(self, decorator: ast.expr) -> str | None:
        """``"agent"``/``"tool"`` if ``decorator`` declares a component, else None."""
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        dotted = _dotted(target)
        if dotted is None:
            return None
        if "." not in dotted:
            return self.names.get(dotted)
        prefix, _, last = dotted.rpartition(".")
        if last in _DECORATOR_KINDS and prefix in self.modules:
            return last
        return None


def _decorator_names(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    names = []
    for d in node.decorator_list:
        dotted = _dotted(d.func if isinstance(d, ast.Call) else d)
        if dotted is not None:
            names.append(dotted)
    return names


def _params(args: ast.arguments) -> list[_Param]:
    def text(node: ast.expr | None) -> str | None:
        return ast.unparse(node) if node is not None else None

    out: list[_Param] = []
    positional = [(a, "posonly") for a in args.posonlyargs] + [(a, "regular") for a in args.args]
    first_default = len(positional) - len(args.defaults)
    for i, (a, kind) in enumerate(positional):
        d = args.defaults[i - first_default] if i >= first_default else None
        out.append(_Param(a.arg, kind, d is not None, text(a.annotation), text(d)))
    if args.vararg is not None:
        out.append(_Param(args.vararg.arg, "varargs", annotation=text(args.vararg.annotation)))
    for a, d in zip(args.kwonlyargs, args.kw_defaults):
        out.append(_Param(a.arg, "kwonly", d is not None, text(a.annotation), text(d)))
    if args.kwarg is not None:
        out.append(_Param(args.kwarg.arg, "varkw", annotation=text(args.kwarg.annotation)))
    return out


def _callable(node: ast.FunctionDef | ast.AsyncFunctionDef, *, bound: bool, static: bool) -> _Callable:
    params = _params(node.args)
    c = _Callable(
        name=node.name,
        params=params,
        returns=ast.unparse(node.returns) if node.returns is not None else None,
        doc=ast.get_docstring(node),
        lineno=node.lineno,
        static=static,
    )
    if bound and not static and params and params[0].kind in ("posonly", "regular"):
        c.params = params[1:]  # ``self``/``cls``: the stub has its own receiver
    return c


def _class_methods(cls: ast.ClassDef, classes: dict[str, ast.ClassDef], seen_classes: set[str], seen: set[str]) -> list[_Callable]:
    """Public methods of ``cls`` and of its bases defined in the same file (first wins)."""
    methods: list[_Callable] = []
    own: dict[str, _Callable | None] = {}  # None: a name that hides a base's method
    for node in cls.body:
        if isinstance(node, ast.Assign):
            hidden = [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and isinstance(node.target, ast.Name):
            hidden = [node.target.id]
        elif isinstance(node, ast.ClassDef):
            hidden = [node.name]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name not in seen:
            lasts = {d.rpartition(".")[2] for d in _decorator_names(node)}
            if "overload" in lasts:
                continue
            own.pop(node.name, None)  # redefinition: the last one wins, at its position
            if lasts & (_PROPERTY_DECORATORS | _PROPERTY_ATTRS) or node.name.startswith("_"):
                own[node.name] = None
            else:
                own[node.name] = _callable(node, bound=True, static="staticmethod" in lasts)
                own[node.name].owner = cls.name  # type: ignore[union-attr]
            continue
        else:
            continue
        for name in hidden:
            if name not in seen:
                own.pop(name, None)
                own[name] = None
    methods.extend(m for m in own.values() if m is not None)
    seen.update(own)
    seen_classes.add(cls.name)
    for base in cls.bases:
        if isinstance(base, ast.Name) and base.id in classes and base.id not in seen_classes:
            methods.extend(_class_methods(classes[base.id], classes, seen_classes, seen))
    return methods


def _components(tree: ast.Module) -> list[_Component]:
    aliases = _Aliases(tree)
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    found: list[_Component] = []
    for node in tree.body:
        if not isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        kinds = [k for k in map(aliases.kind_of, node.decorator_list) if k is not None]
        if not kinds:
            continue
        comp = _Component(kind=kinds[0], name=node.name, lineno=node.lineno,
                          doc=ast.get_docstring(node), is_class=isinstance(node, ast.ClassDef))
        if isinstance(node, ast.ClassDef):
            comp.methods = _class_methods(node, classes, set(), set())
        else:
            comp.function = _callable(node, bound=False, static=False)
        found.append(comp)
    return found


# -- code generation ----------------------------------------------------------------------


def _doc_literal(text: str, indent: str) -> str:
    """``text`` as a docstring literal at ``indent``."""
    safe = (
        '"""' not in text and "\\" not in text and not text.endswith('"')
        and all(ch.isprintable() or ch == "\n" for ch in text)
    )
    if not safe:
        return indent + repr(text)
    lines = text.split("\n")
    if len(lines) == 1:
        return f'{indent}"""{text}"""'
    body = "\n".join((indent + ln) if ln else "" for ln in lines[1:])
    return f'{indent}"""{lines[0]}\n{body}\n{indent}"""'


def _source_signature(c: _Callable) -> str:
    parts: list[str] = []
    saw_posonly = saw_star = False
    for p in c.params:
        if p.kind != "posonly" and saw_posonly:
            parts.append("/")
            saw_posonly = False
        ann = f": {p.annotation}" if p.annotation else ""
        if p.kind == "posonly":
            saw_posonly = True
        if p.kind == "kwonly" and not saw_star:
            parts.append("*")
            saw_star = True
        if p.kind == "varargs":
            saw_star = True
            parts.append(f"*{p.name}{ann}")
        elif p.kind == "varkw":
            parts.append(f"**{p.name}{ann}")
        elif p.has_default:
            parts.append(f"{p.name}{ann} = {p.default}" if ann else f"{p.name}={p.default}")
        else:
            parts.append(f"{p.name}{ann}")
    if saw_posonly:
        parts.append("/")
    ret = f" -> {c.returns}" if c.returns else ""
    return f"{c.name}({', '.join(parts)}){ret}"


def _stub_parameters(c: _Callable) -> str:
    parts: list[str] = []
    posonly = [p for p in c.params if p.kind == "posonly"]
    saw_star = False
    for p in c.params:
        if p.kind == "kwonly" and not saw_star:
            parts.append("*")
            saw_star = True
        if p.kind == "varargs":
            parts.append(f"*{p.name}")
            saw_star = True
        elif p.kind == "varkw":
            parts.append(f"**{p.name}")
        else:
            parts.append(f"{p.name}=_DEFAULT" if p.has_default else p.name)
        if posonly and p is posonly[-1]:
            parts.append("/")
    return ", ".join(parts)


def _mangle(name: str, class_name: str | None) -> str:
    """The name Python gives ``name`` when written inside ``class_name`` (``__x`` mangling)."""
    if class_name and name.startswith("__") and not name.endswith("__") and class_name.strip("_"):
        return f"_{class_name.lstrip('_')}{name}"
    return name


def _forward_expr(c: _Callable, class_name: str | None) -> str | None:
    """The ``_da_forward(...)`` call for ``c``'s parameters, or None if it has none."""
    if not c.params:
        return None
    positional = [p for p in c.params if p.kind in ("posonly", "regular")]
    posonly = sum(p.kind == "posonly" for p in c.params)
    varargs = next((p.name for p in c.params if p.kind == "varargs"), None)
    kwonly = [p for p in c.params if p.kind == "kwonly"]
    varkw = next((p.name for p in c.params if p.kind == "varkw"), None)

    def pairs(ps: list[_Param]) -> str:
        items = [f"({_mangle(p.name, class_name)!r}, {p.name})" for p in ps]
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"

    return (
        f"_da_forward({pairs(positional)}, {posonly}, {varargs or '()'}, "
        f"{pairs(kwonly)}, {varkw or 'None'})"
    )


def _check_names(c: _Callable, filename: str) -> None:
    for name in [c.name] + [p.name for p in c.params]:
        if name in _RESERVED or name.startswith(_RESERVED_PREFIX):
            raise ValueError(
                f"{filename}:{c.lineno}: {c.name}() uses the name {name!r}, which dask-agents "
                f"stubgen reserves for generated code ({', '.join(sorted(_RESERVED))}, "
                f"{_RESERVED_PREFIX}*); rename it"
            )


def _forward_lines(callee: str, lead: list[str], fwd: str | None, indent: str) -> list[str]:
    """The body that calls ``callee(*lead, ...)`` with the arguments the caller really passed."""
    if fwd is None:
        return [f"{indent}return {callee}({', '.join(lead)})"]
    args = ", ".join(lead + ["*_da_args", "**_da_kwargs"])
    return [f"{indent}_da_args, _da_kwargs = {fwd}", f"{indent}return {callee}({args})"]


def _method_source(comp: _Component, m: _Callable, filename: str) -> str:
    _check_names(m, filename)
    self_name = "_da_self" if any(p.name == "self" for p in m.params) else "self"
    params = _stub_parameters(m)
    sig = f"{self_name}, {params}" if params else self_name
    doc = m.doc or f"Submit ``{comp.name}.{m.name}`` to the cluster; returns an AgentFuture at once."
    doc += f"\n\nComponent signature: ``{_source_signature(m)}``"
    fwd = _forward_expr(m, m.owner)
    lines = [f"    def {m.name}({sig}) -> _da.AgentFuture:", _doc_literal(doc, " " * 8)]
    lines += _forward_lines(f"{self_name}._call", [repr(m.name)], fwd, " " * 8)
    return "\n".join(lines)


def _class_source(comp: _Component, module_name: str, filename: str) -> str:
    doc = comp.doc or (
        f"Stub for the ``{comp.name}`` {comp.kind} of ``{module_name}``: "
        "each method submits a call and returns an AgentFuture."
    )
    out = [
        f"class {comp.name}(_da.Stub):",
        _doc_literal(doc, "    "),
        "",
        "    __slots__ = ()",
        "",
        "    def __init__(self) -> None:",
        _doc_literal(
            f"Bind to the real ``{comp.name}``, importing ``{module_name}`` on first use.", " " * 8
        ),
        f"        _da.Stub.__init__(self, _da_class_spec({comp.name!r}))",
    ]
    for m in comp.methods:
        out += ["", _method_source(comp, m, filename)]
    return "\n".join(out)


def _function_source(comp: _Component, filename: str) -> str:
    f = comp.function
    assert f is not None
    _check_names(f, filename)
    doc = f.doc or f"Submit the ``{comp.name}`` {comp.kind} to the cluster; returns an AgentFuture at once."
    doc += f"\n\nComponent signature: ``{_source_signature(f)}``"
    fwd = _forward_expr(f, None)
    lines = [f"def {f.name}({_stub_parameters(f)}) -> _da.AgentFuture:", _doc_literal(doc, "    ")]
    lines += _forward_lines(f"_da_function_stub({f.name!r})", [], fwd, "    ")
    return "\n".join(lines)


_PRELUDE = '''\
import importlib as _da_importlib
from typing import Any as _da_Any

import dask_agents as _da

__all__ = {all!r}

_da_SOURCE_MODULE = {module!r}


class _da_Default:
    """The value of a parameter the caller left out: the component's own default applies."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<default>"


_DEFAULT: _da_Any = _da_Default()


def _da_forward(positional, posonly, varargs, keyword, varkw):
    """Drop omitted (``_DEFAULT``) arguments; return ``(args, kwargs)`` to submit.

    Positional parameters go positionally up to the first omitted one, then by keyword;
    keyword-only parameters go by keyword.
    """
    args = []
    kwargs = {{}}
    omitted = None
    for i, (name, value) in enumerate(positional):
        if value is _DEFAULT:
            omitted = omitted or name
        elif omitted is None:
            args.append(value)
        elif i < posonly:
            raise TypeError(
                f"positional-only argument {{name!r}} cannot follow the omitted {{omitted!r}}"
            )
        else:
            kwargs[name] = value
    if varargs:
        if omitted is not None:
            raise TypeError(f"extra positional arguments cannot follow the omitted {{omitted!r}}")
        args.extend(varargs)
    for name, value in keyword:
        if value is not _DEFAULT:
            kwargs[name] = value
    if varkw:
        kwargs.update(varkw)
    return tuple(args), kwargs


def _da_resolve(name: str) -> _da_Any:
    """Import the source module (by its import path) and return its component ``name``."""
    module = _da_importlib.import_module(_da_SOURCE_MODULE)
    if module.__dict__ is globals():
        raise ImportError(
            f"the stub module {{__name__!r}} shadows its source module {{_da_SOURCE_MODULE!r}}: "
            "write the stubs into a package (dask-agents stubgen -o stubs/) and import them "
            "from there, keeping the source module importable by its own path"
        )
    try:
        return getattr(module, name)
    except AttributeError:
        raise ImportError(
            f"{{_da_SOURCE_MODULE!r}} has no component {{name!r}}: regenerate the stubs"
        ) from None


def _da_class_spec(name: str) -> _da.ComponentSpec:
    """The spec of the class component ``name`` of the source module."""
    spec = _da.spec_of(_da_resolve(name))
    if not spec.is_class:
        raise TypeError(f"{{_da_SOURCE_MODULE}}.{{name}} is no longer a class: regenerate the stubs")
    return spec


_da_function_stubs: dict = {{}}


def _da_function_stub(name: str) -> _da.FunctionStub:
    """The (cached) stub of the function component ``name`` of the source module."""
    stub = _da_function_stubs.get(name)
    if stub is None:
        stub = _da.stub(_da_resolve(name))
        if not isinstance(stub, _da.FunctionStub):
            raise TypeError(
                f"{{_da_SOURCE_MODULE}}.{{name}} is no longer a function: regenerate the stubs"
            )
        _da_function_stubs[name] = stub
    return stub
'''


def _check_module_name(module_name: str, filename: str) -> None:
    parts = module_name.split(".")
    if not all(p.isidentifier() and not keyword.iskeyword(p) for p in parts):
        raise ValueError(
            f"{filename}: {module_name!r} is not an importable module name; rename the file "
            "or pass --package-root so its import path is a dotted name of identifiers"
        )


def generate_stub_source(source: str, module_name: str, filename: str = "<string>") -> str:
    """Generate the stub module for the component source ``source``.

    ``module_name`` is the import path of the source module (what the stubs import lazily to
    find the real components); ``filename`` is used in the header and in error messages.
    The source is only parsed, never executed. Raises :class:`ValueError` naming the file
    (and line) if the source does not parse, declares no ``@agent``/``@tool`` component at
    top level, or uses a name that the generated code reserves.
    """
    try:
        tree = ast.parse(source, filename=filename)
    except SyntaxError as e:
        raise ValueError(f"{filename}:{e.lineno}: syntax error: {e.msg}") from e
    _check_module_name(module_name, filename)
    comps = _components(tree)
    if not comps:
        raise ValueError(
            f"{filename}: declares no dask-agents components (no top-level class or function "
            "decorated with @agent/@da.agent/@dask_agents.agent or @tool)"
        )
    for comp in comps:
        if comp.name in _RESERVED or comp.name.startswith(_RESERVED_PREFIX):
            raise ValueError(
                f"{filename}:{comp.lineno}: component name {comp.name!r} is reserved by "
                "dask-agents stubgen; rename it"
            )
    names = [c.name for c in comps]
    header = (
        f"# Generated by dask-agents stubgen from {filename}. Do not edit.\n"
        + _doc_literal(
            f"Dask stubs for the components of ``{module_name}``.\n\n"
            "Each class and function keeps the name and call syntax of its component; calling it\n"
            "submits the call to Dask and returns a ``dask_agents.AgentFuture`` at once. The real\n"
            f"components are imported lazily from ``{module_name}``. Regenerate with\n"
            "``dask-agents stubgen`` when the components change.",
            "",
        )
        + "\n\n"
    )
    body = [
        _class_source(c, module_name, filename) if c.is_class else _function_source(c, filename)
        for c in comps
    ]
    return header + _PRELUDE.format(all=names, module=module_name) + "\n\n" + "\n\n\n".join(body) + "\n"


def module_name_for(path: str, package_root: str | None = None) -> str:
    """The import path of the module in ``path``.

    Without ``package_root``: the file's stem (``agents.py`` -> ``agents``) for a file outside
    any package; inside one (its directory holds an ``__init__.py``), the root is inferred as the
    directory above the outermost package, as Python would import it from there
    (``root/app/agents.py`` with ``root/app/__init__.py`` -> ``app.agents``). With it, the path
    relative to the root, dotted (a package's ``__init__.py`` gives the package name). Raises
    ValueError if ``path`` is outside the root.
    """
    stem = os.path.splitext(os.path.basename(path))[0]
    if package_root is None:
        root = os.path.dirname(os.path.abspath(path))
        while os.path.isfile(os.path.join(root, "__init__.py")):
            root = os.path.dirname(root)
        if root == os.path.dirname(os.path.abspath(path)):
            return stem
        package_root = root
    rel = os.path.relpath(os.path.abspath(path), os.path.abspath(package_root))
    if rel == os.pardir or rel.startswith(os.pardir + os.sep) or os.path.isabs(rel):
        raise ValueError(f"{path}: not under the package root {package_root}")
    parts = os.path.splitext(rel)[0].split(os.sep)
    if parts[-1] == "__init__":
        parts.pop()
    if not parts:
        raise ValueError(f"{path}: the package root's own __init__.py has no module name")
    return ".".join(parts)


def write_stubs(paths: list[str], out_dir: str, package_root: str | None = None) -> list[str]:
    """Write the stub module of each component file in ``paths`` into ``out_dir``.

    Each ``<dir>/<stem>.py`` becomes ``<out_dir>/<stem>.py``; ``out_dir`` gets an
    ``__init__.py`` if it has none, so the stubs import as a package (``stubs.agents``)
    beside the real modules. Every file is parsed and generated before anything is written.
    Returns the paths written. Raises ValueError (naming the file) for a source that does not
    parse or declares no components, for two inputs with the same output name, and for an
    output that would overwrite its own input.
    """
    if not paths:
        raise ValueError("no component files given")
    generated: dict[str, str] = {}
    sources: dict[str, str] = {}
    for path in paths:
        module_name = module_name_for(path, package_root)
        with tokenize.open(path) as f:  # honours a PEP 263 encoding declaration
            source = f.read()
        stem = os.path.splitext(os.path.basename(path))[0]
        if stem == "__init__":
            stem = module_name.rpartition(".")[2]
        target = os.path.join(out_dir, f"{stem}.py")
        if os.path.abspath(target) == os.path.abspath(path):
            raise ValueError(f"{path}: the stub would overwrite its own source; choose another -o/--out")
        if target in generated:
            raise ValueError(f"{path}: {sources[target]} also writes {target}; generate them into different directories")
        generated[target] = generate_stub_source(source, module_name, path)
        sources[target] = path
    os.makedirs(out_dir, exist_ok=True)
    written: list[str] = []
    for target, text in generated.items():
        with open(target, "w", encoding="utf-8") as f:
            f.write(text)
        written.append(target)
    init = os.path.join(out_dir, "__init__.py")
    if not os.path.exists(init):
        with open(init, "w", encoding="utf-8") as f:
            f.write('"""Stubs generated by ``dask-agents stubgen``."""\n')
        written.append(init)
    return written
