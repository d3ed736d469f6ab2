"""The C decode- and prefill-attention kernels (services/engine/cpu/native*.py) against torch's paged path, and
the engine falling back to torch where the kernels cannot be built."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from services.engine.attention import AttentionMetadata, TorchPagedAttention
from services.engine.cpu import native

KERNELS = native.load()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="no C compiler on this host")


def _step(batch: int, ctx: list[int], heads: int, kv_heads: int, dim: int, dtype: torch.dtype, block: int = 16,
          seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A KV cache of random pages, each sequence's blocks scattered through the pool, and one decode token per
    sequence (its K/V not stored yet: forward stores it)."""
    g = torch.Generator().manual_seed(seed)
    per = max((c + block - 1) // block for c in ctx)
    blocks = max(batch * per + 8, 96)
    kv = torch.randn(1, 2, blocks, block, kv_heads, dim, generator=g).to(dtype)
    perm = torch.randperm(blocks - 1, generator=g)[: batch * per] + 1
    tables = perm.view(batch, per).to(torch.int32)
    slots = torch.tensor([int(tables[i, (c - 1) // block]) * block + (c - 1) % block for i, c in enumerate(ctx)])
    meta = AttentionMetadata(slot_mapping=slots, block_tables=tables,
                             context_lens=torch.tensor(ctx, dtype=torch.int32), query_lens=[1] * batch,
                             context_lens_host=list(ctx), num_decode=batch)
    return kv, torch.randn(batch, heads, dim, generator=g).to(dtype), meta


def _both(kv, q, meta, window=0, kv_new=None):
    k_new = kv_new if kv_new is not None else torch.randn(q.shape[0], kv.shape[4], q.shape[2]).to(q.dtype)
    outs = []
    for use in (KERNELS, None):
        backend = TorchPagedAttention(kv.clone(), q.shape[-1] ** -0.5, use)
        m = AttentionMetadata(**{f: getattr(meta, f) for f in ("slot_mapping", "block_tables", "context_lens",
                                                              "query_lens", "context_lens_host", "num_decode")})
        outs.append(backend.forward(0, q, k_new, k_new * 0.5, m, window=window))
    return outs


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(9, 3, 64), (8, 8, 32), (16, 2, 128), (4, 1, 80)])
def test_decode_rows_match_torch(dtype, shape):
    heads, kv_heads, dim = shape
    rng = random.Random(1)
    ctx = [rng.randint(1, 300) for _ in range(7)]
    kv, q, meta = _step(len(ctx), ctx, heads, kv_heads, dim, dtype)
    got, want = _both(kv, q, meta)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol), (got.float() - want.float()).abs().max()


@needs_kernels
@pytest.mark.parametrize("window", [1, 5, 40])
def test_sliding_window_rows_match_torch(window):
    ctx = [3, 17, 64, 150, 33]
    kv, q, meta = _step(len(ctx), ctx, 8, 2, 64, torch.float32, seed=3)
    got, want = _both(kv, q, meta, window=window)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)


@needs_kernels
def test_mixed_step_decode_rows_use_the_kernel_and_match():
    """A step with decode rows and one prefill chunk: the decode rows and the chunk go through the kernels, and
    the whole output equals torch's."""
    ctx = [20, 45]
    kv, qd, meta = _step(2, ctx, 4, 2, 32, torch.float32, seed=5)
    tables = torch.cat([meta.block_tables, torch.tensor([[90, 91, 0]], dtype=torch.int32)[:, : meta.block_tables.shape[1]]])
    q = torch.cat([qd, torch.randn(5, 4, 32)])
    slots = torch.cat([meta.slot_mapping, torch.arange(90 * 16, 90 * 16 + 5)])
    mixed = dict(slot_mapping=slots, block_tables=tables, context_lens=torch.tensor([*ctx, 5], dtype=torch.int32),
                 query_lens=[1, 1, 5], context_lens_host=[*ctx, 5], num_decode=2)
    k_new = torch.randn(7, 2, 32)
    outs = []
    for use in (KERNELS, None):
        outs.append(TorchPagedAttention(kv.clone(), 32 ** -0.5, use).forward(0, q, k_new, k_new * 0.5,
                                                                            AttentionMetadata(**mixed)))
    assert torch.allclose(outs[0], outs[1], atol=1e-5, rtol=1e-5)


def _prefill_step(seqs: list[tuple[int, int]], heads: int, kv_heads: int, dim: int, dtype: torch.dtype,
                  block: int = 16, decode_ctx: tuple[int, ...] = (), seed: int = 0):
    """A step of decode rows (contexts ``decode_ctx``) then prefill chunks ``seqs`` = (cached tokens, new tokens),
    each sequence's blocks scattered through a pool of random pages; the new tokens' K/V not stored yet."""
    g = torch.Generator().manual_seed(seed)
    lens = [*decode_ctx, *(c + n for c, n in seqs)]
    per = max((n + block - 1) // block for n in lens)
    blocks = len(lens) * per + 9
    kv = torch.randn(1, 2, blocks, block, kv_heads, dim, generator=g).to(dtype)
    tables = (torch.randperm(blocks - 1, generator=g)[: len(lens) * per] + 1).view(len(lens), per).to(torch.int32)
    qlens = [1] * len(decode_ctx) + [n for _, n in seqs]
    slots = []
    for i, (total, ql) in enumerate(zip(lens, qlens, strict=True)):
        for p in range(total - ql, total):
            slots.append(int(tables[i, p // block]) * block + p % block)
    meta = dict(slot_mapping=torch.tensor(slots), block_tables=tables, context_lens=torch.tensor(lens, dtype=torch.int32),
                query_lens=qlens, context_lens_host=lens, num_decode=len(decode_ctx))
    t = sum(qlens)
    return kv, torch.randn(t, heads, dim, generator=g).to(dtype), torch.randn(t, kv_heads, dim, generator=g).to(dtype), meta


def _prefill_both(kv, q, k_new, meta, window=0):
    outs = []
    for use in (KERNELS, None):
        backend = TorchPagedAttention(kv.clone(), q.shape[-1] ** -0.5, use)
        outs.append(backend.forward(0, q, k_new, k_new * 0.5, AttentionMetadata(**meta), window=window))
    return outs


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(9, 3, 64), (8, 8, 32), (16, 2, 128), (4, 1, 80), (6, 2, 100), (3, 3, 7)])
def test_prefill_rows_match_torch(dtype, shape):
    """Whole prompts (no cached prefix) and chunks after cached tokens, several sequences in one step."""
    heads, kv_heads, dim = shape
    kv, q, k_new, meta = _prefill_step([(0, 37), (40, 25), (0, 1), (16, 16), (3, 70)], heads, kv_heads, dim, dtype)
    got, want = _prefill_both(kv, q, k_new, meta)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol), (got.float() - want.float()).abs().max()


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 5, 40])
def test_sliding_window_prefill_rows_match_torch(window, dtype):
    kv, q, k_new, meta = _prefill_step([(0, 90), (50, 30), (7, 3)], 8, 2, 64, dtype, block=8, seed=4)
    got, want = _prefill_both(kv, q, k_new, meta, window=window)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol), (got.float() - want.float()).abs().max()


