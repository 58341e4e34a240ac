"""The scheduler plugin's shape (DESIGN §5): an event router over typed collaborators, each with a
narrow interface. Checked on the source, so that a change that couples them again fails here:

- the decision collaborators (placement, sessions, admission, recovery, the view index, drains,
  the roster) never take the plugin: they get the roster, the workflow state and each other;
- whatever still takes the plugin (the control loop through a Protocol, the readers behind the
  dashboard and /metrics, the endpoint checks) says so in its annotation, never ``Any``;
- no module calls another object's private names (``x._name``, x not ``self``/``cls``); Dask's
  internals are reached only through ``dask_compat``;
- the control pass is the control loop's; the watchdog only watches it (and its policies).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "scheduler_plugin"
COLLABORATORS = ("placement", "sessions", "admission", "recovery", "view_index", "drain", "roster",
                 "engine_health", "kv_hints")


def _tree(name: str) -> ast.Module:
    return ast.parse((PKG / f"{name}.py").read_text(encoding="utf-8"))


def _params(tree: ast.AST) -> list[ast.arg]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            out.extend(a.posonlyargs + a.args + a.kwonlyargs)
    return out


def test_the_decision_collaborators_never_take_the_plugin():
    for name in COLLABORATORS:
        tree = _tree(name)
        takes = [p.arg for p in _params(tree) if p.arg in ("plugin", "p")]
        assert not takes, f"scheduler_plugin/{name}.py takes the plugin: {takes}"
        imports = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert "dask_agents.scheduler_plugin.plugin" not in imports, name
        # nor reaches for it through an attribute
        src = (PKG / f"{name}.py").read_text(encoding="utf-8")
        assert "self.plugin" not in src, name


def untyped_plugin_params(src: str) -> list[str]:
    """Parameters named ``plugin`` or ``host`` without an annotation or annotated ``Any``."""
    return [f"{p.lineno} {p.arg}" for p in _params(ast.parse(src))
            if p.arg in ("plugin", "host") and (p.annotation is None or ast.unparse(p.annotation) == "Any")]


# attributes of ours set on foreign objects: the Agents page kept alive by its Bokeh document
OURS_ON_FOREIGN = {"doc._agents_page"}


def private_uses(src: str, allowed: frozenset[str] | set[str] = frozenset()) -> list[str]:
    """``x._name`` where ``x`` is not ``self``/``cls`` and the expression is not ``allowed``
    (a ``noqa`` comment does not excuse it: the coupling this checks was marked so)."""
    found = []
    for node in ast.walk(ast.parse(src)):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        if ast.unparse(node) not in allowed:
            found.append(f"{node.lineno} {ast.unparse(node)}")
    return found


def test_nothing_takes_the_plugin_as_any():
    untyped = [f"{path.name}:{u}" for path in sorted(PKG.glob("*.py"))
               for u in untyped_plugin_params(path.read_text(encoding="utf-8"))]
    assert not untyped, untyped


def test_no_module_calls_another_objects_private_names():
    found = [f"{path.relative_to(ROOT)}:{u}" for path in sorted(PKG.rglob("*.py"))
             if path.name != "dask_compat.py"  # the one place that touches Dask's internals
             for u in private_uses(path.read_text(encoding="utf-8"), OURS_ON_FOREIGN)]
    assert not found, found


def test_the_control_pass_is_the_loops_and_the_watchdog_only_watches():
    watchdog = (PKG / "watchdog.py").read_text(encoding="utf-8")
    for step in ("build_view(", "enforcer.apply(", "enforcer.settle(", "adapt_window("):
        assert step not in watchdog, step  # parts of a pass: control.py's
    control = (PKG / "control.py").read_text(encoding="utf-8")
    for step in ("build_view(", "enforcer.apply(", "adapt_window("):
        assert step in control, step


def test_the_checks_here_find_what_they_look_for():
    """The scans above are not vacuous: each finds its violation in a module that has it (the
    code this split replaced: ``Recovery`` placing calls through the plugin's private methods)."""
    bad = ("class Recovery:\n"
           "    def __init__(self, plugin: Any, history: int = 200):\n"
           "        self.plugin = plugin\n"
           "    def _replace(self, ts, host):\n"
           "        self.plugin._unplace(ts.key)\n"
           "        doc._page = 1  # noqa: SLF001\n"
           "        return self._candidates(ts)\n")
    assert untyped_plugin_params(bad) == ["2 plugin", "4 host"]
    assert sorted(private_uses(bad)) == ["5 self.plugin._unplace", "6 doc._page"]
    assert private_uses(bad, {"doc._page"}) == ["5 self.plugin._unplace"]
    assert untyped_plugin_params("def f(plugin: 'AgentsSchedulerPlugin'): ...") == []
