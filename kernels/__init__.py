"""Triton attention kernels for LLM inference and training.

Public API:
    flash_attn_func: FlashAttention-2 prefill (MHA/GQA/MQA, causal bottom-right, any strides).
    attention_ref:   eager reference used by tests, notebooks and benchmarks.
"""

from .prefill import flash_attn_func
from .reference import attention_ref, causal_mask, rel_err
from ._utils import env_summary, is_interpreter, has_gpu, default_device

__all__ = [
    "flash_attn_func",
    "attention_ref",
    "causal_mask",
    "rel_err",
    "env_summary",
    "is_interpreter",
    "has_gpu",
    "default_device",
]

__version__ = "0.1.0"
