"""The trace simulator: accounting, prefix semantics, pins, tiers, stall."""

from __future__ import annotations

import pytest

from dask_agents.kv.runtime.policies import LRU, get_policy
from dask_agents.kv.offline.simulator import Simulator, simulate
from dask_agents.kv.offline.traces import GenParams, generate
from tests.kv_helpers import BPB, BS, COST, PARAMS, step, tiers, trace


def run(t, acc, host=0, policy="lru", **kw):
    return Simulator(t, tiers(acc, host, **kw), get_policy(policy, PARAMS), COST, tick=0.05).run()


def test_a_session_reuses_its_prefix():
    t = trace(step("a", 0, [1, 2], tail=3), step("a", 1, [1, 2, 3], tail=1, last=True))
    r = run(t, 10)
    assert r.prompt_tokens == (2 * BS + 3) + (3 * BS + 1)
    assert r.hit_tokens == 2 * BS and r.hit_rate == pytest.approx(2 * BS / r.prompt_tokens)
    assert r.recomputed_tokens == r.prompt_tokens - 2 * BS  # tails are always recomputed
    assert r.accelerator_hit_tokens == 2 * BS and r.stall_s == 0


def test_shared_prefix_across_sessions():
    t = trace(step("a", 0, [1, 2], last=True), step("b", 1, [1, 2, 9], last=True))
    assert run(t, 10).hit_tokens == 2 * BS


def test_a_block_is_useful_only_if_its_whole_prefix_is():
    t = trace(step("a", 0, [1, 2, 3]), step("x", 1, [1, 7], last=True), step("y", 2, [8, 9, 10]),
              step("a", 3, [1, 2, 3], last=True))
    sim = Simulator(t, tiers(4), LRU(PARAMS), COST)
    sim.run()
    # At 'y' LRU took 3 and 2 (a's tail) and 7, and kept 1 (read by x at 1): then a reuses only 1.
    assert sim.m["hit"] == 1 * BS + 1 * BS  # x's hit on 1, a's hit on 1
    # Had the head gone instead, nothing after it would count even if resident:
    t2 = trace(step("a", 0, [1, 2]), step("a", 1, [5, 2], last=True))  # a chain that starts elsewhere
    assert run(t2, 10).hit_tokens == 0


def test_running_steps_are_pinned_and_capacity_holds():
    # Two concurrent steps of 3 blocks on a 4-block accelerator: the second keeps 1 block and
    # recomputes the other two; nothing is ever above capacity.
    t = trace(step("a", 0, [1, 2, 3], duration=5, last=True), step("b", 1, [4, 5, 6], duration=5, last=True))
    r = run(t, 4)
    assert r.peak_accelerator_bytes == 4 * BPB
    assert r.recomputed_tokens == 6 * BS and r.discarded_blocks == 0


def test_restore_from_host_counts_bytes_and_stall():
    t = trace(step("a", 0, [1, 2, 3]), step("b", 1, [4, 5, 6], last=True), step("a", 2, [1, 2, 3], last=True))
    r = run(t, 3, host=10, host_bw_blocks_per_s=100.0)
    assert r.hit_tokens == 3 * BS and r.bytes_restored == 3 * BPB and r.bytes_offloaded >= 3 * BPB
    # b waits for a's copy-out (0.03 s); a for b's copy-out then its own restore on the same link.
    assert r.stall_s == pytest.approx(0.03 + 0.06)


def test_slow_host_means_recompute():
    t = trace(step("a", 0, [1, 2, 3]), step("b", 1, [4, 5, 6], last=True), step("a", 2, [1, 2, 3], last=True))
    r = run(t, 3, host=10, host_bw_blocks_per_s=1.0)  # restoring a block (1 s) loses to recomputing it (0.04 s)
    assert r.hit_tokens == 0 and r.bytes_restored == 0


def test_every_policy_sees_the_same_accesses_and_the_graph_learns():
    t = generate(GenParams(sessions=3, seed=1, block_size=BS, system_tokens=4 * BS, task_tokens=4 * BS,
                           user_tokens=BS, summary_tokens=4 * BS, max_context=200 * BS))
    prompts = set()
    for name in ("lru", "wa_lru", "nalar", "ours"):
        sim = Simulator(t, tiers(60, 20), get_policy(name, PARAMS), COST, tick=0.5)
        r = sim.run()
        prompts.add(r.prompt_tokens)
        assert r.peak_accelerator_bytes <= 60 * BPB
        assert r.recomputed_tokens + r.hit_tokens == r.prompt_tokens
    assert len(prompts) == 1
    g = sim.graph.view()
    assert g.successors("plan") and sum(g.successors("act").values()) == pytest.approx(1.0)
    assert sim.graph.latency("after:answer").n > 0  # user think times, learned without a hint


