"""The code's layout as the design card fixes it: no import cycles (module-level or inside
functions) among the modules of ``dask_agents/``, ``scheduler_plugin/`` and ``worker_plugin/``,
one module per engine host, every host implementing the one engine-host interface."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# source folder -> the package it installs as (setup.cfg's package_dir)
FOLDERS = {"dask_agents": "dask_agents", "scheduler_plugin": "dask_agents.scheduler_plugin",
           "worker_plugin": "dask_agents.worker_plugin"}


def import_graph(folders: dict[str, str] = FOLDERS, pattern: str = "*.py") -> dict[str, set[str]]:
    """module -> the modules of ours it imports, anywhere in its code (lazy imports included).
    Importing the bare ``dask_agents`` package is left out: every submodule import runs it.
    ``folders``: source folder -> its package; ``pattern``: "**/*.py" takes subpackages too."""
    modules: dict[str, set[str]] = {}
    for folder, pkg in folders.items():
        for path in (ROOT / folder).glob(pattern):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            name = ".".join((pkg,) + parts)
            deps: set[str] = set()
            tree = ast.parse(path.read_text(encoding="utf-8"))
            typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                           and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
                           for n in ast.walk(node)}  # imports for annotations only never run
            for node in ast.walk(tree):
                if id(node) in typing_only:
                    continue
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    deps.add(node.module)
                    deps.update(f"{node.module}.{a.name}" for a in node.names)
                elif isinstance(node, ast.Import):
                    deps.update(a.name for a in node.names)
            modules[name] = deps
    return {m: {d for d in deps if d in modules and d not in (m, "dask_agents", pkg_root(m, folders))}
            for m, deps in modules.items()}


def pkg_root(module: str, folders: dict[str, str]) -> str | None:
    """The package a module belongs to (its import runs when any of its modules is imported)."""
    return next((p for p in folders.values() if module == p or module.startswith(p + ".")), None)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    graph = import_graph()
    assert "dask_agents.worker_plugin.engines" in graph and "dask_agents.scheduler_plugin.plugin" in graph
    assert cycles(graph) == []


def test_every_engine_host_implements_the_one_interface():
    """One interface per extension point: every host has all of EngineHostAPI (no ``hasattr``
    probes in the registry or the plugin), one module per host."""
    from dask_agents.model_settings import ModelSettings
    from dask_agents.worker_plugin.async_engine import AsyncEngineHost
    from dask_agents.worker_plugin.emulated import EmulatedEngineHost
    from dask_agents.worker_plugin.host import EngineHostAPI
    from dask_agents.worker_plugin.vllm_host import EngineHost

    hosts = [EngineHost("v", ModelSettings(model="builtin:tiny-llama", load_format="dummy", tokenizer="byte")),
             AsyncEngineHost("a", ModelSettings(model="builtin:tiny-llama", engine="vllm-async", tokenizer="byte")),
             EmulatedEngineHost("e", ModelSettings(model="m", engine="emulated", tokenizer="byte"))]
    members = set(EngineHostAPI.__annotations__) | {n for n, v in vars(EngineHostAPI).items()
                                                    if callable(v) and not n.startswith("_")}
    assert {"submit", "abort", "kv_directive", "kv_session_end", "kv_hint", "stats", "crashed"} <= members
    for host in hosts:  # (never started: nothing loads)
        assert isinstance(host, EngineHostAPI), type(host).__name__
        missing = sorted(m for m in members if not hasattr(host, m))
        assert missing == [], (type(host).__name__, missing)
    assert {type(h).__module__ for h in hosts} == {"dask_agents.worker_plugin.vllm_host",
                                                   "dask_agents.worker_plugin.async_engine",
                                                   "dask_agents.worker_plugin.emulated"}
    for module in ("engines.py", "plugin.py"):
        code = (ROOT / "worker_plugin" / module).read_text(encoding="utf-8")
        assert "hasattr(host" not in code and 'getattr(host, "' not in code.replace('getattr(host, "params"', ""), module
