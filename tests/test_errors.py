"""Errors keep their type and name: what a call's caller gets when things do not pickle.

- A component raising an exception that does not travel (an attribute that does not pickle,
  a cause that does not, a class that does not unpickle, a huge or unprintable message) still
  reaches the caller as ``da.CallFailedError`` naming component, method and session, on
  in-process workers and on worker processes; one that travels is kept as ``original``.
- A result that does not pickle is ``da.ResultNotSerializableError`` naming the call (Dask
  reports it as a bare ``TypeError`` when the caller fetches it).
- A call made with a closed client is ``da.ClientClosedError`` naming the call.

The components live at module level: worker processes unpickle them (and the exceptions) by
reference, importing this module.
"""

from __future__ import annotations

import contextvars
import threading

import pytest
from dask import config as dask_config
from distributed import Client, LocalCluster, Scheduler, Worker
from distributed.utils_test import gen_cluster

import dask_agents as da
from dask_agents.errors import ClientClosedError, ResultNotSerializableError


class LockedError(Exception):
    """An error that carries a lock: it does not pickle."""

    def __init__(self, message: str):
        super().__init__(message)
        self.lock = threading.Lock()


class TwoPartError(Exception):
    """Pickles, but its default reduction does not unpickle (two required arguments)."""

    def __init__(self, part: int, whole: int):
        super().__init__(f"{part} of {whole}")
        self.part, self.whole = part, whole


class UnprintableError(Exception):
    """``str()`` of it raises."""

    def __str__(self) -> str:
        raise RuntimeError("no text for you")


@da.agent
class Faulty:
    """Each method fails in its own way (or returns something that cannot travel)."""

    def locked(self) -> None:
        raise LockedError("holding a lock")

    def caused(self) -> None:
        try:
            raise LockedError("the inner one")
        except LockedError as e:
            raise ValueError("the outer one") from e

    def contextual(self) -> None:
        try:
            raise LockedError("the inner one")
        except LockedError:
            raise KeyError("raised while handling it")  # noqa: B904 (the implicit context is the point)

    def two_part(self) -> None:
        raise TwoPartError(1, 2)

    def long(self) -> None:
        raise ValueError("x" * 20_000)

    def unprintable(self) -> None:
        raise UnprintableError()

    def lock(self) -> threading.Lock:
        return threading.Lock()

    def fine(self) -> str:
        return "fine"


FAILING = ["locked", "caused", "contextual", "two_part", "long", "unprintable"]
TRAVELS = {"two_part": TwoPartError, "long": ValueError, "unprintable": UnprintableError}


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], timeout=60)
async def test_an_unpicklable_result_is_named_with_an_asynchronous_client(c: Client, s: Scheduler, a: Worker):
    """Worker and client talk TCP here (one process): the result must serialize. (First in the
    module: gen_cluster's client does not close cleanly while the fixture's clusters run.)"""
    await da.install(c)
    async with da.session(c, name="lock-async") as sess:
        fut = da.stub(Faulty).lock()
        with pytest.raises(ResultNotSerializableError) as info:
            await fut
        assert await da.stub(Faulty).fine() == "fine"
    _named(info.value, "lock", sess, fut.key)


@pytest.fixture(scope="module", params=["threads", "processes"])
def client(request):
    """A LocalCluster with in-process workers, then one with a worker process."""
    processes = request.param == "processes"
    with LocalCluster(n_workers=1, threads_per_worker=2, processes=processes, dashboard_address=":0",
                      worker_dashboard_address=":0") as cluster:
        with Client(cluster) as c:
            da.install(c)
            yield c


def _named(err: BaseException, method: str, session: da.Session, key: str) -> None:
    text = str(err)
    assert f"Faulty.{method}" in text and session.id in text and key in text, text


@da.tool
def failing_tool(x: int) -> int:
    raise ValueError(f"bad input {x}")


@da.agent
class Delegates:
    def run(self, x: int) -> int:
        return da.stub(failing_tool)(x).value()  # its failure escapes this agent


def test_a_nested_failure_reaches_the_caller_with_its_root(client):
    """An agent letting its tool's failure escape: the caller's error names the agent's call,
    its ``original`` is the tool call's CallFailedError, and ``root`` the tool's own exception
    (it took ``.original.original`` before)."""
    with da.session(client, name="nested") as s:
        fut = da.stub(Delegates).run(7)
        with pytest.raises(da.CallFailedError) as info:
            fut.value(60)
    err = info.value
    assert "Delegates.run" in str(err) and s.id in str(err)
    assert isinstance(err.original, da.CallFailedError) and "failing_tool" in str(err.original)
    assert type(err.root) is ValueError and str(err.root) == "bad input 7"


