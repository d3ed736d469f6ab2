"""DeepSeek-V3.2's sparse attention kernels (index scores + top-k selection, sparse latent attention) against their
torch references, and the references against the sums written out on each sequence's contiguous cached values: one
step of decode rows and prefill chunks over shuffled (non-consecutive) blocks, contexts shorter and longer than
topk, a fixed context bound as under CUDA-graph capture, a padding row; index keys in the pool's dtype and in
fp8-e4m3 with per-token scales (the index-key region's two codecs)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tests.kernels.kernel_cases import assert_close
from tests.kernels.mla_cases import TINY, LatentCase, latent_query, make_latent_cache

pytest.importorskip("triton")

from services.kernels.index_topk import index_scores, index_topk, prefill_rows
from services.kernels.reference import ref_fp8_quantize, ref_index_scores, ref_sparse_mla_attention
from services.kernels.sparse_mla_attention import sparse_mla_attention

INDEX_HEADS, INDEX_DIM, TOPK = 4, 16, 8
KEY_START = sum(TINY)  # the test cache's index key values follow the 32 + 8 latent; the kernels read them as a pool
CONTEXTS = [5, 30, 1, 21, 20, 13]
"""Four decode rows (contexts 5 and 1 below TOPK), then two prefill chunks: 12 tokens after an 8-token prefix and
a whole 13-token prompt."""
Q_LENS = [1, 1, 1, 1, 12, 13]
ND = 4


@dataclass
class Part:
    """One part of the step, as gpu_attention.py launches it: decode rows (row = sequence) or prefill tokens."""

    q_idx: torch.Tensor
    weights: torch.Tensor
    tables: torch.Tensor
    end: torch.Tensor
    seq: torch.Tensor | None
    bound: int


def _parts(case: LatentCase, dtype: torch.dtype, device: torch.device, decode_bound: int) -> list[Part]:
    kv = case.kv
    gen = torch.Generator().manual_seed(5)
    total = sum(Q_LENS)
    q_idx = torch.randn((total, INDEX_HEADS, INDEX_DIM), generator=gen).to(dtype).to(device)
    weights = torch.randn((total, INDEX_HEADS), generator=gen).to(device)
    cu = torch.tensor([0, *torch.tensor(Q_LENS[ND:]).cumsum(0).tolist()], dtype=torch.int32, device=device)
    seq, end = prefill_rows(cu, kv.context_lens[ND:], total - ND)
    decode = Part(q_idx[:ND], weights[:ND], kv.block_tables[:ND], kv.context_lens[:ND], None, decode_bound)
    prefill = Part(q_idx[ND:], weights[ND:], kv.block_tables[ND:], end, seq, max(CONTEXTS[ND:]))
    return [decode, prefill]


def _case(dtype: torch.dtype, device: torch.device, block_size: int) -> LatentCase:
    return make_latent_cache(CONTEXTS, TINY, block_size, dtype, device, index_dim=INDEX_DIM)


def _index_pool(case: LatentCase, fp8: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The case's index keys as the index-key pool holds them: [slots, INDEX_DIM] (slot = block * bs + offset) in
    the cache's dtype, or fp8-e4m3 values with fp32 scales [slots]."""
    kv = case.kv
    keys = torch.cat([kv.k_cache, kv.v_cache], dim=-1)[:, :, 0, KEY_START:].reshape(-1, INDEX_DIM)
    if not fp8:
        return keys.contiguous(), None
    q, s = ref_fp8_quantize(keys[:, None])
    return q[:, 0], s[:, 0]


def _row_keys(case: LatentCase, part: int, row: int) -> tuple[int, int]:
    """(sequence, visible keys) of row ``row`` of part 0 (decode) or 1 (prefill)."""
    if part == 0:
        return row, CONTEXTS[row]
    for b in range(ND, len(CONTEXTS)):
        if row < Q_LENS[b]:
            return b, CONTEXTS[b] - Q_LENS[b] + row + 1
        row -= Q_LENS[b]
    raise IndexError(row)


def test_prefill_rows_give_each_token_its_sequence_and_causal_end(device: torch.device) -> None:
    cu = torch.tensor([0, 3, 4, 6], dtype=torch.int32, device=device)
    ctx = torch.tensor([10, 1, 2], dtype=torch.int32, device=device)
    seq, end = prefill_rows(cu, ctx, 6)
    assert seq.tolist() == [0, 0, 0, 1, 2, 2] and end.tolist() == [8, 9, 10, 1, 1, 2]


