"""AgentFuture semantics and bad input on the client side."""

from __future__ import annotations

import threading

import pytest
from distributed import Client, LocalCluster

import dask_agents as da
from dask_agents.futures import MATERIALIZING


@pytest.fixture(scope="module")
def client():
    with LocalCluster(n_workers=1, threads_per_worker=4, processes=False, dashboard_address=":0") as cluster:
        with Client(cluster) as c:
            da.install(c)
            yield c


@da.tool
def make(x):
    return x


GATE = threading.Event()


@da.tool
def blocked(x):
    GATE.wait(30)
    return x


def test_materialization_operations(client):
    with da.session(client):
        f = lambda v: da.stub(make)(v)  # noqa: E731
        assert len(f([1, 2, 3])) == 3
        assert list(f([1, 2])) == [1, 2]
        assert f({"a": 5})["a"] == 5
        assert 2 in f([1, 2])
        assert bool(f(0)) is False and bool(f([0]))
        assert str(f("text")) == "text"
        assert int(f(7)) == 7 and float(f(2)) == 2.0 and [0, 1, 2][f(1)] == 1
        assert f(3) + 1 == 4 and 1 + f(3) == 4 and f(3) * f(2) == 6 and 10 - f(3) == 7
        assert f(7) // 2 == 3 and f(7) % 4 == 3 and f(2) ** 3 == 8 and f(1) / 2 == 0.5
        assert f(3) > 2 and f(3) >= 3 and f(1) < 2 and f(1) <= 1
        assert -f(3) == -3 and abs(f(-3)) == 3
        assert "__len__" in MATERIALIZING and "__repr__" not in MATERIALIZING


def test_identity_semantics_and_explicit_api(client):
    GATE.clear()
    with da.session(client) as s:
        fut = da.stub(blocked)(1)
        assert "blocked" in repr(fut) and "pending" in repr(fut)  # repr never blocks
        assert fut == fut and fut != da.stub(make)(1)
        assert {fut: 1}[fut] == 1 and len({fut, fut}) == 1  # usable in dicts and sets
        assert fut.available() is False
        with pytest.raises(da.CallTimeoutError) as info:
            fut.value(timeout=0.05)
        assert "blocked" in str(info.value) and s.id in str(info.value)
        assert isinstance(info.value, TimeoutError)
        GATE.set()
        assert fut.value(timeout=30) == 1 and fut.available()
        assert fut.meta.component == "blocked" and fut.meta.session == s.id
        assert fut.key.startswith("blocked-")


def test_futures_as_arguments_become_dependencies(client):
    with da.session(client) as s:
        a = da.stub(make)(2)
        b = da.stub(make)([a, {"k": a}])
        assert b.meta.dependencies == [a.key, a.key]
        assert b.value(30) == [2, {"k": 2}]
    g = s.graph()
    assert g.node(b.key).dependencies == [a.key]
    assert g.node(a.key).consumers == [b.key]


def test_kwargs_do_not_collide_with_submit(client):
    @da.tool
    def kw(key, priority=0, resources=None, pure=None):
        return (key, priority, resources, pure)

    with da.session(client):
        assert da.stub(kw)("k", priority=3, resources="r", pure=1).value(30) == ("k", 3, "r", 1)


# -- bad input ----------------------------------------------------------------------------

def test_unknown_hint_key_is_an_error():
    with pytest.raises(da.HintError) as info:
        @da.agent(modle="coder")
        class Typo:
            pass
    assert "Typo" in str(info.value) and "modle" in str(info.value)


def test_wrong_hint_types_are_errors():
    with pytest.raises(da.HintError, match="Bad.*stateful"):
        @da.agent(stateful="yes please")
        class Bad:
            pass
    with pytest.raises(da.HintError, match="kind"):
        @da.tool(kind="teleport")
        def t():
            pass
    with pytest.raises(da.HintError, match="max_replicas"):
        @da.agent(min_replicas=3, max_replicas=1)
        class Bounds:
            pass

    @da.tool(kind="code_exec", batching={"max_batch": 4})
    def ok():
        return 1

    assert da.spec_of(ok).hints.batching.max_batch == 4


def test_non_callable_component_is_an_error():
    with pytest.raises(da.NotAComponentError, match="42"):
        da.stub(42)
    with pytest.raises(da.NotAComponentError):
        da.agent(name="x")("not a class")


def test_unknown_method_is_an_error(client):
    @da.agent
    class Small:
        def go(self):
            return 1

    with pytest.raises(AttributeError, match="Small.*no public method 'gone'"):
        da.stub(Small).gone()


def test_stub_without_client_is_an_error():
    import distributed.client as dc

    @da.agent
    class Lonely:
        def hello(self):
            return 1

    errors: list[BaseException] = []

    def call() -> None:  # a fresh thread: no "current" client context from the fixture
        try:
            da.stub(Lonely).hello()
        except BaseException as e:
            errors.append(e)

    saved = dict(dc._global_clients)
    dc._global_clients.clear()
    try:
        t = threading.Thread(target=call)
        t.start()
        t.join(30)
    finally:
        dc._global_clients.update(saved)
    assert len(errors) == 1 and isinstance(errors[0], da.NoClientError)
    assert "Lonely.hello" in str(errors[0]) and "no Dask client" in str(errors[0])


def test_session_requires_a_client():
    with pytest.raises(TypeError, match="distributed.Client"):
        da.session("not a client")


@pytest.mark.timeout(60)
def test_without_the_plugins_calls_fail_clearly_and_nothing_hangs():
    with LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address=":0") as cluster:
        with Client(cluster) as c:
            assert not da.installed(c)
            with da.session(c) as s:  # leaving the session must not hang either
                fut = da.stub(make)(1)
                with pytest.raises(da.NotInstalledError, match="worker plugin is not installed"):
                    fut.value(30)
            with pytest.raises(da.NotInstalledError, match="da.install"):
                da.telemetry(c)
            with pytest.raises(da.NotInstalledError):
                da.session_graph(c, s.id)
