"""An EMULATED LLM engine: a cost model of a vLLM-like engine, for experiments at scale on CPUs.

It computes nothing. The cost model (:mod:`dask_agents.worker_plugin.emulated_kv`: continuous batching,
chunked prefill, paged KV blocks with prefix reuse, preemption and recompute, a host tier with
its transfer times; the defaults and where each comes from are in that module's docstring)
is stepped here by one thread, which sleeps each iteration's emulated time times
``time_scale``. Every number it produces (latencies, cached tokens, KV use, transfers) is
EMULATED. Settings come from ``agents.llm.models.<name>`` with ``engine: emulated`` and
parameters under ``emulation`` (:class:`EmulationParams`).

The host has the interface :class:`~dask_agents.worker_plugin.engines.Engines` uses of
:class:`~dask_agents.worker_plugin.vllm_host.EngineHost`, per-session KV control included: ``kv`` is an
:class:`EmulatedEngineKV` (the methods and attributes of :class:`dask_agents.kv.runtime.engine_kv.EngineKV` that
KV directives and :class:`dask_agents.kv.runtime.manager.KVManager` use), and with ``kv-policy`` set on the model
entry ``kv_manager`` is KVManager itself, which reads the engine's internals through its KV
backend's ``compat``: :data:`EMULATED_COMPAT` here, :mod:`dask_agents.kv.runtime.vllm_compat` on a real engine.
Unlike EngineHost, the manager runs only when the model entry names a policy (not from
``agents.kv.policy``): emulated engines are the vLLM baseline of existing experiments, which
opt in. No vLLM import anywhere here.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from dask_agents.worker_plugin.token_times import TokenTimes
from dask_agents.kv.runtime.engine_kv import KVDirectiveError, KVStats, Residency, TierConfig, block_count
from dask_agents.kv.runtime.sizing import KVGeometry
from dask_agents.worker_plugin.emulated_kv import (  # noqa: F401  (the cost model's names are this module's too)
    H100_KV_BLOCKS,
    Block,
    EmulatedCompletion,
    EmulatedRequestOutput,
    EmulatedSamplingParams,
    EmulatedScheduler,
    EmulationParams,
    Sequence,
    block_hashes,
)
from dask_agents.model_settings import ModelSettings
from dask_agents.worker_plugin.host import wait_loaded
from dask_agents.worker_plugin.host_kv import SessionKVHost
from dask_agents.worker_plugin.tokenizer import ByteTokenizer

logger = logging.getLogger(__name__)

CATCH_UP_S = 0.05
"""Largest lag (wall seconds) behind its step deadlines the stepping thread makes up by not
sleeping; beyond it the schedule restarts from now (see ``EmulatedEngineHost._run``)."""


# -- the internals KVManager reads, for the emulated scheduler ---------------------------------------

class _BlockPool:
    """What KVManager reads of vLLM's ``BlockPool``: ``blocks`` by id."""

    def __init__(self, sched: EmulatedScheduler):
        self.blocks = sched.blocks
        self.num_gpu_blocks = sched.capacity + 1