@pytest.mark.parametrize("fp8", [False, True], ids=["pool-dtype", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_index_scores_and_top_k(device: torch.device, dtype: torch.dtype, fp8: bool) -> None:
    # Block size 7: contexts off the block grid; decode scored against a bound of 64 (graph capture) > contexts.
    case = _case(dtype, device, 7)
    scale = INDEX_DIM ** -0.5
    keys, key_scales = _index_pool(case, fp8)
    for p, part in enumerate(_parts(case, dtype, device, decode_bound=64)):
        args = (part.q_idx, part.weights, keys, key_scales, part.tables, part.end, 7, scale)
        got = index_scores(*args, part.bound, row_seq=part.seq)
        ref = ref_index_scores(*args, part.bound, row_seq=part.seq)
        assert torch.equal(torch.isinf(got), torch.isinf(ref))
        finite = torch.isfinite(ref)
        assert_close(got[finite], ref[finite], torch.float32 if dtype == torch.float32 else torch.float16)
        sel = index_topk(*args, TOPK, part.bound, row_seq=part.seq)
        chunked = index_topk(*args, TOPK, part.bound, row_seq=part.seq, max_rows=3)
        assert sel.shape == (part.q_idx.shape[0], TOPK)
        assert torch.equal(sel.sort(dim=-1).values, chunked.sort(dim=-1).values)
        for row in range(sel.shape[0]):
            b, visible = _row_keys(case, p, row)
            seq_keys = case.latents[b][:visible, 0, KEY_START:].float()
            if fp8:  # what the pool holds: each key rounded to e4m3 under its own scale
                qk, sk = ref_fp8_quantize(seq_keys[:, None])
                seq_keys = qk[:, 0].float() * sk
            plain = torch.relu(part.q_idx[row].float() @ seq_keys.T * scale).T @ part.weights[row]
            torch.testing.assert_close(ref[row, :visible], plain, atol=1e-4, rtol=1e-4)
            chosen = sel[row][sel[row] >= 0]
            assert len(chosen) == min(TOPK, visible) == len(set(chosen.tolist()))
            assert int(chosen.max()) < visible
            torch.testing.assert_close(ref[row, chosen.long()].sort().values,
                                       plain.topk(len(chosen)).values.sort().values, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_latent_attention_over_the_selection(device: torch.device, dtype: torch.dtype) -> None:
    # 6 heads (one part-masked head group); each row's selection from the reference scores, with -1 where its
    # context is shorter than TOPK; decode row 2 is made a padding row (no key): zeros.
    case = _case(dtype, device, 16)
    kv, heads, value_dim = case.kv, 6, TINY[0]
    scale = (case.key_dim - value_dim + 16) ** -0.5
    total = sum(Q_LENS)
    q = latent_query(total, heads, case.key_dim, dtype, device)
    outs = []
    for p, part in enumerate(_parts(case, dtype, device, decode_bound=max(CONTEXTS[:ND]))):
        scores = ref_index_scores(part.q_idx, part.weights, *_index_pool(case, False), part.tables, part.end, 16,
                                  INDEX_DIM ** -0.5, part.bound, row_seq=part.seq)
        vals, idx = scores.topk(min(TOPK, part.bound), dim=-1)
        sel = idx.masked_fill(vals == float("-inf"), -1).to(torch.int32)
        if p == 0:
            sel[2] = -1
        rows = slice(0, ND) if p == 0 else slice(ND, total)
        got = sparse_mla_attention(q[rows], kv.k_cache, kv.v_cache, part.tables, sel, scale, value_dim,
                                   row_seq=part.seq, block_n=16)
        ref = ref_sparse_mla_attention(q[rows].float(), kv.k_cache.float(), kv.v_cache.float(), part.tables, sel,
                                       scale, value_dim, row_seq=part.seq)
        assert got.shape == (sel.shape[0], heads, value_dim) and got.dtype == dtype
        assert_close(got, ref, dtype)
        for row in range(sel.shape[0]):
            b, _ = _row_keys(case, p, row)
            chosen = sel[row][sel[row] >= 0].long()
            lat = case.latents[b][chosen, 0].float()
            w = torch.softmax(q[rows][row].float() @ lat[:, :case.key_dim].T * scale, dim=-1)
            torch.testing.assert_close(ref[row], w @ lat[:, :value_dim], atol=1e-4, rtol=1e-4)
        outs.append(got)
    assert torch.equal(outs[0][2], torch.zeros_like(outs[0][2]))


def test_empty_rows_and_bad_shapes(device: torch.device) -> None:
    case = _case(torch.float32, device, 16)
    kv = case.kv
    none = torch.empty((0, TOPK), dtype=torch.int32, device=device)
    out = sparse_mla_attention(latent_query(0, 4, case.key_dim, torch.float32, device), kv.k_cache, kv.v_cache,
                               kv.block_tables[:0], none, 0.2, TINY[0])
    assert out.shape == (0, 4, TINY[0])
    q_idx = torch.zeros((1, INDEX_HEADS, INDEX_DIM + 1), device=device)
    keys, _ = _index_pool(case, False)
    with pytest.raises(AssertionError, match="do not fit"):
        index_scores(q_idx, torch.zeros((1, INDEX_HEADS), device=device), keys, None, kv.block_tables[:1],
                     kv.context_lens[:1], 16, 1.0, 32)
    fp8_keys, _ = _index_pool(case, True)
    with pytest.raises(AssertionError, match="fp8 with scales"):
        index_scores(q_idx[..., :INDEX_DIM].contiguous(), torch.zeros((1, INDEX_HEADS), device=device), fp8_keys,
                     None, kv.block_tables[:1], kv.context_lens[:1], 16, 1.0, 32)
