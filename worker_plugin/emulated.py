"""An EMULATED LLM engine: a cost model of a vLLM-like engine, for experiments at scale on CPUs.

It computes nothing. One stepping thread emulates continuous batching: each iteration admits
waiting requests in FIFO order while batch slots and KV blocks allow, charges prefill time for
the prompt tokens not found in the prefix cache plus one decode step, gives every running
sequence one output token, and sleeps the iteration's (scaled) time. KV memory is counted in
blocks with vLLM-style prefix reuse: full prompt blocks are hashed in a chain (hash of the
previous block's hash and the block's tokens), kept after their request ends, and evicted LRU
when capacity is needed; blocks that running sequences reference are never evicted.

Every number it produces (latencies, cached tokens, KV use) is EMULATED. Settings come from
``agents.llm.models.<name>`` with ``engine: emulated`` and parameters under ``emulation``
(:class:`EmulationParams`). The host has exactly the interface :class:`~worker_plugin.engine.Engines`
uses of :class:`~worker_plugin.engine.EngineHost`; no vLLM import anywhere here.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import queue
import random
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from kv.sizing import KVGeometry
from worker_plugin.engine import ModelSettings, wait_loaded
from worker_plugin.tokenizer import OFFSET, ByteTokenizer

logger = logging.getLogger(__name__)


class EmulationParams(BaseModel):
    """Parameters of the emulated engine (``emulation:`` of a model entry; ``_`` or ``-`` in keys).

    Defaults are order-of-magnitude figures for a Llama-3-8B-like model in bf16 on one
    H100-class GPU, not measurements: set them from a measurement of the engine you emulate.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True,
                              alias_generator=lambda n: n.replace("_", "-"))
    max_batch: int = Field(256, ge=1, description="concurrent sequences (vLLM's max_num_seqs)")
    prefill_s_per_token: float = Field(5e-5, ge=0, description="prefill cost per non-cached prompt token (~20k tok/s)")
    decode_s_per_step: float = Field(0.01, ge=0, description="fixed cost of one iteration (weights read once)")
    decode_s_per_seq: float = Field(5e-5, ge=0, description="extra iteration cost per running sequence (its KV reads)")
    kv_blocks: int | None = Field(None, ge=1, description="KV capacity in blocks; None: kv-cache-memory-bytes / bytes per block")
    block_size: int = Field(16, ge=1, description="tokens per KV block (vLLM's default)")
    layers: int = Field(32, ge=1)
    kv_heads: int = Field(8, ge=1)
    head_dim: int = Field(128, ge=1)
    dtype_bytes: int = Field(2, ge=1)
    time_scale: float | None = Field(None, ge=0, description="wall seconds per emulated second; None: agents.emulation.time-scale (1.0)")


@dataclass(frozen=True)
class EmulatedSamplingParams:
    """What a request asks for. ``temperature`` is recorded, not used: tokens depend on (prompt, seed)."""

    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    priority: tuple = ()


@dataclass
class EmulatedCompletion:
    """Shaped like vLLM's ``CompletionOutput`` (the fields Engines reads)."""

    token_ids: list[int]
    finish_reason: str = "length"


