"""SessionGraph as Dask users handle graphs: a short repr, to_networkx(), visualize()."""

from __future__ import annotations

import pytest

from dask_agents.models import CallMeta, GraphEdge, SessionGraph


def _graph() -> SessionGraph:
    """Planner -> Developer -> Tester -> Developer (a retry), the Tester creating the retry."""
    calls = [("plan", "Planner", "finished", 1.0), ("dev1", "Developer", "finished", 2.0),
             ("test", "Tester", "finished", 3.0), ("dev2", "Developer", "running", 4.0)]
    nodes = [CallMeta(call_id=k, component=c, session="s1", state=st, created=t) for k, c, st, t in calls]
    edges = [GraphEdge(src="plan", dst="dev1", kind="dependency"), GraphEdge(src="dev1", dst="test", kind="dependency"),
             GraphEdge(src="test", dst="dev2", kind="created")]
    return SessionGraph(session="s1", state="active", progress=3, nodes=nodes, edges=edges)


def test_repr_is_short():
    g = _graph()
    assert repr(g) == "<SessionGraph 's1' active: 4 calls (finished 3, running 1), 3 edges>"
    assert str(g) == repr(g) and "\n" not in repr(g)


def test_to_networkx():
    nx = pytest.importorskip("networkx")
    g = _graph().to_networkx()
    assert isinstance(g, nx.DiGraph) and g.graph == {"session": "s1", "state": "active", "progress": 3}
    assert list(nx.topological_sort(g)) == ["plan", "dev1", "test", "dev2"]
    assert g.nodes["dev2"]["component"] == "Developer" and g.nodes["dev2"]["state"] == "running"
    assert g.edges["test", "dev2"]["kind"] == "created"


def test_layout_and_visualize(tmp_path):
    g = _graph()
    assert g.layout() == {"plan": (0, 0), "dev1": (1, 0), "test": (2, 0), "dev2": (3, 0)}
    path = tmp_path / "graph.html"
    fig = g.visualize(str(path))
    text = path.read_text()
    assert "Developer" in text and "s1" in text
    (src,) = {r.data_source for r in fig.renderers if "component" in r.data_source.data}
    assert src.data["key"] == ["plan", "dev1", "test", "dev2"]
    assert src.data["color"][3] == "#1e88e5"  # running
