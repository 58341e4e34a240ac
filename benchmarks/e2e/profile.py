"""The EMULATED engine profiles of the end-to-end benchmark (fields of
:class:`~dask_agents.worker_plugin.emulated_kv.EmulationParams`) and the cost model's own formulas.

- :data:`REALISTIC`: a Llama-3-8B-class model (GQA, bf16) served by vLLM on one 80 GB H100 SXM,
  with the LRU host tier of vLLM's native CPU offloading / LMCache. Every number is derived
  from a public spec or default (:data:`CITATIONS`), none is measured here. ``time_scale`` is
  left to the runner.
- :data:`SMALL`: the previous harness's profile (``e2e.py --profile small``): 8 sequences, 2048
  blocks, no host tier, no attention term.

:func:`prefill_cost` and :func:`decode_step_cost` ARE the engine's formulas (re-exported from
:mod:`dask_agents.worker_plugin.emulated_kv`, where the step charges them), so the ideal bound
and the engine cannot disagree; :func:`step_time` and :func:`prefill_time` take a profile dict.
"""

from __future__ import annotations

from typing import Any, Mapping

from dask_agents.worker_plugin.emulated_kv import (  # noqa: F401  (re-exported: the engine's own formulas)
    H100_KV_BLOCKS,
    EmulationParams,
    decode_step_cost,
    prefill_cost,
    prefill_positions,
)

# -- the arithmetic behind REALISTIC ---------------------------------------------------------------

LAYERS, KV_HEADS, HEAD_DIM, D_MODEL, PARAMS = 32, 8, 128, 4096, 8.03e9  # Llama-3-8B config.json
DTYPE_BYTES = 2  # bf16
BLOCK_TOKENS = 16  # vLLM's default block size
KV_BYTES_PER_TOKEN = 2 * LAYERS * KV_HEADS * HEAD_DIM * DTYPE_BYTES  # K and V: 131,072 B = 128 KiB
BLOCK_BYTES = KV_BYTES_PER_TOKEN * BLOCK_TOKENS  # 2 MiB
WEIGHT_BYTES = PARAMS * DTYPE_BYTES  # 16.06 GB
HBM_BYTES_S = 3.35e12  # H100 SXM HBM3
BF16_DENSE_FLOPS = 989e12  # H100 SXM dense bf16 tensor-core peak
MFU = 0.45  # achieved fraction of the peak in prefill (GEMMs and FlashAttention)
STEP_OVERHEAD_S = 1.5e-3  # CPU scheduling, launches, sampling per step (not hidden by CUDA graphs)
KV_BYTES = 29_000 * BLOCK_BYTES  # 60.8 GB: 0.92 x 85.5 GB - 16.1 GB weights - ~1.8 GB activations
HOST_KV_BYTES = 40 * 2**30  # 40 GiB per GPU: a CPU KV buffer as LMCache deployments size it
PCIE_BYTES_S = 50e9  # PCIe Gen5 x16: 64 GB/s raw per direction, ~50 GB/s effective pinned bulk copies

REALISTIC: dict[str, Any] = {
    "max_batch": 256,
    "max_num_batched_tokens": 8192,
    "decode_s_per_step": WEIGHT_BYTES / HBM_BYTES_S + STEP_OVERHEAD_S,  # 6.29 ms
    "decode_s_per_seq": 2 * PARAMS / (MFU * BF16_DENSE_FLOPS),  # 3.6e-5 s
    "decode_s_per_ctx_token": KV_BYTES_PER_TOKEN / HBM_BYTES_S,  # 3.9e-8 s
    "prefill_s_per_token": 2 * PARAMS / (MFU * BF16_DENSE_FLOPS),  # 3.6e-5 s: ~27.7k tokens/s
    "prefill_s_per_token_pos": 4 * LAYERS * D_MODEL / (MFU * BF16_DENSE_FLOPS),  # 1.18e-9 s
    "kv_blocks": KV_BYTES // BLOCK_BYTES,  # 29,000 blocks, 464,000 tokens
    "block_size": BLOCK_TOKENS,
    "layers": LAYERS,
    "kv_heads": KV_HEADS,
    "head_dim": HEAD_DIM,
    "dtype_bytes": DTYPE_BYTES,
    "host_kv_blocks": HOST_KV_BYTES // BLOCK_BYTES,  # 20,480 blocks, 328k tokens
    "host_restore_s_per_block": BLOCK_BYTES / PCIE_BYTES_S,  # 4.2e-5 s
    "host_offload_s_per_block": BLOCK_BYTES / PCIE_BYTES_S,
    "host_policy": "lru",
}

