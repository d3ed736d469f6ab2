"""CPU decode through one torch.compile'd forward (services/engine/compiled_decode.py): the same logits and
the same KV writes as the eager paged path, at batch 1 and at batch 2 with unequal context lengths."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from services.engine.compiled_decode import CompiledDecode
from services.engine.config import EngineConfig, EngineConfigError
from services.engine.engine import LLMEngine
from services.engine.model_loader import load_model
from services.engine.sampling_params import SamplingParams

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


class _Untraceable(CompiledDecode):
    """A forward torch.compile(fullgraph=True) cannot capture (a host sync mid-graph)."""

    def _eager_forward(self, ids: torch.Tensor, pos: torch.Tensor, gather: torch.Tensor, mask: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if ids.sum().item() > 0:
            ids = ids + 0
        return super()._eager_forward(ids, pos, gather, mask)


def test_a_failed_compile_leaves_the_engine_eager(tiny_llama3_dir: Path) -> None:
    model = load_model(str(tiny_llama3_dir), torch.float32).model
    assert not _Untraceable(model, PagedHarness(model, num_seqs=1).kv, max_batch=1).warm_up()


def test_engine_with_compiled_decode_generates_what_the_eager_engine_does(tiny_llama3_dir: Path) -> None:
    """Through LLMEngine: batch 3 (above max_batch: eager) shrinking to 2 and 1 (compiled) as requests end."""
    cfg = dict(model=str(tiny_llama3_dir), dtype="float32", num_kv_blocks=32, enable_prefix_caching=False)
    prompts = [list(range(5, 12)), list(range(30, 52)), list(range(90, 93))]
    lens = [6, 14, 20]
    eager = LLMEngine(EngineConfig(**cfg))
    compiled = LLMEngine(EngineConfig(**cfg, cpu_compile_decode=2))
    cd = compiled.runner.compiled_decode
    assert eager.runner.compiled_decode is None and cd is not None
    steps: list[int] = []
    compiled_step = cd.step
    cd.step = lambda chunks: steps.append(len(chunks)) or compiled_step(chunks)  # type: ignore[method-assign]
    want, got = {}, {}
    for eng, out in ((eager, want), (compiled, got)):
        for i, (p, n) in enumerate(zip(prompts, lens, strict=True)):
            eng.add_request(f"r{i}", p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=True),
                            detokenize=False)
        out.update({f"r{i}": ([], []) for i in range(3)})
        while eng.has_work():
            for o in eng.step():
                out[o.request_id][0].extend(o.new_token_ids)
                out[o.request_id][1].extend(o.new_logprobs)
    assert set(steps) == {1, 2}  # the compiled path ran at both batch sizes, batch 3 stayed eager
    for rid, (tokens, lps) in want.items():
        assert got[rid][0] == tokens
        assert got[rid][1] == pytest.approx(lps, abs=1e-4)
