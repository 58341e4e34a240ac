"""The cost model of the EMULATED engine: continuous batching, paged KV blocks and a host tier,
stepped deterministically (no thread, no clock). :mod:`dask_agents.worker_plugin.emulated` runs it on a
thread and gives it the interfaces of a real engine host.

Everything it produces (latencies, cached tokens, KV use, transfers) is EMULATED: nothing is
computed, only counted. It follows what vLLM v1 does (``vllm/v1/core/sched/scheduler.py``,
``kv_cache_manager.py``, ``block_pool.py``):

- **Blocks.** KV is paged in blocks of ``block_size`` tokens. A block is registered in the
  prefix cache under a chained hash (its parent's hash and its tokens) once a step schedules
  the tokens that fill it (vLLM caches at allocation, before the step computes them), so
  requests with a common prefix share blocks, a request admitted while another is still in
  prefill included. A block nobody references stays cached and is
  evicted least recently used first when a new block is needed; a request's blocks are freed
  tail first, so a chain loses its tail before its head. The last sampled token's KV is never
  computed (its block is not full of computed tokens), as in vLLM.
- **Admission and growth.** A waiting request is admitted (priority, then arrival) while batch
  slots and the step's token budget allow and all the blocks of its prompt fit in the free ones
  (empty, or cached and unreferenced), prefix hits shared; the last prompt token is always
  computed. (vLLM allocates a long prompt chunk by chunk; allocating the whole prompt at once
  keeps a half-prefilled prompt from being preempted by its own later chunks.) Afterwards a
  sequence gets one more block each time it crosses a block boundary.
- **Preemption and recompute.** When a running sequence needs a block and none is free, the
  running sequence with the lowest priority (latest arrival among equals: vLLM's priority
  policy) is preempted: its blocks are freed (its full blocks stay in the prefix cache,
  unreferenced and evictable) and it goes back to the waiting queue with its output so far.
  Readmitted, its prompt and output so far are prefilled again minus prefix hits
  (``recomputed_tokens``). A step that preempts admits nothing new (as vLLM), unless the
  preemption left nothing to run. If nothing runs and retained (pinned) blocks keep the next
  request out, the pins are dropped, so retention never wedges the engine.
- **Chunked prefill.** A step schedules at most ``max_num_batched_tokens`` tokens: running
  sequences first (one token each when decoding, the next chunk of a long prompt otherwise),
  then waiting ones; a long prompt is prefilled over several steps. The step that computes a
  sequence's last pending token samples its next token.
- **Step cost** (emulated seconds)::

      restore stall
        + sum over prefilled tokens of (prefill_s_per_token + prefill_s_per_token_pos * position)
        + decode_s_per_step + decode_s_per_seq * sequences in the step
        + decode_s_per_ctx_token * context tokens read

  where a token's position is the number of tokens before it in its sequence (its attention
  reads them all: the attention FLOPs of a prefill grow with the square of its length), and a
  sequence's context read is every token whose KV the step reads (its tokens so far). The
  prefill term of a chunk at positions ``[start, end)`` is summed in closed form
  (:func:`prefill_cost`); the rest is :func:`decode_step_cost`. Both are pure functions of the
  parameters, so bounds computed outside the engine use the very same formulas.
- **Host tier** (``host_kv_blocks`` > 0). ``host_policy: lru``: every block leaving the device
  (evicted, offloaded) is copied to the host, which evicts LRU: workflow-blind, what vLLM's
  native CPU offloading and LMCache give. ``directed``: only what KV directives offload goes
  there; a block restored from it leaves it. Copies to the host run beside the steps (not
  charged). A prefix block missing on the device but on the host is restored when its request
  is admitted, over one link at ``host_restore_s_per_block``: the step waits for it (a
  synchronous load stalls the batch) unless it arrived earlier, prefetched; an admission that
  waits on a prefetch still in flight pays only the rest.
- **Sessions.** A sequence's blocks belong to its session; per-session operations (retain,
  release, offload, prefetch, invalidate) are those of :class:`dask_agents.kv.runtime.engine_kv.EngineKV`.

Defaults (:class:`EmulationParams`) are for a Llama-3-8B-class model in bf16 on one 80 GB H100,
derived from first principles, not measured:

- KV per token = 2 (K, V) x 32 layers x 8 KV heads x 128 head dim x 2 bytes = 128 KiB;
  a block of 16 tokens = 2 MiB.
- HBM ~3 TB/s: a step reads the 16 GB of weights once, 16e9 / 3e12 = 5.3 ms
  (``decode_s_per_step``), and each token of context, 131072 / 3e12 = 4.4e-8 s
  (``decode_s_per_ctx_token``).
- Compute ~400 TFLOP/s effective, 2 x 8e9 FLOP per token: 4e-5 s per prefilled token
  (``prefill_s_per_token``) and per decoded sequence (``decode_s_per_seq``).
- Attention in prefill: QK^T and AV are 2 x 2 x d_model FLOP per layer per token per earlier
  position, 4 x 32 layers x 4096 = 524,288 FLOP; at ~400 TFLOP/s, 1.3e-9 s per prefilled
  token per token before it (``prefill_s_per_token_pos``): a 32k-token prompt's last token
  costs twice what its first one does. (Decode's attention is a memory read:
  ``decode_s_per_ctx_token``.)
- ``max_batch`` 256 and ``max_num_batched_tokens`` 8192: vLLM's defaults.
- KV capacity: an 80 GB card leaves ~60 GB for KV, ~480k tokens, ~30k blocks
  (:data:`H100_KV_BLOCKS`); used only when the model entry gives no KV bytes (the host uses
  ``kv_blocks`` or ``kv-cache-memory-bytes`` otherwise).
- PCIe Gen5 x16 ~25 GB/s one way: 2 MiB / 25 GB/s = 8.4e-5 s per block each way.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from dask_agents.kv.runtime.engine_kv import disown
from dask_agents.worker_plugin.tokenizer import OFFSET

H100_KV_BLOCKS = 30_000
"""~60 GB of KV on an 80 GB H100 in 2 MiB blocks (16 tokens of a Llama-3-8B-class model)."""


class EmulationParams(BaseModel):
    """Parameters of the emulated engine (``emulation:`` of a model entry; ``_`` or ``-`` in keys).

    Defaults: a Llama-3-8B-class model in bf16 on one 80 GB H100, from the arithmetic in the
    module docstring, not measurements: set them from a measurement of the engine you emulate.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True,
                              alias_generator=lambda n: n.replace("_", "-"))
    max_batch: int = Field(256, ge=1, description="concurrent sequences (vLLM's max_num_seqs)")
    max_num_batched_tokens: int = Field(8192, ge=1, description="tokens one step schedules at most (chunked prefill)")
    prefill_s_per_token: float = Field(4e-5, ge=0, description="prefill cost per computed prompt token (2*8e9 FLOP at 400 TFLOP/s)")
    prefill_s_per_token_pos: float = Field(
        1.3e-9, ge=0, description="prefill attention cost per computed token per token before it "
                                  "(4*32 layers*4096 FLOP at 400 TFLOP/s)")
    decode_s_per_step: float = Field(5.3e-3, ge=0, description="fixed cost of one step (16 GB of weights at 3 TB/s)")
    decode_s_per_seq: float = Field(4e-5, ge=0, description="extra step cost per sequence in it (its token's FLOPs)")
    decode_s_per_ctx_token: float = Field(4.4e-8, ge=0, description="step cost per context token read (128 KiB at 3 TB/s)")
    kv_blocks: int | None = Field(None, ge=1, description="KV capacity in blocks; None: kv-cache-memory-bytes / bytes per block")
    block_size: int = Field(16, ge=1, description="tokens per KV block (vLLM's default)")
    layers: int = Field(32, ge=1)
    kv_heads: int = Field(8, ge=1)
    head_dim: int = Field(128, ge=1)
    dtype_bytes: int = Field(2, ge=1)
    host_kv_blocks: int = Field(0, ge=0, description="host-memory KV tier in blocks (0: none)")
    host_restore_s_per_block: float = Field(8.4e-5, ge=0, description="host -> device per block (2 MiB at 25 GB/s)")
    host_offload_s_per_block: float = Field(8.4e-5, ge=0, description="device -> host per block (2 MiB at 25 GB/s)")
    cache_on_schedule: bool = Field(
        True, description="put a block in the prefix cache when a step schedules it, as vLLM v1 does (False: once "
                          "computed, the emulator's rule before f58ac1c: only to compare with runs made under it)")
    host_policy: Literal["lru", "directed"] = Field(
        "lru", description="lru: every block leaving the device goes to the host (vLLM native offloading, "
                           "LMCache); directed: only what KV directives offload")
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