@dataclass(frozen=True)
class EmulatedParts:
    """The emulated counterpart of :class:`dask_agents.kv.runtime.vllm_compat.EngineParts` (no KV tensors)."""

    sched: EmulatedScheduler
    block_pool: _BlockPool
    block_size: int
    bytes_per_block_: int

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool, the null block included (as vLLM counts them)."""
        return self.sched.capacity + 1

    def bytes_per_block(self) -> int:
        """Bytes one block would take (from the emulated geometry)."""
        return self.bytes_per_block_


class _EmulatedCompat:
    """The functions of :mod:`dask_agents.kv.runtime.vllm_compat` that KVManager calls, on :class:`EmulatedParts`
    (same names, arguments and meaning; ``tests/test_emulated_kv.py`` checks that every
    ``vc.<name>`` in kv/runtime/manager.py is here)."""

    @staticmethod
    def request_hashes(parts: EmulatedParts, request_id: str) -> list | None:
        seq = parts.sched.requests.get(request_id)
        return None if seq is None else seq.hashes

    @staticmethod
    def lookup(parts: EmulatedParts, block_hash: int) -> Block | None:
        return parts.sched._cached.get(block_hash)

    @staticmethod
    def ref_count(block: Block) -> int:
        return block.ref_cnt

    @staticmethod
    def prefix_walk(parts: EmulatedParts, hashes: list, in_lower: Any, held: set) -> tuple[int, int, list]:
        from dask_agents.kv.runtime.blocks import walk_prefix

        return walk_prefix(parts.sched._cached.get, hashes, in_lower, held)

    @staticmethod
    def block_hash(block: Block) -> int | None:
        return block.block_hash

    @staticmethod
    def cached_free_blocks(parts: EmulatedParts) -> list[Block]:
        return list(parts.sched._lru.values())

    @staticmethod
    def take_stored(parts: EmulatedParts) -> list[int]:
        return parts.sched.take_stored()

    @staticmethod
    def empty_free_blocks(parts: EmulatedParts, at_least: int | None = None) -> int:
        n = len(parts.sched._empty)
        return n if at_least is None else min(n, at_least)

    @staticmethod
    def free_blocks(parts: EmulatedParts) -> int:
        return parts.sched.free_blocks

    @staticmethod
    def used_blocks(parts: EmulatedParts) -> int:
        return parts.sched.used_blocks

    @staticmethod
    def token_budget(parts: EmulatedParts) -> int:
        return parts.sched.p.max_num_batched_tokens

    @staticmethod
    def running(parts: EmulatedParts) -> list[tuple[str, int, int]]:
        return [(s.request_id, s.length, s.num_computed) for s in parts.sched.running]

    @staticmethod
    def allocated_blocks(parts: EmulatedParts, request_id: str) -> int:
        seq = parts.sched.requests.get(request_id)
        return len(seq.blocks) if seq is not None else 0

    @staticmethod
    def waiting(parts: EmulatedParts) -> list[tuple[str, int, list]]:
        return [(s.request_id, s.length, s.hashes) for s in parts.sched.waiting_sequences()]

    @staticmethod
    def waiting_requests(parts: EmulatedParts) -> int:
        return len(parts.sched.waiting)

    @staticmethod
    def running_requests(parts: EmulatedParts) -> int:
        return len(parts.sched.running)


EMULATED_COMPAT = _EmulatedCompat()


# -- per-session KV control -------------------------------------------------------------------------

class EmulatedEngineKV:
    """:class:`dask_agents.kv.runtime.engine_kv.EngineKV`'s interface on the emulated engine: the same directives
    (inspect, retain, release, offload, evict, prefetch, invalidate) with the same sharing
    rules, acting on :class:`EmulatedScheduler`'s blocks and host tier.

    Differences, and why: there is no disk tier (the cost model has one lower tier; ``disk``
    is refused as on an engine without one); ``prefetch`` starts transfers that complete over
    emulated time (:meth:`EmulatedScheduler.prefetch`) instead of copying at once; restores
    on admission happen in the scheduler itself (charged to the step), so ``on_admit`` has
    nothing to restore. Session tracking is the scheduler's (from each sequence's session).
    Transfer seconds are reported in wall seconds (emulated x ``time_scale``), the clock the
    manager measures pauses with. Runs on the stepping thread between steps."""

    def __init__(self, sched: EmulatedScheduler, bytes_per_block: int, pin_fraction: float = 0.5,
                 pin_ttl_s: float = 30.0, time_scale: float = 1.0):
        self.sched = sched
        self.compat = EMULATED_COMPAT  # what KVManager calls in place of dask_agents.kv.runtime.vllm_compat
        self.parts = EmulatedParts(sched, _BlockPool(sched), sched.p.block_size, bytes_per_block)
        self.bytes_per_block = bytes_per_block
        self.tiers = TierConfig(host_bytes=sched.host_capacity * bytes_per_block, pin_fraction=pin_fraction,
                                pin_ttl_s=pin_ttl_s)
        self.time_scale = time_scale
        self._expires: dict[str, float] = {}  # session -> monotonic expiry of its pin
        self._pins_expired = 0
        self._pins_released = 0
        self.snapshot: dict[str, int] = {"device": 0, "host": 0, "disk": 0}
        self._snapshot_at = -math.inf

    @property
    def stats(self) -> KVStats:
        """EngineKV's counters, from the scheduler's (a fresh copy per read)."""
        c, bpb, scale = self.sched.counters, self.bytes_per_block, self.time_scale
        return KVStats(offloaded_bytes=int(c["offloaded_blocks"]) * bpb,
                       restored_bytes=int(c["restored_blocks"]) * bpb,
                       restored_on_demand_bytes=int(c["restored_blocks"] - c["prefetched_blocks"]) * bpb,
                       restore_seconds=c["restore_s"] * scale, restore_stall_seconds=c["stall_s"] * scale,
                       offload_seconds=c["offload_s"] * scale,
                       dropped_blocks=int(c["dropped_blocks"] + c["host_evictions"]),
                       pins_expired=self._pins_expired,
                       pins_released_for_admission=self._pins_released + int(c["pins_released"]))

    # -- tracking ------------------------------------------------------------------------------

    def on_admit(self, session: str | None, request_id: str, restore: bool = True) -> None:
        """Nothing to do: the scheduler tracks the request's blocks for its session, and restores
        its prefix from the host when it admits it."""

    def on_finish(self, session: str | None, request_id: str) -> None:
        """Nothing to do: a request's blocks belong to its session from the start."""

    def restore(self, hashes: list, limit: int | None = None) -> int:
        """Restore the prefix ``hashes`` from the host (see :meth:`EmulatedScheduler.restore`)."""
        return self.sched.restore(list(hashes), limit)

    def sessions(self) -> list[str]:
        """Sessions this engine holds KV for."""
        return list(self.sched.sessions)

    def knows(self, session: str) -> bool:
        """Whether this engine tracks KV for ``session``."""
        return self.sched.knows(session)

    def _known(self, session: str) -> None:
        if not self.sched.knows(session):
            raise KVDirectiveError(f"no KV for session {session!r} on this engine")

    def blocks_of(self, session: str) -> list[int]:
        """The session's block hashes in prefix order."""
        self._known(session)
        return self.sched.session_blocks(session)

    def owners(self, block_hash: int) -> frozenset[str]:
        """Sessions that own ``block_hash``."""
        return self.sched.owners(block_hash)

    def block_tokens(self, block_hash: int) -> int:
        """Tokens up to the end of the block (its position in the chain), from an owner; the
        block size when no session owns it."""
        return self.sched.block_tokens(block_hash)

    def pinned(self, session: str) -> int:
        """Blocks the session has pinned."""
        return self.sched.pinned(session)

    def pinned_blocks(self) -> int:
        """Blocks pinned across sessions."""
        return self.sched.retained_blocks()

    def tier_blocks(self) -> dict[str, int]:
        """Blocks held in the host and disk tiers."""
        return {"host": len(self.sched.host), "disk": 0}

    def in_lower_tier(self, block_hash: int) -> str | None:
        """"host" if the host tier holds ``block_hash``, else None."""
        return "host" if self.sched.on_host(block_hash) else None

    # -- directives ------------------------------------------------------------------------------

    def inspect(self, session: str) -> Residency:
        """Where the session's blocks are now."""
        self._known(session)
        r = self.sched.residency(session)
        return Residency(session, r["blocks"], r["device"], r["host"], 0, r["pinned"],
                         self.bytes_per_block, self.sched.p.block_size)

    def retain(self, session: str, ttl_s: float | None = None) -> int:
        """Pin the session's resident blocks for ``ttl_s`` (default ``pin_ttl_s``) within the pin
        budget; returns how many are pinned. Re-retaining renews the TTL."""
        self._known(session)
        if ttl_s is not None and (isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float))):
            raise KVDirectiveError(f"retain's ttl_s must be a number of seconds, got {ttl_s!r}")
        ttl = self.tiers.pin_ttl_s if ttl_s is None else float(ttl_s)
        if not 0 < ttl < math.inf:
            raise KVDirectiveError(f"retain needs a positive, finite TTL, got {ttl_s!r}")
        self.release(session)
        budget = int(self.tiers.pin_fraction * self.parts.num_blocks) - self.pinned_blocks()
        n = self.sched.retain(session, max(budget, 0))
        if n:
            self._expires[session] = time.monotonic() + ttl
        return n

    def release(self, session: str) -> int:
        """Drop the session's pin (its blocks stay cached, evictable)."""
        self._expires.pop(session, None)
        return self.sched.release(session)

    def _check_tier(self, tier: str) -> None:
        if tier not in ("host", "disk"):
            raise KVDirectiveError(f"offload tier must be 'host' or 'disk', got {tier!r}")
        if tier == "disk":
            raise KVDirectiveError("offload to disk: the emulated engine has no disk tier")
        if not self.sched.host_capacity:
            raise KVDirectiveError("offload to host: this engine has no host tier (emulation host_kv_blocks = 0)")

    def offload(self, session: str, tier: str = "host", blocks: int | None = None) -> int:
        """Move the session's device blocks to the host, tail first, at most ``blocks``, except
        blocks another session owns or a running request uses; drops its pin."""
        self._check_tier(tier)
        blocks = block_count("blocks", blocks)
        self._known(session)
        self._expires.pop(session, None)
        return self.sched.offload(session, blocks, copy=True)

    def evict(self, session: str, blocks: int | None = None) -> int:
        """Free the session's device blocks without a copy (as :meth:`offload` otherwise)."""
        blocks = block_count("blocks", blocks)
        self._known(session)
        self._expires.pop(session, None)
        return self.sched.offload(session, blocks, copy=False)

    def offload_blocks(self, hashes: list, tier: str | None) -> int:
        """Move the device blocks ``hashes`` to ``tier`` (None: free them); returns how many left."""
        if tier is not None:
            self._check_tier(tier)
        return self.sched.offload_blocks(list(hashes), copy=tier is not None)

    def prefetch(self, session: str, max_blocks: int | None = None) -> int:
        """Start restoring the session's host blocks (they arrive over emulated time)."""
        max_blocks = block_count("max_blocks", max_blocks)
        self._known(session)
        return self.sched.prefetch(session, max_blocks)

    def invalidate(self, session: str) -> int:
        """Drop the session's pin and every block no other session owns, on both tiers (an
        unknown session is a no-op: 0)."""
        self._expires.pop(session, None)
        return self.sched.invalidate(session)

    # -- housekeeping ----------------------------------------------------------------------------

    def maintain(self, now: float | None = None) -> None:
        """Expire pins; release every pin if they keep the engine from admitting anything."""
        now = time.monotonic() if now is None else now
        if now - self._snapshot_at >= 0.5:
            self.snapshot, self._snapshot_at = self.tier_bytes(), now
        for sid, expires in list(self._expires.items()):
            if expires <= now:
                self.release(sid)
                self._pins_expired += 1
        if self._expires and self.sched.waiting and not self.sched.running:
            for sid in sorted(self._expires, key=self._expires.__getitem__):
                self.release(sid)
                self._pins_released += 1

    def tier_bytes(self) -> dict[str, int]:
        """Bytes held per tier (device: every block holding KV)."""
        bpb = self.bytes_per_block
        return {"device": self.sched.used_blocks * bpb, "host": len(self.sched.host) * bpb, "disk": 0}


