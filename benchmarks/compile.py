"""An attention layer (RMSNorm, fused QKV projection, rotary, attention, output projection, residual)
eager and under torch.compile, with our kernels and with PyTorch's SDPA.

Training: one forward + backward of a (batch, seqlen, embed) block, causal. Decode: one token per
request appended to static caches (the lengths advance on the device inside the step), the step
compiled with mode="reduce-overhead" (CUDA graphs). The SDPA decode is what a static-cache model
compiles: rotary at each request's position, the new K/V scattered into the cache, and SDPA over the
whole cache under a length mask.

Training also runs SDPA's flash backend (forced) as PyTorch ships it and, where torch has the provider
hook, with our kernels behind it (kernels/tritonattn/compile/sdpa.py, activated for those rows only).

Rows (us per step, the caller's wall time: host included, CUDA-synchronised) go to
results/<gpu>/bench_compile.csv; every compiled output is first compared with the eager one:

    python -m benchmarks.compile          # (~2 min on an H200, most of it compiling)

The decode shapes: batch 8 from 1,024 cached tokens (capacity 4,096), and batch 64 from 8,192
(capacity 16,384); the SDPA decode reads the whole capacity, ours each request's length.
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import tritonattn.compile.sdpa as sdpa
from tritonattn import flash_attn_func, flash_attn_with_kvcache
from tritonattn.testing import rel_err

from .measure import table_bench_args, wall_us
from .results import make_row, write_csv

EMBED, NHEADS, NHEADS_K = 4096, 32, 8
DTYPE = torch.bfloat16


def rotary_tables(max_seqlen: int, head_dim: int, device, dtype=DTYPE, base: float = 10000.0):
    """cos, sin (max_seqlen, head_dim / 2): the non-interleaved (GPT-NeoX) rotary of every position."""
    inv = base ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.arange(max_seqlen, device=device, dtype=torch.float32)[:, None] * inv
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (..., seqlen, nheads, head_dim) rotated by cos / sin (..., seqlen, head_dim / 2) per position."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class AttentionLayer(nn.Module):
    """Pre-norm attention block of a Llama-style decoder; attn: "kernels" (ours), "sdpa" (the backend
    PyTorch picks) or "sdpa-flash" (SDPA's flash backend, forced; training only)."""

    def __init__(self, embed: int = EMBED, nheads: int = NHEADS, nheads_k: int = NHEADS_K, attn: str = "kernels"):
        super().__init__()
        self.nheads, self.nheads_k, self.head_dim, self.attn = nheads, nheads_k, embed // nheads, attn
        self.norm = nn.RMSNorm(embed)
        self.qkv = nn.Linear(embed, (nheads + 2 * nheads_k) * self.head_dim, bias=False)
        self.out = nn.Linear(nheads * self.head_dim, embed, bias=False)

    def _qkv(self, x):
        batch, seqlen, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).split(
            [self.nheads * self.head_dim, self.nheads_k * self.head_dim, self.nheads_k * self.head_dim], dim=-1)
        return (q.view(batch, seqlen, self.nheads, self.head_dim), k.view(batch, seqlen, self.nheads_k, self.head_dim),
                v.view(batch, seqlen, self.nheads_k, self.head_dim))

    def forward(self, x, cos, sin):
        """x (batch, seqlen, embed) -> the same; cos / sin the rotary tables' first seqlen rows."""
        q, k, v = self._qkv(x)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if self.attn == "kernels":
            o = flash_attn_func(q, k, v, causal=True)
        elif self.attn == "sdpa-flash":  # SDPA's flash backend: PyTorch's, or a provider's (tritonattn.compile.sdpa)
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                   is_causal=True, enable_gqa=True).transpose(1, 2)
        else:
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                               enable_gqa=True).transpose(1, 2)
        return x + self.out(o.reshape(x.shape[0], x.shape[1], -1))

    def step(self, x, cos, sin, k_cache, v_cache, lens):
        """One decode step: x (batch, 1, embed); k_cache / v_cache (batch, capacity, nheads_k, head_dim) and
        lens (batch,) int32 are updated in place (the new token appended, the lengths advanced)."""
        q, k, v = self._qkv(x)
        if self.attn == "kernels":
            o = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin,
                                        cache_seqlens=lens, causal=True)
        else:
            pos = lens.long()
            q, k = rotate(q, cos[pos][:, None], sin[pos][:, None]), rotate(k, cos[pos][:, None], sin[pos][:, None])
            rows = torch.arange(x.shape[0], device=x.device)
            k_cache[rows, pos] = k[:, 0]
            v_cache[rows, pos] = v[:, 0]
            mask = torch.arange(k_cache.shape[1], device=x.device)[None, None, None, :] <= pos[:, None, None, None]
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2),
                                               attn_mask=mask, enable_gqa=True).transpose(1, 2)
        lens.add_(1)
        return x + self.out(o.reshape(x.shape[0], 1, -1))


@contextlib.contextmanager
def provider(active: bool):
    """Our kernels behind SDPA's flash backend inside (tritonattn.compile.sdpa), when `active`."""
    if active:
        torch.nn.attention.activate_flash_attention_impl(sdpa.IMPL_NAME)
    try:
        yield
    finally:
        if active:
            torch.nn.attention.restore_flash_attention_impl()


