"""Per-session KV control for one vLLM engine: inspect, retain, release, offload, prefetch, invalidate.

The engine's prefix cache stays the single source of truth for what is on the device: this
adapter only (a) remembers which cached blocks belong to which session, from the block hashes
of the session's own requests, (b) pins blocks by taking a reference (a referenced block is
never evicted), (c) copies blocks to a host-memory tier (and from there to a disk tier) and
drops them from the device, and (d) puts them back as ordinary cached blocks, so the next
request with that prefix hits them as if they had never left. Nothing here changes how vLLM
schedules or computes; restored KV is the same bytes, so greedy outputs match a cold run.

Why a project-owned tier store and not a KV connector: vLLM's offloading connectors refuse the
CPU backend, and LMCache needs a paged-layout connector there (``../shared/notes/vllm-cpu.md``).
Copying whole blocks between the paged KV tensor and host memory, between engine steps, needs
no connector and works the same on CPU and GPU (a device-to-host copy per layer).

Sharing: sessions that share a prefix (a system prompt) share its blocks. A block is owned by
every live session that used it; offloading one session leaves blocks another live session
owns on the device, and invalidating a session drops only the blocks no other live session
owns.

Threading: every method must run on the engine's stepping thread, between steps (see
``dask_agents.kv.runtime.vllm_compat``). ``dask_agents.worker_plugin.vllm_host.EngineHost.kv_call`` gets you there.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Literal

from dask_agents.kv.runtime import vllm_compat as vc

logger = logging.getLogger(__name__)

Tier = Literal["device", "host", "disk"]


class KVDirectiveError(ValueError):
    """A KV directive that cannot be applied (unknown session, no such tier, ...)."""


def block_count(name: str, value: Any) -> int | None:
    """A block count argument: None (all) or a non-negative int; anything else is named."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise KVDirectiveError(f"{name} must be a non-negative int or None, got {value!r}")
    return value


def disown(owners: dict, session: str, hashes: Any) -> list:
    """``session`` no longer owns the blocks ``hashes``: drop it from each block's owners
    (``owners``: block hash -> set of sessions); returns the blocks nobody owns now (a block
    shared with a live session, a common prefix, stays)."""
    dropped = []
    for h in hashes:
        held = owners.get(h)
        if held is not None:
            held.discard(session)
            if held:
                continue
            del owners[h]
        dropped.append(h)
    return dropped


@dataclass(frozen=True)
class TierConfig:
    """Where offloaded KV may go. Zero bytes means the tier does not exist."""

    host_bytes: int = 0
    disk_bytes: int = 0
    disk_path: str | None = None
    pin_fraction: float = 0.5  # at most this share of the device blocks may be pinned
    pin_ttl_s: float = 30.0  # a pin without an explicit TTL expires after this long

    def __post_init__(self) -> None:
        if self.host_bytes < 0 or self.disk_bytes < 0:
            raise ValueError("tier capacities must be >= 0 bytes")
        if self.disk_bytes and not self.disk_path:
            raise ValueError("a disk tier needs disk_path")
        if not 0.0 <= self.pin_fraction <= 1.0:
            raise ValueError(f"pin_fraction must be in [0, 1], got {self.pin_fraction}")
        if self.pin_ttl_s <= 0:
            raise ValueError(f"pin_ttl_s must be > 0, got {self.pin_ttl_s}")


@dataclass(frozen=True)
class Residency:
    """Where one session's KV blocks are now."""

    session: str
    blocks: int  # blocks the session owns
    device_blocks: int
    host_blocks: int
    disk_blocks: int
    pinned_blocks: int
    bytes_per_block: int
    block_size: int

    @property
    def device_bytes(self) -> int:
        """Bytes of the session's blocks resident on the device."""
        return self.device_blocks * self.bytes_per_block

    @property
    def host_bytes(self) -> int:
        """Bytes of the session's blocks held in host memory."""
        return self.host_blocks * self.bytes_per_block

    @property
    def disk_bytes(self) -> int:
        """Bytes of the session's blocks held on disk."""
        return self.disk_blocks * self.bytes_per_block

    @property
    def device_tokens(self) -> int:
        """Tokens whose KV is resident on the device."""
        return self.device_blocks * self.block_size


