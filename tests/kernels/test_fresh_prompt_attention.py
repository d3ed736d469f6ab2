"""The GPU backend's fresh-prompt route: whole prompts go to SDPA on their own k/v, everything else to the paged
extend kernel, and both agree with the paged reference."""

from __future__ import annotations

import pytest
import torch

from services.engine.attention import AttentionMetadata
from services.engine.cuda import gpu_attention
from services.engine.cuda.gpu_attention import TritonPagedAttention, fresh_prompt_attention
from services.kernels.reference import ref_paged_decode_attention, ref_prefill_attention

BS, H, KVH, D = 16, 4, 2, 32
SCALE = D**-0.5


def _step(device: torch.device, decode_ctx: list[int], prompts: list[int], prefix: int = 0, dtype=torch.bfloat16):
    """A step of len(decode_ctx) decode rows (their earlier keys already cached) then prompts of the given lengths
    (after `prefix` cached tokens each): (kv_cache, q, k, v, meta), the cache holding every earlier key."""
    gen = torch.Generator().manual_seed(len(prompts) * 7 + prefix)
    ctxs = [*decode_ctx, *(prefix + n for n in prompts)]
    qlens = [1] * len(decode_ctx) + prompts
    tables, slots, nxt = [], [], 0
    for c in ctxs:
        nb = -(-c // BS)
        tables.append(list(range(nxt, nxt + nb)))
        nxt += nb
    kv = (torch.randn((1, 2, nxt, BS, KVH, D), generator=gen) * 0.5).to(dtype)
    for t, c, n in zip(tables, ctxs, qlens, strict=True):
        slots += [t[p // BS] * BS + p % BS for p in range(c - n, c)]
    total = sum(qlens)
    q = (torch.randn((total, H, D), generator=gen) * 0.5).to(dtype)
    k = (torch.randn((total, KVH, D), generator=gen) * 0.5).to(dtype)
    v = (torch.randn((total, KVH, D), generator=gen) * 0.5).to(dtype)
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=device),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
        context_lens=torch.tensor(ctxs, dtype=torch.int32, device=device), query_lens=qlens, context_lens_host=ctxs,
        num_decode=len(decode_ctx),
        cu_seqlens_q=torch.tensor([0, *qlens], dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device))
    return kv.to(device), q.to(device), k.to(device), v.to(device), meta


def _reference(kv: torch.Tensor, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Decode rows and prefill rows by the fp32 paged references (the cache already holds the step's keys)."""
    k_cache, v_cache = kv[0, 0].float(), kv[0, 1].float()
    nd = meta.num_decode
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    if nd:
        out[:nd] = ref_paged_decode_attention(q[:nd].float(), k_cache, v_cache, meta.block_tables[:nd],
                                              meta.context_lens[:nd], SCALE)
    out[nd:] = ref_prefill_attention(q[nd:].float(), k_cache, v_cache, meta.block_tables[nd:],
                                     meta.cu_seqlens_q[nd:] - nd, meta.context_lens[nd:], SCALE)
    return out


def test_fresh_prompt_attention_matches_the_paged_reference(device: torch.device) -> None:
    kv, q, k, v, meta = _step(device, [], [40, 72, 9])
    from services.kernels.store_kv import store_kv

    store_kv(k, v, kv[0, 0], kv[0, 1], meta.slot_mapping)
    out = fresh_prompt_attention(q, k, v, meta.query_lens, SCALE)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.float(), _reference(kv, q, meta), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(("decode_ctx", "prompts", "prefix", "routed"), [
    ([], [300, 256], 0, True),  # whole prompts
    ([37, 80], [260], 0, True),  # decode rows beside a whole prompt: the decode kernel for them
    ([], [300], 16, False),  # a chunk after a prefix: the paged extend kernel
    ([], [300, 100], 0, False),  # one prompt under SDPA_MIN_TOKENS
])
def test_backend_routes_whole_prompts_to_sdpa(device: torch.device, monkeypatch: pytest.MonkeyPatch,
                                              decode_ctx: list[int], prompts: list[int], prefix: int,
                                              routed: bool) -> None:
    calls = []
    real = gpu_attention.fresh_prompt_attention

    def spy(*args, **kwargs):
        calls.append(args[3])
        return real(*args, **kwargs)

    monkeypatch.setattr(gpu_attention, "fresh_prompt_attention", spy)
    kv, q, k, v, meta = _step(device, decode_ctx, prompts, prefix)
    backend = TritonPagedAttention(kv, SCALE)
    out = backend.forward(0, q, k, v, meta)
    assert bool(calls) == routed
    if routed:
        assert calls == [prompts]
    torch.testing.assert_close(out.float(), _reference(kv, q, meta), atol=2e-2, rtol=2e-2)


def test_float32_and_windows_stay_on_the_extend_kernel(device: torch.device) -> None:
    _, q, _, _, meta = _step(device, [], [300], dtype=torch.float32)
    assert not TritonPagedAttention._fresh_prompts(meta, q)
    _, q, _, _, meta = _step(device, [], [300])
    assert TritonPagedAttention._fresh_prompts(meta, q)
    many = [256] * (gpu_attention.SDPA_MAX_SEQS + 1)
    meta.query_lens, meta.context_lens_host = many, many
    assert not TritonPagedAttention._fresh_prompts(meta, q)


def test_sdpa_buckets_bound_the_shapes_and_the_padding() -> None:
    b = gpu_attention.sdpa_bucket
    assert [b(n) for n in (1, 256, 257, 1024, 1025, 2048, 2049, 8192)] == [256, 256, 512, 1024, 1280, 2048, 2560, 8192]
    assert all(b(n) >= n and b(b(n)) == b(n) for n in range(1, 20000))
    assert len({b(n) for n in range(1, 8193)}) == 16  # cuDNN graphs for every prompt up to 8K tokens
    assert max((b(n) - n) / n for n in range(1025, 20000)) <= 0.25


def test_padded_prompts_give_the_same_rows(device: torch.device) -> None:
    """A prompt run padded to its bucket: the real rows equal the unpadded run (causal: padding comes after)."""
    _, q, k, v, meta = _step(device, [], [300, 40, 257])
    plain = fresh_prompt_attention(q, k, v, meta.query_lens, SCALE, bucket=lambda n: n)
    padded = fresh_prompt_attention(q, k, v, meta.query_lens, SCALE, bucket=gpu_attention.sdpa_bucket)
    torch.testing.assert_close(padded.float(), plain.float(), atol=1e-2, rtol=1e-2)
