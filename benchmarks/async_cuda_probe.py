"""Async scheduling on CUDA against synchronous steps, one variant per process (a device-side assert poisons
the CUDA context): eager or CUDA-graph decode steps, greedy or mixed sampling, logprobs.

python3 -m benchmarks.async_cuda_probe VARIANT   (VARIANT: eager-greedy, graphs-greedy, eager-mixed,
graphs-mixed, graphs-greedy-lp); prints RESULT with the number of token-identical requests, or the traceback.
The engine refuses async_scheduling=on on CUDA until this passes; the probe sets it past that check."""

from __future__ import annotations

import sys
import traceback

import torch

from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.model_loader import load_model
from services.text.sampling_params import SamplingParams

SPEC = "random:smollm2-135m"


def run(variant: str, mode: str) -> dict[str, list[int]]:
    graphs = variant.startswith("graphs")
    cfg = EngineConfig(model=SPEC, dtype="bfloat16", device="cuda", num_kv_blocks=256, max_num_seqs=8,
                       max_model_len=512, max_num_batched_tokens=128, max_prefill_chunk=32, async_scheduling="off",
                       cuda_graphs=graphs)
    if mode == "on":
        object.__setattr__(cfg, "async_scheduling", "on")
    loaded = load_model(SPEC, torch.bfloat16, "cuda")
    engine = LLMEngine(cfg, loaded=loaded)
    assert engine.async_steps == (mode == "on"), engine.async_steps
    g = torch.Generator().manual_seed(1)
    vocab = engine.vocab_size
    mixed = "mixed" in variant
    lp = variant.endswith("-lp")
    for i, n in enumerate((7, 40, 90, 15, 64, 3, 33, 21, 50, 11)):
        sp = SamplingParams(max_tokens=6 + 3 * i, temperature=0.8 if (mixed and i % 3 == 0) else 0.0, seed=i,
                            ignore_eos=True, logprobs=lp, top_logprobs=2 if lp else 0)
        engine.add_request(f"r{i}", torch.randint(0, vocab, (n,), generator=g).tolist(), sp, detokenize=False)
    out: dict[str, list[int]] = {}
    steps = 0
    while engine.has_work():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        steps += 1
        torch.cuda.synchronize()
    print(f"{variant} {mode}: {steps} steps, free blocks {engine.block_manager.num_free_blocks}", flush=True)
    return out


def main() -> None:
    variant = sys.argv[1]
    try:
        a = run(variant, "off")
        b = run(variant, "on")
        same = sum(a[k] == b.get(k) for k in a)
        print(f"RESULT {variant}: OK, {same}/{len(a)} requests token-identical", flush=True)
    except Exception:
        traceback.print_exc()
        print(f"RESULT {variant}: FAILED", flush=True)


if __name__ == "__main__":
    main()
