"""An engine in its own process (``process: true``, worker_plugin/process_host.py): the same
answers and per-session KV control as the engine in the worker, and every way the process can
end (closed, killed, a bad configuration, its worker gone) ends in a clear error, never a hang
or an orphaned process. Real child processes; the emulated engine, and once the real vLLM CPU
engine with the tiny dummy-weight model."""

from __future__ import annotations

import os
import signal

import dask
import pytest
from distributed import Client, LocalCluster

import dask_agents as da
from dask_agents.errors import EngineLoadError, EngineStoppedError
from dask_agents.kv.runtime.engine_kv import KVDirectiveError
from dask_agents.model_settings import ModelSettings
from dask_agents.worker_plugin.engines import make_host
from dask_agents.worker_plugin.process_host import ProcessEngineHost
from tests.conftest import wait_for

EMU = {"model": "emulated-llama", "engine": "emulated", "tokenizer": "byte", "max-model-len": 4096,
       "emulation": {"time_scale": 0.001, "kv_blocks": 256, "host_kv_blocks": 256}}


def emulated(process: bool, **extra) -> object:
    host = make_host("emu", ModelSettings(**{**EMU, **extra, "process": process}))
    host.start()
    host.wait_loaded(60)
    return host


def run(host, prompts: list[list[int]], session: str | None = None, max_tokens: int = 6) -> list:
    """The prompts one after the other (each sees the KV the ones before left)."""
    params = host.sampling_params(max_tokens, 0.0, None)
    return [host.submit(f"{session}-{i}", p, params, session).result(60) for i, p in enumerate(prompts)]


def test_the_same_answers_counters_and_kv_as_the_engine_in_the_worker():
    prompts = [list(range(40 + 16 * i)) for i in range(4)]
    inproc, proc = emulated(False), emulated(True)
    try:
        assert isinstance(proc, ProcessEngineHost) and proc.pid not in (None, os.getpid())
        a, b = run(inproc, prompts, "s1"), run(proc, prompts, "s1")
        assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
        assert [o.num_cached_tokens for o in a] == [o.num_cached_tokens for o in b]
        keys = ("queries", "hits", "prefill_tokens", "decode_tokens")
        assert {k: inproc.stats()[k] for k in keys} == {k: proc.stats()[k] for k in keys}
        assert proc.steps == inproc.steps > 0  # mirrored from the child's stats
        # per-session KV control runs in the child, beside the engine's blocks
        assert proc.kv_control and proc.geometry == inproc.geometry
        assert proc.kv_directive("inspect", "s1") == inproc.kv_directive("inspect", "s1")
        assert proc.kv_directive("offload", "s1")["result"] == inproc.kv_directive("offload", "s1")["result"]
        assert proc.kv_directive("inspect", "s1")["residency"]["host_blocks"] > 0
        assert set(proc.kv_report()) == set(inproc.kv_report())
        with pytest.raises(KVDirectiveError, match="unknown session state"):
            proc.kv_hint("s1", "tool-call").result(30)  # the child's error, as the host raises it
        # first-token times come back from the child: TTFT and TPOT as for any engine
        run(proc, [list(range(300, 340))], "s2")
        times = proc.token_times.pop("s2-0", 6)
        assert times["ttft_s"] >= 0 and times["tpot_s"] >= 0
    finally:
        inproc.close()
        proc.close()


def test_close_ends_the_process_and_later_calls_fail_clearly():
    host = emulated(True)
    proc = host._proc  # noqa: SLF001 (the child this host started)
    host.close()
    assert proc.poll() is not None  # gone, not orphaned
    with pytest.raises(EngineStoppedError, match="was stopped"):
        host.submit("late", [1, 2, 3], host.sampling_params(2, 0.0, None), None).result(30)


def test_a_killed_process_fails_its_callers_and_marks_the_host_crashed():
    host = emulated(True, emulation={"time_scale": 1.0, "kv_blocks": 256})  # slow: the call is still running
    fut = host.submit("r", list(range(64)), host.sampling_params(500, 0.0, None), "s")
    os.kill(host.pid, signal.SIGKILL)
    with pytest.raises(EngineStoppedError, match=f"pid {host.pid}") as info:
        fut.result(60)
    assert info.value.crashed and host.crashed is not None  # the registry restarts a crashed host
    host.close()


def test_the_child_leaves_when_its_worker_does():
    """The worker died without closing the engine: the child sees its pipe close and exits."""
    host = emulated(True)
    proc = host._proc  # noqa: SLF001
    host._down.close()  # noqa: SLF001 (what the worker's death does to the pipe)
    assert proc.wait(60) == 0
    host.close()


def test_a_bad_configuration_is_a_load_error_naming_it():
    host = make_host("emu", ModelSettings(**{**EMU, "emulation": {"no_such_knob": 1}, "process": True}))
    host.start()
    with pytest.raises(EngineLoadError, match="no_such_knob"):
        host.wait_loaded(60)
    assert host._proc.wait(60) == 0  # noqa: SLF001 (the child ended after reporting it)
    wait_for(lambda: not host._reader.is_alive())  # noqa: SLF001 (and the proxy saw its pipe close)
    assert host.crashed is None  # a failed load, not a crash: the registry does not restart it in a loop
    host.close()


def test_process_is_moot_for_vllm_async():
    """A user who switches the default model to vllm-async keeps its ``process: true`` (Dask's
    config merges entries): AsyncLLM's engine core is in a child process already."""
    from dask_agents.worker_plugin.async_engine import AsyncEngineHost

    host = make_host("m", ModelSettings(model="builtin:tiny-llama", engine="vllm-async", process=True))
    assert isinstance(host, AsyncEngineHost)  # constructed only: nothing starts


