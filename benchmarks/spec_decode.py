"""Greedy speculative decoding on this library's kernels, for notebook 06: a small decoder-only model (random
weights, built here, no download), a draft made of its first layers, and the loop that drafts a tree, verifies
it in one target step (`KVCache.decode(..., tree_mask=...)`) and keeps the accepted path (`KVCache.accept`).

The model: token embedding, `layers` pre-norm blocks (RMSNorm, GQA attention with rotary embeddings applied here
at explicit positions, a SiLU MLP), a final RMSNorm and an LM head. The draft runs the first
`draft_layers` blocks with the same weights, the same final norm and (untied) head: a target whose later blocks only
refine (their outputs scaled by `refine`) agrees with it on most greedy tokens, as a trained draft does.

The verify tree (`draft_tree`): the last committed token as the root, the draft's greedy chain of `depth` tokens
below it, and at every depth the draft's next `branch - 1` choices as leaves beside the chain's token. The target
scores every node in one step; the accepted path follows, from the root, the child whose token equals the
target's greedy token, and ends with the target's own token (the bonus). In fp32 the result equals plain greedy
decoding of the target token for token, up to near-ties (top-2 logits within `NEAR_TIE`), which `compare`
reports rather than counts.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import List, Optional

import torch

from tritonattn import KVCache

NEAR_TIE = 1e-4  # top-2 logits closer than this: either token is a correct greedy choice


@dataclass(frozen=True)
class LMConfig:
    vocab: int = 512
    dim: int = 256
    layers: int = 8
    draft_layers: int = 2
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 32
    refine: float = 0.05
    max_len: int = 1024
    seed: int = 0


class TinyLM:
    """The target (all layers) and its draft (the first draft_layers), one set of fp32 weights."""

    def __init__(self, cfg: LMConfig, device):
        self.cfg, self.device = cfg, torch.device(device)
        g = torch.Generator().manual_seed(cfg.seed)

        def w(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g) * scale / math.sqrt(shape[0])).to(self.device)
        d, hd = cfg.dim, cfg.head_dim
        self.embed = (torch.randn(cfg.vocab, d, generator=g)).to(self.device)
        self.head = w(d, cfg.vocab)  # untied: a tied head would make every token predict itself
        self.blocks = []
        for layer in range(cfg.layers):
            out = 1.0 if layer < cfg.draft_layers else cfg.refine
            self.blocks.append(dict(wq=w(d, cfg.heads * hd), wk=w(d, cfg.kv_heads * hd), wv=w(d, cfg.kv_heads * hd),
                                    wo=w(cfg.heads * hd, d, scale=out), w1=w(d, 4 * d), w2=w(4 * d, d, scale=out)))

    def caches(self, layers: int, batch: int = 1) -> List[KVCache]:
        return [KVCache(batch, self.cfg.max_len, self.cfg.kv_heads, self.cfg.head_dim, dtype=torch.float32,
                        device=self.device) for _ in range(layers)]

    def flops_per_token(self, layers: int) -> int:
        """Multiply-adds x 2 of the weights one token passes through (blocks and head; attention's own not
        counted): what a draft token costs against a target one."""
        c = self.cfg
        block = c.dim * (c.heads + 2 * c.kv_heads) * c.head_dim + c.heads * c.head_dim * c.dim + 8 * c.dim * c.dim
        return 2 * (layers * block + c.vocab * c.dim)

    def _rotary(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        half = self.cfg.head_dim // 2
        freq = 10000.0 ** (-torch.arange(half, device=self.device, dtype=torch.float32) / half)
        angle = positions.float()[..., None, None] * freq  # (B, T, 1, half)
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * angle.cos() - x2 * angle.sin(), x1 * angle.sin() + x2 * angle.cos()], dim=-1)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, caches: List[KVCache], *, prefill=False,
                tree_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits (B, T, vocab) of tokens (B, T) at positions (B, T) through len(caches) blocks, each appending
        its K/V to its cache (prefill: empty caches; else a decode step, over a draft tree with tree_mask)."""
        c = self.cfg
        x = self.embed[tokens]
        batch, steps = tokens.shape
        for block, cache in zip(self.blocks, caches):
            h = rms(x)
            q = self._rotary((h @ block["wq"]).view(batch, steps, c.heads, c.head_dim), positions)
            k = self._rotary((h @ block["wk"]).view(batch, steps, c.kv_heads, c.head_dim), positions)
            v = (h @ block["wv"]).view(batch, steps, c.kv_heads, c.head_dim)
            o = cache.prefill(q, k, v) if prefill else cache.decode(q, k, v, tree_mask=tree_mask)
            x = x + o.reshape(batch, steps, -1) @ block["wo"]
            h = rms(x)
            x = x + torch.nn.functional.silu(h @ block["w1"]) @ block["w2"]
        return rms(x) @ self.head


def rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def greedy(model: TinyLM, prompt: torch.Tensor, new_tokens: int):
    """Plain greedy decoding of the target: (tokens, near_ties: the steps whose top-2 logits were within NEAR_TIE)."""
    caches = model.caches(model.cfg.layers)
    positions = torch.arange(prompt.shape[1], device=model.device)[None]
    logits = model.forward(prompt, positions, caches, prefill=True)[0, -1]
    out, near = [], []
    for step in range(new_tokens):
        top = logits.topk(2)
        near.append(bool(top.values[0] - top.values[1] < NEAR_TIE))
        out.append(int(top.indices[0]))
        if step + 1 < new_tokens:
            pos = torch.tensor([[prompt.shape[1] + step]], device=model.device)
            logits = model.forward(torch.tensor([[out[-1]]], device=model.device), pos, caches)[0, -1]
    return out, near


def draft_tree(root: int, chain: List[int], alts: List[List[int]]):
    """(tokens, parents, depths) of the verify tree: node 0 the root, chain[i] at node i + 1 (parent node i),
    then each depth's alternatives as leaves under the chain node above them."""
    tokens, parents, depths = [root] + chain, [-1] + list(range(len(chain))), list(range(len(chain) + 1))
    for i, options in enumerate(alts):
        for token in options:
            tokens.append(token)
            parents.append(i)
            depths.append(i + 1)
    return tokens, parents, depths


def ancestor_mask(parents: List[int]) -> torch.Tensor:
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for t in range(n):
        u = t
        while u >= 0:
            mask[t, u] = True
            u = parents[u]
    return mask


def speculative(model: TinyLM, prompt: torch.Tensor, new_tokens: int, depth: int = 4, branch: int = 2):
    """Greedy speculative decoding: (tokens, stats) with stats = verify steps, drafted and accepted tokens."""
    cfg, dev = model.cfg, model.device
    target, draft = model.caches(cfg.layers), model.caches(cfg.draft_layers)
    n = prompt.shape[1]
    positions = torch.arange(n, device=dev)[None]
    logits = model.forward(prompt, positions, target, prefill=True)[0, -1]
    model.forward(prompt, positions, draft, prefill=True)
    out = [int(logits.argmax())]
    pending = [out[-1]]  # committed tokens the draft has not read yet (the last one is the verify tree's root)
    in_target, in_draft = n, n  # tokens each cache holds
    steps = accepted = drafted = 0
    while len(out) < new_tokens:
        feed = torch.tensor([pending], device=dev)
        dl = model.forward(feed, torch.arange(in_draft, in_draft + len(pending), device=dev)[None], draft)[0, -1]
        in_draft += len(pending)
        chain, alts = [], []
        for i in range(depth):
            top = dl.topk(branch).indices.tolist()
            chain.append(top[0])
            alts.append(top[1:])
            if i + 1 < depth:
                dl = model.forward(torch.tensor([[top[0]]], device=dev), torch.tensor([[in_draft]], device=dev),
                                   draft)[0, -1]
                in_draft += 1
        tokens, parents, depths = draft_tree(pending[-1], chain, alts)
        mask = ancestor_mask(parents).to(dev)[None]
        tl = model.forward(torch.tensor([tokens], device=dev), torch.tensor([depths], device=dev) + in_target,
                           target, tree_mask=mask)[0]
        path, u = [0], 0
        while True:  # follow the target's greedy token down the tree
            want = int(tl[u].argmax())
            child = next((c for c in range(len(tokens)) if parents[c] == u and tokens[c] == want), None)
            if child is None:
                break
            path.append(child)
            u = child
        for cache in target:
            cache.accept(torch.tensor([path]))
        in_target += len(path)
        kept = [tokens[c] for c in path[1:]]
        on_chain = sum(1 for c in path[1:] if c <= depth)  # chain nodes are 1..depth
        read = min(on_chain, depth - 1)  # chain tokens the draft read while drafting
        in_draft -= (depth - 1) - read
        for cache in draft:
            cache.truncate(in_draft)
        bonus = int(tl[u].argmax())
        out += kept + [bonus]
        pending = kept[read:] + [bonus]
        steps, accepted, drafted = steps + 1, accepted + len(kept), drafted + depth
    return out[:new_tokens], dict(verify_steps=steps, accepted=accepted, drafted=drafted)


