"""KV blocks, memory tiers and what moving or recomputing them costs.

A session's KV is a chain of prefix blocks of ``block_size`` tokens. A block's id hashes its
parent's id with its own content (as vLLM's prefix cache does), so two prompts that start
with the same tokens start with the same block ids and share those blocks. Only *full*
blocks are ever cached, as in vLLM: the tokens past the last full block of a prompt (its
"tail") are recomputed by every policy, the offline optimum included.

Tiers: the accelerator (where a step's KV must be to run), host memory and local disk. Each
lower tier has a capacity and a bandwidth to and from the accelerator. Restoring a block from
a lower tier costs ``bytes_per_block / bandwidth`` seconds; recomputing it costs
``block_size / prefill_tokens_per_s`` seconds of prefill. Byte sizes come from the model's
geometry (:class:`dask_agents.kv.runtime.sizing.KVGeometry`).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace
from typing import Any, Hashable, Iterable, Sequence

from dask_agents.kv.runtime.sizing import KVGeometry

ROOT = 0
"""Parent id of the first block of every chain."""

ACCELERATOR, HOST, DISK = "accelerator", "host", "disk"
TIER_NAMES = (ACCELERATOR, HOST, DISK)
"""Tiers from fastest to slowest."""


def block_hash(parent: int, content: Hashable) -> int:
    """Id of the block holding ``content`` right after the prefix whose last block is ``parent``.

    Deterministic across processes (a keyed-free BLAKE2b of ``repr``), 63-bit, never ``ROOT``."""
    digest = hashlib.blake2b(f"{parent}:{content!r}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") >> 1) or 1


def chain(tokens: Sequence[int], block_size: int, parent: int = ROOT) -> tuple[int, ...]:
    """Block ids of the full blocks of ``tokens`` (the tail past the last full block has none)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    out = []
    for i in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_hash(parent, tuple(tokens[i:i + block_size]))
        out.append(parent)
    return tuple(out)


def extend(blocks: Sequence[int], contents: Iterable[Hashable]) -> tuple[int, ...]:
    """``blocks`` followed by one new block per item of ``contents`` (chained on its last block)."""
    out = list(blocks)
    parent = out[-1] if out else ROOT
    for c in contents:
        parent = block_hash(parent, c)
        out.append(parent)
    return tuple(out)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of leading blocks ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _bytes(value: Any, what: str) -> int:
    from dask.utils import parse_bytes

    try:
        n = parse_bytes(value) if isinstance(value, str) else int(value)
    except (ValueError, TypeError):
        raise ValueError(f"{what}: {value!r} is not a byte size (e.g. 16 GiB)") from None
    if n < 0:
        raise ValueError(f"{what}: must be >= 0, got {value!r}")
    return n


def _bandwidth(value: Any, what: str) -> float:
    """Bytes per second from ``25 GB/s``, ``25GB`` or a number."""
    text = value.strip().removesuffix("/s") if isinstance(value, str) else value
    bw = float(_bytes(text, what))
    if bw <= 0:
        raise ValueError(f"{what}: must be > 0, got {value!r}")
    return bw


@dataclass(frozen=True)
class Tier:
    """One memory tier: ``capacity`` bytes, ``bandwidth`` bytes/s to and from the accelerator."""

    name: str
    capacity: int
    bandwidth: float = math.inf

    def __post_init__(self) -> None:
        if self.name not in TIER_NAMES:
            raise ValueError(f"unknown tier {self.name!r} (known: {', '.join(TIER_NAMES)})")
        if self.capacity < 0 or not self.bandwidth > 0:
            raise ValueError(f"tier {self.name}: need capacity >= 0 and bandwidth > 0")


