"""Replays of one trace under several policies and tier sizes, side by side with the optimum:
the table, JSON and plot that ``dask-agents replay`` and ``benchmarks/kv_policies.py`` print.

Every row is one (tiers, policy) replay; each tier configuration also gets an ``optimum`` row
(:func:`dask_agents.kv.offline.optimal.lower_bound`, the lower bound on recomputed tokens) and, unless turned off,
an ``offline`` row (:class:`dask_agents.kv.offline.optimal.Offline`, the cost-aware offline schedule). ``ratio`` is a
policy's recomputed prefill tokens over the optimum's (its competitive ratio on this trace);
``excess_ratio`` the same for the avoidable part only (recomputed tokens minus the compulsory
ones: first uses and prompt tails, which no memory size avoids), a harsher view of the same
numbers. The optimum's ``policy`` cell names how it was bounded (``bound``: pinned or flat).

Accelerator and host sizes may be given as a share of the trace's peak footprint
(``accelerator=25%``: a quarter of the most blocks its live sessions' prompts hold at once),
so one spec fits traces of any size.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from dask_agents.kv.runtime.blocks import TIER_NAMES, CostModel, Tiers
from dask_agents.kv.offline.optimal import Offline, lower_bound
from dask_agents.kv.runtime.policies import Params, get_policy
from dask_agents.kv.offline.simulator import Simulator
from dask_agents.kv.offline.traces import Trace

OPTIMUM, OFFLINE = "optimum", "offline"
ONLINE = ("lru", "wa_lru", "nalar", "ours")


@dataclass(frozen=True)
class Row:
    """One replay (or the optimum) of one trace on one tier configuration."""

    trace: str
    family: str
    tiers: str
    accelerator_bytes: int
    accelerator_share: float  # of the trace's peak footprint
    policy: str
    prompt_tokens: int
    recomputed_tokens: int
    hit_rate: float
    ratio: float
    # (recomputed - compulsory) / (optimum - compulsory); None when only the policy has anything avoidable
    excess_ratio: float | None
    bound: str           # how the optimum was computed: "pinned" or "flat" (dask_agents.kv.offline.optimal.lower_bound)
    bytes_offloaded: int = 0
    bytes_prefetched: int = 0
    bytes_restored: int = 0
    stall_s: float = 0.0
    peak_accelerator_bytes: int = 0
    wall_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        """Plain fields."""
        from dataclasses import asdict

        return asdict(self)


def resolve_tiers(spec: str | None, trace: Trace, cost: CostModel, base: Tiers | None = None) -> Tiers:
    """Tiers from ``spec`` (see :meth:`dask_agents.kv.runtime.blocks.Tiers.parse`), where a size ending in ``%`` is that
    share of ``trace``'s peak footprint; ``base`` (else ``agents.kv.tiers``) for what it leaves out."""
    base = base or Tiers.from_config()
    if not spec:
        return base
    parts = []
    peak = None
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, value = part.partition("=")
        if not sep:
            name, value = "accelerator", part
        size, at, bw = value.partition("@")
        if size.strip().endswith("%"):
            try:
                share = float(size.strip()[:-1]) / 100
            except ValueError:
                raise ValueError(f"--tiers {spec!r}: bad share {size!r}") from None
            if peak is None:
                peak = trace.peak_footprint()
            size = str(math.ceil(share * peak) * cost.bytes_per_block)
        parts.append(f"{name.strip()}={size.strip()}{at}{bw}")
    return base.parse(",".join(parts))


