"""Where a driver's direct agent call spends its time, stage by stage: one e2e unit of
dask-agents, run ``--reps`` times, every direct call (``dask_agents/direct.py`` ->
``worker_plugin/direct.py``) stamped at each hand-off between threads and processes, and the
stages summarized per agent role (wall ms: median, P90, mean).

    python benchmarks/hop_stages.py --workflow finance --job 2/24 \\
        --choices benchmarks/results/e2e-finance-choose.json --json out.json

Stages, in order (``issued`` is the program's ``rt.agent`` in the driver):

- ``pack``: the stub call until the payload is pickled (caller's thread);
- ``send``: pickled -> handed to the client's event loop; ``go``: the loop picks it up;
- ``w_recv``: the RPC reaches the worker's handler (comm, both event loops);
- ``w_t0``: the handler's checks and admission, then a pool thread starts the call;
- ``w_t1``: the agent's body (its own tool and LLM calls included: not overhead);
- ``w_ret``: back on the worker's loop, records flushed, the answer returned;
- ``settle0``: the answer reaches the driver's loop; ``settle1``: the key registered, the
  call pinned as its task, the future finished; ``woke``: the caller's thread wakes.

The stamps are a Dask worker preload (this file: ``dask_setup``) and the same wrappers in the
driver, around the product's own functions; nothing else changes. EMULATED engines.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ENV_DIR = "AGENTS_HOP_STAGES_DIR"
STAGES = ("issued", "pack0", "pack1", "send", "go", "w_recv", "w_t0", "w_t1", "w_ret", "settle0", "settle1", "woke")
_rows: list = []
_tl = threading.local()


def _stamp(key: str, stage: str, t: float | None = None) -> None:
    _rows.append((key, stage, time.time() if t is None else t))  # list.append: atomic under the GIL


def _flusher(path: str) -> None:
    while True:
        time.sleep(0.5)
        rows = _rows[:]
        del _rows[:len(rows)]
        if rows:
            with open(path, "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)


def record() -> None:
    """Wrap the direct path's functions (driver and worker halves) to stamp every stage into a
    file of this process under ``$AGENTS_HOP_STAGES_DIR`` (idempotent)."""
    from dask_agents import direct
    from dask_agents.worker_plugin import direct as wdirect

    if getattr(direct, "_hop_stages", False):
        return
    direct._hop_stages = True
    out_dir = os.environ[_ENV_DIR]
    threading.Thread(target=_flusher, args=(os.path.join(out_dir, f"{os.getpid()}.jsonl"),), daemon=True).start()
    pack, send, go, settle, wait = direct.pack, direct.send, direct._go, direct._settle, direct.wait

    def pack_stamped(runner: Any, target: Any, header: tuple, args: tuple, kwargs: dict) -> Any:
        _stamp(header[3], "issued", getattr(_tl, "issued", None))
        _stamp(header[3], "pack0")
        try:
            return pack(runner, target, header, args, kwargs)
        finally:
            _stamp(header[3], "pack1")

    def send_stamped(client: Any, routes: Any, where: Any, header: tuple, *a: Any, **kw: Any) -> Any:
        _stamp(header[3], "send")
        return send(client, routes, where, header, *a, **kw)

    async def go_stamped(client: Any, routes: Any, call: Any, msg: dict) -> None:
        _stamp(call.key, "go")
        await go(client, routes, call, msg)

    def settle_stamped(client: Any, routes: Any, call: Any, answer: dict) -> None:
        _stamp(call.key, "settle0")
        try:
            settle(client, routes, call, answer)
        finally:
            _stamp(call.key, "settle1")

    def wait_stamped(call: Any, timeout: float | None) -> bool:
        try:
            return wait(call, timeout)
        finally:
            _stamp(call.key, "woke")

    direct.pack, direct.send, direct._go, direct._settle, direct.wait = (
        pack_stamped, send_stamped, go_stamped, settle_stamped, wait_stamped)
    handle, run_as = wdirect.DirectCalls.handle, wdirect._run_as

    async def handle_stamped(self: Any, comm: Any = None, key: Any = None, **kw: Any) -> dict:
        _stamp(key, "w_recv")
        try:
            return await handle(self, comm=comm, key=key, **kw)
        finally:
            _stamp(key, "w_ret")

    def run_as_stamped(worker: Any, local: Any, call: Any) -> None:
        _stamp(call.key, "w_t0")
        try:
            run_as(worker, local, call)
        finally:
            _stamp(call.key, "w_t1")

    wdirect.DirectCalls.handle, wdirect._run_as = handle_stamped, run_as_stamped
    from benchmarks.e2e import program

    agent = program.FuturesRuntime.agent

    def agent_stamped(self: Any, role: str, fn: Any, *args: Any) -> Any:
        _tl.issued = time.time()
        return agent(self, role, fn, *args)

    program.FuturesRuntime.agent = agent_stamped


def dask_setup(worker: Any = None) -> None:
    """Worker preload: stamp the worker's half."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    record()


