"""KV caches for generation on top of `flash_attn_with_kvcache`: `KVCache` (dense) and `PagedKVCache`."""

from .dense import KVCache
from .paged import PagedBatch, PagedKVCache, PoolExhaustedError

__all__ = ["KVCache", "PagedKVCache", "PagedBatch", "PoolExhaustedError"]
