"""Per-session KV through vLLM's KV connector API: a host-memory tier under any vLLM engine,
``engine: vllm-async`` included (AsyncLLM keeps its block pool in the engine core's process,
out of reach of :mod:`dask_agents.kv.runtime.engine_kv`).

:class:`SessionKVConnector` implements ``KVConnectorBase_V1`` and is loaded out of tree by
``KVTransferConfig(kv_connector="SessionKVConnector", kv_connector_module_path="dask_agents.kv.runtime.connector")``
(``kv-connector: dask-agents`` in a model's settings builds it, :func:`transfer_config`). Through
the API's hooks it:

- **saves** a finished request's new full blocks to the host store (``request_finished``: the
  step that computed them is done, and vLLM has not freed them yet), owned by the request's
  ``session_id``, in block-hash order, so a session's KV is in host memory at every pause;
- **loads** a request's prefix from the store into the blocks vLLM allocated for it when the
  device no longer holds it (``get_num_new_matched_tokens`` counts the stored blocks past the
  device hit, ``update_state_after_alloc`` copies them in before the step computes anything),
  so a restored prefix is an ordinary cached prefix and greedy outputs match a cold run;
- takes **directives** per session (:func:`control`): ``inspect``, ``offload`` (drop the
  session's device blocks that the store holds: they come back at its next request),
  ``invalidate`` (drop its blocks no other session owns, from the store and the device). The
  engine runs them between steps: ``engine.collective_rpc("dask_agents_kv", ...)`` reaches
  :class:`ControlExtension`, a ``worker_extension_cls``. ``retain``, ``release`` and
  ``prefetch`` are refused, each with the reason (``REFUSED``).

Why the copies run synchronously in the scheduler's hooks, not in the worker's
``start_load_kv``/``save_kv_layer``: the store and the paged KV tensors (handed over by
``register_kv_caches``) live in one process when the worker runs beside the scheduler (an
in-process engine, or AsyncLLM's engine core with the uni-process executor: one device), and a
copy between steps needs no metadata round trip. With workers in other processes (tensor
parallelism) the scheduler never sees the tensors: the connector then matches nothing, saves
nothing and says so once (``SessionKVConnector.usable``).

vLLM internals: device blocks are found and dropped through ``dask_agents.kv.runtime.vllm_compat`` (the
pool's hash map and ``evict_blocks``); everything else is what the connector API hands over
(``Request.block_hashes``, ``num_computed_tokens``, ``session_id``, ``KVCacheBlocks.get_block_ids``,
the paged tensors of ``register_kv_caches``).

The store keeps blocks least recently used first and drops from that end when full
(``host_bytes``); it never holds a block twice (blocks are keyed by vLLM's prefix-cache hash,
which chains the parent's: sessions sharing a system prompt share its stored blocks).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from dask_agents.kv.runtime import vllm_compat as vc
from dask_agents.kv.runtime.engine_kv import KVDirectiveError

logger = logging.getLogger(__name__)

CONNECTOR = "SessionKVConnector"
OPS = ("inspect", "offload", "invalidate")
REFUSED = {
    "retain": "vLLM's connector API can delay freeing a finished request's blocks (request_finished), "
              "not pin a session's blocks for a TTL; a paused session's KV is in the host store instead",
    "release": "nothing is pinned through the connector (see retain)",
    "prefetch": "the connector API loads KV only into blocks vLLM allocates for an admitted request: a "
                "session's stored blocks come back when its next request is scheduled, not before",
}


class HostStore:
    """The host tier of one engine: block hash -> a copy of the block in every layer."""

    def __init__(self, capacity_bytes: int):
        self.capacity = capacity_bytes
        self.blocks: OrderedDict[bytes, list] = OrderedDict()  # least recently used first
        self.owners: dict[bytes, set[str]] = {}
        self.sessions: dict[str, dict[bytes, None]] = {}  # session -> its stored hashes, first use first
        self.bytes = 0
        self.kv_caches: list | None = None  # the paged KV tensors (worker side), one per layer
        self.block_dims: list[int] = []  # each tensor's block dimension
        self.manager: Any = None  # the scheduler's KVCacheManager
        self.block_size = 0
        self.stats = dict.fromkeys(("saved_blocks", "loaded_blocks", "dropped_blocks", "offloaded_blocks"), 0)
        self.lock = threading.Lock()  # directives and hooks run on the engine's thread; reports do not

    # -- blocks -------------------------------------------------------------------------------------
    def read(self, block_id: int) -> list:
        """A host copy of one device block, every layer."""
        return [t.select(d, block_id).to("cpu", copy=True) for t, d in zip(self.kv_caches, self.block_dims)]

    def write(self, block_id: int, data: list) -> None:
        """Put a stored copy into one device block, every layer."""
        for t, d, x in zip(self.kv_caches, self.block_dims, data):
            t.select(d, block_id).copy_(x)

    def put(self, h: bytes, data: list, session: str | None) -> None:
        """Store a block (least recently used blocks go when full)."""
        size = sum(x.numel() * x.element_size() for x in data)
        if size > self.capacity:
            return
        while self.bytes + size > self.capacity and self.blocks:
            self._drop(next(iter(self.blocks)))
        self.blocks[h] = data
        self.bytes += size
        self.stats["saved_blocks"] += 1
        self.own(h, session)

    def own(self, h: bytes, session: str | None) -> None:
        """``session`` uses the stored block ``h``."""
        if session is not None and h in self.blocks:
            self.owners.setdefault(h, set()).add(session)
            self.sessions.setdefault(session, {})[h] = None

    def _drop(self, h: bytes) -> None:
        data = self.blocks.pop(h)
        self.bytes -= sum(x.numel() * x.element_size() for x in data)
        self.stats["dropped_blocks"] += 1
        for s in self.owners.pop(h, ()):
            held = self.sessions.get(s)
            if held is not None:
                held.pop(h, None)
                if not held:
                    del self.sessions[s]

    # -- directives (on the engine's thread, between steps) ----------------------------------------
    def _device(self, h: bytes) -> Any:
        return vc.pool_lookup(self.manager.block_pool, h)

    def inspect(self, session: str) -> dict:
        """Where the session's stored blocks are: in the store, and still on the device."""
        held = list(self.sessions.get(session, ()))
        return {"session": session, "host_blocks": len(held),
                "device_blocks": sum(1 for h in held if self._device(h) is not None)}

    def offload(self, session: str) -> int:
        """Drop the session's device blocks the store holds and nobody references (a later
        request loads them back); returns how many went."""
        blocks = [b for b in (self._device(h) for h in self.sessions.get(session, ())) if b is not None]
        n = vc.pool_evict(self.manager.block_pool, blocks)
        self.stats["offloaded_blocks"] += n
        return n

    def invalidate(self, session: str) -> int:
        """Forget the session: its stored blocks no other session owns are dropped from the
        store and (unreferenced) from the device; returns how many blocks were dropped."""
        held = list(self.sessions.get(session, ()))
        mine = [h for h in held if self.owners.get(h, set()) <= {session}]
        for h in held:
            self.owners.get(h, set()).discard(session)
        blocks = [b for b in (self._device(h) for h in mine) if b is not None]
        for h in mine:
            self._drop(h)
        self.sessions.pop(session, None)
        vc.pool_evict(self.manager.block_pool, blocks)
        return len(mine)