@dataclass
class KVStats:
    """Counters of one engine's KV management (monotonic)."""

    offloaded_bytes: int = 0  # device -> host
    spilled_bytes: int = 0  # host -> disk
    restored_bytes: int = 0  # host/disk -> device (prefetch or on demand)
    restored_on_demand_bytes: int = 0  # the part restored when a request needed it
    restore_seconds: float = 0.0
    restore_stall_seconds: float = 0.0  # the part a waiting request stalled for (on-demand restores)
    offload_seconds: float = 0.0  # time spent copying device -> host/disk (proactive and on demand)
    dropped_blocks: int = 0  # invalidated or lost for lack of tier space
    pins_expired: int = 0
    pins_released_for_admission: int = 0

    def as_dict(self) -> dict[str, float]:
        """The counters as a plain dict (telemetry)."""
        return dict(self.__dict__)


@dataclass
class _Pin:
    blocks: list
    expires: float


@dataclass
class _Session:
    # block hash -> tokens up to the end of that block (its position in the chain), in first-use order
    blocks: "OrderedDict[bytes, int]" = field(default_factory=OrderedDict)
    live: dict = field(default_factory=dict)  # request id -> its (growing) hash list, in flight


class EngineKV:
    """Session-level KV control for one in-process vLLM engine (see the module docstring)."""

    def __init__(self, parts: vc.EngineParts, tiers: TierConfig | None = None):
        self.parts = parts
        self.tiers = tiers or TierConfig()
        self.bytes_per_block = parts.bytes_per_block()
        self.stats = KVStats()
        self._sessions: dict[str, _Session] = {}
        self._owners: dict[bytes, set[str]] = {}
        self._host: "OrderedDict[bytes, tuple[list, int]]" = OrderedDict()  # hash -> (tensors, num_tokens), LRU
        self._disk: "OrderedDict[bytes, int]" = OrderedDict()  # hash -> num_tokens, LRU
        self._pins: dict[str, _Pin] = {}
        # Which host blocks make room when the host tier is full: ``host_victims(n)`` yields
        # block hashes, the best victims first (the KV manager asks its policy, as the
        # simulator does for every tier). None, or once it runs out: least recently stored
        # first. Without it a bounded host tier drops the session about to resume as readily
        # as one that finished or will idle for minutes.
        self.host_victims: Callable[[int], Iterable[bytes]] | None = None
        # bytes per tier as of the last maintain(): other threads read this, not the live state
        self.snapshot: dict[str, int] = {"device": 0, "host": 0, "disk": 0}
        self._snapshot_at = 0.0
        if self.tiers.disk_bytes:
            os.makedirs(self.tiers.disk_path, exist_ok=True)

    # -- tracking (called by the engine host around its requests) -------------------------------

    def on_admit(self, session: str | None, request_id: str, restore: bool = True) -> None:
        """A request was added to the engine (``request_id``: the engine's own id): track its
        blocks for ``session`` and (unless ``restore`` is False: a KV manager restores when the
        scheduler is about to admit it) restore any of its prefix that sits in a lower tier,
        before the scheduler looks for cached blocks."""
        hashes = vc.request_hashes(self.parts, request_id)
        if hashes is None:
            return
        if session is not None:
            self._sessions.setdefault(session, _Session()).live[request_id] = hashes
        if restore:
            self._restore(list(hashes), on_demand=True)

    def restore(self, hashes: list[bytes], limit: int | None = None) -> int:
        """Restore the prefix ``hashes`` from host/disk onto the device, as cached blocks (blocks
        already resident are skipped; it stops at the first block held nowhere), at most
        ``limit`` blocks; counted as on-demand restores. Returns how many were restored."""
        return self._restore(list(hashes), on_demand=True, limit=limit)

    def on_finish(self, session: str | None, request_id: str) -> None:
        """A request finished (or failed): its full blocks now belong to ``session``."""
        s = self._sessions.get(session) if session is not None else None
        if s is None:
            return
        hashes = s.live.pop(request_id, None)
        if hashes is not None:
            self._own(session, s, hashes)

    def _own(self, session: str, s: _Session, hashes: list) -> None:
        for i, h in enumerate(hashes):
            if h not in s.blocks:
                s.blocks[h] = (i + 1) * self.parts.block_size
                self._owners.setdefault(h, set()).add(session)

    def sessions(self) -> list[str]:
        """Sessions this engine holds KV for."""
        return list(self._sessions)

    def knows(self, session: str) -> bool:
        """Whether this engine tracks KV for ``session``."""
        return session in self._sessions

    def blocks_of(self, session: str) -> list[bytes]:
        """The session's block hashes in prefix order (first use first), in flight included."""
        return list(self._session(session).blocks)

    def owners(self, block_hash: bytes) -> frozenset[str]:
        """Sessions that own the block ``block_hash`` (used it and were not invalidated)."""
        return frozenset(self._owners.get(block_hash, ()))

    def pinned(self, session: str) -> int:
        """Blocks the session has pinned (0 without a pin)."""
        pin = self._pins.get(session)
        return len(pin.blocks) if pin else 0

    def tier_blocks(self) -> dict[str, int]:
        """Blocks held in the host and disk tiers."""
        return {"host": len(self._host), "disk": len(self._disk)}

    def host_blocks(self) -> list[bytes]:
        """The host tier's block hashes, least recently stored first (a copy: safe to hold
        while blocks move)."""
        return list(self._host)

    def in_lower_tier(self, block_hash: bytes) -> str | None:
        """"host" or "disk" if a copy of ``block_hash`` sits there, else None."""
        if block_hash in self._host:
            return "host"
        return "disk" if block_hash in self._disk else None

    # -- the directives ---------------------------------------------------------------------------

    def _session(self, session: str) -> _Session:
        s = self._sessions.get(session)
        if s is None:
            raise KVDirectiveError(f"no KV for session {session!r} on this engine")
        for live in s.live.values():  # blocks of requests still running count too
            self._own(session, s, live)
        return s

    def inspect(self, session: str) -> Residency:
        """Where the session's blocks are now."""
        s = self._session(session)
        device = sum(1 for h in s.blocks if vc.lookup(self.parts, h) is not None)
        pin = self._pins.get(session)
        return Residency(session, len(s.blocks), device, sum(1 for h in s.blocks if h in self._host),
                         sum(1 for h in s.blocks if h in self._disk), len(pin.blocks) if pin else 0,
                         self.bytes_per_block, self.parts.block_size)

    def retain(self, session: str, ttl_s: float | None = None) -> int:
        """Pin the session's resident blocks for ``ttl_s`` (default ``pin_ttl_s``), within the pin
        budget; returns how many blocks are pinned. Re-retaining renews the TTL."""
        s = self._session(session)
        if ttl_s is not None and (isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float))):
            raise KVDirectiveError(f"retain's ttl_s must be a number of seconds, got {ttl_s!r}")
        ttl = self.tiers.pin_ttl_s if ttl_s is None else float(ttl_s)
        if not 0 < ttl < math.inf:  # NaN fails too: a pin must expire
            raise KVDirectiveError(f"retain needs a positive, finite TTL, got {ttl_s!r}")
        self.release(session)
        budget = int(self.tiers.pin_fraction * self.parts.num_blocks) - self.pinned_blocks()
        blocks = [b for b in (vc.lookup(self.parts, h) for h in s.blocks) if b is not None][:max(budget, 0)]
        if blocks:
            vc.pin(self.parts, blocks)
            self._pins[session] = _Pin(blocks, time.monotonic() + ttl)
        return len(blocks)

    def release(self, session: str) -> int:
        """Drop the session's pin (its blocks stay cached, evictable in LRU order)."""
        pin = self._pins.pop(session, None)
        if pin is None:
            return 0
        vc.unpin(self.parts, pin.blocks)
        return len(pin.blocks)

    def pinned_blocks(self) -> int:
        """Blocks pinned across sessions."""
        return sum(len(p.blocks) for p in self._pins.values())

    def _check_tier(self, tier: str) -> None:
        if tier not in ("host", "disk"):
            raise KVDirectiveError(f"offload tier must be 'host' or 'disk', got {tier!r}")
        if tier == "host" and not self.tiers.host_bytes:
            raise KVDirectiveError("offload to host: this engine has no host tier (kv host bytes = 0)")
        if tier == "disk" and not self.tiers.disk_bytes:
            raise KVDirectiveError("offload to disk: this engine has no disk tier")

    def _movable(self, session: str, s: _Session, limit: int | None) -> list[bytes]:
        """The session's device blocks that may leave, tail first: unreferenced (no running
        request, no pin) and owned by no other session; at most ``limit``."""
        out: list[bytes] = []
        for h in reversed(s.blocks):
            if limit is not None and len(out) >= limit:
                break
            b = vc.lookup(self.parts, h)
            if b is None or vc.ref_count(b) > 0 or self._owners.get(h, set()) - {session}:
                continue
            out.append(h)
        return out

    def offload(self, session: str, tier: Tier = "host", blocks: int | None = None) -> int:
        """Copy the session's device blocks to ``tier`` ("host" or "disk") and free them on the
        device, tail first (what stays is a usable prefix), at most ``blocks`` of them (None:
        all), except blocks another live session owns or a running request uses. Drops the
        session's pin. Returns the number of blocks moved off the device."""
        self._check_tier(tier)
        blocks = block_count("blocks", blocks)
        s = self._session(session)
        self.release(session)
        return self.offload_blocks(self._movable(session, s, blocks), tier)

    def evict(self, session: str, blocks: int | None = None) -> int:
        """Free the session's device blocks without keeping a copy (for engines with no lower
        tier), tail first, at most ``blocks`` (None: all), with the same exceptions as
        :meth:`offload`. Drops the session's pin. Returns the number of blocks freed."""
        blocks = block_count("blocks", blocks)
        s = self._session(session)
        self.release(session)
        return self.offload_blocks(self._movable(session, s, blocks), None)

    def offload_blocks(self, hashes: list[bytes], tier: Tier | None) -> int:
        """Move the device blocks ``hashes`` (in that order) to ``tier``, or free them without a
        copy when ``tier`` is None. Blocks not resident or still referenced are skipped; when
        the tier cannot take a block, the rest stay. Returns the number of blocks freed."""
        if tier is not None:
            self._check_tier(tier)
        if not hashes:
            return 0
        t0 = time.perf_counter()
        if tier == "host" and self.host_victims is not None:
            self._make_host_room(sum(1 for h in hashes if (b := vc.lookup(self.parts, h)) is not None
                                     and vc.ref_count(b) == 0 and h not in self._host))
        moved = []
        for h in hashes:
            b = vc.lookup(self.parts, h)
            if b is None or vc.ref_count(b) > 0:
                continue
            if tier is not None:
                ntok = self._ntokens(h)
                data = vc.read_block(self.parts, b)
                if not (self._put_host(h, data, ntok) if tier == "host" else self._put_disk(h, data, ntok)):
                    break  # no room: the rest stays on the device
                self.stats.offloaded_bytes += self.bytes_per_block
            moved.append(b)
        n = vc.evict(self.parts, moved)
        if tier is None:
            self.stats.dropped_blocks += n
        else:
            self.stats.offload_seconds += time.perf_counter() - t0
        return n

    def block_tokens(self, block_hash: bytes) -> int:
        """Tokens up to the end of the block (its position in any chain that holds it: the
        hash covers the whole prefix)."""
        return self._ntokens(block_hash)

    def _ntokens(self, h: bytes) -> int:
        """Tokens up to the end of block ``h`` (its position in the chain), from any owner."""
        for sid in self._owners.get(h, ()):
            sess = self._sessions.get(sid)
            ntok = sess.blocks.get(h) if sess is not None else None
            if ntok is not None:
                return ntok
        b = vc.lookup(self.parts, h)
        n = getattr(b, "block_hash_num_tokens", None) if b is not None else None
        return int(n) if n else self.parts.block_size

    def prefetch(self, session: str, max_blocks: int | None = None) -> int:
        """Bring the session's blocks back from host/disk onto the device (prefix order), as
        cached blocks, at most ``max_blocks`` of them; returns how many were restored."""
        max_blocks = block_count("max_blocks", max_blocks)
        s = self._session(session)
        return self._restore(list(s.blocks), on_demand=False, limit=max_blocks)

    def invalidate(self, session: str) -> int:
        """The session ended: drop its pin and every block no other live session owns, on every
        tier. Returns the number of blocks dropped. Unknown sessions are a no-op (0): a session
        may never have reached this engine."""
        s = self._sessions.pop(session, None)
        self.release(session)
        if s is None:
            return 0
        for live in s.live.values():
            self._own(session, s, live)
        dropped = disown(self._owners, session, s.blocks)
        device = [b for b in (vc.lookup(self.parts, h) for h in dropped) if b is not None]
        vc.evict(self.parts, device)
        for h in dropped:
            self._host.pop(h, None)
            if self._disk.pop(h, None) is not None:
                self._remove_file(h)
        self.stats.dropped_blocks += len(dropped)
        return len(dropped)

    # -- housekeeping (the engine host calls this between steps) ----------------------------------

    def maintain(self, now: float | None = None) -> None:
        """Expire pins; if pins keep the engine from admitting anything, release them (oldest
        expiry first) so retention can never wedge admission."""
        now = time.monotonic() if now is None else now
        if now - self._snapshot_at >= 0.5:
            self.snapshot, self._snapshot_at = self.tier_bytes(), now
        for sid, pin in list(self._pins.items()):
            if pin.expires <= now:
                self.release(sid)
                self.stats.pins_expired += 1
        if self._pins and vc.waiting_requests(self.parts) and not vc.running_requests(self.parts):
            for sid in sorted(self._pins, key=lambda k: self._pins[k].expires):
                self.release(sid)
                self.stats.pins_released_for_admission += 1

    def tier_bytes(self) -> dict[str, int]:
        """Bytes held per tier (device: cached blocks owned by tracked sessions)."""
        device = sum(1 for h in self._owners if vc.lookup(self.parts, h) is not None)
        return {"device": device * self.bytes_per_block, "host": len(self._host) * self.bytes_per_block,
                "disk": len(self._disk) * self.bytes_per_block}

    # -- tiers --------------------------------------------------------------------------------------

    def _host_cap(self) -> int:
        return self.tiers.host_bytes // max(self.bytes_per_block, 1)

    def _spill(self, h: bytes, data: list, ntok: int) -> None:
        """A block leaves the host tier: to disk if there is one with room, else it is lost."""
        if self.tiers.disk_bytes and self._put_disk(h, data, ntok):
            self.stats.spilled_bytes += self.bytes_per_block
        else:
            self.stats.dropped_blocks += 1

    def _make_host_room(self, n: int) -> None:
        """Room in the host tier for ``n`` blocks about to come, taken in ``host_victims``' order
        (what it does not cover, ``_put_host`` takes least recently stored first)."""
        over = len(self._host) + n - self._host_cap()
        if over <= 0:
            return
        for h in self.host_victims(over):
            got = self._host.pop(h, None)
            if got is not None:
                self._spill(h, *got)
                over -= 1
                if over <= 0:
                    break

    def _put_host(self, h: bytes, data: list, ntok: int) -> bool:
        cap = self._host_cap()
        while len(self._host) >= cap and self._host:
            old, (odata, ontok) = self._host.popitem(last=False)  # least recently stored
            self._spill(old, odata, ontok)
        if cap < 1:
            return False
        self._host[h] = (data, ntok)
        return True

    def _path(self, h: bytes) -> str:
        return os.path.join(self.tiers.disk_path or "", h.hex() + ".pt")

    def _put_disk(self, h: bytes, data: list, ntok: int) -> bool:
        import torch

        cap = self.tiers.disk_bytes // max(self.bytes_per_block, 1)
        while len(self._disk) >= cap and self._disk:
            old, _ = self._disk.popitem(last=False)
            self._remove_file(old)
            self.stats.dropped_blocks += 1
        if cap < 1:
            return False
        try:
            torch.save([t.contiguous() for t in data], self._path(h))
        except OSError:  # disk full or gone: the block is recomputed later, the engine goes on
            logger.warning("KV disk tier: could not write a block to %s", self.tiers.disk_path, exc_info=True)
            self._remove_file(h)
            return False
        self._disk[h] = ntok
        return True

    def _remove_file(self, h: bytes) -> None:
        try:
            os.remove(self._path(h))
        except FileNotFoundError:
            pass

    def _restore(self, hashes: list, on_demand: bool, limit: int | None = None) -> int:
        import torch

        t0 = time.perf_counter()
        restored = 0
        for h in hashes:
            if limit is not None and restored >= limit:
                break
            if vc.lookup(self.parts, h) is not None:
                continue
            if h in self._host:
                data, ntok = self._host.pop(h)
            elif h in self._disk:
                ntok = self._disk.pop(h)
                data = torch.load(self._path(h), weights_only=True)  # tensors only: no pickled code
                self._remove_file(h)
            else:
                break  # a prefix hit needs every earlier block: stop at the first gap
            if vc.adopt_block(self.parts, h, data, ntok) is None:
                self._put_host(h, data, ntok)  # no free block: keep it for later, within capacity
                break
            restored += 1
        if restored:
            n = restored * self.bytes_per_block
            self.stats.restored_bytes += n
            dt = time.perf_counter() - t0
            if on_demand:
                self.stats.restored_on_demand_bytes += n
                self.stats.restore_stall_seconds += dt
            self.stats.restore_seconds += dt
        return restored