def replay(trace: Trace, policies: Sequence[str] = ONLINE, tiers: Iterable[Tiers] = (),
           cost: CostModel | None = None, params: Params | None = None, tick: float | None = None,
           offline: bool = True, progress=None) -> list[Row]:
    """Rows for every tier configuration: the optimum, the offline schedule, each policy."""
    import dask_agents.config as c

    cost = cost or CostModel.from_config()
    params = params or Params.from_config()
    tick = c.seconds("kv.tick") if tick is None else tick
    min_samples = int(c.get("kv.min-samples"))
    tiers = list(tiers) or [Tiers.from_config()]
    for name in policies:
        get_policy(name, params)  # unknown names fail before any work
    peak = trace.peak_footprint()
    rows: list[Row] = []
    for t in tiers:
        acc = t.accelerator.capacity
        share = cost.blocks_in(t.accelerator) / peak if peak else math.inf
        bound = lower_bound(trace, t, cost)
        rows.append(Row(trace.name, trace.family, t.describe(), acc, share, OPTIMUM, bound.prompt_tokens,
                        bound.recomputed_tokens, bound.hit_rate, 1.0, 1.0, bound.kind))
        avoidable = bound.recomputed_tokens - bound.compulsory_tokens
        todo = [(n, get_policy(n, params)) for n in policies]
        if offline:
            todo.append((OFFLINE, Offline(trace, params)))
        for name, policy in todo:
            r = Simulator(trace, t, policy, cost, tick, min_samples).run()
            ratio = r.recomputed_tokens / bound.recomputed_tokens if bound.recomputed_tokens else 1.0
            excess = r.recomputed_tokens - bound.compulsory_tokens
            excess_ratio = excess / avoidable if avoidable else (1.0 if excess == 0 else None)
            rows.append(Row(trace.name, trace.family, t.describe(), acc, share, name, r.prompt_tokens,
                            r.recomputed_tokens, r.hit_rate, ratio, excess_ratio, bound.kind,
                            r.bytes_offloaded, r.bytes_prefetched,
                            r.bytes_restored, r.stall_s, r.peak_accelerator_bytes, r.wall_s))
            if progress:
                progress(rows[-1])
    return rows


def _num(x: float | None, width: int, digits: int) -> str:
    return f"{'-':>{width}s}" if x is None else f"{x:{width}.{digits}f}"


COLUMN_NOTES = (
    "acc/peak: accelerator capacity / the trace's peak footprint; hit rate: reused prompt tokens / prompt "
    "tokens; recomp Mtok: prompt tokens recomputed (millions); vs opt: recomputed / the optimum's; excess: the "
    "same over the avoidable part (first uses and prompt tails left out); offl, pref GiB: bytes offloaded to and "
    "prefetched from lower tiers; stall s: time steps waited for restores; peak GiB: most accelerator bytes in "
    "use; policy 'opt' with the bound's kind: the optimum (a lower bound, knowing the future); 'offline': the "
    "cost-aware schedule that knows the future")


def format_table(rows: Sequence[Row], notes: bool = True) -> str:
    """The rows as a text table (tiers, then policies; the optimum first), with what each
    column means below it unless ``notes`` is False. Columns are as wide as their longest value:
    nothing is cut; sizes are in GiB, as the tiers are written."""
    gib = 2**30
    tw = max([len("trace"), *(len(r.trace) for r in rows)])
    sw = max([len("tiers"), *(len(r.tiers) for r in rows)])
    hdr = (f"{'trace':{tw}s} {'tiers':{sw}s} {'acc/peak':>8s} {'policy':10s} {'hit rate':>8s} "
           f"{'recomp Mtok':>11s} {'vs opt':>7s} {'excess':>7s} {'offl GiB':>8s} {'pref GiB':>8s} {'stall s':>8s} "
           f"{'peak GiB':>8s}")
    lines = [hdr, "-" * len(hdr)]
    for r in rows:
        name = f"opt/{r.bound}" if r.policy == OPTIMUM else r.policy
        lines.append(
            f"{r.trace:{tw}s} {r.tiers:{sw}s} {r.accelerator_share:8.2f} {name:10s} {r.hit_rate:8.3f} "
            f"{r.recomputed_tokens / 1e6:11.3f} {r.ratio:7.3f} {_num(r.excess_ratio, 7, 2)} "
            f"{r.bytes_offloaded / gib:8.1f} "
            f"{r.bytes_prefetched / gib:8.1f} {r.stall_s:8.2f} {r.peak_accelerator_bytes / gib:8.1f}")
    if notes:
        lines += ["", COLUMN_NOTES]
    return "\n".join(lines)


