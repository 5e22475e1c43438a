"""Triton attention kernels for LLM inference and training.

Public API:
    flash_attn_func: FlashAttention-2 prefill (MHA/GQA/MQA, causal bottom-right, any strides).
    flash_attn_qkvpacked_func, flash_attn_kvpacked_func: the same over a fused QKV / KV tensor.
    flash_attn_varlen_func: the same kernels over sequences of different lengths packed without padding
                     (and flash_attn_varlen_qkvpacked_func, flash_attn_varlen_kvpacked_func).
    flash_attn_with_kvcache: decode over a dense or paged KV cache (fused append, per-request lengths,
                     split-KV, block_table).
    KVCache:         preallocated K/V buffers and lengths for generation (prefill, decode, reset).
    PagedKVCache:    a paged K/V block pool with a free list (add/extend/prefill/decode/free requests);
                     PoolExhaustedError when its blocks or request slots run out.
    attention_ref:   eager reference used by tests, notebooks and benchmarks.
    rel_err:         ||out - ref|| / ||ref||; tritonattn.testing holds the error rule built on it.
    The SDPA provider (tritonattn.compile.sdpa): our kernels as scaled_dot_product_attention's flash
                     backend, registered on import, activated by the user:
                     torch.nn.attention.activate_flash_attention_impl("tritonattn") (torch >= 2.10).
    InputError, InputTypeError: what bad input raises, before any launch (ValueError / TypeError and
                     RuntimeError, as flash-attn raises).

The attention functions have flash-attn 2's signatures (flash_attn.flash_attn_interface), so code
written for it runs by changing the import; our own options come after theirs, keyword-only.

Layout (docs/design.md): api/ (the public functions, the one translation of their arguments, the
validation) -> launch/ (plans and launches) -> jit/ (the kernels) -> config/ (options, hardware, tables);
cache/ (KVCache, PagedKVCache), compile/ (torch.compile's ops, the SDPA provider), integrations/ and
testing/ (references, the error rule) sit on top.
"""

from . import _versions  # noqa: F401, I001  (first: checks Triton and numpy before any kernel is decorated)
from .compile import ops as _ops, sdpa as _sdpa  # noqa: F401  (registered: the custom ops, the SDPA provider)
from .api.kvcache import flash_attn_with_kvcache
from .api.packed import (
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from .api.prefill import flash_attn_func, flash_attn_varlen_func
from .cache import KVCache, PagedKVCache, PoolExhaustedError
from .config.hardware import default_device, env_summary, has_gpu, is_interpreter
from .errors import InputError, InputTypeError
from .testing import attention_ref, causal_mask, rel_err

__all__ = [
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_with_kvcache",
    "KVCache",
    "PagedKVCache",
    "PoolExhaustedError",
    "InputError",
    "InputTypeError",
    "attention_ref",
    "causal_mask",
    "rel_err",
    "env_summary",
    "is_interpreter",
    "has_gpu",
    "default_device",
]

__version__ = "0.1.0"
