"""Paged decode attention alone at TP=1's and one TP=2 rank's shapes of Llama-3-8B (batch 64, 2048-token
contexts, bf16, 16-token blocks): device us per call for several split-K partition lengths, and the KV
bytes it reads per second against a device-to-device copy measured in the same run (the ceiling).
Run from the repo root: python3 docs/reports/h200-2026-12-01e/tp-shard/attn_sweep.py"""

import sys

import torch

sys.path.insert(0, ".")
from kernels.paged_decode_attention import _choose_partition, paged_decode_attention

dev = torch.device("cuda")
B, CTX, BS, HD = 64, 2048, 16, 128


def t_us(fn, iters: int = 50) -> float:
    """Median device us of one fn() call: iters calls captured in a CUDA graph, 7 replays."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters):
            fn()
    ts = []
    for _ in range(7):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) * 1000 / iters)
    return sorted(ts)[len(ts) // 2]


def copy_gbs() -> float:
    """A 2 GiB device-to-device copy, read + write counted (GB/s)."""
    a = torch.empty(2 << 30, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    us = t_us(lambda: b.copy_(a), 5)
    print(f"d2d copy 2 GiB: {us:.0f} us, {2 * a.numel() / us / 1e3:.0f} GB/s (read+write)")
    return 2 * a.numel() / us / 1e3


def sweep(name: str, hq: int, hkv: int, ceiling: float) -> None:
    nblocks = B * CTX // BS
    k = torch.randn(nblocks, BS, hkv, HD, dtype=torch.bfloat16, device=dev)
    v = torch.randn_like(k)
    q = torch.randn(B, hq, HD, dtype=torch.bfloat16, device=dev)
    bt = torch.arange(nblocks, dtype=torch.int32, device=dev).view(B, CTX // BS)
    cl = torch.full((B,), CTX, dtype=torch.int32, device=dev)
    kv_bytes = 2 * k.numel() * 2
    auto = _choose_partition(B, hkv, CTX, 64, dev)
    for part in (None, 2048, 1024, 512, 256, 128):
        us = t_us(lambda p=part: paged_decode_attention(q, k, v, bt, cl, 0.088, max_context_len=CTX, partition_size=p))
        print(f"{name:9s} q{hq} kv{hkv} partition {part or ('auto=' + str(auto)):>10}: {us:7.1f} us, "
              f"KV {kv_bytes / us / 1e3:6.0f} GB/s = {kv_bytes / us / 1e3 / ceiling:.2f}x copy", flush=True)


if __name__ == "__main__":
    ceiling = copy_gbs()
    for name, hq, hkv in (("tp1", 32, 8), ("tp2-rank", 16, 4), ("tp4-rank", 8, 2)):
        sweep(name, hq, hkv, ceiling)
