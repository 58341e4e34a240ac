"""Per-session KV through vLLM's KV connector API (kv/runtime/connector.py) under ``engine:
vllm-async``: vLLM's AsyncLLM with its engine core in a child process (CPU build, tiny
dummy-weight model). Greedy decoding: a prefix loaded back from the host tier must give exactly
the tokens of a cold run."""

from __future__ import annotations

import pytest

from dask_agents.kv.runtime.engine_kv import KVDirectiveError
from tests.kv_helpers import prompt_ids
from dask_agents.worker_plugin.async_engine import AsyncEngineHost
from dask_agents.model_settings import ModelSettings

BLOCK = 128
TINY = dict(model="builtin:tiny-llama", load_format="dummy", tokenizer="byte", dtype="bfloat16", max_model_len=1024,
            kv_cache_memory_bytes="2 MiB", kv_host_bytes="4 MiB", engine="vllm-async", kv_connector="dask-agents")


@pytest.fixture(scope="module")
def host():
    h = AsyncEngineHost("conn", ModelSettings(**TINY))
    h.start()
    h.wait_loaded(300)
    yield h
    h.close()


def run(host, ids, session):
    out = host.submit(f"r{len(ids)}-{session}-{id(ids)}", ids, host.sampling_params(8, 0.0, None), session).result(120)
    return list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)


def kv(host, op, session):
    return host.kv_connector_directive(op, session)


def test_directives_through_the_connector_keep_greedy_outputs_identical(host):
    assert host.kv_control and host.kv_control_reason is None
    prompt = prompt_ids(1, 520)  # 4 full blocks (the last 8 tokens are a partial block)
    cold, cached = run(host, prompt, "s1")
    assert cached == 0
    r = kv(host, "inspect", "s1")["result"]
    assert r == {"session": "s1", "host_blocks": 4, "device_blocks": 4}  # saved when the request finished
    assert kv(host, "offload", "s1")["result"] == 4  # gone from the device: the host copy stays
    assert kv(host, "inspect", "s1")["result"]["device_blocks"] == 0
    loaded = kv(host, "inspect", "s1")["stats"]["loaded_blocks"]
    again, cached = run(host, prompt, "s1")
    assert again == cold and cached == 4 * BLOCK  # loaded back through the connector, same tokens
    assert kv(host, "inspect", "s1")["stats"]["loaded_blocks"] == loaded + 4
    # a follow-up that extends the prompt reuses it too (on the device now)
    longer, cached = run(host, prompt + again + prompt_ids(2, 200), "s1")
    assert cached >= 4 * BLOCK
    # invalidate: gone from the host tier and the device, so the next run is cold and still the same
    assert kv(host, "invalidate", "s1")["result"] >= 4
    assert kv(host, "inspect", "s1")["result"] == {"session": "s1", "host_blocks": 0, "device_blocks": 0}
    third, cached = run(host, prompt, "s2")
    assert third == cold and cached == 0


def test_a_shared_prefix_survives_invalidating_one_session(host):
    system = prompt_ids(7, 256)  # 2 blocks every session starts with
    a, _ = run(host, system + prompt_ids(8, 300), "a")
    run(host, system + prompt_ids(9, 300), "b")
    kv(host, "invalidate", "a")
    assert kv(host, "inspect", "b")["result"]["host_blocks"] >= 4  # b's own and the shared ones
    kv(host, "offload", "b")
    again, cached = run(host, system + prompt_ids(8, 300), "a")
    assert again == a and cached == 2 * BLOCK  # the shared system prompt came back from the host tier
    for s in ("a", "b"):
        kv(host, "invalidate", s)


def test_a_session_end_drops_its_kv_from_the_host_tier(host):
    from tests.conftest import wait_for
    from dask_agents.worker_plugin.engines import Engines

    run(host, prompt_ids(11, 520), "ends")
    assert kv(host, "inspect", "ends")["result"]["host_blocks"] == 4
    engines = Engines("tcp://worker", ["conn"])
    engines._hosts["conn"] = host  # (the plugin's own Engines loads its hosts from agents.llm.models)
    engines.end_session("ends")  # what the worker plugin does when the scheduler says the session ended
    wait_for(lambda: kv(host, "inspect", "ends")["result"] == {"session": "ends", "host_blocks": 0,
                                                               "device_blocks": 0})


def test_directives_the_connector_cannot_apply_say_why(host):
    for op, why in (("prefetch", "loads KV only into blocks vLLM allocates"), ("retain", "not pin a session"),
                    ("release", "nothing is pinned")):
        with pytest.raises(KVDirectiveError, match=why):
            kv(host, op, "s1")
    with pytest.raises(KVDirectiveError, match="unknown KV directive"):
        kv(host, "explode", "s1")
    with pytest.raises(KVDirectiveError, match="takes no arguments"):
        host.kv_connector_directive("offload", "s1", blocks=2)


def test_loaded_kv_is_really_used(monkeypatch):
    """Corrupt every load (the same connector, loaded out of tree from tests/scrambled_connector.py):
    the prefix is still a hit, and the tokens change."""
    from dask_agents.kv.runtime import connector

    make = connector.transfer_config

    def scrambled(name, host_bytes):
        cfg = make(name, host_bytes)
        cfg.kv_connector_module_path = "tests.scrambled_connector"
        return cfg

    monkeypatch.setattr(connector, "transfer_config", scrambled)
    h = AsyncEngineHost("conn-bad", ModelSettings(**TINY))
    h.start()
    try:
        h.wait_loaded(300)
        prompt = prompt_ids(3, 520)
        cold, _ = run(h, prompt, "bad")
        assert kv(h, "offload", "bad")["result"] == 4
        out, cached = run(h, prompt, "bad")
        assert cached == 4 * BLOCK and out != cold
    finally:
        h.close()
