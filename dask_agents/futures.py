"""``AgentFuture``: a ``distributed.Future`` that carries call metadata and materializes on use.

Identity semantics (``__hash__``/``__eq__``) are Dask's, so futures keep working in dicts and
sets. Value-consuming operations block until the result is there (implicit materialization):

    len(f), iter(f), f[i], x in f, bool(f), str(f), int(f), float(f), f.__index__(),
    arithmetic (+ - * / // % ** and their reflected forms, unary - + abs), ordering (< <= > >=)

``repr(f)`` never blocks. ``available()`` never blocks. ``value(timeout)`` raises
:class:`~dask_agents.errors.CallTimeoutError` naming the call when time runs out.
Waiting inside a running component first secedes from the worker's thread pool, so a
waiting call does not hold a worker thread.
"""

from __future__ import annotations

import asyncio
import operator
from typing import Any

from distributed import Future

from dask_agents.errors import (CallLostError, CallTimeoutError, ClientClosedError, ResultNotSerializableError,
                                 where)
from dask_agents.models import CallMeta
from dask_agents.worker_plugin.local import SCHEDULER as _SCHEDULER

LOST_REASON = "dask-agents: lost with the driver's connection"  # scheduler_plugin.sessions.LOST_REASON

_NOT_SERIALIZABLE = "Could not serialize object of type "
"""How Dask reports a result its worker could not serialize: the worker sends an error
frame in its place and the reader's deserialization raises ``TypeError`` with this text
(``distributed.protocol.serialize.serialization_error_loads``)."""


def check_client_open(client: Any, component: str, method: str | None, session: str | None) -> None:
    """Raise :class:`~dask_agents.errors.ClientClosedError` naming the call if ``client`` is
    closing or closed (Dask would raise its bare ``ClosedClientError`` at submit)."""
    status = getattr(client, "status", None)
    if status in ("closing", "closed"):
        raise ClientClosedError(
            f"{where(component, method, session)} was called with a Dask client that is {status} "
            f"({getattr(client, 'id', '?')}): create a new distributed.Client for new calls"
        )


def closed_client_error(exc: BaseException, client: Any, component: str, method: str | None,
                        session: str | None) -> ClientClosedError | None:
    """The :class:`~dask_agents.errors.ClientClosedError` naming the call for an exception
    ``client.submit`` raised because ``client`` closed meanwhile; None for any other."""
    from distributed.client import ClosedClientError

    if isinstance(exc, ClientClosedError):
        return exc
    if not isinstance(exc, ClosedClientError) and getattr(client, "status", None) not in ("closing", "closed"):
        return None
    try:
        check_client_open(client, component, method, session)
    except ClientClosedError as err:
        return err
    return ClientClosedError(f"{where(component, method, session)}: the Dask client closed while the call was "
                             f"submitted ({exc})")


def _running_on() -> Any:
    """The worker whose task this thread runs, or None (the driver, or any other thread)."""
    from distributed import get_worker

    try:
        return get_worker()
    except ValueError:
        return None


_LOCAL_STATUS = {"deferred": "pending", "running": "pending", "finished": "finished", "erred": "error",
                 "cancelled": "cancelled"}


def waiting_elsewhere() -> None:
    """Inside a component about to wait: its calls still deferred on this worker's fast path go
    to the scheduler first (they run meanwhile instead of after)."""
    from dask_agents import context

    creator = context.call_id()
    if creator is None:
        return
    worker = _running_on()
    local = getattr(worker.plugins.get("dask-agents"), "local", None) if worker is not None else None
    if local is not None:
        local.waiting_elsewhere(creator)


def _unprofiled() -> Any:
    """A waiting thread leaves Dask's profiler while it waits (``worker_plugin/dask_compat.py``)."""
    from dask_agents.worker_plugin import dask_compat

    return dask_compat.unprofiled()


def release_worker_slot() -> None:
    """If running in a worker task thread, secede once so waiting frees the slot."""
    from dask_agents.worker_plugin import dask_compat

    dask_compat.secede_if_in_task()