def compare(model: TinyLM, prompt: torch.Tensor, new_tokens: int, depth: int = 4, branch: int = 2) -> dict:
    """Both decodings, timed (wall clock, synchronised), and their agreement: the first mismatch, if any, and
    whether plain greedy decoding had a near-tie there."""
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    plain, near = greedy(model, prompt, new_tokens)
    sync()
    t1 = time.perf_counter()
    spec, stats = speculative(model, prompt, new_tokens, depth, branch)
    sync()
    t2 = time.perf_counter()
    mismatch = next((i for i, (a, b) in enumerate(zip(plain, spec)) if a != b), None)
    return dict(plain=plain, speculative=spec, equal=mismatch is None, first_mismatch=mismatch,
                mismatch_is_near_tie=mismatch is not None and near[mismatch], near_ties=sum(near),
                plain_tokens_per_s=new_tokens / (t1 - t0), speculative_tokens_per_s=new_tokens / (t2 - t1),
                tokens_per_verify=new_tokens / max(stats["verify_steps"], 1),
                accepted_per_verify=stats["accepted"] / max(stats["verify_steps"], 1),
                acceptance_rate=stats["accepted"] / max(stats["drafted"], 1), **stats,
                draft_cost=model.flops_per_token(model.cfg.draft_layers) / model.flops_per_token(model.cfg.layers))


def verify_checks(device, dtype, *, batch: int = 3, drafts: int = 9, prefix: int = 40, head_dim: int = 64,
                  seed: int = 0) -> List[dict]:
    """One verify step per case (a random tree, a chain, all siblings; dense and paged with drafts crossing a
    page), each against the eager reference with its tree materialised over every key (the tests' error rule):
    rows of case, cache, error, bound, ok."""
    from tritonattn import flash_attn_with_kvcache
    from tritonattn.testing import check_close, per_request_references

    g = torch.Generator().manual_seed(seed)
    rows = []
    for kind in ("random tree", "chain", "siblings"):
        if kind == "chain":
            parents = [[t - 1 for t in range(drafts)]] * batch
        elif kind == "siblings":
            parents = [[-1] * drafts] * batch
        else:
            parents = [[-1] + [int(torch.randint(0, t, (1,), generator=g)) for t in range(1, drafts)]
                       for _ in range(batch)]
        mask = torch.stack([ancestor_mask(p) for p in parents]).to(device)
        lengths = [prefix + 7 * b for b in range(batch)]
        rand = lambda *s: torch.randn(*s, generator=g).to(device, dtype)  # noqa: E731
        q, k, v = rand(batch, drafts, 8, head_dim), rand(batch, drafts, 2, head_dim), rand(batch, drafts, 2, head_dim)
        k_cache, v_cache = rand(batch, 128, 2, head_dim), rand(batch, 128, 2, head_dim)
        ref32, _, same = per_request_references(q, k_cache, v_cache, k, v, lengths, causal=True, tree_mask=mask)
        seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
        page = 16  # the same caches as pools of 16-token pages, each request's pages in reverse order
        pools = [t.reshape(-1, page, 2, head_dim).flip(0).contiguous() for t in (k_cache, v_cache)]
        table = (pools[0].shape[0] - 1 - torch.arange(pools[0].shape[0], device=device)).view(batch, -1).int()
        for cache, args in (("dense", (k_cache.clone(), v_cache.clone())), ("paged", tuple(pools))):
            extra = {"block_table": table} if cache == "paged" else {}
            out = flash_attn_with_kvcache(q, *args, k, v, cache_seqlens=seqlens, causal=True, tree_mask=mask, **extra)
            ok, err, bound = check_close(out, ref32, same)
            rows.append(dict(case=kind, cache=cache, drafts=drafts, error=err, bound=bound, ok=ok))
    return rows
