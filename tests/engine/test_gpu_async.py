"""Async scheduling on the GPU (decode CUDA graphs, eager mixed steps) against synchronous steps: the same
tokens, except where bf16 rounding flips a near-tie (the two most likely tokens within 0.05 in logprob),
after which the runs may differ. Skips cleanly without CUDA."""

from __future__ import annotations

import pytest
import torch

from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.model_loader import load_model
from services.engine.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SPEC = "random:smollm2-135m"


def _run(mode: str) -> tuple[LLMEngine, dict[str, list]]:
    cfg = EngineConfig(model=SPEC, dtype="bfloat16", device="cuda", num_kv_blocks=256, max_num_seqs=8,
                       max_model_len=512, max_num_batched_tokens=128, max_prefill_chunk=32, async_scheduling=mode)
    engine = LLMEngine(cfg, loaded=load_model(SPEC, torch.bfloat16, "cuda"))
    g = torch.Generator().manual_seed(1)
    vocab = engine.vocab_size
    for i, n in enumerate((7, 40, 90, 15, 64, 3, 33, 21, 50, 11)):
        sp = SamplingParams(max_tokens=6 + 3 * i, temperature=0.0 if i % 3 else 0.8, seed=i, ignore_eos=True,
                            logprobs=True, top_logprobs=2)
        engine.add_request(f"r{i}", torch.randint(0, vocab, (n,), generator=g).tolist(), sp, detokenize=False)
    out: dict[str, list] = {}
    while engine.has_work():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(zip(o.new_token_ids, o.new_top_logprobs, strict=True))
    return engine, out


def test_async_matches_sync_on_gpu() -> None:
    sync, a = _run("off")
    asyn, b = _run("on")
    assert asyn.async_steps and not sync.async_steps and asyn.runner.graphs is not None
    assert a.keys() == b.keys() and all(len(a[k]) == len(b[k]) for k in a)
    for rid in a:
        for (ta, top), (tb, _) in zip(a[rid], b[rid], strict=True):
            if ta != tb:
                assert top.logprobs[0] - top.logprobs[1] < 0.05, f"{rid}: tokens differ away from a near-tie"
                break
    assert asyn.block_manager.num_free_blocks == 256