# -- the host ---------------------------------------------------------------------------------------

class EmulatedEngineHost(SessionKVHost):
    """An emulated engine and the thread that steps it; the interface of ``EngineHost``."""

    def __init__(self, name: str, settings: ModelSettings):
        self.name = name
        self.settings = settings
        # An emulated model has no tokenizer of its own: "auto" means the byte tokenizer too.
        self.tokenizer: ByteTokenizer | None = ByteTokenizer() if settings.tokenizer in ("byte", "auto") else None
        self.max_model_len = settings.max_model_len
        self.token_times = TokenTimes()  # first-token times (the registry reads TTFT/TPOT)
        self.stream_sinks: dict[str, Any] = {}  # streaming calls' delta sinks (host.stream_deltas)
        self._streamed: dict[str, int] = {}  # streaming request -> output tokens sent
        self.loaded = threading.Event()
        self.load_error: BaseException | None = None
        self.steps = 0
        self.started_at: float | None = None
        self.load_seconds: float | None = None  # "loading" is instant: 0.0 once started
        self.crashed: BaseException | None = None  # why the stepping thread died (the host restarts it)
        self.vocab_size: int | None = None  # the byte tokenizer's ids are not checked against a model
        try:  # a bad config is reported like a failed load: to every caller, not at worker start
            self.params = EmulationParams(**settings.emulation)
        except Exception as e:
            self.load_error = ValueError(f"invalid emulation settings for model {name!r}: {e}")
            self.params = EmulationParams()
        p = self.params
        self.geometry = KVGeometry(p.layers, p.kv_heads, p.head_dim, p.dtype_bytes, p.block_size)
        if p.kv_blocks is not None:
            capacity = p.kv_blocks
        elif settings.kv_bytes():
            capacity = max(1, settings.kv_bytes() // self.geometry.bytes_per_block)
        else:  # no KV bytes given: a whole 80 GB H100's worth
            capacity = H100_KV_BLOCKS
        self._sched = EmulatedScheduler(p, capacity, settings.enable_prefix_caching)
        if p.time_scale is not None:
            self.time_scale = p.time_scale
        else:
            import dask_agents.config as agents_config

            self.time_scale = float(agents_config.get("emulation.time-scale", 1.0))
        # Per-session KV control: directives always work with prefix caching (a host tier is
        # optional); the KV manager runs when the model entry names a policy.
        self.kv: EmulatedEngineKV | None = None
        self.kv_manager: Any = None
        self._manager_failures = 0
        if settings.enable_prefix_caching:
            self.kv = EmulatedEngineKV(self._sched, self.geometry.bytes_per_block, settings.kv_pin_fraction,
                                       time_scale=self.time_scale)
            self.kv_control, self.kv_control_reason = True, None
        else:
            self.kv_control = False
            self.kv_control_reason = "prefix caching is off (enable-prefix-caching: false)"
        # guards _sched between the stepping thread and readers (stats, kv_report)
        self._lock = threading.RLock()
        self._inbox: queue.SimpleQueue[Sequence | None] = queue.SimpleQueue()
        self._calls: queue.SimpleQueue[tuple[Any, Future]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._finishing: list[Sequence] = []  # done in the current iteration, resolved after its sleep
        # Pacing (wall seconds, busy iterations only): what the steps should have taken
        # (cost x time_scale) and what they took; more wall than paced means this thread was
        # late (a starved core, the GIL held by other threads of its process), and lag beyond
        # CATCH_UP_S is dropped, not made up. Their ratio is how much the engine was slowed.
        self.paced_s = 0.0
        self.busy_wall_s = 0.0
        self.dropped_lag_s = 0.0
        self.woke_late_s = 0.0  # summed over busy steps: how late after its deadline each step ended
        self._thread = threading.Thread(target=self._run, name=f"dask-agents-emulated-{name}", daemon=True)

    def start(self) -> None:
        """Start the stepping thread (idempotent); "loading" is instant."""
        if self.started_at is None:
            self.started_at = time.time()
            if self.load_error is None:
                self.kv_manager = self._make_manager()
                self._thread.start()
                self.load_seconds = time.time() - self.started_at
            self.loaded.set()

    def _make_manager(self) -> Any:
        import dask_agents.config as agents_config

        # unset on the model: the configured policy, as on a vLLM engine (vllm_host.py)
        name = self.settings.kv_policy or str(agents_config.get("kv.policy") or "none")
        if self.kv is None or name == "none":
            return None
        try:
            from dask_agents.kv.runtime.manager import KVManager

            return KVManager(self.kv, name)
        except Exception as e:  # optional: KV directives still work without a policy
            logger.warning("emulated engine %s: KV policy %r is off: %s: %s", self.name, name, type(e).__name__, e)
            return None

    def wait_loaded(self, timeout: float | None = None) -> None:
        """Block until started; re-raise a configuration error."""
        wait_loaded(self, timeout)

    def sampling_params(self, max_tokens: int, temperature: float, seed: int | None,
                        priority: tuple = (), options: dict | None = None) -> EmulatedSamplingParams:
        """Parameters of one call (the engine always produces exactly ``max_tokens`` tokens).

        A cost model, not a language model: the options that shape text (stop strings,
        structured outputs, ``tool_choice``, sampling filters, penalties, logprobs) are accepted
        and change nothing; ``n`` > 1 is refused (one completion per call is what it models)."""
        if options and options.get("n", 1) != 1:
            raise ValueError(f"the emulated engine {self.name!r} models one completion per call (n=1), "
                             f"got n={options['n']}")
        return EmulatedSamplingParams(max_tokens, temperature, seed, tuple(priority))

    def extract_tool_calls(self, text: str, tools: list[dict]) -> tuple[str | None, list[dict]]:
        """A chat output's ``(content, tool calls)``: the JSON fallback (no vLLM parser here)."""
        from dask_agents.worker_plugin.sampling import json_fallback

        return json_fallback(text, {t["function"]["name"] for t in tools})

    def submit(self, request_id: str, token_ids: list[int], params: Any, session: str | None) -> Future:
        """Queue a request; the future resolves to an :class:`EmulatedRequestOutput`."""
        fut: Future = Future()
        if self._stop.is_set():
            fut.set_exception(self._stopped_error())
            return fut
        try:
            self._sched.check(request_id, len(token_ids), params.max_tokens)
        except ValueError as e:  # too big for the KV: fail now rather than wait forever
            fut.set_exception(e)
            return fut
        self.token_times.start(request_id)
        self._inbox.put(Sequence(request_id, list(token_ids), params.max_tokens, params.seed, fut,
                                 session=session, priority=tuple(params.priority)))
        return fut

    def abort(self, request_id: str) -> None:
        """Stop a request its caller gave up on: its blocks and batch slot are freed, its future
        fails with RuntimeError (between steps, on the stepping thread)."""
        def drop() -> None:
            seq = self._sched.abort(request_id)
            if seq is not None:
                self._finished(seq)
                if seq.future is not None and not seq.future.done():
                    seq.future.set_exception(RuntimeError(f"request {request_id} aborted"))

        if not self._stop.is_set():
            self._calls.put((drop, Future()))
            self._inbox.put(None)

    # -- KV control (EngineHost's interface) ----------------------------------------------------

    def _stopped(self) -> bool:
        return self._stop.is_set()

    def _fail_if_gone(self) -> None:
        if self._stop.is_set():  # raced with close: nobody would answer
            self._fail_all(self._stopped_error())

    def _kv_or_raise(self) -> EmulatedEngineKV:
        if self.kv is None:
            raise KVDirectiveError(f"engine {self.name!r} has no per-session KV control ({self.kv_control_reason})")
        return self.kv

    def kv_report(self) -> dict | None:
        """``EngineHost.kv_report``'s shape: policy, its actions, bytes and capacity per tier
        (the host tier only when there is one), cumulative traffic; None without KV control."""
        kv = self.kv
        if kv is None:
            return None
        manager = self.kv_manager
        actions = self._manager_actions()
        with self._lock:
            held, st = kv.tier_bytes(), kv.stats
        bpb = kv.bytes_per_block
        tiers = ("device", "host") if self._sched.host_capacity else ("device",)
        capacity = {"device": self._sched.capacity * bpb, "host": kv.tiers.host_bytes}
        return {"kv_policy": manager.policy.name if manager is not None else "none",
                "kv_actions": actions,
                "kv_bytes": {t: held[t] for t in tiers},
                "kv_capacity_bytes": {t: capacity[t] for t in tiers},
                "kv_traffic_bytes": {"offloaded": st.offloaded_bytes, "spilled": st.spilled_bytes,
                                     "restored": st.restored_bytes}}

    def stats(self) -> dict[str, Any]:
        """EMULATED counters and KV state (:meth:`EmulatedScheduler.stats`): tokens (queries,
        hits, prefill_tokens, decode_tokens, recomputed_tokens, host_hits, ...), blocks
        (used/pinned/free/cached/capacity, host_used/host_capacity, evictions, preemptions,
        restored/offloaded, ...), running, waiting, steps, emulated seconds; the stepping thread's
        pacing (``paced_s``, ``busy_wall_s``, ``dropped_lag_s``, ``woke_late_s``: see ``__init__``)."""
        with self._lock:
            return {**self._sched.stats(), "emulated": True, "paced_s": self.paced_s,
                    "busy_wall_s": self.busy_wall_s, "dropped_lag_s": self.dropped_lag_s,
                    "woke_late_s": self.woke_late_s}

    # -- the stepping thread ----------------------------------------------------------------------

    def _admit(self, seq: Sequence) -> None:
        if seq.future is not None and not seq.future.set_running_or_notify_cancel():
            return  # its caller gave up before the engine saw it
        try:
            self._sched.add(seq)
        except Exception as e:  # a bad request fails that call only
            if seq.future is not None:
                seq.future.set_exception(e)
            return
        self._kv_track("admit", seq.session, seq.request_id)

    def _finished(self, seq: Sequence) -> None:
        self._kv_track("finish", seq.session, seq.request_id)

    def _kv_lock(self) -> Any:
        return self._lock  # stats() and kv_report() read the scheduler from other threads

    def _take(self, item: Sequence | None) -> None:
        if item is not None:
            with self._lock:
                self._admit(item)

    def _run(self) -> None:
        sched = self._sched
        # Steps are paced against a wall-clock deadline, not slept one by one: a busy engine's
        # step i ends at due_(i-1) + cost_i x time_scale, so this thread's own Python work
        # between steps (admission, futures) runs inside the emulated step instead of adding to
        # it. Otherwise at small time scales that work would inflate every step (0.2 ms on a
        # 1 ms step is +20%) and no framework could come near the cost model's own bound. A
        # lag over CATCH_UP_S (a GC pause, a starved core) is dropped rather than caught up.
        due: float | None = None
        while not self._stop.is_set():
            t_iter = time.monotonic()
            # Requests first, then calls: an abort that follows its request finds it.
            while True:  # everything that arrived joins this iteration's admission
                try:
                    self._take(self._inbox.get_nowait())
                except queue.Empty:
                    break
            self._run_calls()
            self._kv_poll()
            if self._stop.is_set():
                break
            if not sched.running and not sched.waiting:
                t0 = time.monotonic()
                try:  # idle: sleep until a request, a KV call or close arrives
                    item = self._inbox.get(timeout=self._idle_wait())
                except queue.Empty:
                    item = None
                due = None  # idle: the next step starts when it is computed
                with self._lock:  # idle time passes for transfers in flight too
                    idle = time.monotonic() - t0
                    sched.advance(idle / self.time_scale if self.time_scale > 0 else math.inf)
                self._take(item)
                continue  # the rest of what arrived, the calls and a look, then the step
            try:
                with self._lock:
                    before = sched.steps
                    cost, self._finishing = sched.step()
                    self.steps = sched.steps
            except Exception as e:  # like a real engine: a failing step kills it (Engines restarts it)
                logger.exception("emulated engine %s step failed", self.name)
                self.crashed = e
                self._stop.set()
                break
            if sched.steps == before:  # nothing could run (check() and the pin release prevent it); don't spin
                due = None
                try:
                    self._take(self._inbox.get(timeout=0.05))
                except queue.Empty:
                    pass
                continue
            # The iteration "runs" now; close() interrupts the wait.
            now = time.monotonic()
            if due is not None and now - due >= CATCH_UP_S:
                self.dropped_lag_s += now - due
            due = (due if due is not None and now - due < CATCH_UP_S else now) + cost * self.time_scale
            if due > now and self._stop.wait(due - now):
                break
            self.woke_late_s += max(0.0, time.monotonic() - due)  # outputs go out this late
            stamp = self.token_times.token  # the step's tokens are out now (TTFT, TPOT)
            for s in sched.running:
                if s.output:
                    stamp(s.request_id)
            for s in self._finishing:
                stamp(s.request_id)
            if self.stream_sinks:
                self._stream(sched.running, self._finishing)
            for s in self._finishing:
                with self._lock:
                    self._finished(s)
                if s.future is not None and not s.future.done():
                    s.future.set_result(s.result())
            self._finishing = []
            self.paced_s += cost * self.time_scale
            self.busy_wall_s += time.monotonic() - t_iter
        self._fail_all(self._stopped_error())

    def _stream(self, *groups: Any) -> None:
        """Streaming requests' new tokens to their sinks (decoded bytes: the text is a cost
        model's, not a language model's)."""
        sent = self._streamed
        for group in groups:
            for s in group:
                sink = self.stream_sinks.get(s.request_id)
                if sink is None or len(s.output) <= sent.get(s.request_id, 0):
                    continue
                new = s.output[sent.get(s.request_id, 0):]
                sent[s.request_id] = len(s.output)
                sink(0, self.tokenizer.decode(new) if self.tokenizer else "", list(new))
        for s in groups[-1]:  # finished: forget them
            sent.pop(s.request_id, None)

    def _stopped_error(self) -> BaseException:
        from dask_agents.errors import EngineStoppedError

        if self.crashed is not None:
            return EngineStoppedError(f"emulated engine {self.name!r} crashed: {self.crashed!r}", crashed=True)
        return EngineStoppedError(f"emulated engine {self.name!r} closed while the request was in flight")

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            seqs = self._finishing + self._sched.drain()
            self._finishing = []
        seqs.extend(self._take_inbox())
        for s in seqs:
            if s.future is not None and not s.future.done():
                s.future.set_exception(exc)
        self._fail_calls(exc)

    def close(self) -> None:
        """Stop the stepping thread; in-flight and queued requests fail with a clear error."""
        self._stop.set()
        self._inbox.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        # Requests queued before the thread ever ran (or raced with close) fail too.
        self._fail_all(self._stopped_error())