# -- the cost formulas (pure: the step charges these, and bounds computed outside use them) ----

def prefill_positions(start: int, end: int) -> int:
    """Sum of the positions ``start .. end - 1`` (each token's count of tokens before it)."""
    return (end - start) * (start + end - 1) // 2 if end > start else 0


def prefill_cost(p: EmulationParams, start: int, end: int) -> float:
    """Emulated seconds to prefill one sequence's tokens at positions ``[start, end)``:
    ``prefill_s_per_token`` each, plus ``prefill_s_per_token_pos`` per token before it."""
    if end <= start:
        return 0.0
    return _prefill_cost(p, end - start, prefill_positions(start, end))


def _prefill_cost(p: EmulationParams, tokens: int, positions: int) -> float:
    """The prefill term of ``tokens`` prefilled tokens whose positions sum to ``positions``."""
    return p.prefill_s_per_token * tokens + p.prefill_s_per_token_pos * positions


def decode_step_cost(p: EmulationParams, seqs: int, ctx_tokens: int) -> float:
    """Emulated seconds of a step of ``seqs`` sequences reading ``ctx_tokens`` tokens of KV in
    all, besides its prefill term and restore stall: ``decode_s_per_step`` (the weights read
    once), ``decode_s_per_seq`` per sequence, ``decode_s_per_ctx_token`` per context token."""
    return p.decode_s_per_step + p.decode_s_per_seq * seqs + p.decode_s_per_ctx_token * ctx_tokens


def _chain(parent: int, tokens: Iterable[int]) -> int:
    # hash() of ints and tuples of ints is not salted: identical in every process.
    return hash((parent, tuple(tokens)))


def block_hashes(tokens: list[int] | tuple[int, ...], block_size: int) -> list[int]:
    """Chained hashes of the full blocks of ``tokens`` (a block's hash covers its whole prefix)."""
    t = tokens if isinstance(tokens, tuple) else tuple(tokens)  # (slices of a tuple are tuples: _chain's key)
    out, parent = [], 0
    for i in range(0, len(t) - block_size + 1, block_size):
        parent = hash((parent, t[i:i + block_size]))
        out.append(parent)
    return out


