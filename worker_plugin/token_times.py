"""When each LLM request was submitted and produced its first token, for the latency metrics
vLLM reports (time to first token, time per output token). Each engine host keeps one; the
engine registry pops a request's times as its call returns. Thread-safe (single dict ops):
the hosts stamp from their stepping thread or event loop, the registry pops from a task."""

from __future__ import annotations

import time
from collections import OrderedDict


class TokenTimes:
    """Request id -> (submitted, first token or None), bounded (aborted requests are never
    popped: the oldest go past ``limit``)."""

    def __init__(self, limit: int = 100_000):
        self.limit = limit
        self._times: OrderedDict[str, list] = OrderedDict()

    def start(self, request_id: str, at: float | None = None) -> None:
        """The request was submitted (now, or at ``at``)."""
        self._times[request_id] = [time.time() if at is None else at, None]
        while len(self._times) > self.limit:
            self._times.popitem(last=False)

    def token(self, request_id: str, at: float | None = None) -> bool:
        """The request has output tokens now: its first token's time, if not stamped yet.
        Returns whether this was its first token."""
        t = self._times.get(request_id)
        if t is not None and t[1] is None:
            t[1] = time.time() if at is None else at
            return True
        return False

    def restamp(self, request_id: str, at: float) -> None:
        """The request reached the engine's host at ``at`` (earlier than its submission, which
        followed tokenizing and checks): TTFT and the reported arrival count from there."""
        t = self._times.get(request_id)
        if t is not None:
            t[0] = at

    def submitted_at(self, request_id: str) -> float | None:
        """When the request was submitted (POSIX seconds), or None if unknown."""
        t = self._times.get(request_id)
        return None if t is None else t[0]

    def pop(self, request_id: str, output_tokens: int, finished: float | None = None) -> dict:
        """``ttft_s`` (submitted -> first token) and ``tpot_s`` (first -> last token over the
        tokens after the first; None for one token) of a finished request; {} if unknown."""
        t = self._times.pop(request_id, None)
        if t is None or t[1] is None:
            return {}
        finished = time.time() if finished is None else finished
        out = {"ttft_s": max(t[1] - t[0], 0.0)}
        out["tpot_s"] = max(finished - t[1], 0.0) / (output_tokens - 1) if output_tokens > 1 else None
        return out