class AgentFuture(Future):
    """A future for one agent, tool or LLM call. ``meta`` holds its :class:`CallMeta`."""

    meta: CallMeta

    @classmethod
    def adopt(cls, fut: Future, meta: CallMeta) -> "AgentFuture":
        """Turn the Future that ``client.submit`` returned into an AgentFuture (no new ref)."""
        fut.__class__ = cls
        fut.meta = meta
        return fut  # type: ignore[return-value]

    def __reduce__(self):
        call = self.__dict__.get("_agents_local")
        if call is not None:  # a fast-path call leaving its caller: its key must exist first
            call.controller.escape(call)
        sent = self.__dict__.get("_agents_direct")
        if sent is not None:  # a driver's direct call: likewise (dask_agents/direct.py)
            from dask_agents import direct

            direct.escape(sent)
        return Future, (self.key,)

    def _direct(self) -> Any:
        """The driver's direct call of this future while it has not gone to the scheduler."""
        sent = self.__dict__.get("_agents_direct")
        return sent if sent is not None and sent.state != "scheduler" else None

    # -- a call on the worker-local fast path (worker_plugin/local.py) ----------------------
    def done(self) -> bool:
        call = self.__dict__.get("_agents_local")
        if call is not None and call.state != "submitted":
            return call.state in ("finished", "erred", "cancelled")
        sent = self._direct()
        if sent is not None:
            return sent.state != "sent"
        return super().done()

    @property
    def status(self) -> str:
        call = self.__dict__.get("_agents_local")
        if call is not None and call.state != "submitted":
            return _LOCAL_STATUS[call.state]
        sent = self._direct()
        if sent is not None:
            return sent.status
        return super().status

    def cancel(self, reason: Any = None, msg: Any = None, **kwargs: Any) -> Any:
        """Cancel the call (Dask's ``Future.cancel``); one still waiting for its caller here
        never runs; a driver's direct call still running is dropped when it ends."""
        call = self.__dict__.get("_agents_local")
        if call is not None and call.controller.cancel(call):
            from dask_agents.worker_plugin import dask_compat

            self.client.loop.add_callback(dask_compat.cancel_future, self.client, self.key, msg or "cancelled")
            return None
        sent = self._direct()
        if sent is not None:
            from dask_agents import direct

            if direct.cancel(sent) or sent.state != "finished":
                return None
        return super().cancel(reason=reason, msg=msg, **kwargs)

    def __repr__(self) -> str:
        m = self.meta
        return f"<AgentFuture {where(m.component, m.method, m.session)} {self.status} key={self.key}>"

    # -- explicit API --------------------------------------------------------------
    def available(self) -> bool:
        """True once the call has finished (with a result or an error). Never blocks."""
        return self.done()

    def value(self, timeout: float | None = None) -> Any:
        """The result; blocks up to ``timeout`` seconds, then raises CallTimeoutError."""
        return self.result(timeout=timeout)

    def stream(self, timeout: float | None = None) -> Any:
        """An LLM call made with ``stream=True``: its output as it is generated, an iterator of
        :class:`~dask_agents.streaming.Delta` (text and token ids since the last one) that ends
        with the call and raises its error if it fails. The result is still ``value()``."""
        from dask_agents import streaming

        return streaming.iterate(self, timeout)

    def astream(self) -> Any:
        """:meth:`stream` as an async iterator (``async for delta in fut.astream()``)."""
        from dask_agents import streaming

        return streaming.aiterate(self)

    def result(self, timeout: float | None = None) -> Any:
        """Like ``Future.result``, but secedes inside a component and names the call on timeout
        (:class:`CallTimeoutError`) and when its result cannot leave its worker
        (:class:`ResultNotSerializableError`). A coroutine with an asynchronous client."""
        if self.client.asynchronous:
            return self._async_result(timeout)
        call = self.__dict__.get("_agents_local")
        if call is not None:  # made on this worker's fast path: runs here now, unless it left
            value = call.controller.result(call, timeout)
            if value is not _SCHEDULER:
                return value
        if self._direct() is not None:  # sent straight to its worker: its answer, unless it left
            value = self._direct_result(timeout)
            if value is not _SCHEDULER:
                return value
        try:
            return self._scheduler_result(timeout)
        except Exception as e:
            if not _lost_with_connection(e) or not self.client.sync(self._reattach, timeout):
                raise
        try:
            return self._scheduler_result(timeout)
        except Exception as e:
            raise _not_kept(e) from None

    def _direct_result(self, timeout: float | None) -> Any:
        """The answer of a driver's direct call (``dask_agents/direct.py``): its value, its
        error raised, or :data:`_SCHEDULER` if it went down the scheduler path after all."""
        from dask_agents import direct

        sent = self.__dict__["_agents_direct"]
        with _unprofiled():
            answered = direct.wait(sent, timeout)
        if not answered:
            m = self.meta
            raise CallTimeoutError(f"{where(m.component, m.method, m.session)} did not finish within {timeout}s "
                                   f"(status: running, key: {self.key})")
        if sent.state == "finished":
            return sent.value
        if sent.state == "erred":
            raise sent.error  # type: ignore[misc]
        if sent.state == "cancelled":
            from distributed.client import FutureCancelledError

            raise FutureCancelledError(self.key, "cancelled", "cancelled while it ran")
        return _SCHEDULER

    def _scheduler_result(self, timeout: float | None) -> Any:
        if not self.done():
            waiting_elsewhere()
            release_worker_slot()
        worker = _running_on()
        try:
            with _unprofiled():
                if worker is None or getattr(worker, "loop", None) is not self.client.loop:  # not the worker's client
                    return super().result(timeout=timeout)
                self._verify_initialized()
                return self.client.sync(self._local_result, worker, callback_timeout=timeout)
        except TimeoutError as e:
            if isinstance(e, CallTimeoutError):
                raise
            m = self.meta
            raise CallTimeoutError(
                f"{where(m.component, m.method, m.session)} did not finish within {timeout}s "
                f"(status: {self.status}, key: {self.key})"
            ) from None
        except TypeError as e:
            err = self._not_serializable(e)
            if err is None:
                raise
        raise err  # outside the except block: Dask's TypeError holds a whole remote traceback

    async def _local_result(self, worker: Any) -> Any:
        """The result, read from ``worker``'s memory where the call finished on the caller's own
        worker: no ``who_has``/``get_data`` round trip (what Dask's ``Client.gather`` does inside
        a task; the caller gets the stored object, as a dependent task on that worker would).
        Anywhere else, or on an error or cancellation, as Dask reads it. Runs on the client's
        loop, where the worker's data is changed."""
        await self._state.wait()
        if self.status == "finished":
            try:
                return worker.data[self.key]
            except KeyError:  # produced on another worker (or moved away): fetch it
                pass
        return await self._result()

    async def _async_result(self, timeout: float | None) -> Any:
        try:
            return await self._async_result_once(timeout)
        except Exception as e:
            if not _lost_with_connection(e) or not await self._reattach(timeout):
                raise
        try:
            return await self._async_result_once(timeout)
        except Exception as e:
            raise _not_kept(e) from None

    async def _async_result_once(self, timeout: float | None) -> Any:
        try:
            return await Future.result(self, timeout=timeout)
        except TypeError as e:
            err = self._not_serializable(e)
            if err is None:
                raise
        raise err

    async def _reattach(self, timeout: float | None) -> bool:
        """Dask cancelled this future because the client lost its scheduler connection (a
        blip): wait for the client to reconnect (Dask retries for its ``timeout``), then ask
        for the call again. The scheduler plugin held it meanwhile (for
        ``agents.scheduler.session-grace``), so a call that ran is not run again and its result
        is the one it produced. True once asked; False if the scheduler has no plugin (the
        cancellation stands). Raises :class:`CallLostError` naming the call when the client did
        not come back, or came back to another scheduler (a restart: nothing was kept)."""
        from dask_agents import client_api
        from dask_agents.worker_plugin import dask_compat

        client = self.client
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        while client.status in ("connecting", "newly-created") and (
                deadline is None or asyncio.get_running_loop().time() < deadline):
            await asyncio.sleep(0.02)  # Dask's reconnect has no event to wait on
        m = self.meta
        if client.status != "running":
            raise CallLostError(
                f"{where(m.component, m.method, m.session)}: the client lost its scheduler connection and is "
                f"{client.status} (it did not reconnect within its timeout); the call may or may not have run "
                f"(call {self.key})")
        was, now = self.__dict__.get("_agents_scheduler"), dask_compat.scheduler_id(client)
        if was is not None and now is not None and was != now:
            raise CallLostError(
                f"{where(m.component, m.method, m.session)}: the scheduler restarted while the call was in "
                f"flight ({was} -> {now}); the call may or may not have run and its result is gone; a "
                f"session's stateful instances went with the old scheduler's workers: start a new session "
                f"(call {self.key})")
        dask_compat.rebind_future(self)
        if not await client_api.reattach(client, [self.key]):
            return False
        return True

    def _not_serializable(self, e: TypeError) -> ResultNotSerializableError | None:
        """The da.* error for Dask's report that this call's result did not serialize on its
        worker (None for any other TypeError)."""
        text = str(e.args[0]) if e.args else ""
        if not text.startswith(_NOT_SERIALIZABLE):
            return None
        kind = text[len(_NOT_SERIALIZABLE):].split("\n", 1)[0].strip() or "?"
        m = self.meta
        return ResultNotSerializableError(
            f"{where(m.component, m.method, m.session)} returned a {kind} that cannot leave its worker "
            f"(it does not pickle): return plain data instead (call {self.key})"
        )

    def _materialize(self) -> Any:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return self.result()
        raise RuntimeError(
            f"{self!r} cannot be materialized on a running event loop; use `await future`"
        )

    # -- implicit materialization ------------------------------------------------
    def __len__(self) -> int:
        return len(self._materialize())

    def __iter__(self):
        return iter(self._materialize())

    def __getitem__(self, item: Any) -> Any:
        return self._materialize()[item]

    def __contains__(self, item: Any) -> bool:
        return item in self._materialize()

    def __bool__(self) -> bool:
        return bool(self._materialize())

    def __str__(self) -> str:
        try:
            asyncio.get_running_loop()
            return repr(self)
        except RuntimeError:
            return str(self.result())

    def __int__(self) -> int:
        return int(self._materialize())

    def __float__(self) -> float:
        return float(self._materialize())

    def __index__(self) -> int:
        return operator.index(self._materialize())

    def __neg__(self) -> Any:
        return -self._materialize()

    def __pos__(self) -> Any:
        return +self._materialize()

    def __abs__(self) -> Any:
        return abs(self._materialize())


