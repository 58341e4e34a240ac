"""What one KV look costs on the engine's stepping thread, by device size: block state from vLLM's
KV events (``dask_agents.kv.runtime.device_index``) against walking vLLM's free-block queue from Python.

What runs
---------
For each ``--blocks`` N: a real in-process vLLM CPU engine (``builtin:tiny-llama``, 128-token
blocks of 128 KiB, so N blocks take N x 128 KiB of memory) with the ``ours`` KV manager; a few
sessions run so the cache holds blocks of live, paused and finished sessions. Then, on the
stepping thread between steps, the manager's look (``KVManager.view`` and what a policy reads
from it: device use and the stale blocks) is timed ``--looks`` times two ways, side by side in
one run:

``events``  device use and stale blocks from the event index (the default, O(running requests)
            plus the stale candidates);
``walk``    the same look on the same engine with the index taken away: device use and stale
            blocks from a walk of vLLM's free queue (what every look did before, O(blocks)).

The median per look is printed with its range; the ratio is walk / events.

Reproduce::

    .venv/bin/python benchmarks/kv_look_cost.py --json benchmarks/results/kv-look-cost.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

BLOCK_BYTES = 128 * 1024


def measure(blocks: int, looks: int) -> dict:
    """Time ``looks`` looks each way on an engine of ``blocks`` KV blocks."""
    import dask

    import dask_agents  # noqa: F401  (agents.* defaults)
    from tests.kv_helpers import generate, prompt_ids
    from dask_agents.worker_plugin.vllm_host import EngineHost
    from dask_agents.model_settings import ModelSettings

    settings = ModelSettings(model="builtin:tiny-llama", load_format="dummy", tokenizer="byte", dtype="bfloat16",
                             max_model_len=2048, kv_cache_memory_bytes=blocks * BLOCK_BYTES,
                             kv_host_bytes="16 MiB", kv_policy="ours")
    with dask.config.set({"agents.kv.tick": "10s"}):
        host = EngineHost(f"look-{blocks}", settings)
        host.start()
        host.wait_loaded(900)
        try:
            for i in range(6):  # live, paused and finished sessions with cached blocks
                generate(host, prompt_ids(i, 1500), f"s{i}")
            for i in range(3):
                host.kv_hint(f"s{i}", "finished").result(30)

            def time_looks(kv) -> dict:
                m = host.kv_manager
                out = {}
                for name, parts in (("events", kv.parts), ("walk", dataclasses.replace(kv.parts, index=None))):
                    kv.parts = parts  # the manager reads kv.parts at each look
                    xs = []
                    for _ in range(looks):
                        t0 = time.perf_counter()
                        view = m.view()
                        stale = sum(1 for _ in view.stale_blocks())
                        xs.append(time.perf_counter() - t0)
                    out[name] = {"median_ms": 1e3 * statistics.median(xs), "min_ms": 1e3 * min(xs),
                                 "max_ms": 1e3 * max(xs), "used_blocks": view.used["accelerator"],
                                 "stale_blocks": stale}
                kv.parts = parts_events
                return out

            parts_events = host.kv.parts
            res = host.kv_call(time_looks).result(600)
        finally:
            host.close()
    res["blocks"] = blocks
    res["walk_over_events"] = res["walk"]["median_ms"] / max(res["events"]["median_ms"], 1e-9)
    return res


def main(argv: list[str] | None = None) -> int:
    """Run it; print the table; write JSON if asked."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, nargs="+", default=[5000, 50000], help="device KV blocks per engine")
    p.add_argument("--looks", type=int, default=50)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    rows = []
    print(f"{'blocks':>8s} {'events (ms)':>18s} {'walk (ms)':>18s} {'walk/events':>12s}  used  stale")
    for n in args.blocks:
        r = measure(n, args.looks)
        e, w = r["events"], r["walk"]
        assert (e["used_blocks"], e["stale_blocks"]) == (w["used_blocks"], w["stale_blocks"]), r
        print(f"{n:8d} {e['median_ms']:7.3f} [{e['min_ms']:.3f}, {e['max_ms']:.3f}] "
              f"{w['median_ms']:7.2f} [{w['min_ms']:.2f}, {w['max_ms']:.2f}] {r['walk_over_events']:11.0f}x  "
              f"{e['used_blocks']}  {e['stale_blocks']}", flush=True)
        rows.append(r)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"config": {"looks": args.looks, "block_bytes": BLOCK_BYTES,
                                  "machine": f"{platform.machine()}, {os.cpu_count()} cpus"},
                       "results": rows}, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
