"""The KV manager's cost on the engine thread does not grow with history (kv/runtime/manager.py on
the emulated engine, stepped by hand with a fake clock: no thread, no timing).

What is counted is work, not time: lookups of block hashes in the scheduler's device and host
tiers and blocks walked in sessions' block lists, during a look, a poll and room-making on a
full device. A session's history (blocks it used that left the device) and the number of
sessions are doubled; the counts must stay flat: bounded by the blocks the next step needs and
the free queue, never by what every session ever used. The per-session residency counts the
scheduler keeps are checked against a recount under random operations.
"""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from dask_agents.kv.runtime.manager import KVManager
from dask_agents.worker_plugin.emulated import EmulatedEngineKV, EmulatedScheduler, EmulationParams, Sequence

FREE = dict(prefill_s_per_token=0.0, prefill_s_per_token_pos=0.0, decode_s_per_step=0.0, decode_s_per_seq=0.0,
            decode_s_per_ctx_token=0.0)
TICK = 1.0


class Counts:
    n = 0


class _CountingLookups:
    """Counts lookups (``get``, ``in``) on the dict it is mixed into."""

    def get(self, k, default=None):
        Counts.n += 1
        return super().get(k, default)

    def __contains__(self, k):
        Counts.n += 1
        return super().__contains__(k)


class CountingDict(_CountingLookups, dict):
    """The scheduler's device tier (hash -> block): counts lookups (``[]`` too)."""

    def __getitem__(self, k):
        Counts.n += 1
        return super().__getitem__(k)


class CountingOrderedDict(_CountingLookups, OrderedDict):
    """The host tier, and a session's blocks: counts lookups and blocks walked."""

    def __iter__(self):
        for k in super().__iter__():
            Counts.n += 1
            yield k

    def __reversed__(self):
        for k in super().__reversed__():
            Counts.n += 1
            yield k


def _run(sched: EmulatedScheduler, mgr: KVManager, clock: list[float], seqs: list[Sequence]) -> None:
    for seq in seqs:
        sched.add(seq)
        mgr.on_admit(seq.session, seq.request_id, clock[0])
    while sched.running or sched.waiting:
        mgr.poll(clock[0])
        _, done = sched.step()
        clock[0] += 0.001
        for seq in done:
            mgr.on_finish(seq.session, seq.request_id, clock[0])


def full_device(sessions: int, turns: int, capacity: int = 240):
    """``sessions`` sessions that ran ``turns`` turns of 10 new blocks each (older turns went to
    the host or were dropped by the LRU), then paused; a device full of their latest turns."""
    p = EmulationParams(block_size=4, host_kv_blocks=400, host_policy="lru", **FREE)
    sched = EmulatedScheduler(p, capacity)
    kv = EmulatedEngineKV(sched, 1 << 20)
    clock = [0.0]
    mgr = KVManager(kv, "ours", tick_s=TICK, min_samples=3, prior_scale=1.0, clock=lambda: clock[0])
    rng = random.Random(f"{sessions}-{turns}")
    n = 0
    for _ in range(turns):
        batch = []
        for s in range(sessions):
            batch.append(Sequence(f"r{n}", [rng.randrange(3, 259) for _ in range(40)], 1, session=f"s{s}"))
            n += 1
        _run(sched, mgr, clock, batch)
    # fill the device: every session's latest turn stays cached, the rest is this filler's
    filler = capacity - sched.used_blocks
    if filler > 0:
        _run(sched, mgr, clock, [Sequence("fill", [rng.randrange(3, 259) for _ in range(4 * filler)], 1,
                                          session="filler")])
    for s in range(sessions):  # what they wait on: far off (they rank before the filler's finish)
        mgr.hint(f"s{s}", "paused", node="developer", wait_key="web_api")
    clock[0] += 2 * TICK  # a look is due
    assert sched.used_blocks == capacity and sched.free_blocks > 0  # full; cached, unreferenced blocks
    sched._cached = CountingDict(sched._cached)
    sched.host = CountingOrderedDict(sched.host)
    sched.sessions = {s: CountingOrderedDict(h) for s, h in sched.sessions.items()}
    return sched, kv, mgr, clock, rng


def cost(fn) -> int:
    Counts.n = 0
    fn()
    return Counts.n


def measure(sessions: int, turns: int) -> dict[str, int]:
    sched, kv, mgr, clock, rng = full_device(sessions, turns)
    history = sum(len(h) for h in sched.sessions.values())
    out = {"history": history, "view": cost(lambda: mgr.view(clock[0]))}
    out["look"] = cost(lambda: mgr.tick(clock[0]))  # trims the full device down to theta-high
    out["trimmed"] = sched.capacity - sched.used_blocks
    out["poll"] = cost(lambda: mgr.poll(clock[0]))  # a look was just taken: none due
    used = sched.used_blocks
    # a new request the device has no empty room for: room is made in the policy's order
    seq = Sequence("new", [rng.randrange(3, 259) for _ in range(4 * 60)], 1, session="new")
    sched.add(seq)
    kv_before = sched.counters["offloaded_blocks"] + sched.counters["dropped_blocks"]
    out["admit"] = cost(lambda: mgr.on_admit("new", "new", clock[0]))
    out["freed"] = used - sched.used_blocks
    out["moved"] = sched.counters["offloaded_blocks"] + sched.counters["dropped_blocks"] - kv_before
    sched.check_residency()
    return out


