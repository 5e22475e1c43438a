"""`flash_attn` as the upstream flash-attention test file imports it, backed by this repo's `tritonattn`.

This package is a test fixture, not a distribution: tests/upstream/conftest.py puts tests/upstream at
the front of sys.path for the upstream run only, so `import flash_attn` in flash-attention's own
tests/test_flash_attn.py resolves here and every attention call runs our Triton kernels. Nothing
outside tests/upstream imports it, and it is never installed.

Modules (only what the upstream test file imports):
    flash_attn                      the seven public attention functions (tritonattn.flash_attn_interface)
    flash_attn.flash_attn_interface the same functions, `_get_block_size_n`, `USE_TRITON_ROCM`
    flash_attn.bert_padding         `pad_input`, `unpad_input`: our own pure-torch helpers
    flash_attn.layers.rotary        `apply_rotary_emb`: a pure-torch rotary reference
"""

from .flash_attn_interface import *  # noqa: F403  the public functions, as flash_attn exports them
