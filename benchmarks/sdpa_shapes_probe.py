"""What a new prompt length costs the fresh-prompt SDPA route on a GPU: the first call at each of N distinct
lengths, each prompt at its own length against each padded to its `sdpa_bucket` (separate length ranges, so neither
reuses the other's cuDNN graphs), then the same calls again (cached), and the largest difference between the two
forms' real rows. Llama-3-8B heads (32 / 8 of 128), bf16.

    python3 benchmarks/sdpa_shapes_probe.py --lengths 8
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    import torch

    from services.engine.cuda.gpu_attention import fresh_prompt_attention, sdpa_bucket

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, default=8, help="distinct prompt lengths per form")
    p.add_argument("--start", type=int, default=1000)
    a = p.parse_args()
    heads, kv_heads, dim, dev = 32, 8, 128, torch.device("cuda")

    def call(n: int, bucket) -> tuple[float, torch.Tensor]:
        g = torch.Generator(device=dev).manual_seed(n)
        q = torch.randn(n, heads, dim, device=dev, dtype=torch.bfloat16, generator=g)
        k = torch.randn(n, kv_heads, dim, device=dev, dtype=torch.bfloat16, generator=g)
        v = torch.randn(n, kv_heads, dim, device=dev, dtype=torch.bfloat16, generator=g)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fresh_prompt_attention(q, k, v, [n], dim**-0.5, bucket=bucket)
        torch.cuda.synchronize()
        return 1e3 * (time.perf_counter() - t0), out

    call(a.start - 7, lambda n: n)  # the library's own first call, outside both
    own = [a.start + i for i in range(a.lengths)]
    padded = [a.start + a.lengths + i for i in range(a.lengths)]
    for name, lens, bucket in (("own length", own, lambda n: n), ("padded", padded, sdpa_bucket)):
        first = [call(n, bucket)[0] for n in lens]
        again = [call(n, bucket)[0] for n in lens]
        print(f"{name:10s} lengths {lens[0]}-{lens[-1]} (runs at {sorted({bucket(n) for n in lens})}): first calls "
              f"{[round(x, 1) for x in first]} ms (sum {sum(first):.0f}), again {[round(x, 2) for x in again]} ms")
    worst = max((call(n, sdpa_bucket)[1].float() - call(n, lambda m: m)[1].float()).abs().max().item() for n in own)
    print(f"largest |padded - own length| over the real rows: {worst:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
