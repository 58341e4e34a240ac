"""The Agent Execution Graph (SAGA's G = (V, E, P, phi)), learned online from observed steps.

Nodes are step labels (``plan``, ``act``, the creating agent's name...); an edge ``u -> v``
counts how often a session's step ``u`` was followed by ``v`` (``END``: the session ended after
``u``), and remembers the mean share of ``u``'s prompt blocks that ``v`` reused (prefix overlap).
phi maps each node to the tool kinds seen in the pauses after it. Pause durations are kept per
*latency key*: the tool's kind when the step carries it (a hint), else ``after:<node>``; each key
has a :class:`LatencyModel`, the kind's prior (:func:`dask_agents.kv.runtime.tool_latency.prior`; ``custom``'s for keys
of no known kind) until ``min_samples`` pauses were seen, their empirical distribution after.

Nothing needs hints: with none, every key is ``after:<node>`` and all of it is learned. The
simulator feeds observations as steps arrive and end; policies only query (:class:`GraphView`).

Predictions for a paused session (``elapsed`` seconds into its pause):

- Nalar: time until runnable = mean duration of what it waits on minus ``elapsed`` (>= 0).
- SAGA: the latency CDF conditioned on ``elapsed``: P(resume within ``h``) and the TTL quantile.
- ours: the expected *remaining* pause E[L - e | L > e] (mean residual life), which for the
  heavy-tailed tools grows the longer a call has run (a call past its P95 is likely to run
  much longer); beyond every sample it is taken as ``e`` itself (a Lindy estimate).
"""

from __future__ import annotations

import bisect
import math
from collections import Counter, defaultdict, deque
from dataclasses import dataclass

from dask_agents.kv.runtime.tool_latency import PRIORS, ToolLatency

END = "<end>"
"""Successor of a session's last step."""


def _prior_partial_mean(d: ToolLatency, e: float) -> tuple[float, float]:
    """``(P(L > e), E[L; L > e])`` of a prior: each log-uniform piece from a to b with mass w
    contributes w*(b-a)/ln(b/a) over the part of it above ``e``."""
    tail, partial = 0.0, 0.0
    for (q0, x0), (q1, x1) in zip(d.knots, d.knots[1:]):
        if x1 <= e:
            continue
        lo = max(x0, e)
        w = (q1 - q0) * math.log(x1 / lo) / math.log(x1 / x0)  # mass of [lo, x1]
        tail += w
        partial += (q1 - q0) * (x1 - lo) / math.log(x1 / x0)
    return tail, partial


class LatencyModel:
    """Latency distribution of one key: a prior until ``min_samples`` samples, then the samples
    (the most recent ``max_samples``). Queries are read-only; all times in seconds."""

    def __init__(self, prior: ToolLatency, min_samples: int = 20, max_samples: int = 2000):
        self.prior = prior
        self.min_samples = min_samples
        self._recent: deque[float] = deque(maxlen=max_samples)
        self._sorted: list[float] = []
        self._suffix: list[float] | None = None  # suffix sums of _sorted, rebuilt lazily

    @property
    def n(self) -> int:
        """Samples kept."""
        return len(self._sorted)

    @property
    def empirical(self) -> bool:
        """Whether the samples (not the prior) answer queries."""
        return self.n >= self.min_samples

    def add(self, x: float) -> None:
        """One observed latency."""
        if len(self._recent) == self._recent.maxlen:
            old = self._recent[0]
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self._recent.append(x)
        bisect.insort(self._sorted, x)
        self._suffix = None

    def _sums(self) -> list[float]:
        if self._suffix is None:
            acc, out = 0.0, [0.0] * (len(self._sorted) + 1)
            for i in range(len(self._sorted) - 1, -1, -1):
                acc += self._sorted[i]
                out[i] = acc
            self._suffix = out
        return self._suffix

    def mean(self) -> float:
        """Expected latency."""
        if not self.empirical:
            return self.prior.mean()
        return self._sums()[0] / self.n

    def quantile(self, q: float) -> float:
        """Latency at quantile ``q``."""
        if not self.empirical:
            return self.prior.quantile(q)
        return self._sorted[min(self.n - 1, max(0, math.ceil(q * self.n) - 1))]

    def cdf(self, x: float) -> float:
        """P(latency <= x)."""
        if not self.empirical:
            return self.prior.cdf(x)
        return bisect.bisect_right(self._sorted, x) / self.n

    def longer_than(self, x: float) -> int:
        """How many of the kept samples exceed ``x`` (counted from the first sample on)."""
        return self.n - bisect.bisect_right(self._sorted, x)

    def resume_within(self, elapsed: float, horizon: float) -> float:
        """P(latency <= elapsed + horizon | latency > elapsed): SAGA's conditional CDF."""
        survive = 1.0 - self.cdf(elapsed)
        if survive <= 0.0:
            return 0.0  # past everything seen: no evidence it ends soon
        return max(0.0, self.cdf(elapsed + horizon) - self.cdf(elapsed)) / survive

    def residual(self, elapsed: float) -> float:
        """E[latency - elapsed | latency > elapsed]; ``elapsed`` itself beyond all the mass (Lindy)."""
        if not self.empirical:
            tail, partial = _prior_partial_mean(self.prior, elapsed)
            return partial / tail - elapsed if tail > 1e-12 else max(elapsed, 1e-3)
        i = bisect.bisect_right(self._sorted, elapsed)
        k = self.n - i
        if k == 0:
            return max(elapsed, 1e-3)
        return self._sums()[i] / k - elapsed


