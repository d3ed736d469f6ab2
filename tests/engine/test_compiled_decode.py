"""CPU decode through one torch.compile'd forward (services/engine/compiled_decode.py): the same logits and
the same KV writes as the eager paged path, at batch 1 and at batch 2 with unequal context lengths."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from services.engine.compiled_decode import CompiledDecode
from services.engine.config import EngineConfig, EngineConfigError
from services.engine.model_loader import load_model

from .conftest import PagedHarness

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("gcc") is None,
                                reason="inductor's CPU backend needs a C++ compiler")


@torch.inference_mode()
def test_compiled_decode_matches_the_eager_paged_path(tiny_llama3_dir: Path) -> None:
    model = load_model(str(tiny_llama3_dir), torch.float32).model
    h = PagedHarness(model, num_seqs=2, max_len=64)
    prompts = {0: list(range(3, 8)), 1: list(range(40, 61))}  # 5 and 21 tokens: unequal pages, padding masked
    last = h.step(prompts)
    kv = h.kv.clone()
    compiled = CompiledDecode(model, kv, max_batch=2)
    compiled.warm_up()
    for step in range(24):
        seqs = [0] if step % 3 == 2 else [0, 1]  # batch 1 and batch 2 steps
        tokens = {s: int(last[s].argmax()) for s in seqs}
        rows = [(tokens[s], h.lens[s], h.block_table(s)) for s in seqs]
        got = compiled.forward(rows)
        last.update(h.step({s: [tokens[s]] for s in seqs}))
        for i, s in enumerate(seqs):
            torch.testing.assert_close(got[i], last[s], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kv, h.kv, rtol=1e-5, atol=1e-5)  # the same K/V stored in the same slots


@torch.inference_mode()
def test_compiled_decode_takes_only_small_pure_decode_steps(tiny_llama3_dir: Path) -> None:
    model = load_model(str(tiny_llama3_dir), torch.float32).model
    compiled = CompiledDecode(model, PagedHarness(model, num_seqs=1).kv, max_batch=2)

    class _Chunk:
        def __init__(self, n: int) -> None:
            self.num_new_tokens, self.spec_tokens = n, 0

    assert compiled.accepts([_Chunk(1), _Chunk(1)])
    assert not compiled.accepts([_Chunk(1)] * 3)  # above max_batch: eager
    assert not compiled.accepts([_Chunk(1), _Chunk(4)])  # a prefill chunk in the step: eager
    assert not compiled.accepts([])


def test_setting_is_bounded() -> None:
    assert EngineConfig().cpu_compile_decode == 0  # eager unless asked for
    with pytest.raises(EngineConfigError):
        EngineConfig(cpu_compile_decode=9)
