"""The transformers backend (kernels/tritonattn/integrations/transformers.py), end to end on models built from
configs with random weights: a Llama-style model with GQA, a Mistral-style model whose sliding window
engages, a Gemma-2-style model with softcap, a gpt-oss-style model with sinks.

Each model runs with attn_implementation="triton_attention" against a baseline ("sdpa" where
transformers' sdpa path applies all the model's options, "eager" for softcap and sinks) and the fp32
eager model as ground truth: teacher-forced logits at every real position of a left-padded batch (Llama
also right-padded and unpadded) and a training step's gradients (right padding) within tritonattn.testing's
rule; for a left-padded batch, decode logits along the baseline's tokens within the rule's bound, and
greedy tokens equal to the baseline's up to the first step where its own top two logits are within
that tolerance. A window off by one key fails the Mistral logits check (8e-2 against 1e-5 on CPU). CPU (the Triton
interpreter, fp32, tiny models) checks the same paths exactly; the GPU runs bf16 at a larger size.
Also: registration is explicit, and our package lives beside Hugging Face's hub-kernels package (`import
kernels`, which transformers >= 5.25 requires) without shadowing it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import tritonattn.integrations.transformers as kt  # noqa: E402
from helpers import DEVICE, ON_GPU  # noqa: E402
from tritonattn.errors import InputError  # noqa: E402
from tritonattn.testing import check_close, error_bound, rel_err  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DTYPE = torch.bfloat16 if ON_GPU else torch.float32
WINDOW = 32 if ON_GPU else 8  # smaller than prompt + generated, so the window engages
# (batch, prompt, new tokens, leading pad tokens per row): rows 0 and 2 are left-padded
SHAPE = dict(batch=4, prompt=96, new=64, pads=(40, 0, 7, 0)) if ON_GPU else dict(batch=3, prompt=12, new=8,
                                                                                  pads=(5, 0, 2))


def _dims():
    if ON_GPU:
        return dict(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                    num_attention_heads=8, num_key_value_heads=2, head_dim=64)
    return dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16)


def llama():
    return transformers.LlamaConfig(**_dims(), max_position_embeddings=512)


def mistral():
    return transformers.MistralConfig(**_dims(), max_position_embeddings=512, sliding_window=WINDOW)


def gemma2():
    # A softcap of 1 engages on the O(1) scores `build` makes; Gemma 2 ships 50.
    return transformers.Gemma2Config(**_dims(), max_position_embeddings=512, sliding_window=WINDOW,
                                     attn_logit_softcapping=1.0, final_logit_softcapping=None,
                                     query_pre_attn_scalar=_dims()["head_dim"])


def gpt_oss():
    dims = dict(_dims(), intermediate_size=_dims()["hidden_size"])
    layer_types = ["sliding_attention", "full_attention"] * (dims["num_hidden_layers"] // 2)
    return transformers.GptOssConfig(**dims, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=512,
                                     sliding_window=WINDOW, layer_types=layer_types)


# model -> (config, the baseline that applies all its options)
MODELS = {"llama": (llama, "sdpa"), "mistral": (mistral, "sdpa"), "gemma2": (gemma2, "eager"),
          "gpt_oss": (gpt_oss, "eager")}


def build(name: str, attn: str, dtype=DTYPE, seed: int = 0):
    torch.manual_seed(seed)
    config = MODELS[name][0]()
    config.pad_token_id, config.eos_token_id, config.bos_token_id = 0, None, None
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            # Random init gives scores of ~0.01 and near-uniform attention: scale the queries so the
            # scores are O(1) (peaked rows, an engaged softcap), and give gpt-oss's sinks weight.
            layer.self_attn.q_proj.weight.mul_(10.0)
            if name == "gpt_oss":
                layer.self_attn.sinks.normal_(0.0, 1.0)
    return model.to(device=DEVICE, dtype=dtype).eval()


def batch(seed: int = 1, side: str = "left"):
    """(input_ids, attention_mask) of SHAPE, padded on `side` ("left", "right" or "none")."""
    g = torch.Generator().manual_seed(seed)
    b, n = SHAPE["batch"], SHAPE["prompt"]
    ids = torch.randint(1, _dims()["vocab_size"], (b, n), generator=g)
    mask = torch.ones(b, n, dtype=torch.long)
    for row, pads in enumerate(SHAPE["pads"] if side != "none" else ()):
        mask[row, :pads] = 0
    if side == "right":
        mask = mask.flip(1)
    ids[mask == 0] = 0
    return ids.to(DEVICE), mask.to(DEVICE)


def logits(model, ids, mask, attn: str) -> torch.Tensor:
    """Teacher-forced logits in the model's dtype (the rule takes its yardstick from the dtype)."""
    model.set_attn_implementation(attn)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def _child_env() -> dict:
    """This process's environment with the library's source root first on PYTHONPATH."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO / "kernels"),
                                                                     os.environ.get("PYTHONPATH")])))


def test_registration_is_explicit():
    """`import tritonattn` registers nothing with transformers; importing the integration registers NAME."""
    code = textwrap.dedent("""
        import tritonattn
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
        assert "triton_attention" not in AttentionInterface._global_mapping
        import tritonattn.integrations.transformers
        assert "triton_attention" in AttentionInterface._global_mapping
        assert "triton_attention" in AttentionMaskInterface._global_mapping
        import transformers.modeling_utils
        print("ok")
    """)
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         env=_child_env())
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr[-2000:]


def test_hub_kernels_is_not_shadowed():
    """With our source root first on sys.path, `import kernels` is Hugging Face's hub-kernels package (where
    installed: transformers >= 5.25 requires it) or nothing, never this repository; transformers' own import
    and our backend load side by side."""
    code = textwrap.dedent("""
        import importlib.metadata, importlib.util, json
        import tritonattn.integrations.transformers
        import transformers.modeling_utils
        spec = importlib.util.find_spec("kernels")
        try:
            hub = importlib.metadata.version("kernels")
        except importlib.metadata.PackageNotFoundError:
            hub = None
        if hub is not None:
            import kernels
            origin = kernels.__file__
        else:
            origin = spec.origin if spec else None
        print(json.dumps({"hub": hub, "origin": origin, "ours": tritonattn.__file__}))
    """)
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         env=_child_env())
    assert run.returncode == 0, run.stderr[-2000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    source_root = REPO / "kernels"  # ours: kernels/tritonattn/; `kernels` must never resolve into it
    assert Path(found["ours"]).resolve().parent == source_root / "tritonattn"
    if found["hub"] is not None:
        assert found["origin"] and source_root not in Path(found["origin"]).resolve().parents, found
    else:
        assert found["origin"] is None or source_root not in Path(found["origin"]).resolve().parents, found
    from importlib.metadata import version

    from packaging.version import Version
    if Version(version("transformers")) >= Version("5.25"):
        assert found["hub"] is not None, "transformers >= 5.25 requires hub-kernels; it should be installed"


def test_register_refuses_names_transformers_routes_elsewhere():
    """A name with 'flash' or '/' would be sent to transformers' flash-attn or hub-kernel loaders."""
    for name in ("my_flash", "org/repo"):
        with pytest.raises(InputError, match="without 'flash' or '/'"):
            kt.register(name)