_STORES: dict[str, HostStore] = {}  # by engine name, in the process that runs the engine core
_STORES_LOCK = threading.Lock()


def store(name: str, capacity_bytes: int = 0) -> HostStore:
    """The host store of engine ``name`` (created on first use)."""
    with _STORES_LOCK:
        s = _STORES.get(name)
        if s is None:
            s = _STORES[name] = HostStore(capacity_bytes)
        return s


def transfer_config(name: str, host_bytes: int) -> Any:
    """The ``KVTransferConfig`` that puts :class:`SessionKVConnector` under engine ``name``."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(kv_connector=CONNECTOR, kv_connector_module_path=__name__, kv_role="kv_both",
                            kv_connector_extra_config={"store": name, "host_bytes": int(host_bytes)})


def check(op: str) -> None:
    """KVDirectiveError unless ``op`` is a directive the connector applies (``OPS``), naming
    the reason for one it refuses (``REFUSED``)."""
    if op in REFUSED:
        raise KVDirectiveError(f"KV directive {op!r} is not available through the KV connector: {REFUSED[op]}")
    if op not in OPS:
        raise KVDirectiveError(f"unknown KV directive {op!r} (known: {', '.join(OPS)})")


def control(name: str, op: str, session: str) -> dict:
    """Apply one directive to engine ``name``'s store (``OPS``); KVDirectiveError otherwise."""
    check(op)
    s = _STORES.get(name)
    if s is None or s.manager is None:
        raise KVDirectiveError(f"engine {name!r} has no dask-agents KV connector in this process")
    with s.lock:
        result = s.inspect(session) if op == "inspect" else getattr(s, op)(session)
        return {"result": result, "residency": s.inspect(session), "stats": dict(s.stats), "bytes": s.bytes}