@dataclass(eq=False)
class Block:
    """One device KV block (the fields ``dask_agents.kv.runtime.vllm_compat`` reads of vLLM's ``KVCacheBlock``)."""

    block_id: int
    block_hash: int | None = None  # set while it is in the prefix cache
    ref_cnt: int = 0  # running sequences and pins referencing it
    ready_at: float = 0.0  # emulated time its KV is on the device (later: a restore in flight)
    from_host: bool = False  # restored from the host and not hit since (a hit on it is a host hit)
    is_null: bool = False


@dataclass(eq=False)
class Sequence:
    """One request inside the emulated engine (compared by identity)."""

    request_id: str
    prompt: list[int]
    max_tokens: int
    seed: int | None = None
    future: Future | None = None
    session: str | None = None
    priority: tuple = ()  # smaller is admitted first; FIFO among equals (like vLLM's priority policy)
    output: list[int] = field(default_factory=list)
    cached_tokens: int = 0  # prefix hit at its first admission (vLLM's num_cached_tokens)
    hashes: list[int] = field(default_factory=list)  # full blocks of prompt + output so far (a live list)
    blocks: list[Block] = field(default_factory=list)  # device blocks it holds, in chain order
    num_computed: int = 0  # tokens whose KV is computed
    prefill_target: int = 0  # tokens so far when last admitted: the ones below are prefill
    num_hashed: int = 0  # leading blocks already registered in the prefix cache
    preemptions: int = 0
    status: str = "new"  # waiting, running, done, aborted
    key: tuple = ()  # (priority, arrival): its place in the waiting queue
    tracked: bool = True  # its blocks are recorded for its session (False once that was invalidated)
    rng: random.Random | None = None
    ready_at: float = 0.0  # its prefix blocks' arrival when last admitted (restores)
    length: int = 0  # prompt and output tokens so far (kept by the scheduler: read every step)

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens so far."""
        return len(self.prompt) + len(self.output)

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens ``start:end`` of prompt + output, without copying both."""
        n = len(self.prompt)
        if end <= n:
            return self.prompt[start:end]
        if start >= n:
            return self.output[start - n:end - n]
        return self.prompt[start:] + self.output[:end - n]

    def result(self) -> EmulatedRequestOutput:
        """The final output of a finished sequence."""
        return EmulatedRequestOutput(self.request_id, self.prompt,
                                     [EmulatedCompletion(list(self.output))], self.cached_tokens)


COUNTERS = ("queries", "hits", "prefill_tokens", "decode_tokens", "evictions", "preemptions",
            "recomputed_tokens", "preempted_queries", "preempted_hits", "host_hits", "restored_blocks",
            "prefetched_blocks", "offloaded_blocks", "host_evictions", "dropped_blocks", "pins_released")
SECONDS = ("restore_s", "offload_s", "stall_s")


def _rank(seq: Sequence) -> tuple:
    return seq.key