@dataclass(frozen=True)
class Tiers:
    """The accelerator and the tiers below it (a tier of capacity 0 does not exist)."""

    accelerator: Tier
    host: Tier = Tier(HOST, 0, 25e9)
    disk: Tier = Tier(DISK, 0, 3e9)

    def __iter__(self):
        return iter((self.accelerator, self.host, self.disk))

    def get(self, name: str) -> Tier:
        """The tier called ``name``."""
        return {t.name: t for t in self}[name]

    @property
    def lower(self) -> tuple[Tier, ...]:
        """Host and disk, in that order, where they have capacity."""
        return tuple(t for t in (self.host, self.disk) if t.capacity > 0)

    def with_accelerator(self, capacity: int) -> "Tiers":
        """The same tiers with an accelerator of ``capacity`` bytes."""
        return replace(self, accelerator=replace(self.accelerator, capacity=int(capacity)))

    def describe(self) -> str:
        """``accelerator=16GiB,host=64GiB`` (tiers of capacity 0 left out)."""
        from dask.utils import format_bytes

        return ",".join(f"{t.name}={format_bytes(t.capacity).replace(' ', '')}"
                        for t in self if t.capacity or t.name == ACCELERATOR)

    @classmethod
    def from_config(cls, cfg: dict | None = None) -> "Tiers":
        """From ``agents.kv.tiers`` (or a dict shaped like it)."""
        if cfg is None:
            import dask_agents.config as agents_config

            cfg = agents_config.get("kv.tiers") or {}
        unknown = set(cfg) - set(TIER_NAMES)
        if unknown:
            raise ValueError(f"unknown tier(s) {', '.join(sorted(unknown))} (known: {', '.join(TIER_NAMES)})")
        tiers = {}
        for name in TIER_NAMES:
            t = cfg.get(name) or {}
            bw = t.get("bandwidth")
            tiers[name] = Tier(name, _bytes(t.get("capacity", 0), f"{name}.capacity"),
                               math.inf if name == ACCELERATOR or bw is None else _bandwidth(bw, f"{name}.bandwidth"))
        return cls(**tiers)

    def parse(self, spec: str) -> "Tiers":
        """These tiers with the capacities of ``spec``: ``accelerator=8GiB,host=32GiB`` (a bare size
        means the accelerator; a tier may also be given as ``host=32GiB@25GB/s`` to set its bandwidth)."""
        out = self
        for part in filter(None, (p.strip() for p in spec.split(","))):
            name, sep, value = part.partition("=")
            if not sep:
                name, value = ACCELERATOR, part
            name = name.strip()
            if name not in TIER_NAMES:
                raise ValueError(f"--tiers {spec!r}: unknown tier {name!r} (known: {', '.join(TIER_NAMES)})")
            size, _, bw = value.partition("@")
            tier = replace(out.get(name), capacity=_bytes(size.strip(), f"tier {name}"))
            if bw:
                tier = replace(tier, bandwidth=_bandwidth(bw, f"tier {name} bandwidth"))
            out = replace(out, **{name: tier})
        return out


@dataclass(frozen=True)
class CostModel:
    """Bytes of a block, and seconds to move it between tiers or to recompute it."""

    geometry: KVGeometry
    prefill_tokens_per_s: float = 10_000.0
    decode_s_per_token: float = 0.02

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self.geometry.block_size

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes in any tier."""
        return self.geometry.bytes_per_block

    def blocks_in(self, tier: Tier) -> int:
        """How many whole blocks fit in ``tier``."""
        return tier.capacity // self.bytes_per_block

    def transfer_s(self, blocks: int, tier: Tier) -> float:
        """Seconds to move ``blocks`` between the accelerator and ``tier`` (one way)."""
        return 0.0 if tier.name == ACCELERATOR else blocks * self.bytes_per_block / tier.bandwidth

    def recompute_s(self, tokens: int) -> float:
        """Seconds of prefill to recompute the KV of ``tokens``."""
        return tokens / self.prefill_tokens_per_s

    def restore_wins(self, tier: Tier) -> bool:
        """Whether restoring a full block from ``tier`` is faster than recomputing it."""
        return self.transfer_s(1, tier) < self.recompute_s(self.block_size)

    @classmethod
    def from_config(cls, cfg: dict | None = None) -> "CostModel":
        """From ``agents.kv`` (``model``, ``block-size``, ``prefill-tokens-per-s``, ``decode-s-per-token``)."""
        if cfg is None:
            import dask_agents.config as agents_config

            cfg = agents_config.get("kv") or {}
        m = cfg.get("model") or {}
        hf = {"num_hidden_layers": m.get("num-layers", 32), "num_attention_heads": m.get("num-attention-heads", 32),
              "num_key_value_heads": m.get("num-kv-heads", 8), "head_dim": m.get("head-dim", 128)}
        geometry = KVGeometry.from_hf_config(hf, str(m.get("dtype", "bfloat16")), int(cfg.get("block-size", 512)))
        return cls(geometry, float(cfg.get("prefill-tokens-per-s", 10_000.0)),
                   float(cfg.get("decode-s-per-token", 0.02)))


def walk_prefix(get: Any, hashes: list, in_lower: Any, held: set) -> tuple[int, int, list]:
    """A prompt's prefix, block by block from the start: ``(hit, restore, touched)``: blocks
    ``get(h)`` finds on the device or (``in_lower(h)`` true; None: nothing below) in a lower
    tier, of them those below, and the device blocks nobody references (``ref_cnt`` 0) that are
    not in ``held``. One tight loop: the KV manager walks every waiting prompt each step."""
    hit = restore = 0
    touched = []
    for h in hashes:
        b = get(h)
        if b is None:
            if in_lower is None or not in_lower(h):
                break
            restore += 1
        elif b.ref_cnt == 0 and h not in held:
            touched.append(h)
        hit += 1
    return hit, restore, touched
