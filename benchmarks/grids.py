"""What the benchmark suite measures: the suites, their shape grids and dtypes, the columns that
identify a measurement, and the labels and colours the report draws them with. Needs no GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import List, Union

import torch

PathLike = Union[str, Path]

SUITES = ("prefill_fwd", "prefill_fwd_bwd", "decode", "decode_splits", "chunked")
MODES = {"prefill_fwd": "fwd", "prefill_fwd_bwd": "fwd_bwd"}
CSV_NAMES = {suite: f"bench_{suite}" for suite in SUITES}
CEILINGS_CSV = "bench_ceilings"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEFAULT_DTYPES = {"prefill_fwd": ("bf16", "fp16"), "prefill_fwd_bwd": ("bf16", "fp16"), "decode": ("bf16",),
                  "decode_splits": ("bf16",), "chunked": ("bf16",)}
QUICK_DTYPES = ("bf16",)
FLEX_DTYPES = ("bf16",)  # FlexAttention compiles per shape and dtype: minutes; bf16 only unless --flex-dtypes

# Grids. Prefill (issues 2/3): 32 q heads over 32 (MHA) or 8 (GQA) KV heads, batch x seqlen = 16384
# tokens, causal and not, at head dims 128, 64 and 256; the seed's setup (32 q
# heads, 8 KV heads, D=128, batch 2, seqlen 2048/4096/8192). Decode (issue 4): 32 q / 8 KV heads,
# D=128 (and 64), batch x cache length; the seed's decode (batch 2, caches up to 8192).
PREFILL_NHEADS, PREFILL_TOKENS = 32, 16384
PREFILL_NHEADS_K = (32, 8)
PREFILL_SEQLENS = (1024, 2048, 4096, 8192, 16384)
PREFILL_HEAD_DIMS = (128, 64, 256)
SEED_BATCH, SEED_SEQLENS = 2, (2048, 4096, 8192)
DECODE_NHEADS, DECODE_NHEADS_K = 32, 8
DECODE_BATCHES = (1, 8, 32, 128)
DECODE_CACHE_LENS = (1024, 4096, 16384, 65536)
DECODE_HEAD_DIMS = (128, 64)
SEED_DECODE_CACHE_LENS = (1024, 2048, 4096, 8192)
PAGE_SIZES = (16, 64, 256)
SPLIT_VALUES = (1, 2, 4, 8, 16, 32, 64)  # decode_splits: num_splits of ours (and 0, the heuristic)
SPLIT_CACHE_LENS = (4096, 16384, 65536)  # decode_splits: one request, 32 q / 8 KV heads, D=128
GQA_NHEADS, GQA_NHEADS_K, GQA_SEQLEN = 16, (16, 8, 4, 2, 1), 4096  # gqa_shapes: the group-size sweep
HOST_OVERHEAD_SHAPE = (1, 4096)  # (batch, cache_len) of the host-overhead rows, at head dim 128
CHUNK_SIZES = (512, 2048)
CHUNK_PREFIXES = (0, 4096, 12288)
CHUNK_BATCHES = (1, 4)
CHUNK_PAGE_SIZES = (64, 256)

_PREFILL_KEY = ("impl", "grid", "dtype", "batch", "seqlen", "nheads", "nheads_k", "head_dim", "causal", "quick")
KEY_COLUMNS = {
    "prefill_fwd": _PREFILL_KEY,
    "prefill_fwd_bwd": _PREFILL_KEY,
    "decode": ("metric", "impl", "page_size", "dtype", "batch", "cache_len", "nheads", "nheads_k", "head_dim",
               "quick"),
    "decode_splits": ("metric", "impl", "num_splits", "dtype", "batch", "cache_len", "nheads", "nheads_k",
                      "head_dim", "quick"),
    "chunked": ("impl", "page_size", "dtype", "batch", "cache_len", "chunk", "nheads", "nheads_k", "head_dim",
                "quick"),
}

LABELS = {
    "ours": "Triton (ours)",
    "sdpa_flash": "SDPA flash (FA2)",
    "sdpa_cudnn": "SDPA cuDNN",
    "sdpa_efficient": "SDPA mem-efficient",
    "flex": "FlexAttention (compiled)",
    "eager": "eager PyTorch",
    "sdpa_expand_kv": "repeat_interleave K/V + SDPA",
    "ours_paged": "Triton (ours), paged",
    "sdpa": "SDPA, length-1 query",
    "eager_slice": "eager, cache sliced (seed)",
    "eager_cat": "eager, torch.cat cache (seed)",
    "ours_prefill": "ours flash_attn_func (q chunk vs all keys)",
    "ours_kvcache": "ours flash_attn_with_kvcache (chunk appended)",
    "ours_kvcache_paged": "ours flash_attn_with_kvcache, paged",
}
COLORS = {"ours": "C3", "sdpa_cudnn": "C0", "sdpa_flash": "C2", "sdpa_efficient": "C4", "flex": "C1",
          "sdpa_expand_kv": "C8", "eager": "C7", "sdpa": "C0", "eager_slice": "C7", "eager_cat": "C5",
          "ours_paged": "C3",
          "ours_prefill": "C0", "ours_kvcache": "C3", "ours_kvcache_paged": "C3"}
PAGE_STYLES = {0: "-", 16: ":", 64: "--", 256: "-."}

# ============================================================================================
# Shapes
# ============================================================================================
@dataclass(frozen=True)
class PrefillShape:
    """Self-attention prefill: q (batch, seqlen, nheads, head_dim), k/v (batch, seqlen, nheads_k, head_dim)."""

    batch: int
    seqlen: int
    nheads: int
    nheads_k: int
    head_dim: int
    causal: bool
    grid: str = "issue"  # "issue" (batch x seqlen = 16384 tokens) or "seed" (the seed's batch-2 setup)


@dataclass(frozen=True)
class DecodeShape:
    """One decode step: batch requests, each with cache_len - 1 cached tokens plus the appended one."""

    batch: int
    cache_len: int
    nheads: int
    nheads_k: int
    head_dim: int
    grid: str = "issue"
    host: bool = False  # also measure the host overhead of one eager step at this shape


@dataclass(frozen=True)
class ChunkedShape:
    """Chunked prefill: a chunk of `chunk` new tokens appended to caches already holding cache_len tokens."""

    batch: int
    cache_len: int
    chunk: int
    nheads: int
    nheads_k: int
    head_dim: int
    grid: str = "issue"


def prefill_shapes(quick: bool = False) -> List[PrefillShape]:
    """The prefill grid: the issues' grid at head dims 128, 64 and 256, plus the seed's setup.

    quick: head dim 128, seqlens 1024/4096/16384, and one seed shape (seqlen 4096, causal).
    """
    seqlens = (1024, 4096, 16384) if quick else PREFILL_SEQLENS
    head_dims = (128,) if quick else PREFILL_HEAD_DIMS
    shapes = [
        PrefillShape(PREFILL_TOKENS // s, s, PREFILL_NHEADS, hk, d, causal, "issue")
        for d in head_dims for hk in PREFILL_NHEADS_K for causal in (False, True) for s in seqlens
    ]
    seed = [(4096, True)] if quick else [(s, c) for c in (False, True) for s in SEED_SEQLENS]
    shapes += [PrefillShape(SEED_BATCH, s, 32, 8, 128, c, "seed") for s, c in seed]
    return shapes


def decode_shapes(quick: bool = False) -> List[DecodeShape]:
    """The decode grid: batch {1, 8, 32, 128} x cache {1024 ... 65536} at head dims 128 and 64, plus the
    seed's batch 2 x caches up to 8192. quick: batch {1, 32} x cache {4096, 65536} and batch 2 x 8192."""
    batches, lens = ((1, 32), (4096, 65536)) if quick else (DECODE_BATCHES, DECODE_CACHE_LENS)
    head_dims = (128,) if quick else DECODE_HEAD_DIMS
    shapes = [
        DecodeShape(b, n, DECODE_NHEADS, DECODE_NHEADS_K, d, "issue", host=(d == 128 and (b, n) == HOST_OVERHEAD_SHAPE))
        for d in head_dims for b in batches for n in lens
    ]
    seed_lens = (8192,) if quick else SEED_DECODE_CACHE_LENS
    shapes += [DecodeShape(SEED_BATCH, n, 32, 8, 128, "seed") for n in seed_lens]
    return shapes