class EmulatedScheduler:
    """The cost model itself (see the module docstring): ``add`` requests, ``step`` iterations.

    Kept apart from the host so tests (and offline simulators) can step it deterministically.
    Device KV: ``blocks`` (the pool, id 0 a null block as in vLLM), ``_empty`` (free blocks
    holding nothing), ``_lru`` (cached blocks nobody references, least recently used first),
    ``_cached`` (every block in the prefix cache by hash). Host KV: ``host`` (hashes, LRU).
    ``now`` is the emulated clock: steps advance it by their cost, :meth:`advance` by idle time.
    """

    def __init__(self, params: EmulationParams, capacity_blocks: int, prefix_caching: bool = True):
        self.p = params
        self.capacity = capacity_blocks
        self.prefix_caching = prefix_caching
        self.blocks: list[Block] = [Block(0, is_null=True)] + [Block(i) for i in range(1, capacity_blocks + 1)]
        self._empty: list[Block] = self.blocks[:0:-1]  # a stack: lowest ids handed out first
        self._lru: OrderedDict[int, Block] = OrderedDict()
        self._cached: dict[int, Block] = {}
        self._stored: dict[int, None] | None = None  # cached since take_stored(), once watched
        self.host: OrderedDict[int, None] = OrderedDict()
        self.host_capacity = params.host_kv_blocks
        # (priority, arrival, sequence): a heap, so a retry of an advanced session is admitted
        # before new work, as the control plane's priorities say; FIFO among equals.
        self.waiting: list[tuple[tuple, int, Sequence]] = []
        self._arrivals = itertools.count()
        # in the order they were admitted, as vLLM's running list: a step gives its token budget
        # to them in this order (a request admitted with a higher priority does not cut in
        # front of the decodes already running); priority picks whom to admit and to preempt
        self.running: list[Sequence] = []
        self.requests: dict[str, Sequence] = {}  # added and not finished
        # session -> its block hashes (first use first) -> tokens up to that block's end
        self.sessions: dict[str, OrderedDict[int, int]] = {}
        self._owners: dict[int, set[str]] = {}
        # session -> its blocks on the device / how many are on the host, kept as blocks move
        # (``residency`` is O(1), ``movable`` O(its device blocks); ``check_residency`` recounts)
        self._on_device: dict[str, set[int]] = {}
        self._on_host: dict[str, int] = {}
        self._pins: dict[str, list[Block]] = {}
        self.now = 0.0
        self._link_free_at = 0.0  # host -> device transfers run one after another
        self.steps = 0
        self.emulated_s = 0.0  # busy time: the sum of the steps' costs
        self.counters: dict[str, float] = {**dict.fromkeys(COUNTERS, 0), **dict.fromkeys(SECONDS, 0.0)}

    # -- sizes -------------------------------------------------------------------------------

    @property
    def used_blocks(self) -> int:
        """Blocks holding KV: referenced (running sequences, pins) or cached."""
        return self.capacity - len(self._empty)

    @property
    def pinned_blocks(self) -> int:
        """Blocks referenced by running sequences or retained by directives (never evicted)."""
        return self.capacity - len(self._empty) - len(self._lru)

    @property
    def free_blocks(self) -> int:
        """Blocks an allocation may take now: empty ones and cached unreferenced ones."""
        return len(self._empty) + len(self._lru)

    def blocks_needed(self, prompt_len: int, max_tokens: int) -> int:
        """Blocks a request holds at most: the last sampled token's KV is never computed."""
        return math.ceil(max(1, prompt_len + max_tokens - 1) / self.p.block_size)

    def check(self, request_id: str, prompt_len: int, max_tokens: int) -> None:
        """ValueError if the request could never fit, even in an empty cache (so it cannot hang)."""
        need = self.blocks_needed(prompt_len, max_tokens)
        if need > self.capacity:
            raise ValueError(
                f"request {request_id} needs {need} KV blocks ({prompt_len} prompt + {max_tokens} output tokens, "
                f"{self.p.block_size} tokens per block) but the emulated engine holds only {self.capacity} blocks"
            )

    # -- requests ----------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a request (by priority, then arrival)."""
        self.check(seq.request_id, len(seq.prompt), seq.max_tokens)
        if seq.request_id in self.requests:
            raise ValueError(f"request {seq.request_id} is already in the emulated engine")
        prompt = tuple(seq.prompt)
        seq.rng = random.Random(hash((prompt, 0 if seq.seed is None else seq.seed)))
        if self.prefix_caching:
            seq.hashes = block_hashes(prompt, self.p.block_size)
            self._own(seq, 0)
        seq.key = (tuple(seq.priority), next(self._arrivals))
        seq.length = len(seq.prompt) + len(seq.output)
        seq.status = "waiting"
        self.requests[seq.request_id] = seq
        heapq.heappush(self.waiting, (*seq.key, seq))

    def waiting_sequences(self) -> list[Sequence]:
        """Queued requests in admission order."""
        return [entry[2] for entry in sorted(self.waiting, key=lambda e: e[:2])]

    def contains(self, block_hash: int) -> bool:
        """True if the block is on the device (referenced or cached)."""
        return block_hash in self._cached

    def on_host(self, block_hash: int) -> bool:
        """True if the host tier holds the block."""
        return block_hash in self.host

    def abort(self, request_id: str) -> Sequence | None:
        """Drop a request wherever it is (its blocks freed); the sequence, or None if unknown."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return None
        if seq.status == "running":
            self.running.remove(seq)
            self._release_blocks(seq)
        elif seq.status == "waiting":
            self.waiting = [e for e in self.waiting if e[2] is not seq]
            heapq.heapify(self.waiting)
        seq.status = "aborted"
        return seq

    def drain(self) -> list[Sequence]:
        """Drop every running (KV released) and waiting sequence; return them."""
        out = self.running + self.waiting_sequences()
        for s in self.running:
            self._release_blocks(s)
        self.running, self.waiting = [], []
        self.requests.clear()
        return out

    # -- the block pool ------------------------------------------------------------------------

    def _allocate(self) -> Block | None:
        """A block holding nothing: an empty one, else the least recently used cached one."""
        if self._empty:
            return self._empty.pop()
        if not self._lru:
            return None
        _, b = self._lru.popitem(last=False)
        self.counters["evictions"] += 1
        self._uncache(b, to_host=self.p.host_policy == "lru")
        return b

    def _allocate_into(self, out: list[Block], n: int) -> None:
        """Append ``n`` blocks holding nothing to ``out``, referenced once; the caller checked
        that ``n`` are free. :meth:`_allocate` ``n`` times, inlined: an admission takes thousands."""
        empty = self._empty
        k = min(n, len(empty))
        for _ in range(k):
            b = empty.pop()
            b.ref_cnt = 1
            out.append(b)
        n -= k
        if n <= 0:
            return
        lru, cached, owners, on_device = self._lru, self._cached, self._owners, self._on_device
        to_host = self.p.host_policy == "lru" and self.host_capacity > 0
        host_put = self._host_put
        self.counters["evictions"] += n
        for _ in range(n):  # (_uncache inlined)
            h, b = lru.popitem(last=False)
            del cached[h]
            who = owners.get(h)
            if who:
                for o in who:
                    on_device[o].discard(h)
            if to_host:
                host_put(h)
            b.block_hash, b.ready_at, b.from_host = None, 0.0, False
            b.ref_cnt = 1
            out.append(b)

    def _count(self, counts: dict[str, int], h: int, delta: int) -> None:
        """Block ``h`` came onto (``delta`` 1) or left (-1) a tier: its owners' counts follow."""
        who = self._owners.get(h)
        if who:
            for o in who:
                counts[o] = counts.get(o, 0) + delta

    def _cache(self, h: int, b: Block) -> None:
        self._cached[h] = b
        who = self._owners.get(h)
        if who:
            for o in who:
                self._on_device[o].add(h)
        if self._stored is not None:
            self._stored[h] = None

    def take_stored(self) -> list[int]:
        """Hashes cached since the last call and still cached (vLLM's ``BlockStored`` events,
        as ``dask_agents.kv.runtime.device_index.DeviceIndex.take_stored`` reads them); the first call
        starts the watch and returns every cached hash."""
        if self._stored is None:
            self._stored = {}
            return list(self._cached)
        out = [h for h in self._stored if h in self._cached]
        self._stored.clear()
        return out

    def _uncache(self, b: Block, to_host: bool) -> None:
        """Take an unreferenced block (already out of ``_lru``) out of the prefix cache."""
        h = b.block_hash
        del self._cached[h]
        who = self._owners.get(h)
        if who:
            for o in who:
                self._on_device[o].discard(h)
        if to_host:
            self._host_put(b.block_hash)
        b.block_hash, b.ready_at, b.from_host = None, 0.0, False

    def _drop(self, b: Block, to_host: bool) -> None:
        """Free a cached unreferenced block now (a directive), first in line for reuse."""
        self._lru.pop(b.block_hash)
        self._uncache(b, to_host)
        self._empty.append(b)

    def _ref(self, b: Block) -> None:
        if b.ref_cnt == 0 and b.block_hash is not None:
            self._lru.pop(b.block_hash, None)
        b.ref_cnt += 1

    def _unref(self, b: Block) -> None:
        b.ref_cnt -= 1
        if b.ref_cnt == 0:
            if b.block_hash is not None:
                self._lru[b.block_hash] = b  # most recently used end
            else:
                self._empty.append(b)

    def _release_blocks(self, seq: Sequence) -> None:
        # Tail first, as vLLM frees them: the LRU takes a chain's tail before its head.
        lru, empty = self._lru, self._empty
        for b in reversed(seq.blocks):  # (_unref inlined)
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                if b.block_hash is not None:
                    lru[b.block_hash] = b  # most recently used end
                else:
                    empty.append(b)
        seq.blocks, seq.num_hashed = [], 0

    def _cache_full(self, seq: Sequence, upto: int | None = None) -> None:
        """Register the sequence's blocks that are full of computed tokens (``upto``: of tokens
        computed by the end of this step) in the prefix cache."""
        if not self.prefix_caching:
            return
        full = min((seq.num_computed if upto is None else upto) // self.p.block_size, len(seq.hashes))
        for i in range(seq.num_hashed, full):
            b, h = seq.blocks[i], seq.hashes[i]
            if b.block_hash is not None:
                continue
            twin = self._cached.get(h)
            if twin is not None and twin.ref_cnt == 0:
                # An unreferenced copy of the same KV (its tokens could not be a hit: the block
                # ends past the prompt): the fresh copy replaces it (vLLM keeps both until
                # evicted; one entry keeps the LRU order what reuse made it).
                self._drop(twin, to_host=False)
                twin = None
            if twin is None:  # (a referenced twin keeps the entry; this copy stays private)
                b.block_hash = h
                self._cache(h, b)
        seq.num_hashed = max(seq.num_hashed, full)

    def _extend_hashes(self, seq: Sequence) -> None:
        """Hash the blocks the new output token completed (vLLM's request.block_hashes grows too)."""
        if not self.prefix_caching:
            return
        bs, start = self.p.block_size, len(seq.hashes)
        while (len(seq.hashes) + 1) * bs <= seq.length:
            i = len(seq.hashes)
            seq.hashes.append(_chain(seq.hashes[-1] if seq.hashes else 0, seq.tokens(i * bs, (i + 1) * bs)))
        self._own(seq, start)

    # -- the host tier --------------------------------------------------------------------------

    def _host_keep(self, h: int) -> bool:
        """Put ``h`` at the host's most recent end, evicting LRU to make room; False without a host tier."""
        if self.host_capacity < 1:
            return False
        if h in self.host:
            self.host.move_to_end(h)
            return True
        while len(self.host) >= self.host_capacity:
            old, _ = self.host.popitem(last=False)
            self._count(self._on_host, old, -1)
            self.counters["host_evictions"] += 1
        self.host[h] = None
        self._count(self._on_host, h, 1)
        return True

    def _host_put(self, h: int) -> bool:
        """Copy a device block to the host (beside the steps: not charged); False without a host tier.
        (:meth:`_host_keep` inlined: every eviction under ``lru`` comes here.)"""
        host = self.host
        if h in host:  # the copy is there already (so there is a host tier)
            host.move_to_end(h)
            return True
        if self.host_capacity < 1:
            return False
        while len(host) >= self.host_capacity:
            old, _ = host.popitem(last=False)
            self._count(self._on_host, old, -1)
            self.counters["host_evictions"] += 1
        host[h] = None
        self._count(self._on_host, h, 1)
        self.counters["offloaded_blocks"] += 1
        self.counters["offload_s"] += self.p.host_offload_s_per_block
        return True

    def _host_take(self, h: int) -> None:
        """Take ``h`` off the host (KeyError if it is not there)."""
        self.host.pop(h)
        self._count(self._on_host, h, -1)

    def _transfer(self) -> float:
        """Book one block on the host -> device link; returns when it arrives."""
        start = max(self.now, self._link_free_at)
        self._link_free_at = start + self.p.host_restore_s_per_block
        self.counters["restore_s"] += self.p.host_restore_s_per_block
        self.counters["restored_blocks"] += 1
        return self._link_free_at

    def _restore_block(self, h: int, prefetch: bool, held: bool = False) -> Block | None:
        """A device block holding host block ``h`` (arriving over the link), unreferenced and
        out of ``_lru``; None if no block can be had. Under ``directed`` it leaves the host.
        ``held``: the caller took ``h`` off the host already."""
        if not held:
            self._host_take(h)  # held aside: the allocation below may push blocks to the host
        b = self._allocate()
        if b is None:
            self.host[h] = None
            self._count(self._on_host, h, 1)
            return None
        if self.p.host_policy == "lru":
            self._host_keep(h)
        b.block_hash, b.from_host, b.ready_at = h, True, self._transfer()
        self._cache(h, b)
        if prefetch:
            self.counters["prefetched_blocks"] += 1
        return b

    def restore(self, hashes: list[int], limit: int | None = None, prefetch: bool = False) -> int:
        """Bring the prefix ``hashes`` from the host onto the device as cached blocks, in chain
        order: resident ones are skipped, it stops at the first block held nowhere, at ``limit``
        blocks, or when only its own restores could make room. They arrive over the link in the
        background (``ready_at``); an admission that needs one before then waits for it."""
        done: set[int] = set()
        for h in hashes:
            if limit is not None and len(done) >= limit:
                break
            if h in self._cached:
                continue
            if h not in self.host:
                break
            if not self._empty and (not self._lru or next(iter(self._lru)) in done):
                break
            b = self._restore_block(h, prefetch)
            if b is None:
                break
            self._lru[h] = b
            done.add(h)
        return len(done)

    def advance(self, seconds: float) -> None:
        """Idle time passes (no step runs); infinite: every transfer in flight completes."""
        if math.isinf(seconds):
            self.now = max(self.now, self._link_free_at)
        elif seconds > 0:
            self.now += seconds

    # -- admission, preemption, the step -------------------------------------------------------

    def _try_admit(self, seq: Sequence) -> bool:
        """Admit ``seq`` if all its tokens' blocks fit: take its prefix hits (device, or host:
        restored now), allocate the rest. False (nothing changed) if they do not fit."""
        bs, ntok = self.p.block_size, seq.length
        total = math.ceil(ntok / bs)
        # (Loops over the prefix inlined, _ref included: a long context's admission walks thousands.)
        plan: list[Block | None] = []  # per prefix block: the device block, or None (on the host)
        if self.prefix_caching:
            cached, host = self._cached, self.host
            for h in seq.hashes[:(ntok - 1) // bs]:  # the last token is always computed
                b = cached.get(h)
                if b is None and h not in host:
                    break
                plan.append(b)
        device = [b for b in plan if b is not None]
        touched = 0  # taken off the free pool by admitting
        for b in device:
            if b.ref_cnt == 0:
                touched += 1
        if total - len(device) > self.free_blocks - touched:
            return False
        lru = self._lru
        for b in device:  # referenced first: the allocations below cannot evict them
            if b.ref_cnt == 0 and b.block_hash is not None:
                lru.pop(b.block_hash, None)
            b.ref_cnt += 1
        if len(device) == len(plan):  # every prefix block on the device
            blocks = device
        else:
            for h, b in zip(seq.hashes, plan):  # held aside too: evictions push blocks to the host
                if b is None:
                    self._host_take(h)
            blocks = []
            for h, b in zip(seq.hashes, plan):
                if b is None:
                    b = self._restore_block(h, prefetch=False, held=True)
                    b.ref_cnt = 1
                blocks.append(b)
        self._allocate_into(blocks, total - len(blocks))
        hit = len(plan) * bs
        host_hits, ready = 0, 0.0
        for i in range(len(plan)):
            b = blocks[i]
            if b.from_host:  # restored for this admission, or prefetched earlier and not hit since
                host_hits += bs
                b.from_host = False
            if b.ready_at > ready:
                ready = b.ready_at
        if host_hits:
            self.counters["host_hits"] += host_hits
        seq.blocks, seq.num_computed, seq.num_hashed, seq.prefill_target = blocks, hit, len(plan), ntok
        seq.ready_at = ready
        if seq.preemptions:
            self.counters["preempted_queries"] += ntok
            self.counters["preempted_hits"] += hit
            self.counters["recomputed_tokens"] += ntok - hit
        else:
            seq.cached_tokens = hit
            self.counters["queries"] += ntok
            self.counters["hits"] += hit
        return True

    def _grow(self, seq: Sequence, tokens: int) -> bool:
        """Blocks for ``tokens`` computed tokens of ``seq``; False (nothing taken) if too few are free."""
        need = math.ceil(tokens / self.p.block_size) - len(seq.blocks)
        if need > self.free_blocks:
            return False
        self._allocate_into(seq.blocks, need)
        return True

    def _preempt(self, seq: Sequence) -> None:
        """vLLM's recompute preemption: free its blocks, back to the waiting queue, output kept."""
        self.running.remove(seq)
        self._release_blocks(seq)
        seq.num_computed = 0
        seq.preemptions += 1
        seq.status = "waiting"
        self.counters["preemptions"] += 1
        heapq.heappush(self.waiting, (*seq.key, seq))

    def _release_pins_for_admission(self) -> bool:
        """Nothing runs and retained blocks keep the next request out: drop the pins (as
        ``EngineKV.maintain`` does), so retention can never wedge the engine."""
        if self.running or not self._pins:
            return False
        for session in list(self._pins):
            self.release(session)
            self.counters["pins_released"] += 1
        return True

    def step(self) -> tuple[float, list[Sequence]]:
        """One iteration: schedule running sequences, then admit waiting ones, within the token
        budget; every sequence whose pending tokens are all computed samples one token.

        Returns the iteration's emulated duration (seconds, unscaled) and the sequences that
        finished in it (released from the KV; their futures are left to the caller)."""
        p, bs = self.p, self.p.block_size
        budget = p.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        preempted = False
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.status != "running":  # preempted for an earlier one in this step
                continue
            n = min(seq.length - seq.num_computed, budget)
            if seq.num_computed + n > len(seq.blocks) * bs:  # (most steps: inside its last block)
                while not self._grow(seq, seq.num_computed + n):
                    victim = max(self.running, key=_rank)  # lowest priority, latest arrival (vLLM)
                    self._preempt(victim)
                    preempted = True
                    if victim is seq:
                        break
                    for i, (s, k) in enumerate(scheduled):  # scheduled earlier in this step: undone
                        if s is victim:
                            del scheduled[i]
                            budget += k
                            break
            if seq.status == "running":
                scheduled.append((seq, n))
                budget -= n
        caching = self.prefix_caching
        early = caching and p.cache_on_schedule
        if early:
            # vLLM caches a block when it is allocated for the tokens a step schedules, not once
            # computed (KVCacheManager.allocate_slots -> cache_blocks): a request admitted after
            # it, in this step or later, hits the blocks this step computes (a fan-out's
            # siblings arriving while the first is in prefill share its prefix). After the
            # preemptions: a sequence unscheduled by one caches nothing it did not compute.
            for seq, n in scheduled:
                if (seq.num_computed + n) // bs > seq.num_hashed:
                    self._cache_full(seq, seq.num_computed + n)
        admitted: list[Sequence] = []
        if not preempted or not scheduled:  # (vLLM admits nothing in a step that preempted)
            while self.waiting and len(self.running) < p.max_batch and budget > 0:
                seq = self.waiting[0][2]
                if not self._try_admit(seq) and not (self._release_pins_for_admission() and self._try_admit(seq)):
                    break
                heapq.heappop(self.waiting)
                seq.status = "running"
                self.running.append(seq)
                admitted.append(seq)
                n = min(seq.length - seq.num_computed, budget)
                scheduled.append((seq, n))
                budget -= n
                if early and (seq.num_computed + n) // bs > seq.num_hashed:
                    self._cache_full(seq, seq.num_computed + n)  # (as above: the next admitted may hit it)
        if not scheduled:
            return 0.0, []
        stall = max(0.0, max((s.ready_at for s in admitted), default=0.0) - self.now)
        prefill = positions = ctx = decoded = 0
        done: list[Sequence] = []
        for seq, n in scheduled:
            c = seq.num_computed
            if c < seq.prefill_target:  # prefill of positions c .. c + k - 1
                k = min(n, seq.prefill_target - c)
                prefill += k
                positions += prefill_positions(c, c + k)
            c += n
            seq.num_computed = c
            ctx += c
            if caching and c // bs > seq.num_hashed:
                self._cache_full(seq)
            if c >= seq.length:  # ids 3..258: the byte tokenizer decodes every one
                seq.output.append(seq.rng.randrange(OFFSET, 256 + OFFSET))
                seq.length += 1
                decoded += 1
                if caching and seq.length % bs == 0:
                    self._extend_hashes(seq)
                if len(seq.output) >= seq.max_tokens:
                    done.append(seq)
        cost = stall + _prefill_cost(p, prefill, positions) + decode_step_cost(p, len(scheduled), ctx)
        self.counters["prefill_tokens"] += prefill
        self.counters["decode_tokens"] += decoded
        self.counters["stall_s"] += stall
        for seq in done:
            self.running.remove(seq)
            self._release_blocks(seq)
            seq.status = "done"
            self.requests.pop(seq.request_id, None)
        self.steps += 1
        self.emulated_s += cost
        self.now += cost
        return cost, done

    # -- sessions (the per-session operations of dask_agents.kv.runtime.engine_kv.EngineKV) --------------------------

    def _own(self, seq: Sequence, start: int) -> None:
        if seq.session is None or not seq.tracked:
            return
        session, hashes, owners = seq.session, seq.hashes, self._owners
        blocks = self.sessions.get(session)
        if blocks is None:
            blocks = self.sessions[session] = OrderedDict()
            self._on_device[session], self._on_host[session] = set(), 0
        bs = self.p.block_size
        cached, host, device = self._cached, self.host, self._on_device[session]
        on_host = 0
        for i in range(start, len(hashes)):
            h = hashes[i]
            if h not in blocks:
                blocks[h] = (i + 1) * bs
                who = owners.get(h)
                if who is None:
                    owners[h] = {session}
                else:
                    who.add(session)
                if h in cached:
                    device.add(h)
                if h in host:
                    on_host += 1
        self._on_host[session] += on_host

    def knows(self, session: str) -> bool:
        """Whether the engine tracks blocks for ``session``."""
        return session in self.sessions

    def session_blocks(self, session: str) -> list[int]:
        """The session's block hashes in prefix order (first use first); [] if unknown."""
        return list(self.sessions.get(session, ()))

    def owners(self, block_hash: int) -> frozenset[str]:
        """Sessions whose requests used the block (and were not invalidated)."""
        return frozenset(self._owners.get(block_hash, ()))

    def block_tokens(self, block_hash: int) -> int:
        """Tokens up to the end of the block (its position in the chain: the hash covers the
        whole prefix), from any session that owns it; the block size when none does."""
        for session in self._owners.get(block_hash, ()):
            return self.sessions[session][block_hash]
        return self.p.block_size

    def residency(self, session: str) -> dict[str, int]:
        """Where the session's blocks are: ``blocks`` (all), ``device``, ``host``, ``pinned``.
        O(1): the counts are kept as blocks move (:meth:`check_residency` recounts them)."""
        hs = self.sessions.get(session)
        if hs is None:
            return {"blocks": 0, "device": 0, "host": 0, "pinned": 0}
        return {"blocks": len(hs), "device": len(self._on_device[session]), "host": self._on_host[session],
                "pinned": len(self._pins.get(session, ()))}

    def check_residency(self) -> None:
        """Recount every session's device and host blocks by a scan of its blocks and compare
        with the counts :meth:`residency` keeps (AssertionError naming the first mismatch).
        O(every block of every session): for tests and debugging, never on the stepping thread."""
        if set(self._on_device) != set(self.sessions) or set(self._on_host) != set(self.sessions):
            raise AssertionError(f"residency counts kept for {sorted(self._on_device)} / {sorted(self._on_host)}, "
                                 f"sessions are {sorted(self.sessions)}")
        for session, hs in self.sessions.items():
            device = {h for h in hs if h in self._cached}
            host = sum(1 for h in hs if h in self.host)
            if (device, host) != (self._on_device[session], self._on_host[session]):
                raise AssertionError(f"session {session!r}: {len(device)} blocks on the device and {host} on the "
                                     f"host, kept {len(self._on_device[session])} ({len(device ^ self._on_device[session])} "
                                     f"differ) and {self._on_host[session]}")

    def pinned(self, session: str) -> int:
        """Blocks ``session`` has retained."""
        return len(self._pins.get(session, ()))

    def retained_blocks(self) -> int:
        """Blocks retained across sessions."""
        return sum(len(v) for v in self._pins.values())

    def retain(self, session: str, max_blocks: int | None = None) -> int:
        """Pin the session's device blocks (a reference each: never evicted), at most
        ``max_blocks``; re-retaining replaces the pin. Returns the blocks pinned."""
        self.release(session)
        blocks = [b for b in (self._cached.get(h) for h in self.sessions.get(session, ())) if b is not None]
        if max_blocks is not None:
            blocks = blocks[:max(0, max_blocks)]
        for b in blocks:
            self._ref(b)
        if blocks:
            self._pins[session] = blocks
        return len(blocks)

    def release(self, session: str) -> int:
        """Drop the session's pin (its blocks stay cached, evictable)."""
        blocks = self._pins.pop(session, None) or []
        for b in blocks:
            self._unref(b)
        return len(blocks)

    def movable(self, session: str, limit: int | None = None) -> list[int]:
        """The session's device blocks that may leave, tail first: unreferenced and owned by no
        other session; at most ``limit``."""
        out: list[int] = []
        hs = self.sessions.get(session)
        if not hs:
            return out
        # its device blocks only (not its whole history), tail first: by position in the chain
        # (what first use order gives for a chain that grows), ties by hash for a fixed order
        for h in sorted(self._on_device[session], key=lambda h: (hs[h], h), reverse=True):
            if limit is not None and len(out) >= limit:
                break
            b = self._cached[h]
            if b.ref_cnt > 0 or self._owners.get(h, set()) - {session}:
                continue
            out.append(h)
        return out

    def offload_blocks(self, hashes: list[int], copy: bool) -> int:
        """Free the device blocks ``hashes`` (unreferenced ones; others skipped), copied to the
        host first when ``copy`` (stops when it has no host tier) or the host policy is ``lru``.
        Returns the number freed."""
        n = 0
        for h in hashes:
            b = self._cached.get(h)
            if b is None or b.ref_cnt > 0:
                continue
            if copy and self.host_capacity < 1:
                break
            to_host = copy or self.p.host_policy == "lru"
            self._drop(b, to_host)
            if not (to_host and self.host_capacity):
                self.counters["dropped_blocks"] += 1
            n += 1
        return n

    def offload(self, session: str, blocks: int | None = None, copy: bool = True) -> int:
        """Move the session's device blocks to the host (``copy``) or free them, tail first, at
        most ``blocks``, except blocks another session owns or a running request uses; drops
        the session's pin. Returns the number moved off the device."""
        self.release(session)
        return self.offload_blocks(self.movable(session, blocks), copy)

    def prefetch(self, session: str, max_blocks: int | None = None) -> int:
        """Start bringing the session's host blocks back (prefix order), at most ``max_blocks``:
        they arrive over the link in the background, not charged to any step."""
        return self.restore(self.session_blocks(session), max_blocks, prefetch=True)

    def invalidate(self, session: str) -> int:
        """The session ended: drop its pin and every block no other session owns, on both tiers
        (a block a running request uses is freed when that request ends). Returns the number dropped."""
        hs = self.sessions.pop(session, None)
        self.release(session)
        if hs is None:
            return 0
        del self._on_device[session], self._on_host[session]
        for seq in self.requests.values():  # its requests still in flight stop recording blocks for it
            if seq.session == session:
                seq.tracked = False
        dropped = disown(self._owners, session, hs)
        for h in dropped:
            b = self._cached.get(h)
            if b is not None and b.ref_cnt == 0:
                self._drop(b, to_host=False)
            self.host.pop(h, None)  # (nobody owns it now: no count to change)
        self.counters["dropped_blocks"] += len(dropped)
        return len(dropped)

    # -- reports --------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Counters (tokens: queries, hits, prefill/decode/recomputed tokens, host_hits; blocks
        for the rest; ``*_s`` emulated seconds) and the KV state now."""
        return {**self.counters, "used_blocks": self.used_blocks, "pinned_blocks": self.pinned_blocks,
                "free_blocks": self.free_blocks, "cached_blocks": len(self._lru), "capacity_blocks": self.capacity,
                "retained_blocks": self.retained_blocks(), "host_used_blocks": len(self.host),
                "host_capacity_blocks": self.host_capacity, "running": len(self.running),
                "waiting": len(self.waiting), "max_batch": self.p.max_batch, "block_size": self.p.block_size,
                "steps": self.steps, "emulated_s": self.emulated_s, "clock_s": self.now}
