"""Triton attention kernels for LLM inference and training.

Public API:
    flash_attn_func: FlashAttention-2 prefill (MHA/GQA/MQA, causal bottom-right, any strides).
    flash_attn_varlen_func: the same kernels over sequences of different lengths packed without padding.
    flash_attn_with_kvcache: decode over a dense or paged KV cache (fused append, per-request lengths,
                     split-KV, block_table).
    KVCache:         preallocated K/V buffers and lengths for generation (prefill, decode, reset).
    PagedKVCache:    a paged K/V block pool with a free list (add/extend/prefill/decode/free requests);
                     PoolExhaustedError when its blocks or request slots run out.
    attention_ref:   eager reference used by tests, notebooks and benchmarks.
"""

from ._utils import default_device, env_summary, has_gpu, is_interpreter
from .decode import KVCache, PagedKVCache, PoolExhaustedError, flash_attn_with_kvcache
from .prefill import flash_attn_func, flash_attn_varlen_func
from .reference import attention_ref, causal_mask, rel_err

__all__ = [
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "KVCache",
    "PagedKVCache",
    "PoolExhaustedError",
    "attention_ref",
    "causal_mask",
    "rel_err",
    "env_summary",
    "is_interpreter",
    "has_gpu",
    "default_device",
]

__version__ = "0.1.0"
