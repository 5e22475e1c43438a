"""Adapters that put our kernels behind other libraries' attention switches.

    transformers: `import tritonattn.integrations.transformers` registers "triton_attention" with
                  transformers' AttentionInterface and AttentionMaskInterface, so a model takes
                  `attn_implementation="triton_attention"`.

Nothing here is imported by `import tritonattn`: each adapter needs its library, and registering is the
user's choice.
"""