def test_unsupported_masks_are_refused():
    """Mask patterns the kernels cannot express (or/and overlays) and dense 4-D masks raise, naming the fix."""
    from transformers.masking_utils import and_masks, causal_mask_function, chunked_overlay

    chunked = and_masks(causal_mask_function, chunked_overlay(4, torch.zeros(1, dtype=torch.long)))
    with pytest.raises(NotImplementedError, match="sdpa"):
        kt.padding_mask(1, 8, 8, mask_function=chunked, local_size=4)
    kt.padding_mask(1, 8, 8, mask_function=causal_mask_function)  # the patterns the kernels compute pass
    q = torch.randn(1, 2, 8, 16, device=DEVICE)
    with pytest.raises(InputError, match="2-D padding mask"):
        kt.attention_forward(torch.nn.Module(), q, q, q, torch.zeros(1, 1, 8, 8, device=DEVICE))
    with pytest.raises(NotImplementedError, match="output_attentions"):
        kt.attention_forward(torch.nn.Module(), q, q, q, None, output_attentions=True)
    with pytest.raises(NotImplementedError, match="continuous-batching"):
        kt.attention_forward(torch.nn.Module(), q, q, q, None, cache=object())


def test_padding_mask_forms():
    """No padding -> None (dense kernels); left padding -> leftpad counts; other padding -> varlen only."""
    none = torch.ones(2, 6, dtype=torch.bool, device=DEVICE)
    assert kt.padding_mask(2, 6, 6, attention_mask=none) is None
    left = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool, device=DEVICE)
    mask = kt.padding_mask(2, 6, 6, attention_mask=left)  # the 2-D mask, as flash-attn's hook returns it
    padding = getattr(mask, kt.PADDING_ATTR)
    assert torch.equal(mask, left) and mask.contiguous() is mask and padding.leftpad.tolist() == [2, 0]
    (rows_q, _), (cu_q, cu_k), (max_q, max_k) = padding.varlen(1)
    assert cu_q.tolist() == [0, 1, 2] and cu_k.tolist() == [0, 4, 10] and (max_q, max_k) == (1, 6)
    right = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 0, 1, 1, 1, 1]], dtype=torch.bool, device=DEVICE)
    assert getattr(kt.padding_mask(2, 6, 6, attention_mask=right), kt.PADDING_ATTR).leftpad is None
    # a sliding-window cache holds the last kv_length keys: the mask's last columns
    assert getattr(kt.padding_mask(2, 1, 5, attention_mask=left), kt.PADDING_ATTR).leftpad.tolist() == [1, 0]
    assert kt.padding_mask(2, 1, 4, attention_mask=left) is None


