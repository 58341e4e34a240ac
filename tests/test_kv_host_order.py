"""A full host tier makes room in the KV policy's order (kv/runtime/manager.py ``_host_victims``),
on a real vLLM engine (CPU build, tiny dummy-weight model, in-process).

The engine has 2 MiB of device KV (16 blocks of 128 tokens) and a host tier of 1 MiB (8 blocks):
two paused sessions of 4 blocks fill it, and a third session's offload must push one of them out.
Under LRU the tier drops what it stored first; under ours it drops the session expected back
last (paused on a slow tool), whatever the order it was stored in. Each check runs on the engine
thread in one call, so no look of the manager (a prefetch) moves blocks in between.
"""

from __future__ import annotations

import dask
import pytest

from dask_agents.kv.runtime.policies import Policy
from dask_agents.model_settings import ModelSettings
from dask_agents.worker_plugin.vllm_host import EngineHost
from tests.kv_helpers import generate as run
from tests.kv_helpers import prompt_ids as tokens

BLOCK = 128
MODEL = dict(model="builtin:tiny-llama", load_format="dummy", tokenizer="byte", dtype="bfloat16",
             max_model_len=1024, kv_cache_memory_bytes="2 MiB", kv_host_bytes="1 MiB", kv_policy="ours")
CONFIG = {"agents.kv.tick": "20ms", "agents.emulation.time-scale": 1.0}


@pytest.fixture(scope="module")
def host():
    with dask.config.set(CONFIG):
        h = EngineHost("kvhost", ModelSettings(**MODEL))
        h.start()
        h.wait_loaded(300)
        yield h
        h.close()


def on_engine(host: EngineHost, fn):
    return host.kv_call(lambda kv: fn(kv, host.kv_manager)).result(30)


def fill_and_push(host: EngineHost, policy, tag: str) -> tuple[int, int, int, list[int]]:
    """``soon`` (paused on file_io) and ``later`` (paused on web_api) go to the host tier, ``soon``
    first; then ``new``'s offload needs room. Host blocks left to each, and ``soon``'s prompt."""
    soon, later, new = f"{tag}-soon", f"{tag}-later", f"{tag}-new"
    prompts = {s: tokens(seed, 4 * BLOCK + 8) for seed, s in enumerate((soon, later, new), 40 + len(tag))}
    for s, ids in prompts.items():
        run(host, ids, s)

    def push(kv, m):
        m.set_policy(policy)
        m.hint(soon, "paused", node="developer", wait_key="file_io")  # back in ~0.1 s
        m.hint(later, "paused", node="planner", wait_key="web_api")  # back in seconds
        assert kv.offload(soon, "host") == 4 and kv.offload(later, "host") == 4  # the tier is full
        assert kv.offload(new, "host") == 4
        return tuple(kv.inspect(s).host_blocks for s in (soon, later, new))

    left = on_engine(host, push)
    return (*left, prompts[soon])


def forget(host: EngineHost, tag: str) -> None:
    on_engine(host, lambda kv, m: [kv.invalidate(f"{tag}-{s}") for s in ("soon", "later", "new")])


def test_under_lru_a_full_host_tier_drops_what_it_stored_first(host):
    assert fill_and_push(host, "lru", "lru")[:3] == (0, 4, 4)
    forget(host, "lru")


def test_under_ours_a_full_host_tier_drops_the_session_expected_back_last(host):
    soon, later, new, prompt = fill_and_push(host, "ours", "ours")
    assert (soon, later, new) == (4, 0, 4)
    assert host.kv_manager.stats.host_looks >= 1
    # the session that resumes first finds its whole prefix (restored from the host tier)
    restored = host.kv.stats.restored_bytes
    _, cached = run(host, prompt, "ours-soon")
    assert cached == 4 * BLOCK and host.kv.stats.restored_bytes > restored
    forget(host, "ours")


class Reverse(Policy):
    """Host order: the sessions by name, last first (checks the manager reads the policy's order
    session by session, each tail first)."""

    name = "reverse"

    def order(self, view, tier):
        return sorted((s for s in view.sessions if getattr(view.sessions[s], tier)), reverse=True)


def test_the_host_order_is_the_policys_session_by_session_tail_first(host):
    def check(kv, m):
        m.set_policy(Reverse())
        a, b = "rev-a", "rev-b"
        assert kv.offload(a, "host") == 4 and kv.offload(b, "host") == 4
        tail_b = kv.blocks_of(b)[-2:]
        assert kv.offload("rev-c", "host", 2) == 2  # room for 2: b's last two blocks go
        return ([kv.in_lower_tier(h) for h in tail_b], kv.inspect(a).host_blocks, kv.inspect(b).host_blocks)

    for seed, s in enumerate(("rev-a", "rev-b", "rev-c"), 60):
        run(host, tokens(seed, 4 * BLOCK + 8), s)
    assert on_engine(host, check) == ([None, None], 4, 2)
    on_engine(host, lambda kv, m: [kv.invalidate(s) for s in ("rev-a", "rev-b", "rev-c")])
