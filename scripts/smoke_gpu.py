"""Quick compiled-GPU sanity check of forward and backward on a few odd shapes (prints errors)."""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "kernels"))  # the library's source root
from tritonattn import attention_ref, flash_attn_func, rel_err  # noqa: E402
from tritonattn.config.options import attn_options  # noqa: E402
from tritonattn.config.tables import AttnConfig  # noqa: E402
from tritonattn.launch.prefill import launch_prefill  # noqa: E402

torch.manual_seed(0)
bad = 0
for (B, M, N, H, HK, D, causal, dt) in [
    (2, 1023, 1023, 16, 4, 128, True, torch.bfloat16), (1, 113, 1023, 12, 4, 80, True, torch.float16),
    (1, 1023, 113, 16, 1, 64, True, torch.bfloat16), (2, 17, 17, 16, 16, 256, False, torch.float16),
    (1, 4096, 4096, 8, 2, 128, False, torch.bfloat16), (1, 300, 300, 4, 2, 96, True, torch.float32),
    (1, 1, 1, 4, 4, 192, True, torch.bfloat16),
]:
    q = torch.randn(B, M, H, D, device="cuda", dtype=dt, requires_grad=True)
    k = torch.randn(B, N, HK, D, device="cuda", dtype=dt, requires_grad=True)
    v = torch.randn(B, N, HK, D, device="cuda", dtype=dt, requires_grad=True)
    o = flash_attn_func(q, k, v, causal=causal)
    do = torch.randn_like(o)
    g = torch.autograd.grad(o, (q, k, v), do)
    qr, kr, vr = [x.detach().float().requires_grad_() for x in (q, k, v)]
    ro, _ = attention_ref(qr, kr, vr, causal=causal)
    gr = torch.autograd.grad(ro, (qr, kr, vr), do.float())
    errs = [rel_err(o, ro)] + [rel_err(a, b) for a, b in zip(g, gr)]
    # both load paths of the forward
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    options = attn_options(D, None, causal)
    o_ptr, _ = launch_prefill(qd, kd, vd, options, AttnConfig(128, 64, 4, 2, False))
    o_tma, _ = launch_prefill(qd, kd, vd, options, AttnConfig(128, 64, 4, 2, True))
    errs += [rel_err(o_ptr, ro), rel_err(o_tma, ro)]
    ok = all(e < 2e-2 for e in errs) and all(torch.isfinite(x).all() for x in (o, *g))
    bad += not ok
    print(("ok  " if ok else "BAD ") + f"B={B} M={M} N={N} H={H}:{HK} D={D} causal={causal} {dt}: "
          + " ".join(f"{e:.1e}" for e in errs), flush=True)
print("smoke:", "PASS" if bad == 0 else f"{bad} FAILED")