def chunked_shapes(quick: bool = False) -> List[ChunkedShape]:
    """Chunked prefill: batch {1, 4} x chunk {512, 2048} x cached prefix {0, 4096, 12288}, 32 q / 8 KV
    heads, D=128. quick: batch 1, prefixes 0 and 12288."""
    batches, prefixes = ((1,), (0, 12288)) if quick else (CHUNK_BATCHES, CHUNK_PREFIXES)
    return [ChunkedShape(b, n, c, 32, 8, 128) for b in batches for c in CHUNK_SIZES for n in prefixes]


def gqa_shapes(quick: bool = False) -> List[PrefillShape]:
    """The group-size sweep (not in the default grid; notebook 01 runs it): 16 q heads over 16, 8, 4, 2, 1
    KV heads, seqlen 4096, batch 4 (16384 tokens), D=128, causal and not. quick: groups 1, 4 and 16."""
    nheads_k = (16, 4, 1) if quick else GQA_NHEADS_K
    return [PrefillShape(PREFILL_TOKENS // GQA_SEQLEN, GQA_SEQLEN, GQA_NHEADS, hk, 128, causal, "gqa")
            for causal in (False, True) for hk in nheads_k]


def decode_split_shapes(quick: bool = False) -> List[DecodeShape]:
    """Split-KV at batch 1: one request of 32 q / 8 KV heads, D=128, caches of 4096, 16384 and 65536 keys
    (quick: 16384), each timed at every num_splits in SPLIT_VALUES and with the heuristic."""
    lens = (16384,) if quick else SPLIT_CACHE_LENS
    return [DecodeShape(1, n, DECODE_NHEADS, DECODE_NHEADS_K, 128, "splits") for n in lens]


def suite_shapes(suite: str, quick: bool = False) -> list:
    """The grid of one suite."""
    if suite in MODES:
        return prefill_shapes(quick)
    return {"decode": decode_shapes, "decode_splits": decode_split_shapes, "chunked": chunked_shapes}[suite](quick)
