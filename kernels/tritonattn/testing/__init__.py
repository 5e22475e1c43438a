"""What tests, notebooks and benchmarks check the kernels with: the eager references (`reference`: fp32 or
fp64, any option; SDPA on the same layout), the error rule (`tolerance`), the per-request reference of a
batch of requests served from a cache (`requests`), and check tables over lists of problems (`checks`, imported
as `tritonattn.testing.checks`: it runs the public API, which this package's import does not need)."""

from .reference import (
    attention_fp8_ref,
    attention_padded_keys_ref,
    attention_ref,
    attention_sdpa,
    causal_mask,
    dequantize_ref,
    quantize_e4m3_ref,
    rotary_ref,
    sdpa_supports_enable_gqa,
    window_mask,
)
from .requests import per_request_references, references, tree_attn_mask
from .tolerance import (
    AGREEMENT,
    ATOL_FLOOR,
    FA3_FP8_RMSE,
    FP8_KV_OUTLIER_RTOL,
    FP8_KV_RTOL,
    FP8_PREFILL_OUTLIER_RTOL,
    FP8_PREFILL_RTOL,
    FP32_AGREEMENT,
    FP32_GRAD_RTOL,
    FP32_RTOL,
    FWD_FACTOR,
    GRAD_FACTOR,
    LSE_ATOL,
    LSE_FP32_GPU,
    ZERO_RMS,
    agreement_tolerance,
    check_close,
    check_dsinks,
    check_lse,
    error_bound,
    lse_tolerance,
    rel_err,
)

__all__ = [
    "attention_ref", "attention_fp8_ref", "attention_padded_keys_ref", "attention_sdpa", "sdpa_supports_enable_gqa",
    "causal_mask", "window_mask", "rotary_ref", "quantize_e4m3_ref", "dequantize_ref", "references",
    "per_request_references", "tree_attn_mask", "rel_err", "error_bound", "check_close", "agreement_tolerance",
    "lse_tolerance",
    "check_lse", "check_dsinks", "FWD_FACTOR", "GRAD_FACTOR", "ATOL_FLOOR", "FP32_RTOL", "FP32_GRAD_RTOL",
    "FP8_KV_RTOL", "FP8_PREFILL_RTOL", "FP8_PREFILL_OUTLIER_RTOL", "FA3_FP8_RMSE", "FP8_KV_OUTLIER_RTOL", "AGREEMENT",
    "FP32_AGREEMENT", "LSE_ATOL", "LSE_FP32_GPU", "ZERO_RMS",
]
