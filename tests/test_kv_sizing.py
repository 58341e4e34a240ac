"""KV sizing from model configs."""

import pytest

from dask_agents.kv import KVGeometry
from dask_agents.worker_plugin.engines import registry


def test_builtin_tiny_model_geometry_matches_vllm_blocks():
    coder = registry()["coder"]
    g = KVGeometry.from_model_dir(coder.model_path(), coder.dtype)
    # 2 layers x 2 KV heads x head_dim 64 x K,V x bf16 = 1 KiB per token, 128 KiB per 128-token block
    assert g.bytes_per_token == 1024 and g.bytes_per_block == 128 * 1024
    assert g.blocks(129) == 2 and g.bytes_for(1) == g.bytes_per_block


def test_llama_like_config_and_bad_dtype():
    cfg = {"num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096, "num_hidden_layers": 32}
    g = KVGeometry.from_hf_config(cfg, "float16", block_size=16)
    assert g.bytes_per_token == 2 * 32 * 8 * 128 * 2  # 128 KiB per token (Llama-3-8B)
    with pytest.raises(ValueError, match="unknown KV dtype"):
        KVGeometry.from_hf_config(cfg, "int3")
