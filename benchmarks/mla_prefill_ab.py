"""Same-process A/B of a latent-attention model's prompt attention forms (--mla-prefill): one whole-prompt prefill
step of a DeepSeek-V2-Lite-wide model cut to 2 layers (16 heads, kv_lora 512, rope 64, nope 128, v 128; small
experts: the attention is what differs), absorbed (every row in the latent space) against expanded (per-head K/V
from the prompt's latents, SDPA), rounds alternating so drift hits both.

    python -m benchmarks.mla_prefill_ab --prompts 512,2048 --dtypes bfloat16,float32 --rounds 3 [--device cuda]
    python -m benchmarks.mla_prefill_ab --prompts 2,16,171,512 --prefix 2048 --dtypes bfloat16
        (chunks after a 2048-token prefix, computed first and not timed; --min-chunk 1, the engine's CPU rule)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from services.engine.cpu.cpu_features import host_cpu
from services.engine.model_loader import load_model
from tests.engine.conftest import PagedHarness
from tests.moe_checkpoints import write_tiny_moe

V2_LITE_ATTENTION = dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512,
                         qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=8,
                         moe_intermediate_size=64, intermediate_size=256, vocab_size=1024,
                         max_position_embeddings=8192, n_group=1, topk_group=1, topk_method="greedy")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", default="512,2048")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--prefix", type=int, default=0, help="cached tokens before the timed chunk (computed untimed)")
    p.add_argument("--min-chunk", type=int, default=1,
                   help="fewest new tokens after a prefix that take the expanded form (the engine's CPU rule: 1; "
                        "0: the multiply-add rule a GPU keeps)")
    a = p.parse_args()
    cpu = host_cpu()
    isa = ", ".join(sorted(f for f in cpu.flags if f.startswith(("avx512", "amx", "avx2"))))
    print(f"CPU {cpu.model} ({cpu.family or 'family unknown'}) [{isa}]; torch threads {torch.get_num_threads()}; "
          f"device {a.device}")
    d = write_tiny_moe(Path(tempfile.mkdtemp()), "deepseek_v2", **V2_LITE_ATTENTION)
    sync = torch.cuda.synchronize if a.device.startswith("cuda") else (lambda: None)
    for name in a.dtypes.split(","):
        m = load_model(str(d), getattr(torch, name), a.device).model
        for n in map(int, a.prompts.split(",")):
            ms: dict[str, list[float]] = {"absorbed": [], "expanded": []}
            for _ in range(a.rounds):
                for form in ms:
                    m.set_prefill_form(form, a.min_chunk or None)
                    h = PagedHarness(m, num_seqs=1, max_len=a.prefix + n + 2, block_size=16)
                    if a.prefix:
                        h.step({0: [(7 * i) % 1000 for i in range(a.prefix)]})
                    sync()
                    t0 = time.perf_counter()
                    h.step({0: [i % 1000 for i in range(n)]})
                    sync()
                    ms[form].append((time.perf_counter() - t0) * 1e3)
            ab, ex = statistics.median(ms["absorbed"]), statistics.median(ms["expanded"])
            what = f"chunk after {a.prefix}" if a.prefix else "prompt"
            print(f"{name:9s} {n:5d}-token {what}: absorbed {ab:8.1f} ms, expanded {ex:8.1f} ms "
                  f"(x{ab / ex:.2f}); rounds {[round(x) for x in ms['absorbed']]} / {[round(x) for x in ms['expanded']]}")


if __name__ == "__main__":
    main()
