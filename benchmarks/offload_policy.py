"""Our policy inside vLLM's offloading, on CPU: a generated agent trace replayed through vLLM's own
``CPUOffloadingManager`` (the OffloadingConnector's host tier, scheduler side), evicting by vLLM's
LRU, vLLM's ARC, or ours (``kv/runtime/offload_policy.py``), host tier at several sizes.

    .venv/bin/python benchmarks/offload_policy.py --json benchmarks/results/offload-policy.json

The engine in front is a block-level model of vLLM's prefix cache (an LRU of ``--device`` of
the trace's peak footprint): a step's prompt hits the device's prefix first, then the host
tier's (loaded back), and the rest is recomputed; every block computed is stored to the host
tier (as the connector stores new chunks). The sessions' state hints (paused on a tool kind
after a step, finished) travel with the next request of any session, as the engine host sends
them (``AsyncEngineHost.kv_hint``); LRU and ARC ignore them. Reported per host size: blocks
recomputed, over the floor (blocks never seen before: what no cache avoids), host hits, and
the policy's time per eviction. No GPU and no engine: vLLM refuses this connector on CPU, and
only the eviction order differs between the variants.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import os
import statistics
import sys
import time
from collections import OrderedDict
from typing import Any

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

POLICIES = ("lru", "arc", "ours")


def _manager(chunks: int, policy: str) -> Any:
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    from dask_agents.kv.runtime import offload_policy

    if policy == "ours":
        return CPUOffloadingManager(chunks, cache_policy=offload_policy.SessionCachePolicy.__name__,
                                    cache_policy_module_path=offload_policy.__name__)
    return CPUOffloadingManager(chunks, cache_policy=policy)


class _Device:
    """vLLM's device prefix cache as blocks in LRU order (a prompt's blocks touched tail first,
    so a chain's tail goes before its head), ``size`` blocks."""

    def __init__(self, size: int):
        self.size, self.blocks = size, OrderedDict()

    def prefix(self, blocks: tuple[int, ...]) -> int:
        n = 0
        for b in blocks:
            if b not in self.blocks:
                break
            n += 1
        return n

    def use(self, blocks: tuple[int, ...]) -> None:
        for b in reversed(blocks):
            self.blocks[b] = None
            self.blocks.move_to_end(b)
        while len(self.blocks) > self.size:
            self.blocks.popitem(last=False)