def summarize(out_dir: str) -> dict:
    """Per agent role (the key's prefix): calls, and per stage the median, P90 and mean wall ms
    from the stage before; ``overhead_ms``: issued -> woke less the body."""
    calls: dict[str, dict[str, float]] = defaultdict(dict)
    for name in os.listdir(out_dir):
        with open(os.path.join(out_dir, name)) as f:
            for line in f:
                key, stage, t = json.loads(line)
                if t is not None:
                    calls[key][stage] = t
    complete = {k: c for k, c in calls.items() if all(s in c for s in STAGES)}
    by_role: dict[str, list[dict]] = defaultdict(list)
    for k, c in complete.items():
        by_role[k.rsplit("-", 1)[0]].append(c)

    def dist(xs: list[float]) -> dict:
        xs = sorted(xs)
        return {"p50": round(statistics.median(xs), 3), "p90": round(xs[min(len(xs) - 1, int(0.9 * len(xs)))], 3),
                "mean": round(statistics.fmean(xs), 3)}

    out = {"calls": len(calls), "complete": len(complete), "roles": {}}
    for role, cs in sorted(by_role.items()):
        stages = {b: dist([(c[b] - c[a]) * 1e3 for c in cs]) for a, b in zip(STAGES, STAGES[1:])}
        overhead = dist([((c["woke"] - c["issued"]) - (c["w_t1"] - c["w_t0"])) * 1e3 for c in cs])
        out["roles"][role] = {"calls": len(cs), "stages_ms": stages, "overhead_ms": overhead}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workflow", required=True)
    ap.add_argument("--job", required=True, help="the unit, as e2e.py measure's --job K/N")
    ap.add_argument("--choices", required=True)
    ap.add_argument("--variant", default="dask-agents", help="a dask-agents variant (dask-agents@KEY=VALUE too)")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(a.reps):
            out_dir = os.path.join(tmp, str(rep))
            os.makedirs(out_dir)
            unit = os.path.join(tmp, f"{rep}.json")
            env = {**os.environ, _ENV_DIR: out_dir, "PYTHONPATH": ROOT,
                   "DASK_DISTRIBUTED__WORKER__PRELOAD": json.dumps([os.path.abspath(__file__)])}
            cli = ["measure", "--workflow", a.workflow, "--job", a.job, "--choices", a.choices,
                   "--variants", a.variant, "--json", unit]
            code = (f"import sys; sys.path.insert(0, {ROOT!r}); from benchmarks import hop_stages; "
                    f"hop_stages.record(); from benchmarks.e2e.cli import main; sys.exit(main({cli!r}))")
            subprocess.run([sys.executable, "-c", code], env=env, check=True, stdout=subprocess.DEVNULL)
            with open(unit) as f:
                m = json.load(f)["units"][0]["metrics"]
            run = {"rep": rep, "mean_s": round(m["mean_s"], 3),
                   "overhead_parts_s": {k: round(x, 4) for k, x in m["overhead_parts_s"].items()},
                   **summarize(out_dir)}
            runs.append(run)
            print(json.dumps(run))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"workflow": a.workflow, "job": a.job, "variant": a.variant, "reps": a.reps,
                       "engines": "EMULATED", "clock": "wall ms (time.time() of processes on one machine)",
                       "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