def _lost_with_connection(e: BaseException) -> bool:
    from dask_agents.worker_plugin import dask_compat

    return dask_compat.lost_with_connection(e)


def _not_kept(e: Exception) -> Exception:
    """The error of a call asked for again after a reconnect: :class:`CallLostError` (naming
    the call, its session and why) if the scheduler no longer had it, else ``e`` itself."""
    if getattr(e, "reason", None) == LOST_REASON:
        return CallLostError(str(getattr(e, "msg", None) or e))
    return e


def _value(x: Any) -> Any:
    return x._materialize() if isinstance(x, AgentFuture) else x


def _binary(op):
    def fwd(self, other):
        return op(self._materialize(), _value(other))

    def rev(self, other):
        return op(_value(other), self._materialize())

    return fwd, rev


for _name, _op in [
    ("add", operator.add), ("sub", operator.sub), ("mul", operator.mul),
    ("truediv", operator.truediv), ("floordiv", operator.floordiv), ("mod", operator.mod),
    ("pow", operator.pow),
]:
    _f, _r = _binary(_op)
    setattr(AgentFuture, f"__{_name}__", _f)
    setattr(AgentFuture, f"__r{_name}__", _r)

for _name, _op in [("lt", operator.lt), ("le", operator.le), ("gt", operator.gt), ("ge", operator.ge)]:
    setattr(AgentFuture, f"__{_name}__", _binary(_op)[0])

MATERIALIZING = (
    "__len__", "__iter__", "__getitem__", "__contains__", "__bool__", "__str__", "__int__",
    "__float__", "__index__", "__neg__", "__pos__", "__abs__", "__add__", "__radd__", "__sub__",
    "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__", "__floordiv__",
    "__rfloordiv__", "__mod__", "__rmod__", "__pow__", "__rpow__", "__lt__", "__le__", "__gt__",
    "__ge__",
)
"""The operations that materialize an AgentFuture (documented in the README)."""