def train_cases(batch: int, seqlen: int):
    """name -> one training step (forward + backward; returns the layer's output): eager and compiled,
    ours and SDPA's."""
    torch.manual_seed(0)
    base = AttentionLayer().to("cuda", DTYPE)
    cos, sin = rotary_tables(seqlen, base.head_dim, "cuda")
    x = torch.randn(batch, seqlen, EMBED, device="cuda", dtype=DTYPE, requires_grad=True)
    grad = torch.randn_like(x)
    layers = {}
    cases = [("kernels eager", "kernels", False), ("kernels compiled", "kernels", True),
             ("sdpa compiled", "sdpa", True), ("sdpa-flash compiled", "sdpa-flash", True)]
    if sdpa.available():
        cases.append(("sdpa-flash compiled, kernels provider", "sdpa-flash", True))
    for name, attn, compiled in cases:
        layer = AttentionLayer(attn=attn).to("cuda", DTYPE)
        layer.load_state_dict(base.state_dict())
        layers[name] = torch.compile(layer, fullgraph=True) if compiled else layer

    def step(layer):
        x.grad = None
        out = layer(x, cos, sin)
        out.backward(grad)
        return out

    return {name: (lambda layer=layer: step(layer)) for name, layer in layers.items()}


def decode_cases(batch: int, capacity: int, start: int):
    """name -> (one decode step, reset of its lengths to `start`)."""
    torch.manual_seed(0)
    base = AttentionLayer().to("cuda", DTYPE)
    cos, sin = rotary_tables(capacity, base.head_dim, "cuda")
    k0 = torch.randn(batch, capacity, NHEADS_K, base.head_dim, device="cuda", dtype=DTYPE)
    v0 = torch.randn_like(k0)
    x = torch.randn(batch, 1, EMBED, device="cuda", dtype=DTYPE)
    cases = {}
    for name, attn, compiled in (("kernels eager", "kernels", False), ("kernels compiled", "kernels", True),
                                 ("sdpa compiled", "sdpa", True)):
        layer = AttentionLayer(attn=attn).to("cuda", DTYPE)
        layer.load_state_dict(base.state_dict())
        k_cache, v_cache = k0.clone(), v0.clone()
        lens = torch.full((batch,), start, dtype=torch.int32, device="cuda")
        for t in (k_cache, v_cache, lens):  # the same buffers every step: CUDA graphs may mutate them
            torch._dynamo.mark_static_address(t)
        fn = torch.compile(layer.step, mode="reduce-overhead", fullgraph=True) if compiled else layer.step
        cases[name] = (lambda fn=fn, k=k_cache, v=v_cache, n=lens: fn(x, cos, sin, k, v, n).clone(),
                       lambda n=lens: n.fill_(start))
    return cases


DECODE_SHAPES = ((8, 4096, 1024), (64, 16384, 8192))  # (batch, cache capacity, length at the first step)


def measure(batch: int = 2, seqlen: int = 2048, decode_shapes=DECODE_SHAPES, *, rounds: int = 3, rep: int = 50,
            verbose: bool = True) -> list:
    """Rows (dicts, not yet stamped with the GPU): us per step of each case, its speedup over the eager
    layer with our kernels, and the relative error of its output against that layer's."""
    rows = []

    def report(path, shape, outs, best):
        for name in outs:
            err = rel_err(outs[name], outs["kernels eager"])
            speedup = best["kernels eager"] / best[name]
            if verbose:
                print(f"{path:6s} {shape:22s} {name:38s} {best[name]:9.1f} us  vs eager {speedup:.3f}x  "
                      f"rel err vs eager {err:.1e}", flush=True)
            rows.append(dict(path=path, shape=shape, impl=name, us=round(best[name], 1),
                             speedup_vs_eager=round(speedup, 3), rel_err=f"{err:.1e}"))

    train = train_cases(batch, seqlen)
    outs, best = {}, {name: float("inf") for name in train}
    for _ in range(rounds):  # interleaved: every case once per round
        for name, fn in train.items():
            with provider(name.endswith("provider")):
                outs.setdefault(name, fn().detach())
                best[name] = min(best[name], wall_us(fn, rep, before=fn))
    report("train", f"{batch}x{seqlen}x{EMBED}", outs, best)
    del train
    for decode_batch, capacity, start in decode_shapes:
        with torch.no_grad():
            decode = decode_cases(decode_batch, capacity, start)
            outs = {}
            for name, (fn, reset) in decode.items():
                reset()
                outs[name] = fn()
            best = {name: float("inf") for name in decode}
            for _ in range(rounds):  # interleaved: every case from the same lengths in each round
                for name, (fn, reset) in decode.items():
                    for _ in range(5):
                        fn()  # warm (and record the CUDA graph) before resetting
                    best[name] = min(best[name], wall_us(fn, rep, before=reset))
        report("decode", f"{decode_batch}x{start}+{rep}of{capacity}", outs, best)
        del decode
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    a = table_bench_args(argv, __doc__, rep=50, rounds=3)
    if a is None:
        return 2
    rows = [make_row(dtype="bf16", nheads=NHEADS, nheads_k=NHEADS_K, head_dim=EMBED // NHEADS, **row)
            for row in measure(rounds=a.rounds, rep=a.rep)]
    if not a.no_write:
        print("wrote", write_csv(rows, "bench_compile", a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