def replay(trace: Any, policy: str, host_blocks: int, device_blocks: int) -> dict:
    """One replay of ``trace`` (see the module docstring)."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key

    from dask_agents.kv.runtime.offload_policy import envelope

    now = [0.0]
    m = _manager(host_blocks, policy)
    if policy == "ours":
        m._policy.clock = lambda: now[0]
    key = {}

    def k(b: int) -> Any:
        got = key.get(b)
        if got is None:
            got = key[b] = make_offload_key(b.to_bytes(16, "big"), 0)
        return got

    device = _Device(device_blocks)
    seen: set[int] = set()
    hints: list = []
    out = {"steps": 0, "prompt_blocks": 0, "device_hits": 0, "host_hits": 0, "recomputed": 0, "floor": 0,
           "stores_refused": 0}
    evict_s: list[float] = []
    if policy == "ours":  # time the policy's evictions (the manager calls it on the store path)
        pol, evict = m._policy, m._policy.evict

        def timed(n: int, protected: set) -> Any:
            t0 = time.perf_counter()
            try:
                return evict(n, protected)
            finally:
                evict_s.append(time.perf_counter() - t0)
        pol.evict = timed
    # events: arrivals (1) after ends (0) at the same time, in trace order
    seq = itertools.count()
    events = [(s.at, 1, next(seq), s) for s in trace.steps]
    heapq.heapify(events)
    running: dict[int, Any] = {}
    while events:
        t, kind, i, s = heapq.heappop(events)
        now[0] = t
        if kind == 0:  # the step ended: its request finishes; the session pauses or ends
            ctx = running.pop(i)
            m.on_request_finished(ctx)
            hints.append((s.session, "finished" if s.last else "paused", s.node, s.tool, t))
            continue
        ctx = ReqContext(req_id=f"r{i}", kv_hints=envelope(s.session, hints) if policy == "ours" else None)
        hints = []
        keys = [k(b) for b in s.blocks]
        for j, key_ in enumerate(keys):
            ctx.set_offload_key_position(key_, (j + 1) * trace.block_size)
        m.on_new_request(ctx)
        d = device.prefix(s.blocks)
        h = 0
        for key_ in keys[d:]:
            if m.lookup(key_, ctx) != LookupResult.HIT:
                break
            h += 1
        if h:
            m.prepare_load(keys[d:d + h], ctx)
            m.complete_load(keys[d:d + h], ctx)
        computed = keys[d + h:]
        new = sum(1 for b in s.blocks[d + h:] if b not in seen)
        seen.update(s.blocks)
        if computed:
            stored = m.prepare_store(computed, ctx)
            if stored is None:
                out["stores_refused"] += 1
            else:
                m.complete_store(stored.keys_to_store, ctx)
        device.use(s.blocks)
        out["steps"] += 1
        out["prompt_blocks"] += len(keys)
        out["device_hits"] += d
        out["host_hits"] += h
        out["recomputed"] += len(computed)
        out["floor"] += new
        running[i] = ctx
        heapq.heappush(events, (s.end, 0, i, s))
    out["recompute_vs_floor"] = round(out["recomputed"] / max(out["floor"], 1), 4)
    if evict_s:
        out["evict_ms_median"] = round(1000 * statistics.median(evict_s), 3)
        out["evict_ms_max"] = round(1000 * max(evict_s), 3)
        out["evictions"] = len(evict_s)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=100, help="sessions of the generated trace")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--device", type=float, default=0.05, help="device prefix cache, share of the peak footprint")
    p.add_argument("--host", type=float, nargs="+", default=[0.05, 0.1, 0.25, 0.5],
                   help="host tier sizes, shares of the peak footprint")
    p.add_argument("--json", metavar="PATH", help="write the result here")
    args = p.parse_args(argv)
    from dask_agents.kv.offline.traces import GenParams, generate

    rows = []
    for seed in args.seeds:
        trace = generate(GenParams(sessions=args.sessions, seed=seed))
        peak = trace.peak_footprint()
        for share in args.host:
            for policy in POLICIES:
                t0 = time.perf_counter()
                r = replay(trace, policy, max(1, int(share * peak)), max(1, int(args.device * peak)))
                r.update(seed=seed, host_share=share, policy=policy, wall_s=round(time.perf_counter() - t0, 2),
                         peak_footprint=peak)
                rows.append(r)
                print(json.dumps(r), flush=True)
    summary = {}
    for share in args.host:
        by = {pol: [r for r in rows if r["host_share"] == share and r["policy"] == pol] for pol in POLICIES}
        ratios = [o["recomputed"] / max(lr["recomputed"], 1) for o, lr in zip(by["ours"], by["lru"])]
        # the share of LRU's recompute above the floor that ours avoids, per seed
        closed = [(lr["recomputed"] - o["recomputed"]) / max(lr["recomputed"] - lr["floor"], 1)
                  for o, lr in zip(by["ours"], by["lru"])]
        summary[str(share)] = {
            **{f"recompute_vs_floor_{pol}": statistics.median(r["recompute_vs_floor"] for r in by[pol])
               for pol in POLICIES},
            "recomputed_ours_over_lru_median": round(statistics.median(ratios), 4),
            "recomputed_ours_over_lru_range": [round(min(ratios), 4), round(max(ratios), 4)],
            "excess_closed_vs_lru_median": round(statistics.median(closed), 4),
            "excess_closed_vs_lru_range": [round(min(closed), 4), round(max(closed), 4)]}
    result = {"what": __doc__.split("\n\n")[0], "command": "benchmarks/offload_policy.py " + " ".join(argv or sys.argv[1:]),
              "device_share": args.device, "sessions": args.sessions, "summary": summary, "rows": rows}
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