def test_through_a_cluster_with_a_restart_after_the_process_is_killed():
    """The whole stack: da.llm on a worker whose engine runs in its own process; killing that
    process is a crash like any engine's: the registry restarts it and the next call is served."""
    prompt = "You are a careful engineer. Read the issue and answer with a patch. " * 2
    with dask.config.set({"agents.llm.models": {"emu": {**EMU, "process": True}}}):
        with LocalCluster(n_workers=1, processes=False, threads_per_worker=4, dashboard_address=":0") as cluster:
            with Client(cluster) as client:
                da.install(client, models=["emu"])
                with da.session(client):
                    r1 = da.llm("emu").generate(prompt + "Issue 1.", max_tokens=8).value(60)
                    r2 = da.llm("emu").generate(prompt + "Issue 1. Now add a test.", max_tokens=8).value(60)
                    pid = client.run(lambda dask_worker: dask_worker.plugins["dask-agents"].engines.start("emu").pid)
                    (pid,) = pid.values()
                    os.kill(pid, signal.SIGKILL)
                    wait_for(lambda: client.run(lambda dask_worker: dask_worker.plugins["dask-agents"]
                                                .engines.start("emu").pid != pid))
                    r3 = da.llm("emu").generate(prompt + "Issue 1.", max_tokens=8).value(60)
    assert r1.output_tokens == 8 and r2.cached_tokens > 0 and r1.emulated
    assert r3.token_ids == r1.token_ids  # the restarted engine answers as the first did


@pytest.mark.timeout(600)
def test_a_real_vllm_engine_in_its_own_process_keeps_per_session_kv_control():
    """The real CPU engine (tiny dummy-weight model) in a child process: greedy tokens, prefix
    hits for a session's follow-up, and the KV directives of the in-worker engine (offload to
    the host tier, then prefetch) run beside its block pool."""
    settings = ModelSettings(model="builtin:tiny-llama", load_format="dummy", tokenizer="byte", dtype="bfloat16",
                             max_model_len=1024, kv_cache_memory_bytes="2 MiB", kv_host_bytes="1 MiB",
                             kv_policy="none", process=True)
    host = make_host("tiny", settings)
    host.start()
    try:
        host.wait_loaded(500)
        assert host.kv_control, host.kv_control_reason
        prompt = [(7 * i) % 200 + 10 for i in range(300)]
        (first,) = run(host, [prompt], "s", max_tokens=5)
        (again,) = run(host, [prompt + [11, 12]], "s", max_tokens=5)
        assert len(first.outputs[0].token_ids) == 5 and again.num_cached_tokens >= 128
        # the output crosses as plain Python: unpickling vLLM's RequestOutput imported vLLM into
        # the worker (4.5 s at the first answer, benchmarks/first_answer.py)
        from dask_agents.worker_plugin.host import PlainOutput

        assert type(first) is PlainOutput and first.finished and first.outputs[0].finish_reason == "length"
        res = host.kv_directive("inspect", "s")["residency"]
        assert res["device_blocks"] > 0
        moved = host.kv_directive("offload", "s")["result"]
        assert moved > 0 and host.kv_directive("inspect", "s")["residency"]["host_blocks"] == moved
        assert host.kv_directive("prefetch", "s")["result"] == moved
    finally:
        host.close()


def test_errors_cross_as_names_and_text_and_come_back_as_their_class():
    """What the child raises reaches the caller as the same class for ours and Python's own
    (EngineStoppedError keeps ``crashed``, ImportError its module name, which the install hint
    needs); anything else as a RuntimeError naming it: nothing arbitrary is unpickled."""
    from dask_agents.worker_plugin.process_host import _portable, _rebuild

    class Odd(Exception):
        def __init__(self, a, b):
            super().__init__(f"{a}/{b}")

    stopped = _rebuild(_portable(EngineStoppedError("engine died", crashed=True)))
    assert type(stopped) is EngineStoppedError and stopped.crashed and "engine died" in str(stopped)
    missing = _rebuild(_portable(ModuleNotFoundError("No module named 'vllm'", name="vllm")))
    assert type(missing) is ModuleNotFoundError and missing.name == "vllm"
    assert type(_rebuild(_portable(KVDirectiveError("no host tier")))) is KVDirectiveError
    odd = _rebuild(_portable(Odd(1, 2)))
    assert type(odd) is RuntimeError and "Odd" in str(odd) and "1/2" in str(odd)


def test_the_child_imports_its_engine_with_the_collector_off_then_frozen():
    """The child's engine library is imported with gc off (its start-up collections walked the
    import's heap again and again) and that heap frozen, the collector on again after, also when
    the import fails (a failed load must not leave the process collecting nothing)."""
    import subprocess
    import sys

    code = (
        "import gc, sys\n"
        "from dask_agents.model_settings import ModelSettings\n"
        "from dask_agents.worker_plugin.process_host import _import_engine\n"
        "gc.disable()\n"
        "_import_engine(ModelSettings(model='emulated-llama', engine='emulated'))\n"
        "print(gc.isenabled(), gc.get_freeze_count() > 0)\n"
        "gc.unfreeze(); gc.disable()\n"
        "sys.modules['vllm'] = None  # an import that fails\n"
        "try:\n"
        "    _import_engine(ModelSettings(model='builtin:tiny-llama'))\n"
        "except ImportError:\n"
        "    print(gc.isenabled(), gc.get_freeze_count() > 0)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["True", "True", "True", "True"], out.stderr[-2000:]