@dataclass
class EmulatedRequestOutput:
    """Shaped like vLLM's final ``RequestOutput``; ``emulated`` marks it as such."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[EmulatedCompletion]
    num_cached_tokens: int
    finished: bool = True
    emulated: bool = True


def block_hashes(tokens: list[int], block_size: int) -> list[int]:
    """Chained hashes of the full blocks of ``tokens`` (a block's hash covers its whole prefix)."""
    out, parent = [], 0
    for i in range(0, len(tokens) - block_size + 1, block_size):
        # hash() of ints and tuples of ints is not salted: identical in every process.
        parent = hash((parent, tuple(tokens[i:i + block_size])))
        out.append(parent)
    return out


@dataclass
class Sequence:
    """One request inside the emulated engine."""

    request_id: str
    prompt: list[int]
    max_tokens: int
    seed: int | None = None
    future: Future | None = None
    output: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    held: list[int] = field(default_factory=list)  # hashed blocks it references, in chain order
    private: int = 0  # blocks it holds that have no hash yet (partial prompt block, output)
    rng: random.Random | None = None
    priority: tuple = ()  # smaller is admitted first; FIFO among equals (like vLLM's priority policy)

    def result(self) -> EmulatedRequestOutput:
        """The final output of a finished sequence."""
        return EmulatedRequestOutput(self.request_id, self.prompt,
                                     [EmulatedCompletion(list(self.output))], self.cached_tokens)


class EmulatedScheduler:
    """The cost model itself, with no thread and no clock: ``add`` requests, ``step`` iterations.

    Kept apart from the host so tests (and offline simulators) can step it deterministically.
    KV accounting: ``_ref`` maps every resident hashed block to the number of running sequences
    referencing it; ``_lru`` holds the unreferenced ones (the prefix cache), oldest first;
    ``_private`` counts blocks of running sequences without a hash. used = len(_ref) + _private.
    A request reserves all the blocks its prompt and ``max_tokens`` will fill when admitted, so
    it never needs preemption (vLLM allocates as it decodes and preempts instead).
    """

    def __init__(self, params: EmulationParams, capacity_blocks: int, prefix_caching: bool = True):
        self.p = params
        self.capacity = capacity_blocks
        self.prefix_caching = prefix_caching
        # (priority, arrival, sequence): a heap, so a retry of an advanced session is admitted
        # before new work, as the control plane's priorities say; FIFO among equals.
        self.waiting: list[tuple[tuple, int, Sequence]] = []
        self._arrivals = itertools.count()
        self.running: list[Sequence] = []
        self._ref: dict[int, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._private = 0
        self.steps = 0
        self.counters = dict.fromkeys(("queries", "hits", "prefill_tokens", "decode_tokens", "evictions"), 0)
        self.emulated_s = 0.0

    @property
    def used_blocks(self) -> int:
        """Blocks in use: referenced by running sequences or kept in the prefix cache."""
        return len(self._ref) + self._private

    def blocks_needed(self, prompt_len: int, max_tokens: int) -> int:
        """Blocks a request occupies when all its tokens are in."""
        return math.ceil((prompt_len + max_tokens) / self.p.block_size)

    def check(self, request_id: str, prompt_len: int, max_tokens: int) -> None:
        """ValueError if the request could never fit, even in an empty cache (so it cannot hang)."""
        need = self.blocks_needed(prompt_len, max_tokens)
        if need > self.capacity:
            raise ValueError(
                f"request {request_id} needs {need} KV blocks ({prompt_len} prompt + {max_tokens} output tokens, "
                f"{self.p.block_size} tokens per block) but the emulated engine holds only {self.capacity} blocks"
            )

    def add(self, seq: Sequence) -> None:
        """Queue a request (by priority, then arrival)."""
        self.check(seq.request_id, len(seq.prompt), seq.max_tokens)
        seq.rng = random.Random(hash((tuple(seq.prompt), 0 if seq.seed is None else seq.seed)))
        heapq.heappush(self.waiting, (tuple(seq.priority), next(self._arrivals), seq))

    def waiting_sequences(self) -> list[Sequence]:
        """Queued requests in admission order."""
        return [entry[2] for entry in sorted(self.waiting)]

    def contains(self, block_hash: int) -> bool:
        """True if the block is resident (referenced or cached)."""
        return block_hash in self._ref

    def _try_admit(self, seq: Sequence) -> bool:
        bs = self.p.block_size
        hashes = block_hashes(seq.prompt, bs) if self.prefix_caching else []
        # Like vLLM, the last prompt token is always computed, so a hit covers at most len-1 tokens.
        hits = 0
        for h in hashes[:(len(seq.prompt) - 1) // bs]:
            if h not in self._ref:
                break
            hits += 1
        shared = [h for h in hashes if h in self._ref]  # hits, and identical blocks computed elsewhere
        new = self.blocks_needed(len(seq.prompt), seq.max_tokens) - len(shared)
        free = self.capacity - self.used_blocks
        evictable = len(self._lru) - sum(1 for h in shared if h in self._lru)
        if new > free + evictable:
            return False
        for h in shared:  # reference first, so the eviction below cannot take them
            self._lru.pop(h, None)
            self._ref[h] += 1
        while self.capacity - self.used_blocks < new:
            victim, _ = self._lru.popitem(last=False)
            del self._ref[victim]
            self.counters["evictions"] += 1
        fresh = [h for h in hashes if h not in self._ref]
        for h in fresh:  # its own full prompt blocks join the cache now: later requests can share them
            self._ref[h] = 1
        seq.held = hashes
        seq.private = new - len(fresh)
        self._private += seq.private
        seq.cached_tokens = hits * bs
        self.counters["queries"] += len(seq.prompt)
        self.counters["hits"] += seq.cached_tokens
        self.counters["prefill_tokens"] += len(seq.prompt) - seq.cached_tokens
        return True

    def _release(self, seq: Sequence) -> None:
        chain = block_hashes(seq.prompt + seq.output, self.p.block_size) if self.prefix_caching else []
        for h in chain[len(seq.held):]:  # full blocks of generated tokens are cached too, as in vLLM
            if h not in self._ref:
                self._ref[h] = 1
                seq.held.append(h)
                seq.private -= 1
                self._private -= 1
        held = set(seq.held)
        # Tail first, so the LRU evicts a prefix's tail before its head (a head-less tail is
        # useless); blocks it used that someone else computed are touched too.
        for h in reversed(chain):
            if h in held:
                self._ref[h] -= 1
            if self._ref[h] == 0:
                self._lru[h] = None
                self._lru.move_to_end(h)
        self._private -= seq.private
        seq.held, seq.private = [], 0

    def step(self) -> tuple[float, list[Sequence]]:
        """One iteration: admit, then one token for every running sequence.

        Returns the iteration's emulated duration (seconds, unscaled) and the sequences that
        finished in it (released from the KV; their futures are left to the caller).
        """
        admitted = []
        while self.waiting and len(self.running) < self.p.max_batch and self._try_admit(self.waiting[0][2]):
            seq = heapq.heappop(self.waiting)[2]
            self.running.append(seq)
            admitted.append(seq)
        if not self.running:
            return 0.0, []
        cost = self.p.prefill_s_per_token * sum(len(s.prompt) - s.cached_tokens for s in admitted)
        cost += self.p.decode_s_per_step + self.p.decode_s_per_seq * len(self.running)
        for s in self.running:  # ids 3..258: the byte tokenizer decodes every one of them
            s.output.append(s.rng.randrange(OFFSET, 256 + OFFSET))
        self.counters["decode_tokens"] += len(self.running)
        done = [s for s in self.running if len(s.output) >= s.max_tokens]
        for s in done:
            self.running.remove(s)
            self._release(s)
        self.steps += 1
        self.emulated_s += cost
        return cost, done

    def drain(self) -> list[Sequence]:
        """Drop every running (KV released) and waiting sequence; return them."""
        out = self.running + self.waiting_sequences()
        for s in self.running:
            self._release(s)
        self.running, self.waiting = [], []
        return out

    def stats(self) -> dict[str, Any]:
        """Counters (tokens for queries/hits/prefill/decode, blocks for the rest)."""
        return {**self.counters, "used_blocks": self.used_blocks, "capacity_blocks": self.capacity,
                "cached_blocks": len(self._lru), "running": len(self.running), "waiting": len(self.waiting),
                "steps": self.steps, "emulated_s": self.emulated_s}


class EmulatedEngineHost:
    """An emulated engine and the thread that steps it; the interface of ``EngineHost``."""

    def __init__(self, name: str, settings: ModelSettings):
        self.name = name
        self.settings = settings
        # An emulated model has no tokenizer of its own: "auto" means the byte tokenizer too.
        self.tokenizer: ByteTokenizer | None = ByteTokenizer() if settings.tokenizer in ("byte", "auto") else None
        self.max_model_len = settings.max_model_len
        self.loaded = threading.Event()
        self.load_error: BaseException | None = None
        self.steps = 0
        self.started_at: float | None = None
        self.crashed: BaseException | None = None  # why the stepping thread died (the host restarts it)
        self.kv_control = False  # no KV directives: its KV is counted, not held
        self.kv_control_reason = "emulated engine"
        try:  # a bad config is reported like a failed load: to every caller, not at worker start
            self.params = EmulationParams(**settings.emulation)
        except Exception as e:
            self.load_error = ValueError(f"invalid emulation settings for model {name!r}: {e}")
            self.params = EmulationParams()
        p = self.params
        self.geometry = KVGeometry(p.layers, p.kv_heads, p.head_dim, p.dtype_bytes, p.block_size)
        capacity = p.kv_blocks if p.kv_blocks is not None else max(1, settings.kv_bytes() // self.geometry.bytes_per_block)
        self._sched = EmulatedScheduler(p, capacity, settings.enable_prefix_caching)
        if p.time_scale is not None:
            self.time_scale = p.time_scale
        else:
            import dask_agents.config as agents_config

            self.time_scale = float(agents_config.get("emulation.time-scale", 1.0))
        self._lock = threading.Lock()  # guards _sched between the stepping thread and stats()
        self._inbox: queue.SimpleQueue[Sequence | None] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._finishing: list[Sequence] = []  # done in the current iteration, resolved after its sleep
        self._thread = threading.Thread(target=self._run, name=f"dask-agents-emulated-{name}", daemon=True)

    def start(self) -> None:
        """Start the stepping thread (idempotent); "loading" is instant."""
        if self.started_at is None:
            self.started_at = time.time()
            if self.load_error is None:
                self._thread.start()
            self.loaded.set()

    def wait_loaded(self, timeout: float | None = None) -> None:
        """Block until started; re-raise a configuration error."""
        wait_loaded(self, timeout)

    def sampling_params(self, max_tokens: int, temperature: float, seed: int | None,
                        priority: tuple = ()) -> EmulatedSamplingParams:
        """Parameters of one call (the engine always produces exactly ``max_tokens`` tokens)."""
        return EmulatedSamplingParams(max_tokens, temperature, seed, tuple(priority))

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
        self._inbox.put(Sequence(request_id, list(token_ids), params.max_tokens, params.seed, fut,
                                 priority=tuple(params.priority)))
        return fut

    def stats(self) -> dict[str, Any]:
        """EMULATED counters: queries, hits, prefill_tokens, decode_tokens (tokens), evictions,
        used_blocks, capacity_blocks, cached_blocks (blocks), running, waiting, steps, emulated_s."""
        with self._lock:
            return {**self._sched.stats(), "emulated": True}

    def _take(self, item: Sequence | None) -> None:
        if item is None:
            return
        try:
            with self._lock:
                self._sched.add(item)
        except Exception as e:  # a bad request fails that call only
            if item.future is not None:
                item.future.set_exception(e)

    def _run(self) -> None:
        sched = self._sched
        while not self._stop.is_set():
            if not sched.running and not sched.waiting:
                try:  # idle: sleep until a request (or close) arrives
                    self._take(self._inbox.get(timeout=0.5))
                except queue.Empty:
                    continue
            while True:  # everything that arrived joins this iteration's admission
                try:
                    self._take(self._inbox.get_nowait())
                except queue.Empty:
                    break
            if self._stop.is_set():
                break
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
            if sched.steps == before:  # nothing could run (cannot happen: check() bounds requests); don't spin
                try:
                    self._take(self._inbox.get(timeout=0.05))
                except queue.Empty:
                    pass
                continue
            # The iteration "runs" now; close() interrupts the wait.
            if cost > 0 and self._stop.wait(cost * self.time_scale):
                break
            for s in self._finishing:
                if s.future is not None and not s.future.done():
                    s.future.set_result(s.result())
            self._finishing = []
        self._fail_all(self._stopped_error())

    def _stopped_error(self) -> BaseException:
        from dask_agents.errors import EngineStoppedError

        if self.crashed is not None:
            return EngineStoppedError(f"emulated engine {self.name!r} crashed: {self.crashed!r}", crashed=True)
        return EngineStoppedError(f"emulated engine {self.name!r} closed while the request was in flight")

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            seqs = self._finishing + self._sched.drain()
            self._finishing = []
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                seqs.append(item)
        for s in seqs:
            if s.future is not None and not s.future.done():
                s.future.set_exception(exc)

    def close(self) -> None:
        """Stop the stepping thread; in-flight and queued requests fail with a clear error."""
        self._stop.set()
        self._inbox.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        # Requests queued before the thread ever ran (or raced with close) fail too.
        self._fail_all(self._stopped_error())
