"""Paged decode attention alone at TP=1's and one TP=2 rank's shapes of Llama-3-8B (batch 64, 2048-token
contexts, bf16, 16-token blocks): device us per call for several split-K partition lengths, and the KV
bytes it reads per second against a device-to-device copy measured in the same run (the ceiling)."""
import sys, torch
sys.path.insert(0, ".")
from kernels.paged_decode_attention import paged_decode_attention, _choose_partition

dev = torch.device("cuda")
B, CTX, BS, HD = 64, 2048, 16, 128


def t_us(fn, iters=50):
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
        s.record(); g.replay(); e.record(); torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) * 1000 / iters)
    return sorted(ts)[len(ts) // 2]


a = torch.empty(2 << 30, dtype=torch.uint8, device=dev)
b = torch.empty_like(a)
copy_us = t_us(lambda: b.copy_(a), 5)
copy_gbs = 2 * a.numel() / copy_us / 1e3  # read + write
print(f"d2d copy 2 GiB: {copy_us:.0f} us, {copy_gbs:.0f} GB/s (read+write)")
del a, b
for name, hq, hkv in (("tp1", 32, 8), ("tp2-rank", 16, 4), ("tp4-rank", 8, 2)):
    nblocks = B * CTX // BS
    k = torch.randn(nblocks, BS, hkv, HD, dtype=torch.bfloat16, device=dev)
    v = torch.randn_like(k)
    q = torch.randn(B, hq, HD, dtype=torch.bfloat16, device=dev)
    bt = torch.arange(nblocks, dtype=torch.int32, device=dev).view(B, CTX // BS)
    cl = torch.full((B,), CTX, dtype=torch.int32, device=dev)
    kv_bytes = 2 * k.numel() * 2
    auto = _choose_partition(B, hkv, CTX, 64, dev)
    for part in (None, 2048, 1024, 512, 256, 128):
        us = t_us(lambda: paged_decode_attention(q, k, v, bt, cl, 0.088, max_context_len=CTX, partition_size=part))
        print(f"{name:9s} q{hq} kv{hkv} partition {part or ('auto=' + str(auto)):>10}: {us:7.1f} us, "
              f"KV {kv_bytes / us / 1e3:6.0f} GB/s = {kv_bytes / us / 1e3 / (copy_gbs):.2f}x copy", flush=True)
    del k, v
