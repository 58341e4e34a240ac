"""One bad request fails alone (issue 13), on the real vLLM CPU engine (tiny dummy-weight model,
in-process) unless a test says otherwise.

- inputs are checked against the model before they reach the engine (token ids inside the
  vocabulary, text that can be encoded, seeds, sampling parameters): a clear InvalidRequestError
  naming the call, and the engine never sees them;
- a request that gets past the checks and crashes the step that first scheduled it fails alone
  (EngineStepError); the requests in flight before it are retried on the restarted engine;
- a replaced engine is shut down through vLLM's own teardown before its successor loads;
- an engine given up (restarted too often) is no longer announced: the scheduler places its
  model's calls on the other hosts until it is back.

Tests poll for state; none sleeps or times itself.
"""

from __future__ import annotations

import gc
import threading

import dask
import pytest
from distributed import Client, LocalCluster

import dask_agents as da
from dask_agents.errors import AgentsError, EngineStepError, InvalidRequestError
from dask_agents.kv.runtime import vllm_compat
from tests.conftest import wait_for
from tests.kv_helpers import generate as run
from tests.kv_helpers import prompt_ids
from dask_agents.worker_plugin import engines as engine_module
from dask_agents.worker_plugin.vllm_host import EngineHost
from dask_agents.worker_plugin.engines import Engines

TINY = {"model": "builtin:tiny-llama", "load-format": "dummy", "tokenizer": "byte", "dtype": "bfloat16",
        "max-model-len": 1024, "kv-cache-memory-bytes": "16 MiB", "kv-policy": "none"}
MODELS = {"tiny": TINY, "tiny2": TINY}
PROMPT = "You are a careful software engineer. Read the failing test and answer with a patch. " * 2
VOCAB = 1024  # worker_plugin/models/tiny-llama/config.json


# -- a replaced engine is shut down before its successor loads (no other engine in this process
#    yet: these run before the module's cluster starts, in file order) -------------------------

def test_a_replaced_engine_is_shut_down_before_its_successor_loads(monkeypatch):
    """A crashed engine is torn down by vLLM's own shutdown on its thread, before the restarted
    one loads. Before: nothing shut it down; vLLM's finalizer ran whenever the old engine was
    collected (a traceback or log record holding it is enough to delay that) and destroyed the
    process's distributed groups under the successor, whose next step failed with "pipeline
    model parallel group is not initialized". Also with a second engine in the process, which
    must keep serving through the other one's restart."""
    events: list[str] = []
    real_load = EngineHost._load

    def load(self):
        events.append(f"load {self.name}")
        return real_load(self)

    real_shutdown = getattr(vllm_compat, "shutdown_engine", None)

    def shutdown(engine):
        events.append("shutdown")
        real_shutdown(engine)

    monkeypatch.setattr(EngineHost, "_load", load)
    monkeypatch.setattr(vllm_compat, "shutdown_engine", shutdown, raising=False)
    ids = prompt_ids(7, 300)
    with dask.config.set({"agents.llm.models": MODELS}):
        engines = Engines("test-worker", ["tiny"])
        try:
            first = engines.start("tiny")
            first.wait_loaded(300)
            ref = run(first, ids)[0]
            for phase in ("alone", "beside another engine"):
                if phase == "beside another engine":
                    other = engines.start("tiny2")
                    other.wait_loaded(300)
                    assert run(other, ids)[0] == ref
                    # two engines of one process stepping at once: each gets its own tokens
                    # (before: vLLM's process-global forward context mixed them up)
                    assert _concurrently([(engines.start("tiny"), ids), (other, ids)] * 2) == [ref] * 4
                host = engines.start("tiny")
                held = host._engine  # outlives the crash, as a traceback or a log record may
                events.clear()
                _crash_next_step(host)
                with pytest.raises(da.EngineStoppedError):
                    run(host, ids)
                wait_for(lambda: not host._thread.is_alive())
                successor = engines.start("tiny")  # the restart
                successor.wait_loaded(300)
                assert events == ["shutdown", "load tiny"], events  # the old engine went first
                del held
                gc.collect()  # vLLM's finalizer of the old engine, if it were still armed, runs here
                assert run(successor, ids)[0] == ref  # the successor's distributed groups are intact
                if phase == "beside another engine":
                    assert run(other, ids)[0] == ref  # and so are the other engine's
            assert engines.restarts["tiny"] == 2
        finally:
            engines.close()


