"""The global controller's part of KV management: tell engines what their sessions are doing.

An engine worker sees only its own requests: it knows a session's LLM call ended, not whether
the session now waits on a 28 s ``code_exec`` tool or on a 50 ms file read, nor when it ended
for good. The scheduler sees the whole call graph, so it sends the worker that holds a
session's KV a small hint at each change (on the batched stream, off the critical path):

- ``running``: one of the session's LLM calls started on that worker;
- ``paused``: the session has no LLM call in flight; ``node`` is what its last LLM step was
  (the calling component), ``wait_key`` the kind of tool it now waits on (``code_exec``,
  ``file_io``...; unset while it waits on other work), so the worker's KV manager can predict
  the pause from the tool's latency distribution (``dask_agents.kv.runtime.aeg``) and retain, offload or prefetch;
- ``finished``: sent by the session's end (``agents_end_session``), which invalidates at once.

Hints only inform the worker's policy; a lost or late hint costs cache hits, never a call.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any, Callable

from dask.utils import key_split

HINT_OP = "agents-kv-hint"
_DONE = ("memory", "erred", "released", "forgotten")


class KVHints:
    """Tracks, per session, which workers hold its KV and whether an LLM call of it is in flight,
    and sends ``HINT_OP`` messages through ``send(worker, msg)`` when that changes."""

    def __init__(self, send: Callable[[str, dict], None]):
        self.send = send
        self.holders: dict[str, set[str]] = defaultdict(set)  # session -> workers its LLM calls ran on
        self.llm_open: Counter[str] = Counter()  # session -> LLM calls processing
        self._processing: dict[str, set[str]] = defaultdict(set)  # session -> its LLM calls counted in llm_open
        # call key -> its session, for the calls in ``_processing``: ``forget`` finds the entry
        # of a call whose record the workflow state has dropped (no session to read from it)
        self._session_of: dict[str, str] = {}
        self._last: dict[str, tuple] = {}  # session -> last (state, wait_key) sent
        self._ended: set[str] = set()  # recently ended sessions: late transitions are ignored

    def on_transition(self, rec: Any, finish: str, worker: str | None) -> None:
        """A call of a session changed state (``rec``: its CallRecord; ``worker``: where it
        runs, for ``processing``)."""
        sid = rec.session
        if sid is None or sid in self._ended:
            return
        if rec.kind == "llm":
            if finish == "processing" and worker is not None and rec.key not in self._processing.get(sid, ()):
                self._processing[sid].add(rec.key)
                self._session_of[rec.key] = sid
                self.holders[sid].add(worker)
                self.llm_open[sid] += 1
                self._hint(sid, "running", workers=[worker])
            elif finish in _DONE and rec.key in self._processing.get(sid, ()):
                self._llm_done(sid, rec.key, key_split(rec.creator) if rec.creator else None)
        elif finish == "processing" and sid in self.holders and not self.llm_open.get(sid):
            kind = getattr(rec, "tool_kind", None)
            if kind:  # the session's KV now waits on this tool: its kind predicts for how long
                self._hint(sid, "paused", wait_key=kind)

    def forget(self, key: str) -> None:
        """An LLM call left ``processing`` after the workflow state dropped its record (O(1)):
        count it done, as ``on_transition`` would have (its creator is unknown by then)."""
        sid = self._session_of.get(key)
        if sid is not None:
            self._llm_done(sid, key, None)

    def _llm_done(self, sid: str, key: str, node: str | None) -> None:
        """One LLM call of ``sid`` counted in ``llm_open`` is over; the last one pauses the session."""
        self._session_of.pop(key, None)
        keys = self._processing.get(sid)
        if keys is None or key not in keys:
            return
        keys.discard(key)
        if not keys:
            del self._processing[sid]
        self.llm_open[sid] -= 1
        if self.llm_open[sid] <= 0:
            del self.llm_open[sid]
            self._hint(sid, "paused", node=node)

    def on_session_end(self, sid: str) -> None:
        """Forget a session (its end invalidates its KV on every holder); calls of it that
        finish later say nothing more."""
        self.holders.pop(sid, None)
        self.llm_open.pop(sid, None)
        self._last.pop(sid, None)
        for key in self._processing.pop(sid, ()):
            self._session_of.pop(key, None)
        self._ended.add(sid)
        if len(self._ended) > 10_000:  # a bound: ended ids only guard against stragglers
            self._ended.clear()

    def _hint(self, sid: str, state: str, node: str | None = None, wait_key: str | None = None,
              workers: list[str] | None = None) -> None:
        if workers is None and self._last.get(sid) == (state, wait_key):
            return  # nothing new to say
        self._last[sid] = (state, wait_key)
        msg = {"op": HINT_OP, "session": sid, "state": state, "node": node, "wait_key": wait_key}
        for w in workers if workers is not None else sorted(self.holders.get(sid, ())):
            self.send(w, msg)
