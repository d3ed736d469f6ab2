"""CPU C kernels against torch's ops, same process, alternating rounds (services/engine/cpu/native*.py): the decode
step with the C decode attention vs torch's paged path, a prompt's prefill with the C RMSNorm / SiLU*mul / RoPE vs
torch's ops, and each op alone. Medians of the rounds; the CPU model, flags and load are printed beside them.

    python -m benchmarks.cpu_native_ab [--batches 4,16,32] [--context 550] [--prompt 512] [--rounds 6]
"""

from __future__ import annotations

import os
import random
import statistics
import time

from services.common.cli_args import ArgParser


def _engine(**kw):
    from services.engine.config import EngineConfig
    from services.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(cpu_compile_decode=0, **kw))


def decode_ab(batch: int, context: int, rounds: int) -> dict[str, float]:
    """ms per decode step of ``batch`` sequences at ~``context`` tokens: C attention vs torch's."""
    from services.text.sampling_params import SamplingParams

    eng = _engine(max_num_batched_tokens=max(2048, batch * context))
    rng = random.Random(0)
    params = SamplingParams(max_tokens=10 * rounds + 20, temperature=0, ignore_eos=True)
    for i in range(batch):
        eng.add_request(f"r{i}", [rng.randrange(100, eng.vocab_size - 100) for _ in range(context)], params,
                        detokenize=False)
    while eng.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running):
        eng.step()
    backend = eng.runner.attn_backend
    kernels = backend.native
    out: dict[str, list[float]] = {"C attention": [], "torch attention": []}
    for _ in range(rounds):
        for name, k in (("C attention", kernels), ("torch attention", None)):
            backend.native = k
            eng.step()
            t0 = time.perf_counter()
            for _ in range(5):
                eng.step()
            out[name].append((time.perf_counter() - t0) / 5 * 1000)
    backend.native = kernels
    return {k: statistics.median(v) for k, v in out.items()}


def prefill_ab(prompt: int, threads: int, rounds: int) -> dict[str, float]:
    """ms of one ``prompt``-token prefill: C layer ops vs torch's."""
    from services.engine.cpu import native
    from services.text.sampling_params import SamplingParams

    eng = _engine(cpu_threads=threads, enable_prefix_caching=False, max_prefill_chunk=max(prompt, 512))
    kernels = native.ACTIVE
    rng = random.Random(1)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    def one() -> float:
        eng.add_request(f"p{rng.random()}", [rng.randrange(100, eng.vocab_size - 100) for _ in range(prompt)],
                        params, detokenize=False)
        t0 = time.perf_counter()
        while eng.has_work():
            eng.step()
        return (time.perf_counter() - t0) * 1000

    one()
    out: dict[str, list[float]] = {"C ops": [], "torch ops": []}
    for _ in range(rounds):
        for name, k in (("C ops", kernels), ("torch ops", None)):
            native.activate(k)
            out[name].append(one())
    native.activate(kernels)
    return {k: statistics.median(v) for k, v in out.items()}


def ops_ab(rounds: int) -> dict[str, tuple[float, float]]:
    """us per call at 1 thread, [512 x 576] / [512 x 3072] bf16: (C, torch) for RMSNorm, SiLU*mul, RoPE, each the
    model's own module run with the kernels active and then without them."""
    import torch

    from services.engine.cpu import native
    from services.engine.models.llama import MLP, RMSNorm
    from services.engine.models.rope import RotaryEmbedding

    k = native.load()
    if k is None:
        return {}
    torch.set_num_threads(1)
    norm = RMSNorm(576, 1e-5).bfloat16()
    mlp = MLP(576, 1536).bfloat16()
    rot = RotaryEmbedding(64, 10000.0, None, 4096)
    x = torch.randn(512, 576).bfloat16()
    gu = torch.randn(512, 3072).bfloat16()
    qkv = torch.randn(512, 960).bfloat16()
    q, kk = qkv[:, :576].view(512, 9, 64), qkv[:, 576:768].view(512, 3, 64)
    pos = torch.arange(512)
    mlp.gate_up_proj, mlp.down_proj = torch.nn.Identity(), torch.nn.Identity()  # its SiLU*mul step alone
    ops = {"RMSNorm": lambda: norm(x), "SiLU*mul": lambda: mlp(gu), "RoPE": lambda: rot(pos, q, kk)}

    def us(f) -> float:
        f()
        t0 = time.perf_counter()
        for _ in range(20):
            f()
        return (time.perf_counter() - t0) / 20 * 1e6

    def timed(f, kernels) -> float:
        native.activate(kernels)
        try:
            return us(f)
        finally:
            native.activate(k)

    with torch.inference_mode():
        return {name: (statistics.median(timed(f, k) for _ in range(rounds)),
                       statistics.median(timed(f, None) for _ in range(rounds))) for name, f in ops.items()}


def main() -> None:
    p = ArgParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="4,16,32")
    p.add_argument("--context", type=int, default=550)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--rounds", type=int, default=6)
    a = p.parse_args()
    from services.engine.cpu.cpu_features import host_cpu

    cpu = host_cpu()
    flags = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in cpu.flags)
    print(f"CPU {cpu.model} [{flags}], {len(cpu.cpus)} CPUs, load {os.getloadavg()[0]:.2f}")
    for b in (int(x) for x in a.batches.split(",")):
        r = decode_ab(b, a.context, a.rounds)
        print(f"decode step, {b} sequences at ~{a.context} tokens: " + ", ".join(f"{k} {v:.1f} ms" for k, v in r.items()))
    for th in (2, 1):
        r = prefill_ab(a.prompt, th, a.rounds)
        print(f"prefill of {a.prompt} tokens at {th} threads: " + ", ".join(f"{k} {v:.1f} ms" for k, v in r.items()))
    for name, (c, t) in ops_ab(a.rounds).items():
        print(f"{name} at 1 thread: C {c:.0f} us, torch {t:.0f} us")
    print(f"load {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