def test_a_look_a_poll_and_room_making_cost_the_same_as_history_doubles():
    small, big = measure(6, 8), measure(6, 16)
    assert big["history"] >= 1.8 * small["history"]
    assert small["trimmed"] > 0 and big["trimmed"] == small["trimmed"]
    assert small["freed"] >= 30 and big["freed"] == small["freed"]  # the same batch is freed
    for k in ("view", "look", "poll", "admit"):
        assert big[k] <= small[k] + 10, (k, small, big)
    # bounded by what changes: a view and an idle poll touch no block; a look, the blocks it
    # moves; room-making, the blocks it frees and their moves, not the histories
    assert small["view"] == 0 and small["poll"] == 0
    assert small["look"] <= 8 * small["trimmed"] and small["admit"] <= 8 * small["freed"], small


def test_room_making_costs_the_same_as_sessions_double():
    small, big = measure(6, 8), measure(12, 8)
    assert big["history"] >= 1.8 * small["history"]
    for k in ("view", "poll", "admit"):
        assert big[k] <= small[k] + 10, (k, small, big)


def test_a_busy_engine_looks_once_per_tick_and_a_session_end_at_once():
    sched, kv, mgr, clock, rng = full_device(4, 2)
    looks = mgr.stats.ticks
    for i in range(50):  # an admission and a finish every step, 0.1 tick apart
        seq = Sequence(f"busy{i}", [rng.randrange(3, 259) for _ in range(8)], 1, session=f"s{i % 4}")
        sched.add(seq)
        mgr.on_admit(seq.session, seq.request_id, clock[0])
        mgr.poll(clock[0])
        for done in sched.step()[1]:
            mgr.on_finish(done.session, done.request_id, clock[0])
        clock[0] += TICK / 10
    assert mgr.stats.ticks - looks <= 6  # 5 ticks' worth of time: not one look per event
    mgr.poll(clock[0])
    looks = mgr.stats.ticks
    mgr.hint("s0", "finished")
    assert mgr.poll(clock[0]) and mgr.stats.ticks == looks + 1  # a session end is looked at at once
    assert not kv.knows("s0")  # ("ours" drops a finished session's KV)


@pytest.mark.parametrize("host_policy", ["lru", "directed"])
def test_residency_counts_equal_a_recount_under_random_operations(host_policy):
    """Shared prefixes (a common system prompt, a branch of another session), evictions to the
    host, restores, prefetches, offloads, pins, invalidations and aborts, checked after every
    operation against a scan of every session's blocks."""
    rng = random.Random(f"residency-{host_policy}")
    sched = EmulatedScheduler(EmulationParams(block_size=4, host_kv_blocks=30, host_policy=host_policy,
                                              max_num_batched_tokens=24, max_batch=6, **FREE), 48)
    sessions = [f"s{i}" for i in range(6)]
    system = [7] * 12  # 3 blocks every session shares
    history = {s: system + [3 + i] * 4 for i, s in enumerate(sessions)}
    n = 0
    for _ in range(2500):
        op = rng.random()
        s = rng.choice(sessions)
        if op < 0.2 and len(sched.requests) < 10:
            base = history[rng.choice(sessions)] if rng.random() < 0.2 else history[s]  # a branch of another's
            prompt = base + [rng.randrange(3, 259) for _ in range(rng.randrange(1, 12))]
            if len(prompt) > 90:
                prompt = system + [3 + sessions.index(s)] * 4
            history[s] = prompt
            sched.add(Sequence(f"r{n}", prompt, rng.randrange(1, 20), session=s))
            n += 1
        elif op < 0.25:
            sched.retain(s, rng.choice([None, 3]))
        elif op < 0.28:
            sched.release(s)
        elif op < 0.34:
            sched.offload(s, rng.choice([None, 2]), copy=rng.random() < 0.7)
        elif op < 0.40:
            sched.prefetch(s, rng.choice([None, 4]))
        elif op < 0.42:
            sched.invalidate(s)
        elif op < 0.44 and sched.requests:
            sched.abort(rng.choice(sorted(sched.requests)))
        elif op < 0.47:
            sched.restore(history[s], rng.choice([None, 2]))
        elif op < 0.50:
            sched.advance(rng.random())
        else:
            sched.step()
        sched.check_residency()
        for sid in sched.sessions:
            r = sched.residency(sid)
            assert r["device"] + r["host"] >= 0 and r["device"] <= r["blocks"]
    c = sched.counters
    assert c["evictions"] > 0 and c["restored_blocks"] > 0 and c["offloaded_blocks"] > 0
    assert any(len(o) > 1 for o in sched._owners.values())  # shared blocks were exercised
