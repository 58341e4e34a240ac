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

A session's tool calls end its pause: when the last of its tool calls in flight ends while none
of its LLM calls runs, the holders hear ``running`` again (its next LLM call is coming: the
manager starts restoring what it offloaded one hop before that call is even created).

Hints only inform the worker's policy; a lost or late hint costs cache hits, never a call.

Pauses. The same transitions tell how long each paused session will wait:
:meth:`KVHints.remaining` is the expected rest of its pause, from the latency distribution of
each tool kind it waits on (SAGA's prior for the kind, scaled by ``agents.emulation.time-scale``,
until ``agents.kv.min-samples`` tool calls of the kind were seen ending here; then those
samples), conditioned on how long the tool has run. Admission reads it to park sessions paused on
long tools (``scheduler_plugin/admission.py``).
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from typing import Any, Callable

from dask.utils import key_split

import dask_agents.config as agents_config
from dask_agents.kv.runtime.aeg import LatencyModel
from dask_agents.kv.runtime.tool_latency import PRIORS, scaled_prior

HINT_OP = "agents-kv-hint"
_DONE = ("memory", "erred", "released", "forgotten")


class KVHints:
    """Tracks, per session, which workers hold its KV and whether an LLM call of it is in flight,
    and sends ``HINT_OP`` messages through ``send(worker, msg)`` when that changes."""

    MAX_KINDS = 256  # tool kinds with a latency model of their own (more share "custom"'s)

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
        # session -> its tool calls of a known kind in flight: call key -> (kind, started)
        self.tools: dict[str, dict[str, tuple[str, float]]] = defaultdict(dict)
        self.latency: dict[str, LatencyModel] = {}  # tool kind -> its latency, learned from calls ending here
        self._scale = float(agents_config.get("emulation.time-scale", 1.0)) or 1.0
        self._min_samples = int(agents_config.get("kv.min-samples", 20))

    def on_transition(self, rec: Any, finish: str, worker: str | None, now: float | None = None) -> None:
        """A call of a session changed state (``rec``: its CallRecord; ``worker``: where it
        runs, for ``processing``; ``now``: when, default now: a fast-path call's own times)."""
        sid = rec.session
        if sid is None or sid in self._ended:
            return
        kind = getattr(rec, "tool_kind", None)
        ended = kind and rec.kind != "llm" and self._tool(sid, rec.key, kind, finish, time.time() if now is None else now)
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
            if kind:  # the session's KV now waits on this tool: its kind predicts for how long
                self._hint(sid, "paused", wait_key=kind)
        elif (ended and finish in ("memory", "erred") and sid in self.holders and not self.llm_open.get(sid)
              and not self.tools.get(sid)):  # its last tool in flight returned: its next LLM call is coming
            self._hint(sid, "running")

    def _tool(self, sid: str, key: str, kind: str, finish: str, now: float) -> bool:
        """Track a tool call of a known kind: in flight from ``processing``; its duration, when
        it ends in ``memory``, teaches its kind's latency. True when this ended a call in flight
        (not a release after its result was used, nor a call that never started)."""
        if finish == "processing":
            self.tools[sid].setdefault(key, (kind, now))
            return False
        if finish not in _DONE:
            return False
        calls = self.tools.get(sid)
        entry = calls.pop(key, None) if calls is not None else None
        if calls is not None and not calls:
            del self.tools[sid]
        if entry is not None and finish == "memory" and now >= entry[1]:
            self.latency_of(kind).add(now - entry[1])
        return entry is not None

    def latency_of(self, kind: str) -> LatencyModel:
        """The latency model of tool kind ``kind`` (its prior scaled by the emulation time scale
        until enough of its calls were seen end)."""
        m = self.latency.get(kind)
        if m is None and len(self.latency) >= self.MAX_KINDS and kind not in PRIORS:
            return self.latency_of("custom")  # a bound: kinds are clients' strings
        if m is None:
            m = self.latency[kind] = LatencyModel(scaled_prior(kind, self._scale), self._min_samples)
        return m

    def remaining(self, sid: str, now: float) -> float | None:
        """Expected seconds until session ``sid``'s pause ends: the longest expected rest of
        its tool calls in flight, each given how long it has run; None when it is not paused on
        a tool (an LLM call of it runs, or it waits on something else: no prediction)."""
        calls = self.tools.get(sid)
        if not calls or self.llm_open.get(sid):
            return None
        return max(self.latency_of(kind).residual(max(0.0, now - started)) for kind, started in calls.values())

    def resume_within(self, sid: str, now: float, horizon: float) -> float | None:
        """Probability that session ``sid``'s pause ends within ``horizon`` seconds: that every
        tool call of it in flight ends by then, each given how long it has run (independent);
        None when it is not paused on a tool (see :meth:`remaining`)."""
        calls = self.tools.get(sid)
        if not calls or self.llm_open.get(sid):
            return None
        p = 1.0
        for kind, started in calls.values():
            p *= self.latency_of(kind).resume_within(max(0.0, now - started), horizon)
        return p

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
        self.tools.pop(sid, None)
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
