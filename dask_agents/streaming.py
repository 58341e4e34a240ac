"""Streaming an LLM call's output: ``fut = da.llm(m).generate(p, stream=True)``, then
``for delta in fut.stream(): ...`` (or ``async for delta in fut.astream()``).

The engine's worker sends the call's text as it is generated, as Dask structured events
(``Worker.log_event``) on one topic per client (``agents-stream-<client id>``) that the client
subscribed to before it submitted the call: the subscription and the call travel on the client's
one ordered stream, so no delta can reach the scheduler before the subscription. A delta is
``{"key", "index", "text", "token_ids"}``; the call's last event is ``{"key", "end": True}``,
sent before its result (both on the worker's one stream to the scheduler, and on the scheduler's
one stream to the client), so the iterator has every delta when the call's future is done. The
call's future resolves to its whole :class:`~dask_agents.models.LLMResult` as usual.
"""

from __future__ import annotations

import queue
import threading
import weakref
from typing import Any, AsyncIterator, Iterator

from pydantic import BaseModel, Field

PREFIX = "agents-stream-"


class Delta(BaseModel):
    """New output of a streaming call: text and token ids of completion ``index`` since the
    previous delta."""

    index: int = 0
    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    # the engine crashed and the call runs again on its restarted engine: its output starts over
    restarted: bool = False


class _Streams:
    """The deltas a client received, per call key, until its iterator takes them."""

    def __init__(self) -> None:
        self.queues: dict[str, queue.SimpleQueue] = {}
        # reentrant: ``drop`` runs from a future's finalizer, which the garbage collector may
        # call at any allocation, also one made while this thread holds the lock (queue_for)
        self.lock = threading.RLock()

    def queue_for(self, key: str) -> queue.SimpleQueue:
        with self.lock:
            q = self.queues.get(key)
            if q is None:
                q = self.queues[key] = queue.SimpleQueue()
            return q

    def drop(self, key: str) -> None:
        with self.lock:
            self.queues.pop(key, None)

    def handle(self, event: Any) -> None:
        """The client's topic handler (on its event loop): file the delta under its call."""
        _ts, msg = event if isinstance(event, tuple) and len(event) == 2 else (None, event)
        if isinstance(msg, dict) and isinstance(msg.get("key"), str):
            self.queue_for(msg["key"]).put(msg)


_by_client: dict[str, _Streams] = {}
_by_client_lock = threading.Lock()


def topic(client: Any) -> str:
    """The client's stream topic."""
    return PREFIX + str(client.id)


def subscribe(client: Any) -> str:
    """Subscribe ``client`` to its stream topic (once); returns the topic. Called before a
    streaming call is submitted (see the module docstring for why that is enough)."""
    name = topic(client)
    with _by_client_lock:
        if client.id in _by_client:
            return name
        streams = _by_client[client.id] = _Streams()
    client.subscribe_topic(name, streams.handle)
    return name


def watch(fut: Any) -> None:
    """Keep ``fut``'s deltas from now on; dropped with the future."""
    streams = _by_client.get(fut.client.id)
    if streams is None:
        return
    streams.queue_for(fut.key)
    weakref.finalize(fut, streams.drop, fut.key)


def _queue(fut: Any) -> queue.SimpleQueue:
    if not getattr(fut, "_agents_stream", False):
        from dask_agents.errors import InvalidRequestError

        raise InvalidRequestError(f"call {fut.key} was not made with stream=True: nothing streams from it "
                                  "(its result is fut.value())")
    streams = _by_client.get(fut.client.id)
    if streams is None:  # (subscribed at submit: only a client closed since leaves none)
        from dask_agents.errors import NoClientError

        raise NoClientError(f"call {fut.key}: its client's stream subscription is gone")
    return streams.queue_for(fut.key)


def iterate(fut: Any, timeout: float | None = None) -> Iterator[Delta]:
    """The deltas of ``fut`` as they arrive; ends with the call (a failed call raises its
    error, as ``value()`` does). ``timeout`` bounds the whole stream (CallTimeoutError)."""
    import time

    q = _queue(fut)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        try:
            msg = q.get(timeout=0.05)  # polls the future too: a call that failed sends no end
        except queue.Empty:
            if fut.done() and fut.status != "finished":
                fut.value()  # done: raises the call's da.* error at once
            if deadline is not None and time.monotonic() > deadline:
                fut.value(0)  # raises CallTimeoutError naming the call
            continue
        if msg.get("end"):
            _by_client[fut.client.id].drop(fut.key)
            return
        yield _delta(msg)


async def aiterate(fut: Any) -> AsyncIterator[Delta]:
    """:func:`iterate` for ``async for`` (the queue is read without blocking the event loop)."""
    import asyncio

    q = _queue(fut)
    while True:
        try:
            msg = q.get_nowait()
        except queue.Empty:
            if fut.done() and fut.status != "finished":
                await fut  # raises the call's error
            await asyncio.sleep(0.01)
            continue
        if msg.get("end"):
            _by_client[fut.client.id].drop(fut.key)
            return
        yield _delta(msg)


def _delta(msg: dict) -> Delta:
    if msg.get("restart"):
        return Delta(restarted=True)
    return Delta(index=msg.get("index", 0), text=msg.get("text", ""), token_ids=msg.get("token_ids", []))
