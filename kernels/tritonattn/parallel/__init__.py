"""Context parallelism over torch.distributed: one sequence's attention split across ranks (ring-flash-attn's
functions and sharding conventions, on this library's kernels). `ring.py` passes K/V around a ring of ranks;
`blocks.py` reduces each (query chunk, key chunk) pair to one kernel call with its mask in global positions;
`comm.py` posts the transfers; `llama3.py` gathers K/V instead (the all-gather form); `agree.py` checks a
call on every rank before any transfer. Any backend (NCCL on GPUs, gloo on CPU)."""

from .llama3 import (
    llama3_flash_attn_prepare_cu_seqlens,
    llama3_flash_attn_varlen_func,
    llama3_flash_attn_varlen_kvpacked_func,
    llama3_flash_attn_varlen_qkvpacked_func,
    shard_llama3,
)
from .ring import (
    LAYOUTS,
    context_parallel_attention,
    ring_flash_attn_func,
    ring_flash_attn_kvpacked_func,
    ring_flash_attn_qkvpacked_func,
    shard,
    stripe_flash_attn_func,
    stripe_flash_attn_kvpacked_func,
    stripe_flash_attn_qkvpacked_func,
    unshard,
    zigzag_ring_flash_attn_func,
    zigzag_ring_flash_attn_kvpacked_func,
    zigzag_ring_flash_attn_qkvpacked_func,
)
from .varlen import (
    context_parallel_varlen_attention,
    ring_flash_attn_varlen_func,
    shard_varlen,
    stripe_flash_attn_varlen_func,
    zigzag_ring_flash_attn_varlen_func,
)

__all__ = [
    "LAYOUTS", "context_parallel_attention", "shard", "unshard", "shard_varlen", "context_parallel_varlen_attention",
    "ring_flash_attn_varlen_func", "zigzag_ring_flash_attn_varlen_func", "stripe_flash_attn_varlen_func",
    "ring_flash_attn_func", "ring_flash_attn_kvpacked_func", "ring_flash_attn_qkvpacked_func",
    "zigzag_ring_flash_attn_func", "zigzag_ring_flash_attn_kvpacked_func", "zigzag_ring_flash_attn_qkvpacked_func",
    "stripe_flash_attn_func", "stripe_flash_attn_kvpacked_func", "stripe_flash_attn_qkvpacked_func",
    "llama3_flash_attn_prepare_cu_seqlens", "llama3_flash_attn_varlen_func", "llama3_flash_attn_varlen_kvpacked_func",
    "llama3_flash_attn_varlen_qkvpacked_func", "shard_llama3",
]
