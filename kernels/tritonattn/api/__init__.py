"""The api layer: the public functions (flash-attn's and ours), the one translation of their arguments
into (AttnOptions, per-call tensors, Dropout) in `args`, and the validation of every argument before any
launch (`validate`, `validate_cache`)."""
