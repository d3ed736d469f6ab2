"""Our models over the paged-attention contract vs transformers, fp32.

Tolerances (max abs logit difference, fp32 on CPU):
  * GGUF SmolLM2-135M vs transformers' own GGUF loading: GGUF_TOL = 2e-3 (measured ~7e-5 on
    logits of magnitude ~40; both dequantize the same Q4_1/Q8_0 blocks to fp32, differences are
    matmul summation order and fused q/k/v, gate/up projections).
  * tiny random HF checkpoints: TINY_TOL = 1e-4 (measured ~1e-6).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from services.engine.model_loader import load_model
from services.engine.models.rope import compute_inv_freq

pytestmark = pytest.mark.slow

GGUF_TOL = 2e-3
TINY_TOL = 1e-4
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. In a faraway land, there lived a wise old owl who "
    "knew the answer to every question anyone asked, from the smallest mouse to the tallest tree",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Once upon a time",
]


def _ref_logits(ref: Any, prompt: list[int], gen: list[int]) -> torch.Tensor:
    """transformers' logits at the positions that predicted each generated token (teacher-forced)."""
    with torch.no_grad():
        out = ref(torch.tensor([prompt + gen])).logits[0].float()
    return out[len(prompt) - 1:len(prompt) - 1 + len(gen)]


def test_gguf_prefill_and_decode_logits_match_transformers(our_gguf_model: Any, hf_gguf_model: Any,
                                                           greedy: Any) -> None:
    prompt = our_gguf_model.tokenizer.encode(PROMPTS[0])
    assert 30 <= len(prompt) <= 50
    gen, logits = greedy(our_gguf_model.model, [prompt], 20)
    ref = _ref_logits(hf_gguf_model, prompt, gen[0])
    diff = (ref - logits[0]).abs().max().item()
    assert diff < GGUF_TOL, f"max |logit diff| {diff:.2e} over prefill + 20 decode steps"
    assert gen[0] == ref.argmax(-1).tolist()


def test_gguf_greedy_tokens_equal_hf_generate(our_gguf_model: Any, hf_gguf_model: Any, greedy: Any) -> None:
    tok = our_gguf_model.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    # All three in one batch, prefilled in 8-token chunks (exercises the cached-prefix attention path).
    gen, _ = greedy(our_gguf_model.model, prompts, 32, chunk=8)
    for p, g in zip(prompts, gen, strict=True):
        with torch.no_grad():
            ref = hf_gguf_model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                         max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                         pad_token_id=tok.bos_token_id)
        assert g == ref[0, len(p):].tolist(), tok.decode(p)


def test_gguf_chat_answers_paris(our_gguf_model: Any, greedy: Any) -> None:
    tok = our_gguf_model.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]),
                        add_special_tokens=False)
    gen, _ = greedy(our_gguf_model.model, [prompt], 12)
    eos = next((i for i, t in enumerate(gen[0]) if t in tok.eos_token_ids), len(gen[0]))
    assert "Paris" in tok.decode(gen[0][:eos])


@pytest.mark.parametrize("fixture", ["tiny_qwen3_dir", "tiny_qwen2_dir", "tiny_llama3_dir"])
def test_tiny_hf_checkpoint_matches_transformers(fixture: str, request: pytest.FixtureRequest,
                                                 greedy: Any) -> None:
    import transformers

    model_dir: Path = request.getfixturevalue(fixture)
    ours = load_model(str(model_dir), torch.float32, "cpu")
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    assert ours.arch.architecture == ref.config.model_type
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (40, 23)]
    gen, logits = greedy(ours.model, prompts, 20, chunk=16)
    for p, toks, lg in zip(prompts, gen, logits, strict=True):
        r = _ref_logits(ref, p, toks)
        diff = (r - lg).abs().max().item()
        assert diff < TINY_TOL, f"{fixture}: max |logit diff| {diff:.2e}"
        assert toks == r.argmax(-1).tolist()


@pytest.mark.parametrize("scaling", [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
])
def test_inv_freq_equals_transformers(scaling: dict[str, Any] | None) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "default", "rope_theta": 500000.0, **(scaling or {})}
    cfg = LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_parameters=params)
    if scaling is None:
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
        ref, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)
    else:
        ref, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](cfg, "cpu")
    assert torch.equal(compute_inv_freq(128, 500000.0, scaling), ref)


@pytest.mark.parametrize("spec", ["random:tiny-llama", "random:tiny-qwen3"])
def test_random_models_run_and_are_deterministic(spec: str, greedy: Any) -> None:
    a = load_model(spec, torch.float32, "cpu", seed=3)
    b = load_model(spec, torch.float32, "cpu", seed=3)
    prompt = a.tokenizer.encode("hello random world")
    gen_a, lg_a = greedy(a.model, [prompt], 8)
    gen_b, lg_b = greedy(b.model, [prompt], 8)
    assert gen_a == gen_b and torch.equal(lg_a[0], lg_b[0])
    assert torch.isfinite(lg_a[0]).all() and lg_a[0].abs().max() < 30  # sane logits at std 0.02
    assert a.max_model_len == a.arch.max_position_embeddings


def test_bf16_tracks_fp32(tiny_qwen3_dir: Path, greedy: Any) -> None:
    f32 = load_model(str(tiny_qwen3_dir), torch.float32, "cpu")
    bf16 = load_model(str(tiny_qwen3_dir), torch.bfloat16, "cpu")
    assert next(bf16.model.parameters()).dtype == torch.bfloat16
    assert bf16.model.rotary.inv_freq.dtype == torch.float32
    prompt = list(range(10, 50))
    _, l32 = greedy(f32.model, [prompt], 1)
    _, l16 = greedy(bf16.model, [prompt], 1)
    assert l16[0].dtype == torch.float32
    assert (l32[0] - l16[0]).abs().max() < 0.25 * l32[0].abs().max()
