"""Sliding-window attention vs transformers fp32: tiny random mistral (window 12 on every layer) and qwen2
(use_sliding_window, window 8 on layers >= max_window_layers=1 of 3), block size 4 so a window spans several
pages, contexts of 40-90 tokens (several windows long). Through the paged harness (decode views and gathers,
chunked prefill over a cached prefix) and through the whole engine (scheduler, odd chunks, prefix-cache hits).

Greedy tokens are compared up to the first near-tie of transformers' logits (top-2 gap under NEAR_TIE):
past it fp32 rounding may pick either token; logits before it within TOL (measured ~1e-6).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from services.engine.model_loader import load_model
from services.text.model.config import SLIDING_ATTENTION
from tests.engine.test_engine_reference import Ref, _engine, _greedy, _hf_logits

pytestmark = pytest.mark.slow

TOL = 1e-4
NEAR_TIE = 1e-3
STEPS = 24
WINDOWS = {"tiny_mistral_window_dir": (12, 12), "tiny_qwen2_window_dir": (0, 8, 8)}


def _upto_tie(ref_logits: torch.Tensor) -> int:
    """Rows of ref_logits [n, vocab] before the first whose top-2 gap is under NEAR_TIE."""
    top = ref_logits.topk(2, dim=-1).values
    ties = ((top[:, 0] - top[:, 1]) < NEAR_TIE).nonzero()
    return int(ties[0]) if len(ties) else ref_logits.shape[0]


def _compare(ours: torch.Tensor, theirs: torch.Tensor, tokens: list[int], what: str) -> int:
    n = _upto_tie(theirs)
    assert n >= 8, f"{what}: near-tie after {n} tokens; pick another prompt"
    diff = (ours[:n] - theirs[:n]).abs().max().item()
    assert diff < TOL, f"{what}: max |logit diff| {diff:.2e} over {n} rows"
    assert tokens[:n] == theirs[:n].argmax(-1).tolist(), what
    return n


@pytest.fixture(scope="module", params=list(WINDOWS))
def window_ref(request: pytest.FixtureRequest) -> Ref:
    transformers = pytest.importorskip("transformers")
    model_dir: Path = request.getfixturevalue(request.param)
    loaded = load_model(str(model_dir), torch.float32, "cpu")
    assert loaded.arch.layer_windows == WINDOWS[request.param]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    assert hf.config.sliding_window == max(WINDOWS[request.param])
    assert hf.config.model_type == "mistral" or SLIDING_ATTENTION in hf.config.layer_types
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, loaded.arch.vocab_size, (n,), generator=g).tolist() for n in (40, 23, 61, 9)]
    return Ref(request.param, loaded, hf, prompts)


@pytest.mark.parametrize("chunk", [None, 5])
def test_harness_greedy_matches_transformers_past_the_window(window_ref: Ref, chunk: int | None,
                                                             greedy: Any) -> None:
    gen, logits = greedy(window_ref.loaded.model, window_ref.prompts, STEPS, chunk=chunk, block_size=4)
    for i, (p, toks, lg) in enumerate(zip(window_ref.prompts, gen, logits, strict=True)):
        theirs = _hf_logits(window_ref.hf, p, toks)
        _compare(lg, theirs, toks, f"{window_ref.name} prompt {i} chunk {chunk}")


def test_harness_single_sequence_decode_reads_views(window_ref: Ref, greedy: Any) -> None:
    """One sequence alone: decode reads its window as a view of consecutive pages (no gather)."""
    p = window_ref.prompts[2]
    gen, logits = greedy(window_ref.loaded.model, [p], STEPS, block_size=4)
    _compare(logits[0], _hf_logits(window_ref.hf, p, gen[0]), gen[0], f"{window_ref.name} alone")


def test_without_the_window_the_tokens_differ(window_ref: Ref, greedy: Any) -> None:
    """The window matters at these lengths: the same weights at full attention give other logits."""
    arch = window_ref.loaded.arch
    model = window_ref.loaded.model
    saved = [(layer.self_attn.window, layer.self_attn._spec) for layer in model.model.layers]
    try:
        for layer in model.model.layers:
            layer.self_attn.window, layer.self_attn._spec = 0, None
        _, full = greedy(model, [window_ref.prompts[2]], 4, block_size=4)
    finally:
        for layer, (w, spec) in zip(model.model.layers, saved, strict=True):
            layer.self_attn.window, layer.self_attn._spec = w, spec
    _, windowed = greedy(model, [window_ref.prompts[2]], 4, block_size=4)
    assert (full[0] - windowed[0]).abs().max().item() > 100 * TOL, arch.layer_windows


@pytest.mark.parametrize(("chunk", "budget"), [(512, 512), (7, 11)])
def test_engine_matches_transformers_past_the_window(window_ref: Ref, chunk: int, budget: int) -> None:
    engine, rec = _engine(window_ref, block_size=4, num_kv_blocks=128, max_prefill_chunk=chunk,
                          max_num_batched_tokens=budget)
    params = [_greedy(STEPS) for _ in window_ref.prompts]
    outs = engine.generate(window_ref.prompts, params)
    for i, (p, sp, out) in enumerate(zip(window_ref.prompts, params, outs, strict=True)):
        _compare(rec.of(sp), _hf_logits(window_ref.hf, p, out), out, f"{window_ref.name} prompt {i}")
    assert engine.block_manager.num_free_blocks == engine.runner.num_blocks


def test_engine_prefix_cache_hit_past_the_window(window_ref: Ref) -> None:
    engine, rec = _engine(window_ref, block_size=4, num_kv_blocks=128, enable_prefix_caching=True)
    first = window_ref.prompts[2]
    engine.generate([first], [_greedy(2)])
    second = first[:50] + window_ref.prompts[1]
    params = _greedy(STEPS)
    engine.add_request("second", second, params, detokenize=False)
    out: list[int] = []
    cached = 0
    while engine.has_work():
        for o in engine.step():
            out += o.new_token_ids
            cached = o.num_cached_tokens
    assert cached == 48
    _compare(rec.of(params), _hf_logits(window_ref.hf, second, out), out, f"{window_ref.name} prefix hit")


def test_layout_fingerprint_names_the_windows(window_ref: Ref) -> None:
    engine, _ = _engine(window_ref, block_size=4, num_kv_blocks=16)
    layout = engine.layout
    assert layout.layer_windows == window_ref.loaded.arch.layer_windows
    assert "windows " in layout.describe()
    full = type(layout).for_model(layout.model_id, layout.num_layers, layout.num_kv_heads, layout.head_dim,
                                  layout.block_size, layout.target_codec)
    assert full.fingerprint != layout.fingerprint