CITATIONS: dict[str, str] = {
    "max_batch": "vLLM max_num_seqs 256 (the default below 70 GiB; 1024 on H100 since ~v0.8): never binding "
                 "here, ~8-20 sequences of 20-60k tokens fill the KV",
    "max_num_batched_tokens": "vLLM's default with chunked prefill for the OpenAI server on H100/H200 "
                              "(EngineArgs._set_default_max_num_seqs_and_batched_tokens_args)",
    "decode_s_per_step": "16.06e9 B of bf16 weights / 3.35e12 B/s (H100 SXM HBM3 spec) = 4.79 ms + 1.5 ms fixed "
                         "per-step CPU overhead (vLLM blog 2024-09-05, v0.6.0: scheduling and API server took 62% "
                         "of Llama-3-8B/H100 time before; its residual assumed ~1.5 ms)",
    "decode_s_per_seq": "2 x 8.03e9 FLOP per token at 45% of H100's 989 TFLOP/s dense bf16 peak",
    "decode_s_per_ctx_token": "128 KiB of KV per token (2 x 32 layers x 8 KV heads x 128 head dim x 2 B, "
                              "Llama-3-8B config) / 3.35e12 B/s HBM3",
    "prefill_s_per_token": "2 x 8.03e9 FLOP per token at 45% of 989 TFLOP/s (445 TFLOP/s: ~27.7k tokens/s, "
                           "the range vLLM reports for 8B prefill on one H100)",
    "prefill_s_per_token_pos": "attention QK^T + AV: 4 x 32 layers x 4096 d_model = 524,288 FLOP per token per "
                               "earlier position, at 445 TFLOP/s",
    "kv_blocks": "vLLM gpu_memory_utilization 0.92 x 85.5 GB (H100 80GB: 81,559 MiB) - 16.1 GB weights - "
                 "~1.8 GB activations = ~60.8 GB / 2 MiB blocks = 29,000 (464k tokens)",
    "block_size": "vLLM's default block size, 16 tokens (2 MiB of KV)",
    "layers": "Llama-3-8B config.json: num_hidden_layers 32",
    "kv_heads": "Llama-3-8B config.json: num_key_value_heads 8 (GQA)",
    "head_dim": "Llama-3-8B config.json: hidden_size 4096 / 32 attention heads = 128",
    "dtype_bytes": "bf16",
    "host_kv_blocks": "40 GiB of pinned host DRAM per GPU for the workflow-blind KV tier: LMCache's CPU buffer "
                      "(max_local_cpu_size) defaults to 5 GB and deployments set 10-48 GB per engine; a node's "
                      "DRAM could hold more (a DGX H100: 2 TB, 256 GB per GPU), but the buffer is what users configure",
    "host_restore_s_per_block": "2 MiB at 50 GB/s: PCIe Gen5 x16 is 64 GB/s raw per direction, ~50 GB/s "
                                "effective for pinned bulk copies",
    "host_offload_s_per_block": "as host_restore_s_per_block (device -> host, same link)",
    "host_policy": "lru: every block leaving the device goes to the host (vLLM native CPU offloading, "
                   "LMCache): workflow-blind, the same tier for every variant",
}

SMALL: dict[str, Any] = {  # the previous harness's ENGINE (git show 9f87883:benchmarks/legacy/e2e_swe.py)
    "max_batch": 8,
    "decode_s_per_step": 0.02,
    "decode_s_per_seq": 5e-5,
    "prefill_s_per_token": 1e-4,
    "prefill_s_per_token_pos": 0.0,  # (the old model had no attention term; the default has one now)
    "kv_blocks": 2048,
    "block_size": 16,
    "time_scale": 0.5,
}

PROFILES: dict[str, dict[str, Any]] = {"realistic": REALISTIC, "small": SMALL}


def profile(name: str) -> dict[str, Any]:
    """A copy of the profile ``name`` (``realistic`` or ``small``, any case); KeyError otherwise."""
    try:
        return dict(PROFILES[name.lower()])
    except KeyError:
        raise KeyError(f"unknown engine profile {name!r}; known: {', '.join(sorted(PROFILES))}") from None


def params(p: Mapping[str, Any] | EmulationParams) -> EmulationParams:
    """``p`` as EmulationParams (a profile dict is validated: unknown keys fail)."""
    return p if isinstance(p, EmulationParams) else EmulationParams(**p)


def kv_tokens(p: Mapping[str, Any] | EmulationParams) -> int:
    """Tokens the device KV holds (``kv_blocks`` x ``block_size``; a whole H100's without ``kv_blocks``)."""
    q = params(p)
    return (q.kv_blocks if q.kv_blocks is not None else H100_KV_BLOCKS) * q.block_size


def step_time(p: Mapping[str, Any] | EmulationParams, batch: int, ctx_tokens: int) -> float:
    """Emulated seconds of a step of ``batch`` sequences reading ``ctx_tokens`` tokens of KV in
    all, besides prefill (:func:`decode_step_cost`)."""
    return decode_step_cost(params(p), batch, ctx_tokens)


def prefill_time(p: Mapping[str, Any] | EmulationParams, start: int, n: int) -> float:
    """Emulated seconds of the prefill term of ``n`` tokens at positions ``start ..``
    (:func:`prefill_cost`; the step they run in costs :func:`step_time` on top)."""
    return prefill_cost(params(p), start, start + n)


def restore_time(p: Mapping[str, Any] | EmulationParams, tokens: int) -> float:
    """Emulated seconds to restore the full blocks of ``tokens`` tokens from the host tier."""
    q = params(p)
    return tokens // q.block_size * q.host_restore_s_per_block
