"""Pause and resume at tool boundaries (issue 28) on a real vLLM engine (CPU build, tiny
dummy-weight model, stepped in the worker): a session paused on a long tool is parked, a waiting
session takes its room, and the parked session's KV comes back from the host tier exactly.

The engine has 2 MiB of KV (16 blocks of 128 tokens) and a 4 MiB host tier. Session A (700
prompt tokens, 40 output: 6 blocks) waits on a test run; session B (1,300 + 40 tokens: 11
blocks) does not fit beside it under the engine's limit (0.9 x its blocks) and would wait for
``max-wait``; parked, A makes room: B is admitted and served, A's KV goes to the host for B's
prefill, and A's next call, after its tool, finds its prompt cached and decodes (greedy) exactly
what a cold run of the same prompt decodes.
"""

from __future__ import annotations

import threading
import time

import dask
import pytest
from distributed import Client, LocalCluster

import dask_agents as da
from dask_agents.scheduler_plugin.plugin import NAME
from tests.conftest import wait_for

MODEL = {"model": "builtin:tiny-llama", "load-format": "dummy", "tokenizer": "byte", "dtype": "bfloat16",
         "max-model-len": 1536, "kv-cache-memory-bytes": "2 MiB", "kv-host-bytes": "4 MiB", "process": False,
         "kv-policy": "ours"}
CONFIG = {"agents.llm.models": {"parkable": MODEL}, "agents.scheduler.admission.max-wait": "60s",
          "agents.control.policies.reallocate.enabled": False, "agents.emulation.time-scale": 1.0}
PROMPT_A = "".join(chr(97 + (i * 7) % 26) for i in range(700))
PROMPT_B = "".join(chr(65 + (i * 11) % 26) for i in range(1300))
_GO = threading.Event()


@da.tool(kind="code_exec")
def held_test_run() -> str:
    """A test run that lasts until the test lets it end."""
    _GO.wait(120)
    return "passed"


@pytest.fixture(scope="module")
def client():
    with dask.config.set(CONFIG):
        with LocalCluster(n_workers=1, threads_per_worker=4, processes=False, dashboard_address=":0") as cluster:
            with Client(cluster) as c:
                da.install(c, models=["parkable"])
                yield c


def _admission(client: Client):
    return client.cluster.scheduler.plugins[NAME].admission


def test_a_parked_sessions_kv_comes_back_from_the_host_exactly(client):
    adm = _admission(client)
    plugin = client.cluster.scheduler.plugins[NAME]
    (worker,) = client.cluster.workers.values()
    host = worker.plugins["dask-agents"].engines.start("parkable")
    wait_for(lambda: any(r.host_free for r in adm.engines.values()))
    (room,) = adm.engines.values()
    llm = da.llm("parkable")
    _GO.clear()
    try:
        with da.session(client) as sa:
            first = llm.generate(PROMPT_A, max_tokens=40).value(300)
            run = da.stub(held_test_run)()
            wait_for(lambda: sa.id in adm.parked(room, time.time()))
            with da.session(client):
                out_b = llm.generate(PROMPT_B, max_tokens=40).value(300)
            assert out_b.output_tokens == 40
            assert adm.counts["admitted_parked"] == 1 and adm.counts["waited_out"] == 0
            traffic = (host.kv_report() or {}).get("kv_traffic_bytes", {})
            assert traffic.get("offloaded", 0) > 0  # A's blocks made room for B's prefill
            _GO.set()
            assert run.value(60) == "passed"
            again = llm.generate(PROMPT_A + " and now the tests pass", max_tokens=16).value(300)
        assert first.cached_tokens == 0 and again.cached_tokens >= 640  # its 5 full prompt blocks
        assert host.kv_report()["kv_traffic_bytes"]["restored"] > 0
        wait_for(lambda: sa.id not in plugin.kv_hints.holders)
        with da.session(client):  # A ended: its KV is gone; the same prompt computed cold
            cold = llm.generate(PROMPT_A + " and now the tests pass", max_tokens=16).value(300)
        assert cold.cached_tokens < again.cached_tokens
        assert cold.token_ids == again.token_ids  # restored KV decodes exactly what recomputed KV does
    finally:
        _GO.set()