@needs_kernels
@pytest.mark.parametrize("window", [0, 37])
@pytest.mark.parametrize("shape", [(9, 3, 64), (8, 8, 32), (16, 2, 128)])
def test_long_prompts_match_torch_whatever_the_thread_count(shape, window):
    """The kernel sizes its token blocks from the query heads per KV head and the thread count (fewer, longer
    blocks on one thread): 300 new tokens after a cached prefix of 5, on one thread and on eight, both equal to
    torch's path."""
    heads, kv_heads, dim = shape
    kv, q, k_new, meta = _prefill_step([(5, 300)], heads, kv_heads, dim, torch.float32, seed=9)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 8):
            torch.set_num_threads(n)
            outs.append(_prefill_both(kv, q, k_new, meta, window=window))
    finally:
        torch.set_num_threads(threads)
    for got, want in outs:
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()


@needs_kernels
def test_mixed_step_rows_all_match_torch_with_pages_of_4():
    """Decode rows and prefill chunks in one step, pages smaller than the kernel's key tile."""
    kv, q, k_new, meta = _prefill_step([(9, 20), (0, 33)], 4, 2, 32, torch.float32, block=4, decode_ctx=(5, 30), seed=6)
    got, want = _prefill_both(kv, q, k_new, meta)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)


@needs_kernels
def test_prefill_rows_use_the_kernel(monkeypatch):
    calls = []
    real = KERNELS.paged_prefill_attention
    monkeypatch.setattr(KERNELS, "paged_prefill_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    kv, q, k_new, meta = _prefill_step([(0, 12), (16, 4)], 4, 2, 32, torch.float32)
    TorchPagedAttention(kv, 32 ** -0.5, KERNELS).forward(0, q, k_new, k_new, AttentionMetadata(**meta))
    assert len(calls) == 2
    assert not KERNELS.supports_prefill(torch.float16, 8, 2, 64, 16)
    assert not KERNELS.supports_prefill(torch.float32, 8, 3, 64, 16)
    assert not KERNELS.supports_prefill(torch.float32, 8, 2, 1024, 16)
    assert KERNELS.supports_prefill(torch.bfloat16, 9, 3, 64, 16)


@needs_kernels
def test_unsupported_shapes_and_dtypes_stay_on_torch():
    assert not KERNELS.supports_decode(torch.float16, 8, 2, 64, 16)
    assert not KERNELS.supports_decode(torch.float32, 8, 3, 64, 16)   # heads not a multiple of KV heads
    assert not KERNELS.supports_decode(torch.float32, 128, 8, 64, 16)  # more query heads than the kernel holds
    assert not KERNELS.supports_decode(torch.float32, 8, 2, 64, 128)   # pages larger than its tile
    assert KERNELS.supports_decode(torch.bfloat16, 9, 3, 64, 16)


def test_no_compiler_means_torch_kernels_and_one_warning(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    with caplog.at_level(logging.WARNING, logger=native.log.name):
        assert native.load.__wrapped__(str(tmp_path)) is None
    assert any("no C compiler" in r.getMessage() for r in caplog.records)


def test_the_kernel_is_built_into_the_directory_given(tmp_path):
    if native._compiler() is None:
        pytest.skip("no C compiler on this host")
    kernels = native.load.__wrapped__(str(tmp_path / "k"))
    assert kernels is not None and kernels.path.parent == tmp_path / "k" and kernels.path.exists()


def test_a_failed_build_means_torch_kernels(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", "false")   # a "compiler" that exits 1
    monkeypatch.setattr(native, "_key", lambda cc: "broken")
    with caplog.at_level(logging.WARNING, logger=native.log.name):
        assert native.load.__wrapped__(str(tmp_path)) is None
    assert any("could not be built" in r.getMessage() for r in caplog.records)
    assert not list(tmp_path.glob("*.so"))


# ---- the layers' elementwise ops (RMSNorm, SiLU*mul, RoPE) -------------------------------------------------


def _torch_and_native(fn):
    """fn() with the C kernels active, then with torch's ops; the previous state restored."""
    before = native.ACTIVE
    try:
        native.activate(KERNELS)
        got = fn()
        native.activate(None)
        want = fn()
    finally:
        native.activate(before)
    return got, want


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    if dtype == torch.float32:
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    else:  # the same roundings: equal bits but for rare last-place differences of expf / sqrtf
        diff = (got.float() - want.float()).abs()
        assert (diff > 0).float().mean() < 0.01 and diff.max() <= 0.0625 * want.float().abs().max(), diff.max()


def _norm(dtype: torch.dtype):
    """An RMSNorm over 576 values with weights in [0.5, 1.5)."""
    from services.engine.models.llama import RMSNorm

    norm = RMSNorm(576, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(576) + 0.5)
    return norm


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_torch(dtype):
    from services.engine.models.llama import RMSNorm

    norm = _norm(dtype)
    x = (torch.randn(37, 576) * 3).to(dtype)
    heads = torch.randn(5, 12, 64).to(dtype)[:, 1:10]  # qwen3's per-head q/k norms: a strided 3-D view
    got, want = _torch_and_native(lambda: norm(x))
    _close(got, want, dtype)
    norm64 = RMSNorm(64, 1e-6).to(dtype)
    got, want = _torch_and_native(lambda: norm64(heads))
    _close(got, want, dtype)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_torch(dtype):
    from services.engine.models.llama import MLP

    mlp = MLP(64, 96).to(dtype)
    x = torch.randn(11, 64).to(dtype)
    with torch.no_grad():
        got, want = _torch_and_native(lambda: mlp(x))
    _close(got, want, dtype)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_matches_torch_on_views_of_a_fused_projection(dtype):
    from services.engine.models.rope import RotaryEmbedding

    rot = RotaryEmbedding(64, 10000.0, None, 4096)
    qkv = torch.randn(13, (9 + 3 + 3) * 64).to(dtype)
    q, k, _ = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)
    q, k = q.view(13, 9, 64), k.view(13, 3, 64)  # strided rows, as the attention layer hands them over
    pos = torch.randint(0, 4000, (13,))
    (gq, gk), (wq, wk) = _torch_and_native(lambda: rot(pos, q, k))
    _close(gq, wq, dtype)
    _close(gk, wk, dtype)
    # the engine's step-cached rotary (models/cpu_fast.py) takes the kernels too, with the same numbers
    from services.engine.models.cpu_fast import StepCachedRotary

    cached = StepCachedRotary(64, 10000.0, None, 4096)
    (cq, ck), (tq, tk) = _torch_and_native(lambda: cached(pos, q, k))
    assert torch.equal(cq, gq) and torch.equal(ck, gk)
    _close(cq, tq, dtype)
    _close(ck, tk, dtype)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_is_the_add_then_the_norm(dtype):
    from services.engine.models.llama import add_rms_norm

    norm = _norm(dtype)
    x, delta = (torch.randn(23, 576) * 3).to(dtype), torch.randn(23, 640).to(dtype)[:, :576]  # strided delta rows
    (gs, gy), (ws, wy) = _torch_and_native(lambda: add_rms_norm(x, delta, norm))
    assert torch.equal(gs, ws)  # the sum rounds once, as torch's add does
    _close(gy, wy, dtype)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_residual_carrying_forward_computes_the_layer_by_layer_numbers(dtype):
    """LlamaForCausalLM with the kernels carries each layer's last delta into the next norm; hidden states equal
    the plain per-layer forward with the same kernels up to last-place differences, and the prefill steps of a
    whole engine give torch's greedy tokens."""
    from services.engine.attention import ForwardContext
    from services.engine.models.llama import LlamaForCausalLM
    from services.text.model.config import ModelArchConfig

    arch = ModelArchConfig(architecture="llama", vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=3,
                           num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                           max_position_embeddings=256, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(arch).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p.float()).to(dtype) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    model.init_buffers()
    ids, pos = torch.randint(0, 97, (19,)), torch.arange(19)

    def run(carry: bool) -> torch.Tensor:
        kv = torch.zeros(arch.num_layers, 2, 4, 16, 2, 16, dtype=dtype)
        backend = TorchPagedAttention(kv, 16 ** -0.5, KERNELS)
        meta = AttentionMetadata(slot_mapping=torch.arange(19), block_tables=torch.tensor([[0, 1]], dtype=torch.int32),
                                 context_lens=torch.tensor([19], dtype=torch.int32), query_lens=[19],
                                 context_lens_host=[19], num_decode=0)
        with torch.no_grad():
            if carry:
                return model.forward(ids, pos, ForwardContext(backend, meta))
            h = model.model.embed_tokens(ids)
            for layer in model.model.layers:
                h = layer(h, pos, model.rotary, ForwardContext(backend, meta))
            return model.model.norm(h)

    before = native.ACTIVE
    try:
        native.activate(KERNELS)
        got, want = run(True), run(False)
    finally:
        native.activate(before)
    _close(got, want, dtype)


def test_ops_stay_on_torch_inside_a_compile_trace(monkeypatch):
    monkeypatch.setattr(native, "ACTIVE", object())
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert native.active(torch.zeros(2)) is None
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    assert native.active(torch.zeros(2)) is not None


@needs_kernels
def test_loading_the_kernels_keeps_subnormal_floats():
    """Fast-math code must not switch the process to flush-to-zero (a -ffast-math link adds crtfastmath.o, whose
    constructor does): in a fresh interpreter, subnormals survive the load."""
    import subprocess
    import sys

    code = ("from services.engine.cpu import native; import numpy as np; k = native.load(); "
            "assert k is not None; print(5e-324 * 1.0 != 0.0, np.float32(1e-40) * np.float32(1.0) != 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=str(native.SOURCE.parents[3]))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "True"], out.stdout
