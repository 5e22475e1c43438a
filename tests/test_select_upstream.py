"""scripts/select_flash_attn_tests.py --hopper-forward picks the upstream cases whose forward takes Hopper's
warp-specialized kernel: checked here on the parameters alone (no upstream file, no GPU)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from tritonattn.config.tables import SM90_WS_MIN_KEYS, gluon_sm90_available

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "select_flash_attn_tests.py"


@pytest.fixture(scope="module")
def select():
    saved = sys.path[:]  # the script puts tests/upstream (the flash_attn alias) first on sys.path
    try:
        spec = importlib.util.spec_from_file_location("_select_flash_attn_tests", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclass resolves the module while the class body runs
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved
    return module


@pytest.mark.skipif(not gluon_sm90_available(), reason="this Triton's Gluon lacks the Hopper API the forward uses")
def test_hopper_forward_cases_follow_the_dispatcher_rule(select):
    full, causal = SM90_WS_MIN_KEYS[False], SM90_WS_MIN_KEYS[True]
    base = dict(d=128, dtype=torch.float16, dropout_p=0.0, causal=False, seqlen_q=128, seqlen_k=full)
    takes = select.takes_hopper_forward
    assert takes("test_flash_attn_output", base)
    assert takes("test_flash_attn_output", dict(base, dtype=torch.bfloat16, causal=True, seqlen_k=causal))
    assert not takes("test_flash_attn_output", dict(base, seqlen_k=full - 1))
    assert not takes("test_flash_attn_output", dict(base, causal=True, seqlen_k=causal - 1))
    assert not takes("test_flash_attn_output", dict(base, d=64))
    assert not takes("test_flash_attn_output", dict(base, d=111))  # padded to 128, not 128 itself
    assert not takes("test_flash_attn_output", dict(base, dropout_p=0.17))
    # packed sequences take it, not over a paged K/V; the KV-cache test's chunks stay on the decode kernel
    assert takes("test_flash_attn_varlen_output", base)
    assert not takes("test_flash_attn_varlen_output", dict(base, dropout_p=0.17))
    assert not takes("test_flash_attn_varlen_causal", dict(base, paged_kv_block_size=256, seqlen_k=causal))
    assert takes("test_flash_attn_varlen_causal", dict(d=128, dtype=torch.float16, seqlen_q=causal, seqlen_k=causal,
                                                        swap_sq_sk=False, paged_kv_block_size=None))
    assert not takes("test_flash_attn_varlen_causal", dict(d=128, dtype=torch.float16, seqlen_q=full, seqlen_k=full,
                                                            swap_sq_sk=False, paged_kv_block_size=None))
    assert not takes("test_flash_attn_kvcache", base)
    # qkvpacked has one seqlen; test_flash_attn_causal has no causal parameter and is always causal
    assert takes("test_flash_attn_qkvpacked", dict(d=128, dtype=torch.float16, dropout_p=0.0, causal=False,
                                                   seqlen=full))
    causal_case = dict(d=128, dtype=torch.float16, seqlen_q=full, seqlen_k=full, swap_sq_sk=False)
    assert not takes("test_flash_attn_causal", causal_case)
    assert takes("test_flash_attn_causal", dict(causal_case, seqlen_k=causal))
    # swap_sq_sk: the body swaps the pair, so the keys are seqlen_q's value
    swapped = dict(base, seqlen_q=full, seqlen_k=1, swap_sq_sk=True)
    assert takes("test_flash_attn_splitkv", swapped)
    assert not takes("test_flash_attn_splitkv", dict(swapped, swap_sq_sk=False))
