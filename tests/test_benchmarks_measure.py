"""CPU tests of benchmarks/measure.py: FLOP and byte models, the read-bandwidth probe, and the no-GPU errors."""

import pytest
import torch

from benchmarks import measure
from tritonattn.testing import causal_mask


def _brute_pairs(seqlen_q: int, seqlen_k: int) -> int:
    return int(causal_mask(seqlen_q, seqlen_k).sum().item())


def test_flops_noncausal_exact():
    """Non-causal forward FLOPs are exactly 4*B*H*M*N*D, x2.5 backward, x3.5 fwd+bwd."""
    b, h, m, n, d = 2, 8, 1024, 1024, 128
    fwd = 4 * b * h * m * n * d
    assert measure.attention_flops(b, h, m, n, d, causal=False) == fwd
    assert measure.attention_flops(b, h, m, n, d, causal=False, mode="bwd") == 2.5 * fwd
    assert measure.attention_flops(b, h, m, n, d, causal=False, mode="fwd_bwd") == 3.5 * fwd
    assert measure.attention_flops(b, h, 17, 113, d, causal=False) == 4 * b * h * 17 * 113 * d


@pytest.mark.parametrize("seqlen", [1, 17, 128, 1023])
def test_flops_causal_square_is_half(seqlen):
    """Causal M == N is half the non-causal count: the brute-force pairs minus the diagonal's half."""
    b, h, d = 3, 4, 64
    flops = measure.attention_flops(b, h, seqlen, seqlen, d, causal=True)
    assert flops == measure.attention_flops(b, h, seqlen, seqlen, d, causal=False) / 2
    assert flops == 4 * b * h * d * (_brute_pairs(seqlen, seqlen) - seqlen / 2)


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(113, 17), (1023, 1), (300, 299), (17, 113), (1, 1023), (64, 65)])
def test_flops_causal_rectangular_counts_pairs(seqlen_q, seqlen_k):
    """Causal M != N counts exactly the (i, j) pairs the bottom-right causal mask lets through."""
    b, h, d = 2, 3, 32
    pairs = _brute_pairs(seqlen_q, seqlen_k)
    assert measure.causal_pairs(seqlen_q, seqlen_k) == pairs
    assert measure.attention_flops(b, h, seqlen_q, seqlen_k, d, causal=True) == 4 * b * h * d * pairs
    assert measure.attention_flops(b, h, seqlen_q, seqlen_k, d, causal=True, mode="bwd") == 2.5 * 4 * b * h * d * pairs


def test_flops_rejects_bad_input():
    """An unknown mode or a negative size is a ValueError."""
    with pytest.raises(ValueError, match="mode"):
        measure.attention_flops(1, 1, 16, 16, 64, causal=False, mode="backward")
    with pytest.raises(ValueError, match="seqlen_q"):
        measure.attention_flops(1, 1, -1, 16, 64, causal=False)


def test_decode_kv_bytes():
    """Decode reads K and V: 2 * tokens * nheads_k * head_dim * itemsize, tokens summed over the batch."""
    assert measure.decode_kv_bytes(4096, 8, 128, torch.float16) == 2 * 4096 * 8 * 128 * 2
    assert measure.decode_kv_bytes(1000, 1, 64, torch.float32) == 2 * 1000 * 64 * 4
    lens = torch.tensor([100, 1, 4000], dtype=torch.int32)
    assert measure.decode_kv_bytes(lens, 2, 128, torch.bfloat16) == 2 * 4101 * 2 * 128 * 2
    assert measure.decode_kv_bytes([100, 1, 4000], 2, 128, torch.bfloat16) == 2 * 4101 * 2 * 128 * 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without a GPU")
def test_timing_raises_without_gpu():
    """Timing without a CUDA GPU raises a RuntimeError that says a GPU is needed."""
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        measure.time_fn(lambda: None)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        measure.time_cuda_graph(lambda: None)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        measure.peak_memory_delta(lambda: None)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        measure.ceilings()
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        measure.time_fn(lambda: None, flush_l2=True)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        measure.host_overhead_us(lambda: None)


def test_stream_read_sums_every_element(device):
    """The read-only bandwidth probe reads each element once: its partial sums add up to x.sum()."""
    block, iters = 128, 4
    x = torch.randn(block * iters + 100, device=device, dtype=torch.float32)  # two programs, the second one masked
    partial = measure.stream_read(x, block=block, iters=iters)
    assert partial.shape == (2,)
    torch.testing.assert_close(partial.sum(), x.sum(), rtol=1e-5, atol=1e-3)
    with pytest.raises(ValueError, match="contiguous"):
        measure.stream_read(x.view(2, -1)[:, :10])


@pytest.mark.gpu
def test_hide_host_times_the_gpu_work_alone():
    """time_fn(hide_host=True) excludes a call's host work: 200 us of Python before a tiny kernel is
    timed without it (the GPU idles between the events) and not with it."""
    import time

    x = torch.zeros(1024, device="cuda")

    def slow_host_call():
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 200e-6:
            pass
        x.add_(1)

    assert measure.time_fn(slow_host_call, warmup=2, rep=20)["median_ms"] > 0.15
    assert measure.time_fn(slow_host_call, warmup=2, rep=20, hide_host=True)["median_ms"] < 0.1


def test_first_graph_timing_of_a_process_is_dropped(monkeypatch):
    """time_cuda_graph measures the process's first graph twice and keeps the second (the first read
    fast on an H200); later calls measure once. The measurement itself is faked: no GPU needed."""
    calls = []

    def fake_median(fn, rep, repeat):
        calls.append((rep, repeat))
        return 10.0 * len(calls)  # ms per replay: the first measurement 10, the second 20, ...

    monkeypatch.setattr(measure, "require_gpu", lambda what: None)
    monkeypatch.setattr(measure, "graph_median_ms", fake_median)
    monkeypatch.setattr(measure, "GRAPH_TIMED", False)
    assert measure.time_cuda_graph(lambda: None, rep=7, repeat=2) == 10.0  # 20 ms per replay / 2 calls
    assert calls == [(7, 2), (7, 2)]
    assert measure.time_cuda_graph(lambda: None, rep=5, repeat=1) == 30.0
    assert calls == [(7, 2), (7, 2), (5, 1)]


def test_best_medians_interleaves_rounds_and_sums_a_keys_calls():
    """Every key is timed once per round, in order, with the L2 flushed and the host hidden; a key's value is
    the least over rounds of its calls' medians summed."""
    medians = {"a": [3.0, 1.0], "b1": [2.0, 4.0], "b2": [0.5, 0.25]}
    seen = []

    def timer(fn, *, rep, flush_l2, hide_host):
        assert (rep, flush_l2, hide_host) == (7, True, True)
        seen.append(fn.__name__)
        return {"median_ms": medians[fn.__name__].pop(0)}

    def a(): ...
    def b1(): ...
    def b2(): ...

    best = measure.best_medians({"A": a, "B": [b1, b2]}, rounds=2, rep=7, timer=timer)
    assert seen == ["a", "b1", "b2", "a", "b1", "b2"]
    assert best == {"A": 1.0, "B": 2.5}
