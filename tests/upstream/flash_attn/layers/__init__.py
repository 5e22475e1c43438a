"""`flash_attn.layers`: only `rotary` is provided (the upstream test imports nothing else from it)."""
