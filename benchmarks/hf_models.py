"""A transformers model end to end with each attention backend: ours ("triton_attention",
kernels/tritonattn/integrations/transformers.py), "sdpa" and "flex_attention".

The model: a Llama-3.2-1B-shaped config with random weights (2048 hidden, 16 layers, 32 query heads and
8 KV heads of 64, 8192 MLP, 128256 vocab, tied embeddings: 1.24 B parameters), bf16, no download.
  - generate: batch 8, a 2048-token prompt, 128 new tokens (greedy, no early stop), DynamicCache;
    tokens/s = batch * new tokens / wall time of `generate` (prefill included), and the prefill alone.
  - train: one forward + backward of the loss over batch 8 x 2048 tokens.
Times are the best of `rounds` interleaved rounds, CUDA-synchronised wall time (host included). Each
backend's greedy tokens are compared with sdpa's (`same_tokens`: the shortest run of equal leading
tokens over the rows; random weights give near-ties, so a short run is not by itself an error: the
tests check equality up to the first near-tie). Rows go to results/<gpu>/bench_hf_models.csv:

    python -m benchmarks.hf_models        # (~3 min on an H200)
"""

from __future__ import annotations

import sys
import time

import torch

from .measure import table_bench_args, wall_us
from .results import make_row, write_csv

BACKENDS = ("triton_attention", "sdpa", "flex_attention")
BATCH, PROMPT, NEW = 8, 2048, 128


def llama_1b():
    import transformers

    return transformers.LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                    num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                                    max_position_embeddings=8192, tie_word_embeddings=True, rope_theta=500000.0,
                                    pad_token_id=0, bos_token_id=None, eos_token_id=None)


def measure(rounds: int = 2, verbose: bool = True) -> list:
    import transformers

    import tritonattn.integrations.transformers  # noqa: F401  (registers "triton_attention")

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(llama_1b(), dtype=torch.bfloat16).cuda().eval()
    params = sum(p.numel() for p in model.parameters())
    ids = torch.randint(1, 128256, (BATCH, PROMPT), device="cuda")
    mask = torch.ones_like(ids)
    labels = ids.clone()
    gen_kw = dict(attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)

    def prefill():
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, logits_to_keep=1)

    def train():
        model.train()
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        model.eval()

    tokens, best = {}, {b: dict(generate=float("inf"), prefill=float("inf"), train=float("inf")) for b in BACKENDS}
    warm = {}
    for backend in BACKENDS:  # warm each backend once (flex compiles here), keep its tokens
        model.set_attn_implementation(backend)
        start = time.perf_counter()
        with torch.no_grad():
            tokens[backend] = model.generate(ids, **gen_kw)[:, PROMPT:]
        train()
        prefill()
        warm[backend] = time.perf_counter() - start
        if verbose:
            print(f"{backend}: warm-up {warm[backend]:.1f} s", flush=True)
    for _ in range(rounds):  # interleaved rounds
        for backend in BACKENDS:
            model.set_attn_implementation(backend)
            with torch.no_grad():
                generate_s = wall_us(lambda: model.generate(ids, **gen_kw)) / 1e6
            best[backend]["generate"] = min(best[backend]["generate"], generate_s)
            best[backend]["prefill"] = min(best[backend]["prefill"], wall_us(prefill) / 1e6)
            best[backend]["train"] = min(best[backend]["train"], wall_us(train) / 1e6)
    rows = []
    for backend in BACKENDS:
        same = (tokens[backend] == tokens["sdpa"]).int().cumprod(-1).sum(-1).min().item()
        b = best[backend]
        row = dict(model=f"llama-{params / 1e9:.2f}B", backend=backend, batch=BATCH, prompt=PROMPT, new_tokens=NEW,
                   generate_s=round(b["generate"], 3), generate_tok_s=round(BATCH * NEW / b["generate"], 1),
                   prefill_ms=round(b["prefill"] * 1e3, 1), train_step_ms=round(b["train"] * 1e3, 1),
                   train_tok_s=round(BATCH * PROMPT / b["train"], 0), same_tokens=f"{same}/{NEW}",
                   warmup_s=round(warm[backend], 1))
        rows.append(row)
        if verbose:
            print(row, flush=True)
    return rows


def main(argv=None) -> int:
    a = table_bench_args(argv, __doc__, rep=1, rounds=2)
    if a is None:
        return 2
    rows = [make_row(dtype="bf16", **row) for row in measure(rounds=a.rounds)]
    if not a.no_write:
        print("wrote", write_csv(rows, "bench_hf_models", a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