def _concurrently(calls: list) -> list:
    """Run ``(host, ids)`` requests from one thread each, all at once; their output tokens."""
    outs: list = [None] * len(calls)

    def one(i, host, ids):
        try:
            outs[i] = run(host, ids, max_tokens=16)[0][:4]
        except Exception as e:  # reported as a mismatch
            outs[i] = repr(e)

    threads = [threading.Thread(target=one, args=(i, h, ids)) for i, (h, ids) in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outs


def _crash_next_step(host: EngineHost) -> None:
    """The host's next engine step raises (before scheduling anything: no request is blamed).
    Nothing here references the engine: only the test's ``held`` keeps it alive (the logged
    traceback holds no frame that references it)."""
    host._engine.step = _failing_step


def _failing_step():
    raise RuntimeError("injected engine failure")


# -- through a cluster ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def client():
    with dask.config.set({"agents.llm.models": MODELS}):  # before the cluster: in-process workers share it
        with LocalCluster(n_workers=1, threads_per_worker=4, processes=False, dashboard_address=":0") as cluster:
            with Client(cluster) as c:
                da.install(c, models=["tiny"])
                yield c


def _engine_state(model: str = "tiny", dask_worker=None) -> tuple[int, int]:
    """(restarts of ``model``'s engine, its steps so far)."""
    engines = dask_worker.plugins["dask-agents"].engines
    return engines.restarts.get(model, 0), engines.start(model).steps


def _state(client) -> tuple[int, int]:
    return client.run(_engine_state).popitem()[1]


def test_a_token_outside_the_vocabulary_fails_alone_and_the_engine_lives(client):
    """Before: 10**6 passed every check (vLLM checks ids only through the tokenizer our engines
    skip), crashed the step (an embedding lookup out of range) with the other calls in flight,
    was retried with them and crashed the restarted engine again."""
    tiny = da.llm("tiny")
    with da.session(client) as s:
        ref = tiny.generate(PROMPT, max_tokens=8).value(300)
        restarts, _ = _state(client)
        innocent = tiny.generate(PROMPT, max_tokens=8)
        poison = tiny.generate([5, 6, 10**6, 7], max_tokens=2)
        with pytest.raises(InvalidRequestError) as info:
            poison.value(120)
        assert innocent.value(120).token_ids == ref.token_ids
    err = info.value
    assert isinstance(err, AgentsError) and isinstance(err, ValueError)
    msg = str(err)
    assert f"llm.tiny.generate (session {s.id})" in msg and poison.key in msg, msg
    assert "1000000" in msg and "position 2" in msg and f"vocabulary of {VOCAB}" in msg, msg
    assert _state(client)[0] == restarts  # the engine never saw it


@da.agent
class Reader:
    """Reads with four long generations at once (what a request's failing branch leaves behind)."""

    def read(self, n: int) -> list[str]:
        futs = [da.llm("tiny").generate(f"{PROMPT} part {i}", max_tokens=800) for i in range(n)]
        return [f.value(300).text for f in futs]


def _llm_in_flight(dask_worker=None) -> tuple[list[str], list[str]]:
    engines = dask_worker.plugins["dask-agents"].engines
    return sorted(engines._inflight), sorted(engines._given_up)  # noqa: SLF001


def test_llm_calls_of_a_given_up_request_stop_in_the_engine(client):
    """Before: the request's calls showed cancelled while their generations ran to the end in
    the engine (Dask lets a released coroutine task finish), holding batch slots and KV."""
    with pytest.raises(RuntimeError, match="saw an error"):
        with da.session(client) as s:
            reading = da.stub(Reader).read(4)  # noqa: F841 (held: a dropped future is cancelled at once)
            wait_for(lambda: len(client.run(_llm_in_flight).popitem()[1][0]) == 4, timeout=120)
            keys = client.run(_llm_in_flight).popitem()[1][0]
            raise RuntimeError("the driver saw an error")
    # the session was given up: the Reader was cancelled, its LLM calls too, and the engine
    # dropped their requests (they left the engine without finishing their 800 tokens)
    inflight, given_up = wait_for(lambda: (st := client.run(_llm_in_flight).popitem()[1]) and not st[0] and st,
                                  timeout=60)
    assert set(keys) <= set(given_up)
    df = wait_for(lambda: (d := da.telemetry(client, s.id)) is not None and (d["state"] == "cancelled").sum() == 5
                  and (d,))[0]
    assert set(df[df["component"] == "llm.tiny"]["key"]) == set(keys)


def test_bad_text_seeds_and_sampling_parameters_are_named_errors(client):
    tiny = da.llm("tiny")
    with da.session(client) as s:
        # text that is not valid Unicode (a lone surrogate): at the call site, or from a future
        with pytest.raises(InvalidRequestError, match=r"generate: the prompt text cannot be encoded") as info:
            tiny.generate("fix \ud800 this", max_tokens=2)
        assert s.id in str(info.value)
        text = client.submit(lambda: "fix \ud800 this", pure=False)
        late = tiny.generate(text, max_tokens=2)
        with pytest.raises(InvalidRequestError, match="the prompt text cannot be encoded") as info:
            late.value(120)
        assert f"llm.tiny.generate (session {s.id})" in str(info.value) and late.key in str(info.value)
        # a seed torch cannot take would crash the step that seeds the request
        with pytest.raises(InvalidRequestError, match=r"seed must be in"):
            tiny.generate(PROMPT, max_tokens=2, temperature=0.5, seed=2**70)
        # a temperature vLLM refuses (> 2) is this call's error, named
        hot = tiny.generate(PROMPT, max_tokens=2, temperature=5.0)
        with pytest.raises(InvalidRequestError, match="refuses the sampling parameters") as info:
            hot.value(120)
        assert hot.key in str(info.value) and "temperature=5.0" in str(info.value)
        # callers of the worker's engines directly get the same checks
        header = ("llm.tiny", "generate", s.id, "direct-call-1", False, None)
        with pytest.raises(InvalidRequestError, match=r"seed must be None or an int") as info:
            client.submit(_generate_here, header, list(range(3, 40)), 0.5, 2**70, pure=False).result(120)
        assert "direct-call-1" in str(info.value) and str(2**70) in str(info.value)
        with pytest.raises(InvalidRequestError, match="token ids must be ints"):
            client.submit(_generate_here, header, [5, "6"], 0.0, None, pure=False).result(120)
        assert tiny.generate(PROMPT, max_tokens=2).value(120).output_tokens == 2
    assert _state(client)[0] == 0


def _generate_here(header, prompt, temperature, seed):
    from dask_agents.worker_plugin.plugin import get_plugin

    return get_plugin().engines.generate(header, "tiny", prompt, max_tokens=2, temperature=temperature, seed=seed)


def test_a_request_that_crashes_its_first_step_fails_alone_and_the_others_are_retried(client, monkeypatch):
    """Defence in depth: with the checks bypassed, the out-of-vocabulary id reaches the engine
    and crashes the step that first schedules it. That call fails, named, and is not retried;
    the call that was decoding meanwhile is retried on the restarted engine and completes with
    the tokens of a healthy run. Before: the bad call was retried too, crashed the restarted
    engine again, and the innocent call failed with it."""
    def unchecked(self, header, model, host, prompt, sampling):
        return host.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    monkeypatch.setattr(Engines, "_check_inputs", unchecked, raising=False)
    tiny = da.llm("tiny")
    long_prompt = PROMPT + " Explain every step."
    with da.session(client) as s:
        # long enough that it is still decoding when the poison's step fails, whichever CPU kernel runs
        ref = tiny.generate(long_prompt, max_tokens=800).value(300)
        restarts, steps = _state(client)
        innocent = tiny.generate(long_prompt, max_tokens=800)
        wait_for(lambda: _state(client)[1] >= steps + 3, timeout=120)  # it is decoding: scheduled before
        poison = tiny.generate([5, 6, 10**6, 7], max_tokens=2)
        with pytest.raises(EngineStepError) as info:
            poison.value(120)
        assert not innocent.done()  # it was in flight when the step failed (800 tokens to go again)
        assert innocent.value(300).token_ids == ref.token_ids
    msg = str(info.value)
    assert f"llm.tiny.generate (session {s.id})" in msg and poison.key in msg, msg
    assert "first scheduled" in msg and "not retried" in msg and "IndexError" in msg, msg
    assert info.value.crashed
    assert _state(client)[0] == restarts + 1  # one crash, one restart: the bad call was not retried


# -- an engine given up leaves the scheduler's hosts (emulated engines: placement, not vLLM) -------

EMU = {"model": "emulated-llama", "engine": "emulated", "tokenizer": "byte", "emulation": {"time_scale": 0.001}}


def _break_for_good(dask_worker=None) -> None:
    """Every step of this worker's "emu" engine fails from now on (a broken accelerator)."""
    host = dask_worker.plugins["dask-agents"].engines.start("emu")

    def step():
        raise RuntimeError("injected: the accelerator is gone")

    host._sched.step = step


def _reload(dask_worker=None) -> list[str]:
    return dask_worker.plugins["dask-agents"].engines.swap("emu", "emu", 60)


def _hosts(client) -> list[str]:
    from dask_agents.client_api import hosted_models

    return sorted(hosted_models(client).get("emu", []))


def test_an_engine_given_up_is_not_placed_on_until_it_is_back(monkeypatch):
    monkeypatch.setattr(engine_module, "RESTARTS_MAX", 0)  # give up at the first crash
    with dask.config.set({"agents.llm.models": {"emu": EMU}}):
        with LocalCluster(n_workers=2, threads_per_worker=4, processes=False, dashboard_address=":0") as cluster:
            with Client(cluster) as client:
                da.install(client, models=["emu"])
                both = sorted(client.scheduler_info()["workers"])
                wait_for(lambda: _hosts(client) == both)
                emu = da.llm("emu")
                with da.session(client) as bound:
                    dead = emu.generate(PROMPT, max_tokens=4).value(60).worker
                    alive = next(w for w in both if w != dead)
                    client.run(_break_for_good, workers=[dead])
                    with pytest.raises(da.EngineStoppedError, match="not restarting"):
                        emu.generate(PROMPT + " again", max_tokens=4).value(60)
                    wait_for(lambda: _hosts(client) == [alive])  # the worker stopped announcing it
                    # the session bound to the dead engine moves to the live one
                    assert emu.generate(PROMPT + " once more", max_tokens=4).value(60).worker == alive
                for i in range(4):  # new sessions all go to the live engine
                    with da.session(client):
                        assert emu.generate(f"session {i}: {PROMPT}", max_tokens=4).value(60).worker == alive
                assert client.run(_reload, workers=[dead])[dead] == ["emu"]
                wait_for(lambda: _hosts(client) == both)  # back: announced, and placed on again
                with da.session(client):
                    assert emu.generate("a new session " + PROMPT, max_tokens=4).value(60).worker == dead


def test_engine_health_keeps_a_given_up_worker_out_of_the_fallback():
    """The scheduler side (scheduler_plugin/engine_health.py), on the plugin's own state: a worker
    that stops announcing a model loses its sessions' bindings for it, and while no worker hosts
    the model it is left out of the fallback candidates (unless it is the only one), until it
    announces the model again."""
    from dask_agents.scheduler_plugin import engine_health
    from dask_agents.scheduler_plugin.plugin import AgentsSchedulerPlugin

    plugin = AgentsSchedulerPlugin()

    def hello(worker, models):  # what set_worker_models does once wired: note first, then apply
        engine_health.note_models(plugin.placement, worker, models)
        plugin.set_worker_models(worker, models)

    hello("tcp://a", ["emu"])
    hello("tcp://b", [])
    key = ("s1", "llm:emu")
    plugin.bindings[key] = "tcp://a"
    plugin.session_bindings["s1"].append(key)
    plugin.bound["tcp://a"] += 1
    hello("tcp://a", [])  # its engine for emu gave up
    assert not plugin.model_workers["emu"]
    assert key not in plugin.bindings and plugin.session_bindings["s1"] == [] and plugin.bound["tcp://a"] == 0
    assert engine_health.exclude_dropped(plugin.placement, "emu", ["tcp://a", "tcp://b"]) == ["tcp://b"]
    assert engine_health.exclude_dropped(plugin.placement, "emu", ["tcp://a"]) == ["tcp://a"]  # never nothing
    assert engine_health.exclude_dropped(plugin.placement, "other", ["tcp://a", "tcp://b"]) == ["tcp://a", "tcp://b"]
    hello("tcp://a", ["emu"])  # back
    assert plugin.model_workers["emu"] == {"tcp://a"}
    plugin.model_workers["emu"].clear()  # (as if it then left the hosts for another reason)
    assert engine_health.exclude_dropped(plugin.placement, "emu", ["tcp://a", "tcp://b"]) == ["tcp://a", "tcp://b"]
