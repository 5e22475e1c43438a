"""flash-attn's `flash_attn.flash_attn_interface`: the public functions, and the forward / backward
primitives that ring-attention and context-parallel libraries build on (`_flash_attn_forward`,
`_flash_attn_backward` and their varlen forms, flash-attn's names and argument lists; api/primitives.py),
with `merge_attention` to combine the partial results of disjoint key blocks."""

from .api.kvcache import flash_attn_with_kvcache
from .api.packed import (
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from .api.prefill import flash_attn_func, flash_attn_varlen_func
from .api.primitives import (  # noqa: F401  (flash-attn's underscore names are its interface)
    _flash_attn_backward,
    _flash_attn_forward,
    _flash_attn_varlen_backward,
    _flash_attn_varlen_forward,
    merge_attention,
)

__all__ = [
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_with_kvcache",
    "merge_attention",
]