def ratios(rows: Sequence[Row], policies: Sequence[str] = ONLINE) -> dict[str, dict[str, float]]:
    """Per family, each policy's recomputed-token ratio to the optimum: the geometric mean over
    the tier configurations replayed (``<policy>_worst``: the largest)."""
    out: dict[str, dict[str, float]] = {}
    for family in dict.fromkeys(r.family for r in rows):
        fam = [r for r in rows if r.family == family]
        d: dict[str, float] = {}
        for p in list(policies) + [OFFLINE]:
            rs = [r.ratio for r in fam if r.policy == p]
            if rs:
                d[p] = math.exp(sum(math.log(x) for x in rs) / len(rs))
                d[f"{p}_worst"] = max(rs)
        out[family] = d
    return out


def write_json(path: str | os.PathLike, payload: dict[str, Any]) -> str:
    """Write ``payload`` (rows converted) as indented JSON; the absolute path."""
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)

    def default(o):
        if isinstance(o, Row):
            return o.as_dict()
        raise TypeError(f"not JSON serializable: {type(o).__name__}")

    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=default)
    return path


def plot(rows: Sequence[Row], path: str | os.PathLike) -> str:
    """PNG: token hit rate vs accelerator memory (share of peak footprint), one panel per trace,
    one line per policy, the optimum dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = list(dict.fromkeys(r.trace for r in rows))
    fig, axes = plt.subplots(1, len(traces), figsize=(5 * len(traces), 4), squeeze=False)
    for ax, name in zip(axes[0], traces):
        mine = [r for r in rows if r.trace == name]
        for policy in dict.fromkeys(r.policy for r in mine):
            pts = sorted((r.accelerator_share, r.hit_rate) for r in mine if r.policy == policy)
            style = dict(linestyle="--", color="black") if policy == OPTIMUM else dict(marker="o")
            ax.plot([x for x, _ in pts], [y for _, y in pts], label=policy, **style)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("accelerator memory / peak footprint")
        ax.set_ylabel("token hit rate")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def load_trace(spec: str, limit: int | None = None) -> Trace:
    """A trace by spec: ``generated`` or ``generated:sessions=50,seed=1`` (any
    :class:`dask_agents.kv.offline.traces.GenParams` field), ``mooncake`` (the shipped file), or a path
    (:func:`dask_agents.kv.offline.traces.load`). ``limit``: sessions to keep (requests, for a Mooncake file or
    directory)."""
    from dataclasses import fields

    from dask_agents.kv.offline import traces

    name, _, args = spec.partition(":")
    if name == "generated":
        known = {f.name: f.type for f in fields(traces.GenParams)}
        kwargs: dict[str, Any] = {}
        for part in filter(None, args.split(",")):
            k, sep, v = part.partition("=")
            k = k.strip().replace("-", "_")
            if not sep or k not in known:
                raise ValueError(f"generated trace option {part!r}: expected key=value with key in {', '.join(known)}")
            kwargs[k] = json.loads(v) if v.strip()[:1] in "[{" or v.strip() in ("true", "false") else (
                float(v) if "." in v or "e" in v.lower() else int(v))
        if limit:
            kwargs.setdefault("sessions", limit)
        return traces.generate(traces.GenParams(**kwargs))
    if spec == "mooncake":
        return traces.load_mooncake(limit=limit)
    if traces.is_mooncake(spec):  # a Mooncake file or directory: its first ``limit`` requests
        return traces.load_mooncake(spec, limit=limit)
    trace = traces.load(spec)
    return trace.head(limit) if limit else trace


__all__ = ["Row", "replay", "resolve_tiers", "format_table", "ratios", "write_json", "plot", "load_trace",
           "OPTIMUM", "OFFLINE", "ONLINE", "TIER_NAMES"]