@dataclass(frozen=True)
class Prediction:
    """What the graph predicts for one paused session (seconds from now; probabilities)."""

    nalar_idle: float        # mean of what it waits on minus elapsed, >= 0 (Nalar)
    residual: float          # expected remaining pause (ours)
    p95: float               # P95 of what it waits on (SAGA's TTL before the cap)
    reuse: float             # P(its next step reuses a block) x mean prefix overlap


class AgentGraph:
    """The online AEG. ``observe_*`` learn; the query methods are what :class:`GraphView` exposes."""

    def __init__(self, min_samples: int = 20):
        self.min_samples = min_samples
        self.edges: dict[str, Counter[str]] = defaultdict(Counter)
        self._overlap: dict[tuple[str, str], tuple[int, float]] = {}
        self.phi: dict[str, Counter[str]] = defaultdict(Counter)
        self.latencies: dict[str, LatencyModel] = {}
        self._reuse: dict[tuple[str, bool], float] = {}  # memo, cleared by every observation

    @staticmethod
    def key(node: str, tool: str | None) -> str:
        """Latency key of the pause after a ``node`` step: its tool kind (hint) else ``after:<node>``."""
        return tool if tool else f"after:{node}"

    def latency(self, key: str) -> LatencyModel:
        """The latency model of ``key`` (created with its prior on first use)."""
        m = self.latencies.get(key)
        if m is None:
            m = self.latencies[key] = LatencyModel(PRIORS.get(key, PRIORS["custom"]), self.min_samples)
        return m

    def observe_transition(self, u: str, v: str, overlap: float) -> None:
        """A session went from step ``u`` to step ``v``, reusing ``overlap`` of ``u``'s blocks."""
        self.edges[u][v] += 1
        self._reuse.clear()
        n, mean = self._overlap.get((u, v), (0, 0.0))
        self._overlap[(u, v)] = (n + 1, mean + (overlap - mean) / (n + 1))

    def observe_end(self, u: str) -> None:
        """A session ended after step ``u``."""
        self.edges[u][END] += 1
        self._reuse.clear()

    def observe_pause(self, node: str, key: str, seconds: float) -> None:
        """A pause after a ``node`` step, waiting on ``key``, lasted ``seconds``."""
        self.phi[node][key] += 1
        self.latency(key).add(seconds)

    def successors(self, u: str) -> dict[str, float]:
        """Transition probabilities out of ``u`` (empty before any observation)."""
        c = self.edges.get(u)
        if not c:
            return {}
        total = sum(c.values())
        return {v: k / total for v, k in c.items()}

    def overlap(self, u: str, v: str) -> float:
        """Mean share of ``u``'s blocks its successor ``v`` reused (1.0 before any observation)."""
        return self._overlap.get((u, v), (0, 1.0))[1]

    def reuse_probability(self, u: str, paused: bool = True) -> float:
        """P(the next step reuses ``u``'s blocks) x overlap, summed over successors. A paused
        session has not ended (ends are known when the step ends), so ``END`` is excluded then."""
        memo = self._reuse.get((u, paused))
        if memo is not None:
            return memo
        succ = self.successors(u)
        if paused:
            succ = {v: p for v, p in succ.items() if v != END}
            total = sum(succ.values())
            succ = {v: p / total for v, p in succ.items()} if total else {}
        out = sum(p * self.overlap(u, v) for v, p in succ.items() if v != END) if succ else 1.0
        self._reuse[(u, paused)] = out
        return out

    def predict(self, node: str, key: str, elapsed: float) -> Prediction:
        """Predictions for a session paused ``elapsed`` seconds after a ``node`` step, waiting on ``key``."""
        m = self.latency(key)
        return Prediction(max(0.0, m.mean() - elapsed), m.residual(elapsed), m.quantile(0.95),
                          self.reuse_probability(node))

    def view(self) -> "GraphView":
        """A query-only facade for policies."""
        return GraphView(self)


class GraphView:
    """Read-only access to an :class:`AgentGraph` (what a policy may ask)."""

    __slots__ = ("_g",)

    def __init__(self, graph: AgentGraph):
        self._g = graph

    def latency(self, key: str) -> LatencyModel:
        """The latency model of ``key`` (query it; do not ``add``)."""
        return self._g.latency(key)

    def successors(self, u: str) -> dict[str, float]:
        """Transition probabilities out of ``u``."""
        return self._g.successors(u)

    def reuse_probability(self, u: str, paused: bool = True) -> float:
        """See :meth:`AgentGraph.reuse_probability`."""
        return self._g.reuse_probability(u, paused)

    def predict(self, node: str, key: str, elapsed: float) -> Prediction:
        """See :meth:`AgentGraph.predict`."""
        return self._g.predict(node, key, elapsed)

    def expected_pause(self, u: str) -> float:
        """Mean pause after a ``u`` step, over the keys seen after it (the custom prior before any)."""
        keys = self._g.phi.get(u)
        if not keys:
            return PRIORS["custom"].mean()
        total = sum(keys.values())
        return sum(k / total * self._g.latency(key).mean() for key, k in keys.items())