def _real(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return x[mask.bool()]


@pytest.mark.parametrize("name, side", [(name, "left") for name in MODELS] + [("llama", "right"), ("llama", "none")])
def test_teacher_forced_logits(name, side):
    """Logits at every real position are within the rule (fp32 eager model as truth): a left-padded batch
    (the kernels read the keys in place), a right-padded one (unpadded to varlen), an unpadded one."""
    ids, mask = batch(side=side)
    model = build(name, "eager")
    ours = _real(logits(model, ids, mask, kt.NAME), mask)
    same = _real(logits(model, ids, mask, MODELS[name][1]), mask)
    ref = _real(logits(build(name, "eager", dtype=torch.float32), ids, mask, "eager"), mask)
    ok, err, bound = check_close(ours, ref, same)
    print(f"{name} ({side} padding): rel err {err:.2e} (baseline {rel_err(same, ref):.2e}, bound {bound:.2e})")
    assert ok, f"{name}: rel err {err:.3e} > bound {bound:.3e}"


@pytest.mark.parametrize("name", ["mistral", "gemma2", "gpt_oss"])
def test_variants_engage(name):
    """The window, softcap and sinks change the logits, so the equality above can fail without them."""
    ids, mask = batch()
    model = build(name, kt.NAME)
    full = _real(logits(model, ids, mask, kt.NAME), mask)
    for layer in model.model.layers:
        attn = layer.self_attn
        if name == "gemma2":
            attn.attn_logit_softcapping = None
        elif name == "gpt_oss":
            attn.sinks.data.fill_(-float("inf"))
        else:
            model.config.sliding_window = None
    changed = _real(logits(model, ids, mask, kt.NAME), mask)
    assert rel_err(changed, full) > 10 * error_bound(DTYPE, 0.0), f"{name}: the variant did not change the logits"


def _near_tie(scores: torch.Tensor, tol: torch.Tensor) -> torch.Tensor:
    """(batch,) the first step whose top two logits are within tol (the step count if none)."""
    top2 = scores.topk(2, dim=-1).values  # (steps, batch, 2)
    tie = (top2[..., 0] - top2[..., 1]) <= tol
    steps = torch.arange(scores.shape[0], device=scores.device)[:, None].expand_as(tie)
    return torch.where(tie, steps, scores.shape[0]).min(0).values


@pytest.mark.parametrize("name, side, cache", [(name, "left", "dynamic") for name in MODELS]
                         + [("llama", "none", "dynamic"), ("llama", "left", "static"), ("mistral", "left", "static")])
def test_greedy_generation(name, side, cache):
    """Greedy tokens of a left-padded (or unpadded) batch equal the baseline's up to its first near-tie
    (prefill + decode with transformers' DynamicCache, its sliding-window layers where the model has them;
    or a StaticCache, whose keys include unfilled rows past the mask: not compiled here)."""
    ids, mask = batch(side=side)
    model = build(name, MODELS[name][1])
    kw = dict(attention_mask=mask, max_new_tokens=SHAPE["new"], min_new_tokens=SHAPE["new"], do_sample=False)
    if cache == "static":
        kw.update(cache_implementation="static", disable_compile=True)
    with torch.no_grad():
        base = model.generate(ids, output_logits=True, return_dict_in_generate=True, **kw)
        model.set_attn_implementation(kt.NAME)
        ours = model.generate(ids, **kw)
    new_base, new_ours = base.sequences[:, ids.shape[1]:], ours[:, ids.shape[1]:]
    scores = torch.stack(base.logits)  # (steps, batch, vocab), the baseline's raw logits
    # The rule's bound, from the baseline's own teacher-forced error on the prompt against the fp32 model.
    ref = _real(logits(build(name, "eager", dtype=torch.float32), ids, mask, "eager"), mask)
    same = _real(logits(model, ids, mask, MODELS[name][1]), mask)
    bound = error_bound(DTYPE, rel_err(same, ref))
    # 1. Decoding along the baseline's tokens (our prefill, then one token a step through the cache),
    #    every step's logits are within that bound of the baseline's: the decode path at each position.
    model.set_attn_implementation(kt.NAME)
    steps = decode_along(model, ids, mask, new_base)
    err = rel_err(steps, scores)
    assert err <= bound, f"{name}: decode logits along the baseline's tokens: rel err {err:.3e} > {bound:.3e}"
    # 2. Greedy tokens agree up to the baseline's first near-tie: top two within the bound times the
    #    step's logit scale.
    agree_until = _near_tie(scores.float(), bound * scores.float().pow(2).mean(-1).sqrt())
    for row in range(ids.shape[0]):
        n = int(agree_until[row])
        assert torch.equal(new_ours[row, :n], new_base[row, :n]), (
            f"{name} row {row}: tokens differ before the baseline's first near-tie at step {n}:\n"
            f"{new_ours[row, :n].tolist()}\n{new_base[row, :n].tolist()}")
    print(f"{name} ({side} padding, {cache} cache): decode logits rel err {err:.2e} (bound {bound:.2e}); "
          f"tokens equal up to the baseline's first near-tie, per row {agree_until.tolist()} of {SHAPE['new']}")


def decode_along(model, ids, mask, tokens) -> torch.Tensor:
    """(steps, batch, vocab) logits of a prefill of (ids, mask) and then of feeding `tokens` (batch, steps)
    one at a time through a DynamicCache, with generate's position ids (counted over real tokens)."""
    cache = transformers.DynamicCache(config=model.config)
    position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)
    out, steps = [], tokens.shape[1]
    with torch.no_grad():
        logit = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, past_key_values=cache,
                      use_cache=True).logits[:, -1]
        for t in range(steps):
            out.append(logit)
            if t + 1 == steps:
                break
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
            position_ids = position_ids[:, -1:] + 1
            logit = model(input_ids=tokens[:, t:t + 1], attention_mask=mask, position_ids=position_ids,
                          past_key_values=cache, use_cache=True).logits[:, -1]
    return torch.stack(out)


