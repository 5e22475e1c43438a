"""The options object (kernels/tritonattn/config/options.py) and the cache keys derived from it: every field reaches the
kernels through its compiled or its runtime part, launch and replay keys follow the compiled part, and
no launch recorded for one value of a field is reused for another.

OTHER_VALUE lists a second value for every field of AttnOptions: a new field without an entry fails
`test_every_field_has_a_second_value`, so the stale-launch checks below cover it from the start.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import tritonattn.launch.decode as decode
import tritonattn.launch.replay as replay
from helpers import DEVICE, ON_GPU
from tritonattn import flash_attn_with_kvcache
from tritonattn.config.hardware import device_target
from tritonattn.config.options import AttnOptions, attn_options
from tritonattn.testing import attention_ref, check_close

BASE = dict(head_dim=64, softmax_scale=0.125, causal=False, window_left=-1, window_right=-1, softcap=0.0,
            alibi=False, sinks=False, seqused_k=False, kv_fp8=False, tree=False)
OTHER_VALUE = dict(head_dim=128, softmax_scale=0.3, causal=True, window_left=5, window_right=3, softcap=2.0,
                   alibi=True, sinks=True, seqused_k=True, kv_fp8=True, tree=True)
# fields whose stale launches the decode checks below look for (tests/test_option_reach.py runs every field everywhere)
KVCACHE_FIELDS = ("causal", "head_dim", "softmax_scale")


def _build(window_left, window_right, **fields) -> AttnOptions:
    return attn_options(window=(window_left, window_right), **fields)


def _with(field: str) -> AttnOptions:
    return _build(**{**BASE, field: OTHER_VALUE[field]})


def test_every_field_has_a_second_value():
    """The tests here know every field of AttnOptions (add a new field's second value to OTHER_VALUE)."""
    assert {f.name for f in dataclasses.fields(AttnOptions)} == set(OTHER_VALUE) == set(BASE)


@pytest.mark.parametrize("field", sorted(OTHER_VALUE))
def test_each_field_reaches_the_kernels(field):
    """Changing one field changes the compiled part (another kernel) or the runtime part (another
    argument), and launch / replay keys change exactly when the compiled part does."""
    base, other = _build(**BASE), _with(field)
    assert base != other
    compiled_changed = base.compiled != other.compiled
    runtime_changed = base.runtime != other.runtime
    assert compiled_changed or runtime_changed, f"{field} reaches no kernel parameter"
    assert set(base.constexprs).isdisjoint(base.runtime)
    # launch keys: LaunchCache adds every constexpr the launch passes to the caller's key
    launch = decode.decode_launcher
    rows = []
    for opts in (base, other):  # the launch's arguments: the options', and 1 for everything else
        args = {**opts.constexprs, **opts.runtime}
        rows.append([args.get(name, 1) for name in launch.names])
    key_a, key_b = (launch.key_of("sig", row, 4, 2, False, None) for row in rows)
    assert (key_a != key_b) == compiled_changed
    # replay keys: the signature, the lengths' layout and options.compiled; runtime values are filled in
    lens = torch.zeros(2, dtype=torch.int32)
    replay_a = replay.replay_key_of(("sig",), lens, base, 0, False)
    replay_b = replay.replay_key_of(("sig",), lens, other, 0, False)
    assert (replay_a != replay_b) == compiled_changed


def test_runtime_options_name_kernel_parameters():
    """Every runtime option is a parameter of each attention kernel, every compiled one a constexpr."""
    import tritonattn.jit.decode as decode_jit
    import tritonattn.jit.prefill_bwd as prefill_bwd
    import tritonattn.jit.prefill_fwd as prefill_fwd
    from tritonattn.launch.fast import LaunchCache

    opts = _build(**BASE)
    for kernel in (prefill_fwd.fwd_kernel, prefill_bwd.bwd_dkdv_kernel, prefill_bwd.bwd_dq_kernel,
                   decode_jit.decode_kernel):
        launch = LaunchCache(kernel)
        constexpr_names = {launch.names[i] for i in launch.constexprs}
        assert set(opts.runtime) <= set(launch.names) - constexpr_names, kernel
        assert set(opts.constexprs) <= constexpr_names, kernel


def test_options_are_validated_and_cached():
    """attn_options resolves the default scale, rejects bad ones, and returns one object per call shape."""
    assert attn_options(64).softmax_scale == 64**-0.5
    assert attn_options(64, 0.5, True) is attn_options(64, 0.5, True)
    assert attn_options(64, 0.5, 1) is attn_options(64, 0.5, True)  # causal is a bool
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="softmax_scale"):
            attn_options(64, bad)
    with pytest.raises(TypeError, match="softmax_scale"):
        attn_options(64, [0.5])
    assert attn_options(64, torch.tensor(0.5)).softmax_scale == 0.5