def test_simulate_reads_the_config():
    t = trace(step("a", 0, [1, 2], last=True))
    with pytest.raises(ValueError, match="block size"):
        simulate(t, tiers(2), LRU(PARAMS))  # agents.kv.block-size is 512, this trace's 4
    assert simulate(t, tiers(2), LRU(PARAMS), COST, tick=0.1).prompt_tokens == 2 * BS


@pytest.mark.parametrize("policy", ["lru", "wa_lru", "nalar", "ours"])
def test_finished_sessions_under_a_shared_prompt_are_forgotten(policy):
    """Sessions that end under a system prompt that never leaves the cache: once their own blocks
    are gone nothing is left to decide about them, so the simulator (and every policy's look at
    it) must not keep them; it kept all of them, and WA-LRU scanned them every tick."""
    keeper = [step("k", 0.0, [1, 900]), step("k", 70.0, [1, 900, 901], last=True)]  # keeps block 1 live
    steps = [step(f"s{i}", 1.0 + i, [1, 100 + i, 200 + i], duration=0.1, last=True) for i in range(60)]
    sim = Simulator(trace(*sorted(keeper + steps, key=lambda x: x.at)), tiers(8), get_policy(policy, PARAMS),
                    COST, tick=0.05)
    r = sim.run()
    assert r.hit_tokens >= 60 * BS  # the shared block stayed cached
    assert len(sim.sessions) <= 6  # k, and the sessions owning the other 5 cached blocks (60 before)


# -- the walk index and the prefix shortcut (replay speed) must not change a replay ---------------
class _Checked(Simulator):
    """Checks after every event that each session's ``hi`` is exact: 1 + the position of its
    last block in each tier (0: none)."""

    def check(self) -> None:
        for s in self.sessions.values():
            want = [0, 0, 0]
            for i, b in enumerate(s.chain):
                t = self.loc.get(b)
                if t is not None:
                    want[t] = i + 1
            assert s.hi == want, (s.id, s.hi, want)

    def _arrive(self, step, now):
        super()._arrive(step, now)
        self.check()

    def _end(self, step, now):
        super()._end(step, now)
        self.check()

    def _apply(self, actions, now):
        super()._apply(actions, now)
        self.check()


class _FullWalks(Simulator):
    """The reference: every walk goes to a chain's head (no prefix shortcut)."""

    prefix_closed = property(lambda self: False, lambda self, value: None)


def _policy(name, t):
    from dask_agents.kv.offline.optimal import Offline

    return Offline(t, PARAMS) if name == "offline" else get_policy(name, PARAMS)


def _small_generated():
    return generate(GenParams(sessions=8, seed=2, block_size=BS, system_tokens=4 * BS, task_tokens=4 * BS,
                              user_tokens=BS, summary_tokens=4 * BS, max_context=120 * BS))


NOT_PREFIX_CLOSED = trace(  # block 2 follows 1 in a's chain and 9 in b's, 6 follows 5 and nothing
    step("a", 0, [1, 2, 3, 4], duration=1), step("b", 0.5, [9, 2, 3, 7], duration=1),
    step("c", 1.0, [5, 6, 8], duration=0.2), step("a", 2.0, [1, 2, 3, 4, 10], last=True),
    step("c", 2.5, [6, 8, 11], last=True), step("b", 3.0, [9, 2, 3, 7, 12], last=True))


@pytest.mark.parametrize("policy", ["lru", "wa_lru", "nalar", "ours", "offline"])
def test_the_walk_index_is_exact_after_every_event(policy):
    for t, size in ((_small_generated(), (40, 20)), (_small_generated().without_session_ends(), (40, 20)),
                    (NOT_PREFIX_CLOSED, (6, 3))):
        sim = _Checked(t, tiers(*size), _policy(policy, t), COST, tick=0.5)
        sim.run()
    assert sim.prefix_closed is False  # the last trace is not prefix-closed: walks go to the head


@pytest.mark.parametrize("policy", ["lru", "wa_lru", "nalar", "ours", "offline"])
def test_the_prefix_shortcut_changes_no_replay(policy):
    from dataclasses import asdict

    t = _small_generated()
    for trace_ in (t, t.without_session_ends()):
        for size in ((30, 0), (40, 20)):
            fast = Simulator(trace_, tiers(*size), _policy(policy, trace_), COST, tick=0.5)
            slow = _FullWalks(trace_, tiers(*size), _policy(policy, trace_), COST, tick=0.5)
            a, b = asdict(fast.run()), asdict(slow.run())
            assert fast.prefix_closed
            a.pop("wall_s"), b.pop("wall_s")
            assert a == b