@pytest.mark.parametrize("name", list(MODELS))
def test_training_step_gradients(name):
    """A training step (loss over a right-padded batch, labels -100 on padding) gives the baseline's gradients
    within the rule, parameter by parameter, with the fp32 eager model as truth; dropout stays 0 so the
    three runs see the same function."""
    ids, mask = batch(side="right")  # what training collators make
    labels = torch.where(mask.bool(), ids, -100)

    def grads(attn, dtype):
        model = build(name, "eager", dtype=dtype)
        model.set_attn_implementation(attn)
        model.train()
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    ours, same, ref = grads(kt.NAME, DTYPE), grads(MODELS[name][1], DTYPE), grads("eager", torch.float32)
    worst = []
    for n in ref:
        if ref[n].norm() == 0:
            continue
        ok, err, bound = check_close(ours[n], ref[n], same[n], grad=True)
        if n.endswith("sinks") and DTYPE != torch.float32:
            # a cancelling sum: tritonattn.testing.check_dsinks's floor of 1e-2 (its bound also takes the
            # forward output's error, so it is never lower than this)
            bound += 1e-2 - error_bound(DTYPE, 0.0, grad=True)
            ok = err <= bound
        worst.append((err / bound, n, err, bound))
        assert ok, f"{name} {n}: grad rel err {err:.3e} > bound {bound:.3e}"
    print(f"{name}: worst grad err/bound {max(worst)[0]:.2f} ({max(worst)[1]})")


def test_packed_sequences_match_separate_runs():
    """A padding-free batch of one (position ids restarting per sequence) equals each sequence run alone."""
    model = build("llama", kt.NAME)
    lengths = (5, 9, 3)
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(1, _dims()["vocab_size"], (1, n), generator=g).to(DEVICE) for n in lengths]
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None].to(DEVICE)
    with torch.no_grad():
        packed = model(input_ids=torch.cat(seqs, 1), position_ids=position_ids).logits
        alone = torch.cat([model(input_ids=s).logits for s in seqs], 1)
    assert rel_err(packed, alone) <= 10 * error_bound(DTYPE, 0.0), rel_err(packed, alone)


def test_training_dropout_reaches_the_kernels():
    """config.attention_dropout in train mode drops attention probabilities in our kernels: the loss moves
    off the eval-mode loss, torch.manual_seed reproduces it, and eval mode is unaffected."""
    ids, mask = batch(side="right")
    labels = torch.where(mask.bool(), ids, -100)
    model = build("llama", kt.NAME)
    model.config.attention_dropout = 0.5
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5

    def loss(train: bool, seed: int = 0) -> float:
        model.train(train)
        torch.manual_seed(seed)
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=mask, labels=labels).loss.item()

    dropped, again, other, plain = loss(True), loss(True), loss(True, seed=1), loss(False)
    assert abs(dropped - again) <= 1e-6 * abs(dropped), "the same seed must draw the same mask"
    assert abs(dropped - plain) > 1e-3 * abs(plain) and abs(dropped - other) > 1e-4 * abs(plain), (
        f"dropout did not reach the kernels: train {dropped}, seed 1 {other}, eval {plain}")