# (batch, new tokens, q heads) of a call that takes each path of flash_attn_with_kvcache
PATHS = {"decode": (2, 3, 8), "chunked": (2, 256, 32) if ON_GPU else (1, 128, 4)}


def _kvcache_call(opts: AttnOptions, path: str, seed: int):
    """A repeated flash_attn_with_kvcache call (device lengths: replayed or launched from LaunchCache on a
    GPU) with `opts`, taking `path` (the decode kernel, or the chunked-prefill kernels), and its references."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    (batch, m, nheads), nheads_k, cache = PATHS[path], 2, 300 + PATHS[path][1]
    d, dtype = opts.head_dim, torch.float16
    assert decode.chunked_prefill_pays(batch, m, nheads, d, dtype, opts.causal,
                                                  device_target(torch.device(DEVICE))) == (path == "chunked")

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=DEVICE).to(dtype)

    q, k, v = randn(batch, m, nheads, d), randn(batch, m, nheads_k, d), randn(batch, m, nheads_k, d)
    k_cache, v_cache = randn(batch, cache, nheads_k, d), randn(batch, cache, nheads_k, d)
    lens = torch.tensor([100, 257][:batch], dtype=torch.int32, device=DEVICE)
    refs = []
    for b in range(batch):
        kk = torch.cat([k_cache[b:b + 1, :lens[b]], k[b:b + 1]], 1)
        vv = torch.cat([v_cache[b:b + 1, :lens[b]], v[b:b + 1]], 1)
        ref = attention_ref(q[b:b + 1].float(), kk.float(), vv.float(), causal=opts.causal,
                            softmax_scale=opts.softmax_scale)[0]
        same = attention_ref(q[b:b + 1], kk, vv, causal=opts.causal, softmax_scale=opts.softmax_scale,
                             upcast=False)[0]
        refs.append((ref, same))

    def call():
        return flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), k, v, cache_seqlens=lens,
                                       softmax_scale=opts.softmax_scale, causal=opts.causal,
                                       num_splits=2 if path == "decode" else 0)

    return call, refs


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("field", KVCACHE_FIELDS)
def test_no_stale_launch_is_reused(field, path):
    """A call repeated until its launches are recorded (replayed, or launched from LaunchCache, on a GPU),
    then the same call with one field changed: the second gives the attention of its own options, not
    the recorded one's."""
    for opts, seed in ((_build(**BASE), 0), (_with(field), 1)):
        call, refs = _kvcache_call(opts, path, seed)
        for _ in range(3 if ON_GPU else 1):  # the first call records, the next ones reuse
            out = call()
            for b, (ref, same) in enumerate(refs):
                ok, err, bound = check_close(out[b:b + 1], ref, same)
                assert ok, f"{field}={getattr(opts, field)!r}: request {b} rel err {err:.2e} > {bound:.2e}"


def test_integer_classes_keep_launches_apart():
    """Launch keys tell integers apart as Triton's dispatcher does (1, a multiple of 16, past 32 bits), so a
    kernel compiled for NUM_SPLITS = 16 is never reused for 12; and decode with 16 effective splits, then
    with fewer, both equal the unsplit result."""
    launch = decode.combine_launcher
    position = launch.names.index("NUM_SPLITS")

    def key(n):
        full = [None if i in launch.constexprs else 7 for i in range(len(launch.names))]
        full[position] = n
        return launch.key_of("sig", full, 4, 1, False, None)

    assert key(16) != key(12) and key(12) == key(10) and key(1) != key(10) and key(2**31) != key(10)
    d, nheads, nheads_k = 32, 4, 2
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    block_n = decode.plan_decode(1, 1, nheads, nheads_k, d, 4096, torch.float16, device_target(torch.device(DEVICE)),
                                  1).block_n
    cache = 32 * block_n  # 32 key blocks: 16 splits of 2 blocks, or 11 of 3

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=DEVICE).to(torch.float16)

    q, k_cache, v_cache = randn(1, 1, nheads, d), randn(1, cache, nheads_k, d), randn(1, cache, nheads_k, d)
    lens = torch.tensor([cache - 5], dtype=torch.int32, device=DEVICE)
    out = {ns: flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, num_splits=ns) for ns in (16, 12, 1)}
    used = {ns: decode.plan_decode(1, 1, nheads, nheads_k, d, cache, torch.float16,
                                    device_target(torch.device(DEVICE)), ns).num_splits for ns in (16, 12)}
    assert used == {16: 16, 12: 11}
    for ns in (16, 12):
        assert (out[ns] - out[1]).abs().max().item() < 2e-3, f"num_splits={ns} differs from the unsplit result"
