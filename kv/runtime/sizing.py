"""How many bytes a session's KV takes, from the model's config (layers, KV heads, dtype)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "fp8": 1, "float8_e4m3fn": 1}


@dataclass(frozen=True)
class KVGeometry:
    """KV layout of one model: per-token bytes across all layers, and the engine's block size."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    block_size: int = 128

    @property
    def bytes_per_token(self) -> int:
        """K and V, every layer, every KV head."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one full block of ``block_size`` tokens."""
        return self.bytes_per_token * self.block_size

    def blocks(self, tokens: int) -> int:
        """Blocks that ``tokens`` occupy (the last one possibly partial)."""
        return math.ceil(tokens / self.block_size)

    def bytes_for(self, tokens: int) -> int:
        """Bytes the KV of ``tokens`` occupies, counted in whole blocks as paged engines allocate it."""
        return self.blocks(tokens) * self.bytes_per_block

    @classmethod
    def from_hf_config(cls, config: dict, dtype: str = "auto", block_size: int = 128) -> "KVGeometry":
        """From a Hugging Face ``config.json`` dict (Llama-style keys)."""
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
        if dtype == "auto":
            dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
        if dtype not in _DTYPE_BYTES:
            raise ValueError(f"unknown KV dtype {dtype!r} (known: {', '.join(sorted(_DTYPE_BYTES))})")
        return cls(int(config["num_hidden_layers"]), kv_heads, head_dim, _DTYPE_BYTES[dtype], block_size)

    @classmethod
    def from_model_dir(cls, path: str, dtype: str = "auto", block_size: int = 128) -> "KVGeometry":
        """From a model folder holding ``config.json``."""
        with open(os.path.join(path, "config.json")) as f:
            return cls.from_hf_config(json.load(f), dtype, block_size)
