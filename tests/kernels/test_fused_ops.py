"""Fused elementwise kernels (residual-add + RMSNorm, SiLU*mul, in-place RoPE) against their references."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.kernel_cases import assert_close, requires_cuda

pytest.importorskip("triton")

from services.engine.models.rope import RotaryEmbedding
from services.kernels.activation import silu_and_mul
from services.kernels.reference import (
    ref_apply_rotary_,
    ref_fused_add_rms_norm,
    ref_rms_norm,
    ref_silu_and_mul,
)
from services.kernels.rms_norm import fused_add_rms_norm, rms_norm
from services.kernels.rotary import apply_rotary_

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _randn(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype).to(device)


def _check_norm(device: torch.device, dtype: torch.dtype, t: int, n: int) -> None:
    x = _randn((t, n), dtype, device, 0)
    res = _randn((t, n), dtype, device, 1) * 4
    w = (1 + 0.1 * _randn((n,), torch.float32, device, 2)).to(dtype)
    assert_close(rms_norm(x, w, 1e-6), ref_rms_norm(x, w, 1e-6), dtype)
    out, new_res = fused_add_rms_norm(x, res, w, 1e-5)
    ref_out, ref_res = ref_fused_add_rms_norm(x, res, w, 1e-5)
    if device.type == "cuda" or dtype != torch.bfloat16:  # the interpreter truncates fp32 -> bf16
        assert torch.equal(new_res, ref_res), "the residual sum is one rounding of x + residual"
    assert_close(new_res, ref_res, dtype)
    assert_close(out, ref_out, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("t", "n"), [(1, 64), (5, 96), (3, 200)])
def test_rms_norm_matches_reference(device: torch.device, dtype: torch.dtype, t: int, n: int) -> None:
    _check_norm(device, dtype, t, n)


def test_rms_norm_strided_rows_and_empty(device: torch.device) -> None:
    base = _randn((4, 160), torch.float32, device, 3)
    x = base[:, :96]  # row stride 160
    w = torch.ones(96, device=device)
    assert_close(rms_norm(x, w, 1e-6), ref_rms_norm(x, w, 1e-6), torch.float32)
    assert rms_norm(x[:0], w, 1e-6).shape == (0, 96)


def test_rms_norm_rejects_mixed_dtypes(device: torch.device) -> None:
    with pytest.raises(AssertionError):
        rms_norm(torch.ones(2, 8, device=device, dtype=torch.float16), torch.ones(8, device=device), 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("t", "n"), [(1, 32), (7, 100), (2, 1500)])
def test_silu_and_mul_matches_reference(device: torch.device, dtype: torch.dtype, t: int, n: int) -> None:
    x = _randn((t, 2 * n), dtype, device, 4) * 3
    assert_close(silu_and_mul(x), ref_silu_and_mul(x), dtype)


def _check_rotary(device: torch.device, dtype: torch.dtype, t: int, hq: int, hk: int, d: int,
                  max_pos: int) -> None:
    rope = RotaryEmbedding(d, 10000.0, None, max_pos).to(device)
    # q/k as strided views of a fused qkv projection, the way the model produces them.
    qkv = _randn((t, (hq + 2 * hk) * d), dtype, device, 5)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    v_before = qkv[:, (hq + hk) * d :].clone()
    gen = torch.Generator().manual_seed(6)
    pos = torch.randint(0, max_pos, (t,), generator=gen).to(device)
    q_ref, k_ref = q.clone(), k.clone()
    ref_apply_rotary_(q_ref, k_ref, pos, rope.cos_cache, rope.sin_cache)
    apply_rotary_(q, k, pos, rope.cos_cache, rope.sin_cache)
    assert_close(q, q_ref, dtype)
    assert_close(k, k_ref, dtype)
    assert torch.equal(qkv[:, (hq + hk) * d :], v_before), "v must be untouched"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("t", "hq", "hk", "d"), [(1, 1, 1, 16), (6, 4, 2, 64), (3, 3, 1, 48)])
def test_rotary_matches_reference(device: torch.device, dtype: torch.dtype, t: int, hq: int, hk: int,
                                  d: int) -> None:
    _check_rotary(device, dtype, t, hq, hk, d, max_pos=64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("t", "hq", "hk", "d"), [(1, 2, 1, 16), (6, 4, 2, 64), (3, 3, 1, 48)])
def test_rotary_after_per_head_norms_matches_the_model_ops(device: torch.device, dtype: torch.dtype, t: int, hq: int,
                                                         hk: int, d: int) -> None:
    """Qwen3's q_norm / k_norm then RoPE in one launch equal the model's RMSNorm modules then the RoPE reference,
    on strided views of a qkv projection; v untouched."""
    from services.engine.models.llama import RMSNorm

    rope = RotaryEmbedding(d, 10000.0, None, 64).to(device)
    qkv = _randn((t, (hq + 2 * hk) * d), dtype, device, 11) * 3
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    v_before = qkv[:, (hq + hk) * d :].clone()
    norms = []
    for seed, eps in ((12, 1e-6), (13, 1e-5)):
        m = RMSNorm(d, eps).to(device)
        m.weight.data = (1 + 0.5 * _randn((d,), torch.float32, device, seed)).to(dtype)
        norms.append(m)
    pos = torch.randint(0, 64, (t,), generator=torch.Generator().manual_seed(14)).to(device)
    with torch.no_grad():
        q_ref, k_ref = norms[0](q.clone()), norms[1](k.clone())
    ref_apply_rotary_(q_ref, k_ref, pos, rope.cos_cache, rope.sin_cache)
    apply_rotary_(q, k, pos, rope.cos_cache, rope.sin_cache, q_norm=(norms[0].weight.data, norms[0].eps),
                  k_norm=(norms[1].weight.data, norms[1].eps))
    assert_close(q, q_ref, dtype)
    assert_close(k, k_ref, dtype)
    assert torch.equal(qkv[:, (hq + hk) * d :], v_before), "v must be untouched"
    with pytest.raises(AssertionError, match="come together"):
        apply_rotary_(q, k, pos, rope.cos_cache, rope.sin_cache, q_norm=(norms[0].weight.data, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("t", "hq", "hk", "d", "norm"), [(1, 2, 1, 16, False), (6, 4, 2, 64, True), (5, 3, 3, 48, False)])
def test_rotary_with_store_equals_rotary_then_store_kv(device: torch.device, dtype: torch.dtype, t: int, hq: int,
                                                       hk: int, d: int, norm: bool) -> None:
    """The store folded into the RoPE launch writes the caches exactly as RoPE then ``store_kv`` do (rotated k, v
    as given, slot -1 skipped, other slots untouched), and q/k come out the same."""
    from services.kernels.store_kv import store_kv

    rope = RotaryEmbedding(d, 10000.0, None, 64).to(device)
    qkv = _randn((t, (hq + 2 * hk) * d), dtype, device, 21)
    blocks, bs = 4, 4
    pos = torch.randint(0, 64, (t,), generator=torch.Generator().manual_seed(22)).to(device)
    slots = torch.randperm(blocks * bs, generator=torch.Generator().manual_seed(23))[:t].to(device)
    if t > 1:
        slots[t // 2] = -1
    norms = {}
    if norm:
        w = (1 + 0.5 * _randn((d,), torch.float32, device, 24)).to(dtype)
        norms = {"q_norm": (w, 1e-6), "k_norm": (w.flip(0).contiguous(), 1e-5)}
    outs = []
    for fused in (False, True):
        x = qkv.clone()
        q = x[:, : hq * d].view(t, hq, d)
        k = x[:, hq * d : (hq + hk) * d].view(t, hk, d)
        v = x[:, (hq + hk) * d :].view(t, hk, d)
        kc = _randn((blocks, bs, hk, d), dtype, device, 25)
        vc = _randn((blocks, bs, hk, d), dtype, device, 26)
        if fused:
            apply_rotary_(q, k, pos, rope.cos_cache, rope.sin_cache, **norms, store=(v, kc, vc, slots))
        else:
            apply_rotary_(q, k, pos, rope.cos_cache, rope.sin_cache, **norms)
            store_kv(k, v, kc, vc, slots)
        outs.append((x, kc, vc))
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(outs[1][1], _randn((blocks, bs, hk, d), dtype, device, 25)), "k was stored"


def test_rotary_matches_module_forward(device: torch.device) -> None:
    """The kernel agrees with `RotaryEmbedding.forward` (the CPU engine path) in fp32."""
    t, hq, hk, d = 5, 4, 2, 32
    rope = RotaryEmbedding(d, 500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
                           128).to(device)
    q = _randn((t, hq, d), torch.float32, device, 7)
    k = _randn((t, hk, d), torch.float32, device, 8)
    pos = torch.tensor([0, 3, 17, 64, 127], device=device)
    q_ref, k_ref = rope(pos, q, k)
    apply_rotary_(q, k, pos, rope.cos_cache, rope.sin_cache)
    assert_close(q, q_ref, torch.float32)
    assert_close(k, k_ref, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleave", [True, False])
def test_rotary_out_matches_the_latent_rotary(device: torch.device, dtype: torch.dtype, interleave: bool) -> None:
    """`rotary_out` (MLA's CUDA path) gives what `LatentRotary` (the CPU engine path) gives, DeepSeek's interleaved
    pairs de-interleaved and rotate_half pairs, with YaRN's cos/sin factor, on strided views of the q and
    kv_a projections' outputs (q_pe after the nope part of each head, k_pe after the latent); the inputs are
    untouched. The torch form rounds each op to bf16 / fp16, the kernel once from fp32."""
    from services.engine.models.deepseek import LatentRotary
    from services.kernels.rotary import rotary_out

    t, h, nope, r, lora = 5, 4, 24, 16, 40
    rope = RotaryEmbedding(r, 10000.0, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.0},
                           128).to(device)
    rotary = LatentRotary(rope, interleave)
    query = _randn((t, h * (nope + r)), dtype, device, 30)
    kv_a = _randn((t, lora + r), dtype, device, 31)
    q_pe = query.view(t, h, nope + r)[..., nope:]
    k_pe = kv_a[:, lora:].view(t, 1, r)
    before = (query.clone(), kv_a.clone())
    pos = torch.tensor([0, 5, 31, 64, 127], device=device)
    q_ref, k_ref = rotary(pos, q_pe.float(), k_pe.float())
    q_out, k_out = rotary_out(q_pe, k_pe, pos, rope.cos_cache, rope.sin_cache, interleave)
    assert q_out.shape == (t, h, r) and k_out.shape == (t, 1, r) and q_out.is_contiguous()
    assert_close(q_out, q_ref.to(dtype), dtype)
    assert_close(k_out, k_ref.to(dtype), dtype)
    assert torch.equal(query, before[0]) and torch.equal(kv_a, before[1])
    q_torch, _ = rotary(pos, q_pe, k_pe)
    assert_close(q_out, q_torch, dtype)
    e_q, e_k = rotary_out(q_pe[:0], k_pe[:0], pos[:0], rope.cos_cache, rope.sin_cache, interleave)
    assert e_q.shape == (0, h, r) and e_k.shape == (0, 1, r)


@pytest.mark.gpu
@requires_cuda
def test_fused_ops_gpu_llama_shapes() -> None:
    dev = torch.device("cuda")
    for t in (1, 64, 8192):
        _check_norm(dev, torch.bfloat16, t, 4096)
        x = _randn((t, 2 * 14336), torch.bfloat16, dev, 9)
        assert_close(silu_and_mul(x), ref_silu_and_mul(x), torch.bfloat16)
        _check_rotary(dev, torch.bfloat16, t, 32, 8, 128, max_pos=8192)


@pytest.mark.parametrize(("arch_name", "rotary_dim"), [("llama", None), ("qwen2", None), ("qwen3", None),
                                                      ("qwen2", 8), ("qwen3", 8)])
def test_model_fused_path_matches_torch_path(device: torch.device, arch_name: str, rotary_dim: int | None) -> None:
    """The model's fused (GPU) forward at tiny shapes equals its plain torch forward: prefill + decode; with
    ``rotary_dim``, RoPE over half of each head (GLM's partial rotary) with the biases or q/k norms around it."""
    from services.engine.attention import AttentionMetadata, ForwardContext, TorchPagedAttention
    from services.engine.model_loader import build_empty_model
    from services.text.model.config import ModelArchConfig

    arch = ModelArchConfig(architecture=arch_name, vocab_size=64, hidden_size=64, intermediate_size=96,
                           num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6,
                           max_position_embeddings=64, attention_bias=arch_name == "qwen2",
                           qk_norm=arch_name == "qwen3", rotary_dim=rotary_dim)
    model = build_empty_model(arch, torch.float32, device)
    gen = torch.Generator().manual_seed(10)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    bs, nblk = 4, 4

    def run(fused: bool, triton_backend: bool = False) -> list[torch.Tensor]:
        from services.engine.cuda.gpu_attention import TritonPagedAttention

        model.fused_kernels = fused
        kv = torch.zeros(arch.num_layers, 2, nblk * 2, bs, arch.num_kv_heads, arch.head_dim, device=device)
        backend = (TritonPagedAttention if triton_backend else TorchPagedAttention)(kv, arch.head_dim ** -0.5)
        tables = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32, device=device)
        outs = []
        # Prefill 5 + 3 tokens, then one decode step of both sequences.
        ids = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8], device=device)
        pos = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2], device=device)
        slots = torch.tensor([0, 1, 2, 3, 4, 16, 17, 18], device=device)
        meta = AttentionMetadata(slot_mapping=slots, block_tables=tables,
                                 context_lens=torch.tensor([5, 3], dtype=torch.int32, device=device),
                                 query_lens=[5, 3], context_lens_host=[5, 3], num_decode=0,
                                 cu_seqlens_q=torch.tensor([0, 5, 8], dtype=torch.int32, device=device))
        with torch.no_grad():
            outs.append(model(ids, pos, ForwardContext(backend, meta)))
            meta = AttentionMetadata(slot_mapping=torch.tensor([5, 19], device=device), block_tables=tables,
                                     context_lens=torch.tensor([6, 4], dtype=torch.int32, device=device),
                                     query_lens=[1, 1], context_lens_host=[6, 4], num_decode=2)
            outs.append(model(torch.tensor([9, 10], device=device), torch.tensor([5, 3], device=device),
                              ForwardContext(backend, meta)))
        return outs

    ref = run(False)
    for got, want in zip(run(True), ref, strict=True):
        assert_close(got, want, torch.float32)
    # the Triton backend: the RoPE kernel writes the new K/V into the pages itself (ForwardContext.store_target)
    for got, want in zip(run(True, triton_backend=True), ref, strict=True):
        assert_close(got, want, torch.float32)