class ControlExtension:
    """Worker extension (``worker_extension_cls``): ``collective_rpc("dask_agents_kv", args=(engine,
    op, session))`` runs :func:`control` in the engine core's process, between steps."""

    def dask_agents_kv(self, name: str, op: str, session: str) -> dict:
        """See :func:`control`."""
        return control(name, op, session)


class SessionKVConnector(KVConnectorBase_V1):
    """The connector (see the module docstring). One instance per role; both reach the same
    :class:`HostStore` by the engine's name (``kv_connector_extra_config["store"]``)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = self._kv_transfer_config
        self.name = str(cfg.get_from_extra_config("store", "default"))
        self.store = store(self.name, int(cfg.get_from_extra_config("host_bytes", 1 << 30)))
        self.store.block_size = self.block_size = int(vllm_config.cache_config.block_size)
        self._num_blocks = getattr(kv_cache_config, "num_blocks", None)
        self._loads: dict[str, tuple[int, list]] = {}  # request id -> (first block, hashes to load)
        self._warned = False

    @property
    def usable(self) -> bool:
        """Whether the KV tensors are in this process (see the module docstring)."""
        ok = self.store.kv_caches is not None
        if not ok and not self._warned:
            self._warned = True
            logger.warning("engine %s: the dask-agents KV connector sees no KV tensors in the scheduler's process "
                           "(workers in other processes): it stores and loads nothing", self.name)
        return ok

    # -- worker side ----------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict) -> None:
        """The paged KV tensors, one per layer: the store copies blocks in and out of them."""
        tensors = list(kv_caches.values())
        n = self._num_blocks
        dims = []
        for t in tensors:
            dim = next((i for i, size in enumerate(t.shape) if size == n), 0) if n else 0
            dims.append(dim)
        self.store.kv_caches, self.store.block_dims = tensors, dims

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Nothing: loads happened when the blocks were allocated (``update_state_after_alloc``)."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for (loads are synchronous)."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """Nothing: blocks are saved when their request finishes (``request_finished``)."""

    def wait_for_save(self) -> None:
        """Nothing to wait for (saves are synchronous)."""

    # -- scheduler side -------------------------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        """The scheduler's KV cache manager: directives find device blocks through its pool."""
        self.store.manager = kv_cache_manager

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens of the prompt's stored blocks past the device hit (at most its first
        ``len - 1`` tokens, as vLLM's own prefix cache), loaded synchronously."""
        if not self.usable:
            return 0, False
        bs = self.block_size
        start = num_computed_tokens // bs
        limit = (request.num_tokens - 1) // bs
        hashes = request.block_hashes
        with self.store.lock:
            n = 0
            while start + n < min(limit, len(hashes)) and bytes(hashes[start + n]) in self.store.blocks:
                n += 1
        if not n:
            return 0, False
        self._loads[request.request_id] = (start, [bytes(h) for h in hashes[start:start + n]])
        return n * bs, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Copy the stored blocks into the device blocks vLLM just allocated for them."""
        plan = self._loads.pop(request.request_id, None)
        if not num_external_tokens or plan is None:
            return
        start, hashes = plan
        ids = blocks.get_block_ids()[0]
        s = self.store
        with s.lock:
            for i, h in enumerate(hashes[:num_external_tokens // self.block_size]):
                data = s.blocks.get(h)
                if data is None:  # (dropped since it was counted: cannot happen on one thread)
                    raise RuntimeError(f"stored block {h.hex()[:12]} vanished before its load")
                s.write(ids[start + i], data)
                s.blocks.move_to_end(h)
                s.own(h, getattr(request, "session_id", None))
                s.stats["loaded_blocks"] += 1

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """Nothing travels to the workers (copies run here)."""
        return KVConnectorMetadata()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        """Save the request's full computed blocks the store lacks, for its session; its blocks
        are freed as usual (False: no delayed free)."""
        if not self.usable:
            return False, None
        session = getattr(request, "session_id", None)
        n = min(len(block_ids), request.num_computed_tokens // self.block_size, len(request.block_hashes))
        s = self.store
        with s.lock:
            for i in range(n):
                h = bytes(request.block_hashes[i])
                if h in s.blocks:
                    s.blocks.move_to_end(h)
                    s.own(h, session)
                else:
                    s.put(h, s.read(block_ids[i]), session)
        return False, None
