"""The worker's half of a driver's direct call (``dask_agents/direct.py``).

``agents_direct`` (an RPC handler) runs a driver's call of a stateless agent or tool here and
answers with its value or its error, with no scheduler in between. It runs the call only for
a driver the scheduler gave a token (a keyed hash of its client id under the scheduler's secret,
which this worker's stream brought), and only with a thread to spare; otherwise it answers ``busy`` and the driver sends the call down the scheduler path.

The call runs as a call of the worker's fast path (``worker_plugin/local.py``): recorded at its
start and end (the records reach the scheduler plugin on this worker's stream before the answer
leaves), the root of the local calls it makes (they may run here too, in its thread), its LLM
calls on the engines here under admission's lease. Its value goes into this worker's memory
before the answer (the driver then names the key to the scheduler, ``update-data``, so later
work may depend on it); a driver that dropped the call meanwhile says so
(``agents_direct_forget``) and the value goes.
"""

from __future__ import annotations

import asyncio
import contextvars
import hmac
import logging
from collections import Counter, OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from dask_agents.models import DRIVER, NOT_ADMITTED

logger = logging.getLogger(__name__)


MAX_HELD = 100_000
"""Values held for direct calls whose driver may still ask to forget them (key -> client)."""


def _never() -> Any:
    raise RuntimeError("a driver's direct call never goes down the scheduler path from its worker")


class DirectCalls:
    """Runs drivers' direct calls on one worker (owned by its ``AgentsWorkerPlugin``)."""

    def __init__(self, plugin: Any):
        self.plugin = plugin
        self.worker = plugin.worker
        self.pool = ThreadPoolExecutor(max_workers=max(1, self.worker.state.nthreads),
                                       thread_name_prefix="agents-direct")
        self.running: dict[str, Any] = {}
        # key -> the client whose answered call's value this worker holds, newest last
        # (bounded): only that client may have it forgotten (``agents_direct_forget``)
        self.held: OrderedDict[str, str] = OrderedDict()
        self.counts: Counter[str] = Counter()

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def refusal(self, key: Any, ann: Any, client: Any, token: Any, header: Any) -> str | None:
        """Why this worker will not run the call (None: it will)."""
        from dask_agents.tokens import direct_token

        plugin, local = self.plugin, self.plugin.local
        if local is None or not plugin.scheduler_ok or self.worker.status.name != "running":
            return "not ready"
        secret = getattr(plugin, "_secret", None)
        if not (isinstance(ann, dict) and isinstance(header, tuple) and len(header) >= 7 and header[3] == key
                and ann.get("call") == key and ann.get("session") == header[2] and isinstance(client, str)):
            return "malformed"
        if (not secret or not isinstance(token, str)
                or not hmac.compare_digest(token, direct_token(secret, client))):
            return "no token"
        if ann.get("kind") not in ("agent", "tool") or ann.get("stateful") or ann.get("batching"):
            return "not a stateless agent or tool call"
        if key in self.running or key in self.worker.data:
            return "duplicate"
        if local.routed_away(ann.get("component")):
            return "routed elsewhere"
        if len(self.running) + self.worker.state.executing_count >= self.worker.state.nthreads:
            return "no free thread"
        return None

    async def handle(self, comm: Any = None, key: Any = None, ann: Any = None, client: Any = None,
                     token: Any = None, model: Any = None, payload: Any = None, bind: Any = False) -> dict:
        """The ``agents_direct`` RPC: run the call here and answer its outcome."""
        from distributed.protocol import to_serialize

        from dask_agents.worker_plugin import dask_compat
        from dask_agents.worker_plugin.local import ERRED, FINISHED, RUNNING, LocalCall

        try:
            runner, header, target, args, kwargs = payload
        except Exception:
            runner = header = None
        why = self.refusal(key, ann, client, token, header)
        if why is not None:
            self.counts[f"refused:{why}"] += 1
            return {"status": "busy", "why": why}
        local = self.plugin.local
        engines = self.plugin.engines
        if isinstance(model, str) and engines is not None and model in engines.hosted:
            # its LLM calls go to the engine here: a session the scheduler has not bound yet is
            # admitted to it now, while the lease is out (the scheduler binds it on their records)
            if not local.admit_here(model, header[2]) and bind:
                # the driver bound the session itself, and something of the model is short here:
                # the scheduler path, where admission decides where it goes
                self.counts[f"refused:{NOT_ADMITTED}"] += 1
                return {"status": "busy", "why": NOT_ADMITTED}
        call = LocalCall(key=key, creator=DRIVER, ann={**ann, "creator": DRIVER}, run=lambda: runner(
            header, target, args, kwargs), submit=_never, submit_error=_never, client=None, controller=local,
            owner=client, state=RUNNING)
        self.running[key] = call
        worker = self.worker
        ctx = contextvars.copy_context()
        try:
            await asyncio.get_running_loop().run_in_executor(self.pool, ctx.run, _run_as, worker, local, call)
        finally:
            self.running.pop(key, None)
        self.counts["ran"] += 1
        self.plugin.flush()  # its records go on this stream ahead of anything the driver does next
        if call.state == FINISHED:
            value = call.value
            dask_compat.hold_value(worker, key, value)
            self.held[key] = client
            while len(self.held) > MAX_HELD:
                self.held.popitem(last=False)
            return {"status": "OK", "value": to_serialize(value), "nbytes": dask_compat.nbytes(value)}
        if call.state == ERRED:
            return {"status": "error", "exception": to_serialize(call.error)}
        return {"status": "lost", "why": f"ended {call.state}"}

    def forget(self, comm: Any = None, key: Any = None, client: Any = None, token: Any = None) -> None:
        """The ``agents_direct_forget`` RPC: the driver dropped the call before its answer;
        its value, held here for it, goes. Only the driver the value was held for (its token)
        may: any other key, or another client's, is left alone."""
        from dask_agents.tokens import direct_token
        from dask_agents.worker_plugin import dask_compat

        secret = getattr(self.plugin, "_secret", None)
        if (not isinstance(key, str) or not isinstance(client, str) or not isinstance(token, str) or not secret
                or self.held.get(key) != client or not hmac.compare_digest(token, direct_token(secret, client))):
            self.counts["refused:forget"] += 1
            return
        del self.held[key]
        dask_compat.drop_value(self.worker, key)
        self.counts["forgotten"] += 1

    def snapshot(self) -> dict:
        return {"running": len(self.running), **self.counts}


def _run_as(worker: Any, local: Any, call: Any) -> None:
    """In a pool thread: run ``call`` as this worker's (``get_worker()``, ``get_client()``)."""
    from dask_agents.worker_plugin import dask_compat

    with dask_compat.as_worker(worker):
        local.run_direct(call)
