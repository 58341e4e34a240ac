"""The LLM path against a real vLLM engine (CPU build, tiny dummy-weight model): ``coder`` as
configured by default (the engine in a process of its own beside the worker), and ``inproc``, the
same model stepped in the worker, for the tests that reach into the engine (a crash injected into
its step, its KV manager's state)."""

from __future__ import annotations

import threading

import dask
import pandas as pd
import pytest
from distributed import Client, LocalCluster

import dask_agents as da
from tests.conftest import wait_for

SYSTEM = "You are a careful software engineer. Read the issue and answer with a patch. " * 4


LOADS: dict = {}  # what the module's da.install returned


@pytest.fixture(scope="module")
def client():
    inproc = {**dask.config.get("agents.llm.models.coder"), "process": False}
    # before the cluster (its workers read it); no reallocation between the two models: the
    # tests here count on both workers hosting coder
    with dask.config.set({"agents.llm.models.inproc": inproc, "agents.control.policies.reallocate.enabled": False}):
        with LocalCluster(n_workers=2, threads_per_worker=4, processes=False, dashboard_address=":0") as cluster:
            with Client(cluster) as c:
                LOADS["coder"] = da.install(c, models=["coder"])
                yield c


def test_generate_and_prefix_cache_hit_in_same_session(client):
    coder = da.llm("coder")
    with da.session(client) as s:
        first = coder.generate(SYSTEM + "Issue: the parser drops the last line.", max_tokens=8)
        r1 = first.value(300)
        second = coder.generate(SYSTEM + "Issue: the parser drops the last line. Now add a test.", max_tokens=8)
        r2 = second.value(120)
    assert isinstance(r1, da.LLMResult) and r1.model == "coder"
    assert r1.output_tokens == 8 and len(r1.token_ids) == 8
    assert r1.prompt_tokens == len((SYSTEM + "Issue: the parser drops the last line.").encode())
    assert r2.cached_tokens > 0  # the session's prefix stayed in vLLM's prefix cache
    assert r2.worker == r1.worker  # session affinity: the worker that holds its KV
    assert first.meta.component == "llm.coder" and first.key.startswith("llm.coder-")
    # the engine's own times (vLLM's arrival/finished): inside the call, the second after the first
    assert r1.arrival_time <= r1.finished_time <= r2.arrival_time <= r2.finished_time

    def tokens_reported():
        df = da.telemetry(client, s.id)
        return (df,) if df["cached_tokens"].notna().sum() == 2 else None

    (df,) = wait_for(tokens_reported)
    assert list(df["prompt_tokens"]) == [r1.prompt_tokens, r2.prompt_tokens]
    assert list(df["cached_tokens"]) == [r1.cached_tokens, r2.cached_tokens]
    # KV footprint in whole 128-token blocks of 128 KiB (the tiny model's geometry)
    assert list(df["kv_bytes"]) == [-(-(r.prompt_tokens + 8) // 128) * 128 * 1024 for r in (r1, r2)]
    # time to first token and per output token, from the real engine's steps: inside the call
    assert (df["ttft_s"] > 0).all() and (df["tpot_s"] > 0).all()
    assert (df["ttft_s"] + 7 * df["tpot_s"] <= df["service_s"] + 1e-6).all()


def test_greedy_generation_is_deterministic_and_batches(client):
    coder = da.llm("coder")
    with da.session(client):
        futs = [coder.generate(f"{SYSTEM} request {i}", max_tokens=6) for i in range(6)]
        again = coder.generate(f"{SYSTEM} request 0", max_tokens=6)
        results = [f.value(300) for f in futs]
        assert again.value(120).token_ids == results[0].token_ids
    assert all(r.output_tokens == 6 for r in results)


def test_sessions_spread_over_engine_workers(client):
    coder = da.llm("coder")
    workers = set()
    for i in range(4):
        with da.session(client):
            workers.add(coder.generate(f"session {i} " + SYSTEM, max_tokens=2).value(300).worker)
    assert len(workers) == 2  # each session is pinned, new sessions go to the less loaded engine


def test_unknown_model_is_an_error(client):
    with da.session(client) as s:
        with pytest.raises(da.UnknownModelError, match="'gpt-huge'.*coder") as info:
            da.llm("gpt-huge").generate("hi")
    assert f"llm.gpt_huge.generate (session {s.id})" in str(info.value)


def test_prompt_longer_than_context_is_an_error_and_session_goes_on(client):
    coder = da.llm("coder")
    with da.session(client) as s:
        too_long = coder.generate("x" * 5000, max_tokens=4)
        with pytest.raises(da.PromptTooLongError) as info:
            too_long.value(300)
        msg = str(info.value)
        assert "llm.coder.generate" in msg and s.id in msg and "5000 tokens" in msg and "2048" in msg
        assert coder.generate("short prompt", max_tokens=2).value(120).output_tokens == 2
    with da.session(client):
        with pytest.raises(ValueError, match="max_tokens"):
            coder.generate("hi", max_tokens=0).value(120)


def _kv(model: str, op: str, session: str, dask_worker=None) -> dict | str:
    try:
        return dask_worker.plugins["dask-agents"].engines.kv_directive(model, op, session)
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def test_session_kv_is_tracked_and_dropped_when_the_session_ends(client):
    coder = da.llm("coder")
    with da.session(client) as s:
        r = coder.generate(SYSTEM + " Explain the failing test in detail, please.", max_tokens=4).value(300)
        seen = client.run(_kv, "coder", "inspect", s.id, workers=[r.worker])[r.worker]
        assert seen["residency"]["device_blocks"] == r.prompt_tokens // 128 > 0, (seen, r)
        off = client.run(_kv, "coder", "offload", s.id, workers=[r.worker])[r.worker]
        assert off["result"] == seen["residency"]["device_blocks"] and off["residency"]["host_blocks"] > 0
        again = coder.generate(SYSTEM + " Explain the failing test in detail, please.", max_tokens=4).value(120)
        assert again.cached_tokens == seen["residency"]["device_blocks"] * 128  # restored on demand
        assert again.token_ids == r.token_ids

    def gone():
        out = client.run(_kv, "coder", "inspect", s.id, workers=[r.worker])[r.worker]
        return out if isinstance(out, str) else None

    assert "no KV for session" in wait_for(gone)  # session end invalidated it on the engine
    bad = client.run(_kv, "coder", "shrink", s.id, workers=[r.worker])[r.worker]
    assert "unknown KV directive 'shrink'" in bad


def _kv_state(session: str, dask_worker=None) -> dict | str:
    host = dask_worker.plugins["dask-agents"].engines.start("inproc")
    try:
        return host.kv_call(lambda kv: host.kv_manager.session_state(session)).result(30)
    except Exception as e:
        return f"{type(e).__name__}: {e}"


_TESTS_GO = threading.Event()


@da.tool(kind="code_exec")
def _held_test_run() -> str:
    """A test run that lasts until the test lets it end (in-process workers share the event)."""
    _TESTS_GO.wait(120)
    return "passed"


def test_the_scheduler_tells_the_engine_what_a_session_waits_on(client):
    """An LLM step, then a code_exec tool: the engine's KV manager hears the session paused on
    code_exec (the kind predicts the pause), from the scheduler's hints; when the tool returns
    it hears the session running again (its next step is coming: restore now)."""
    coder = da.llm("inproc")
    _TESTS_GO.clear()
    try:
        with da.session(client) as s:
            r = coder.generate(SYSTEM + " Write the failing test first.", max_tokens=2).value(300)
            tool = da.stub(_held_test_run)()

            def state():
                st = client.run(_kv_state, s.id, workers=[r.worker])[r.worker]
                return st if isinstance(st, dict) else {}

            st = wait_for(lambda: (x := state()).get("wait_key") == "code_exec" and x)
            assert st["state"] == "paused"  # the tool is held: the session waits on it
            _TESTS_GO.set()
            assert tool.value(120) == "passed"
            wait_for(lambda: state().get("state") == "running")
    finally:
        _TESTS_GO.set()


def _crash_next_step(model: str, dask_worker=None) -> int:
    """Make the engine's next step fail (as a dying engine's would); returns its restart count."""
    engines = dask_worker.plugins["dask-agents"].engines
    host = engines.start(model)
    engine = host._engine
    real = engine.step

    def step():
        engine.step = real
        raise RuntimeError("injected engine failure")

    engine.step = step
    return engines.restarts.get(model, 0)


def _restarts(model: str, dask_worker=None) -> tuple[int, bool]:
    engines = dask_worker.plugins["dask-agents"].engines
    return engines.restarts.get(model, 0), engines.start(model).loaded.is_set()


def test_a_crashed_engine_is_restarted_and_its_calls_retried(client):
    coder = da.llm("inproc")
    prompts = [f"{SYSTEM} crash test {i}" for i in range(4)]
    with da.session(client):
        r0 = coder.generate(prompts[0], max_tokens=6).value(300)  # where this session's engine is
        before = client.run(_crash_next_step, "inproc", workers=[r0.worker])[r0.worker]
        futs = [coder.generate(p, max_tokens=6) for p in prompts]
        results = [f.value(300) for f in futs]
    # every call completed on the restarted engine, with the tokens a healthy engine gives
    assert results[0].token_ids == r0.token_ids
    assert all(r.output_tokens == 6 for r in results)
    after, loaded = client.run(_restarts, "inproc", workers=[r0.worker])[r0.worker]
    assert after == before + 1 and loaded


def test_without_restarts_a_crash_is_a_clear_error_on_the_future(client):
    coder = da.llm("inproc")
    with dask.config.set({"agents.llm.engine-restarts": 0}):  # processes=False: the workers read it
        with da.session(client) as s:
            r0 = coder.generate(SYSTEM + " no retry", max_tokens=2).value(300)
            client.run(_crash_next_step, "inproc", workers=[r0.worker])
            doomed = coder.generate(SYSTEM + " no retry, second call", max_tokens=2)
            with pytest.raises(da.EngineStoppedError) as info:
                doomed.value(300)
            msg = str(info.value)
            assert "llm.inproc.generate" in msg and s.id in msg and "crashed" in msg and "injected engine failure" in msg
            # the session goes on: the next call lands on a restarted engine
            assert coder.generate(SYSTEM + " after the crash", max_tokens=2).value(300).output_tokens == 2


def test_kv_directives_over_the_workers_rpc(client):
    """``agents_kv`` is reachable like any worker RPC, for the scheduler (with the secret it sent
    the worker; anyone else is refused: tests/test_ownership.py), and its ``directive`` argument
    does not clash with Dask's own ``op``; a bad argument comes back as a clear error."""

    from distributed.core import rpc

    coder = da.llm("coder")
    with da.session(client) as s:
        r = coder.generate(SYSTEM + " Over the RPC, please.", max_tokens=2).value(300)

        secret = client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.plugins["dask-agents"].roster.secret)

        async def call(**kw):
            async with rpc(r.worker) as w:
                return await w.agents_kv(model="coder", session=s.id, secret=secret, **kw)

        out = client.sync(call, directive="inspect")
        assert out["residency"]["device_blocks"] == r.prompt_tokens // 128
        with pytest.raises(Exception, match="ttl_s must be a number"):
            client.sync(call, directive="retain", args={"ttl_s": "soon"})
        with pytest.raises(Exception, match="positive, finite TTL"):
            client.sync(call, directive="retain", args={"ttl_s": float("inf")})
        with pytest.raises(Exception, match="blocks must be a non-negative int"):
            client.sync(call, directive="offload", args={"blocks": -3})


def test_install_returns_once_every_engine_has_loaded(client):
    """``da.install(client)`` waits for the start-up engines (``wait=True``): when it returns,
    every worker's engine is loaded (or, after a test here crashed it, reloaded), and it returned
    each engine's load time."""
    loads = LOADS["coder"]
    workers = client.scheduler_info()["workers"]
    assert set(loads) == set(workers) and all(set(m) == {"coder"} for m in loads.values())
    state = client.run(lambda dask_worker: {
        m: (h.loaded.is_set(), h.load_error is None, h.load_seconds)
        for m, h in dask_worker.plugins["dask-agents"].engines._hosts.items()})
    for addr, per in state.items():
        loaded, ok, seconds = per["coder"]
        assert loaded and ok and seconds > 0 and loads[addr]["coder"] > 0


def test_an_engine_load_is_queueing_never_a_calls_service_time():
    """A model no worker hosts at start loads on its first call's worker: the call's telemetry
    says how long it waited (``engine_load_s``), counted in ``queue_s``; ``service_s`` is the
    generation alone (before: the first call's service_s was the 11-12 s load)."""
    with LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address=":0") as cluster:
        with Client(cluster) as c:
            assert da.install(c, models=[]) == {next(iter(c.scheduler_info()["workers"])): {}}
            with da.session(c) as s:
                first = da.llm("coder").generate("hello", max_tokens=4).result(timeout=300)
                second = da.llm("coder").generate("hello again", max_tokens=4).result(timeout=300)
            assert first.output_tokens == second.output_tokens == 4

            def rows():
                df = da.telemetry(c, s)
                df = df[(df["kind"] == "llm") & df["service_s"].notna()]
                return df.sort_values("created").to_dict("records") if len(df) == 2 else None

            one, two = wait_for(rows)
            load = one["engine_load_s"]
            assert load > 0 and pd.isna(two["engine_load_s"])  # the second found the engine there
            assert one["queue_s"] >= load  # the wait for the engine is queueing ...
            # ... and its service starts once the engine was there (the load is not in service_s)
            (loaded_at,) = c.run(lambda dask_worker: dask_worker.plugins["dask-agents"].engines._hosts["coder"].started_at
                                 + dask_worker.plugins["dask-agents"].engines._hosts["coder"].load_seconds).values()
            assert one["started"].timestamp() >= loaded_at