@pytest.mark.parametrize("method", FAILING)
def test_an_exception_that_does_not_travel_is_still_a_named_call_failed_error(client, method):
    with da.session(client, name=f"err-{method}") as s:
        fut = getattr(da.stub(Faulty), method)()
        with pytest.raises(da.CallFailedError) as info:
            fut.value(60)
    err = info.value
    _named(err, method, s, fut.key)
    assert len(str(err)) < 10_000  # under Dask's max-error-length: never "Long error message"
    if method in TRAVELS:  # it travels (Dask pickles it with tblib): kept, with its type
        assert type(err.original) is TRAVELS[method]
        assert method != "two_part" or (err.original.part, err.original.whole) == (1, 2)
    else:  # a lock in it or in its cause or context: its type and traceback travel as text
        assert err.original is None
        assert any("LockedError" in n for n in getattr(err, "__notes__", ())), getattr(err, "__notes__", None)
    assert da.stub(Faulty).fine().value(60) == "fine"  # the worker is fine


def test_an_unpicklable_result_is_named(client):
    if not client.cluster.processes:  # in-process, the result reaches the caller as it is
        with da.session(client, name="lock"):
            assert isinstance(da.stub(Faulty).lock().value(60), type(threading.Lock()))
        return
    with da.session(client, name="lock") as s:
        fut = da.stub(Faulty).lock()
        with pytest.raises(ResultNotSerializableError) as info:
            fut.value(60)
    assert isinstance(info.value, da.CallFailedError)
    _named(info.value, "lock", s, fut.key)
    assert "lock" in str(info.value) and "does not pickle" in str(info.value)


def test_a_call_with_a_closed_client_is_named(client):
    other = Client(client.cluster)
    with da.session(other, name="late") as s:
        ctx = contextvars.copy_context()  # the session's context, as a caller that kept it would
    other.close()
    with pytest.raises(ClientClosedError) as info:
        ctx.run(lambda: da.stub(Faulty).fine())
    err = info.value
    assert "Faulty.fine" in str(err) and s.id in str(err) and "closed" in str(err)
    from distributed.client import ClosedClientError

    assert isinstance(err, da.NoClientError) and isinstance(err, ClosedClientError)  # Dask's, as before


def test_leaving_a_session_whose_client_closed_inside_it_is_quiet(client):
    """Before: ``AttributeError: 'NoneType' object has no attribute 'address'`` from leaving the
    block; the scheduler already saw the client go (its sessions wait out their grace)."""
    other = Client(client.cluster)
    with da.session(other, name="gone"):
        other.close()


def test_a_missing_engine_library_says_how_to_install_it(monkeypatch):
    """No vLLM in the worker's environment: a da.EngineLoadError naming the model and the
    install line, not a bare RuntimeError."""
    from dask_agents.worker_plugin.vllm_host import EngineHost
    from dask_agents.model_settings import ModelSettings

    def no_vllm(self):
        raise ModuleNotFoundError("No module named 'vllm'", name="vllm")

    monkeypatch.setattr(EngineHost, "_load", no_vllm)
    host = EngineHost("nolib", ModelSettings(model="builtin:tiny-llama", load_format="dummy", tokenizer="byte"))
    host.start()
    with pytest.raises(da.EngineLoadError, match=r"engine for model 'nolib' failed to load: ModuleNotFoundError.*"
                                                 r"dask-agents\[cpu\].*download.pytorch.org/whl/cpu.*dask-agents\[gpu\]"):
        host.wait_loaded(60)
    host.close()


def test_install_names_the_worker_and_cause_when_an_engine_cannot_load(monkeypatch):
    """``da.install(client)`` waits for the start-up engines: one that cannot load fails the
    install with da.EngineLoadError naming the worker, the model and the cause (with the install
    line when the engine library is missing), instead of "install ok" and a failure at the first
    call."""
    from dask_agents.worker_plugin.vllm_host import EngineHost

    def no_vllm(self):
        raise ModuleNotFoundError("No module named 'vllm'", name="vllm")

    monkeypatch.setattr(EngineHost, "_load", no_vllm)  # (in-process workers: this process's class)
    # the engine stepped in the worker, where the patch is (a process of its own would not have it)
    monkeypatch.setitem(dask_config.get("agents.llm.models.coder"), "process", False)
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster:
        with Client(cluster) as c:
            (addr,) = c.scheduler_info()["workers"]
            with pytest.raises(da.EngineLoadError, match=rf"da.install: worker 0 \({addr}\): engine for model "
                                                         r"'coder' failed to load: ModuleNotFoundError.*dask-agents\[cpu\]"):
                da.install(c, models=["coder"])
            assert da.install(c, models=["coder"], wait=False) == {}  # not waiting: returns at once
