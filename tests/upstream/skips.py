"""What the upstream flash-attention tests ask of us that we do not do (yet), as data.

tests/upstream/conftest.py marks a collected upstream case skipped, with the entry's reason, when an
entry matches it; scripts/select_flash_attn_tests.py uses the same entries to stratify its sample.
When a feature lands, delete its entries: the cases already in tests/upstream/selected.txt then run.

An entry matches a case when `test` is the case's function name (or "*": any function) and, unless
`param` is None (the whole function), the case's parameter `param` equals `value` and every (name,
value) pair of `also` holds too. Several matching entries are all reported, so a case's skip reason
lists everything it is waiting for.

Three lists:
    OUT_OF_SCOPE  tests of flash-attn's own internals (its CUDA extension `flash_attn_gpu`, private
                  `_flash_attn_*` entry points): never ours to pass; also left out of the sample.
    PENDING       public behaviour we do not implement yet: sampled, skipped until it lands.
    RNG_STREAM    checks that hold for flash-attn's own random stream, not for every correct one: a
                  statistical bound too tight for its sample size. Sampled, skipped for good, and
                  what they check is tested on a sample large enough to mean it (the reason says where).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Mapping, Optional, Tuple

__all__ = ["Skip", "OUT_OF_SCOPE", "PENDING", "RNG_STREAM", "matching", "out_of_scope"]


@dataclass(frozen=True)
class Skip:
    """Skip the cases of `test` ("*" for any) whose parameter `param` is `value` (param None: all) and
    whose parameters also equal each (name, value) of `also`."""

    test: str
    param: Optional[str]
    value: Any
    reason: str
    also: Tuple[Tuple[str, Any], ...] = ()

    def matches(self, test: str, params: Mapping[str, Any]) -> bool:
        """True when this entry applies to a case of function `test` with parameters `params`."""
        if self.test not in ("*", test):
            return False
        if self.param is None:
            return True
        wanted = ((self.param, self.value),) + self.also
        return all(name in params and _same(params[name], value) for name, value in wanted)


def _same(a: Any, b: Any) -> bool:
    """Parameter equality that keeps True apart from 1 and 1.0 (bool is an int in Python)."""
    return type(a) is type(b) and a == b


OUT_OF_SCOPE: List[Skip] = [
    Skip("test_flash_attn_generator_arg_must_be_none", None, None,
         "flash-attn internals: calls its CUDA extension flash_attn_gpu directly (out of scope)"),
    Skip("test_flash_attn_varlen_paged_kv_num_splits", None, None,
         "flash-attn internals: calls the private _flash_attn_varlen_forward (out of scope)"),
]

PENDING: List[Skip] = [
    # The test wants RuntimeError("...block_table...") when *CUDA* cache_seqlens overflow the block
    # table. Our kernels trust device-side lengths and clamp accesses instead of syncing to check
    # them (README, Limits); only host-known lengths are checked.
    Skip("test_flash_attn_kvcache_paged_block_table_bounds", None, None,
         "device-side cache_seqlens are trusted, not checked (no host sync; README Limits)"),
]


RNG_STREAM: List[Skip] = [
    # Its dropout-fraction check at seqlen_q = 1 counts about 3,300 (query, key) pairs (4 sequences x 6
    # heads x ~137 keys), where the tolerance of 0.01 is 1.5 binomial standard deviations: about one
    # seed in eight fails it for any unbiased keep mask. flash-attn's own Philox stream passes at seed 0;
    # ours fails some of the sampled cases. The keep rate (2^17 pairs) and the spread of the drop count
    # per row and its independence across heads, batch entries, queries and keys (65k pairs) are tested in
    # tests/test_dropout.py; the output and gradients with the mask are checked at every other shape.
    Skip("test_flash_attn_varlen_output", "seqlen_q", 1,
         "dropout fraction bound of 1.5 sigma at seqlen_q = 1 holds for flash-attn's RNG stream only "
         "(tests/test_dropout.py checks the keep rate on large samples)", also=(("dropout_p", 0.17),)),
]


def matching(test: str, params: Mapping[str, Any]) -> List[Skip]:
    """The entries of OUT_OF_SCOPE, PENDING and RNG_STREAM that apply to one case."""
    return [entry for entry in OUT_OF_SCOPE + PENDING + RNG_STREAM if entry.matches(test, params)]


def out_of_scope(test: str) -> bool:
    """True for a test function of flash-attn's internals (skipped, and never sampled)."""
    return any(entry.test == test for entry in OUT_OF_SCOPE)
