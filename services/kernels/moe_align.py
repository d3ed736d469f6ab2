"""The fused MoE's alignment step in one launch: (token, slot) pairs sorted by expert, each expert's run padded.

`fused_moe`'s sorted path needs, from topk_ids [T, K], the T*K pair ids grouped by expert with every expert's
run padded to a multiple of BLOCK_M (sentinel pair id T*K), the expert of each BLOCK_M block and the number of
blocks in use. The torch form (``fused_moe.align_pairs_torch``: a histogram, two cumulative sums, a stable sort,
a scatter and a search) is about twenty small launches, and a decode step runs one per MoE layer: in a CUDA
graph each costs a few microseconds whatever the work, as much as the layer's attention at one row.

Here one program does it all, keeping the experts' counters in registers:
1. counts per expert: the pairs walked CHUNK at a time, one-hot against the experts, summed;
2. blocks per expert (counts rounded up to BLOCK_M), their running sum, each expert's first padded row;
3. every output slot set to the sentinel, then (after a barrier, so the pairs' stores land after it) each
   pair's slot: its expert's first row + the pairs of that expert before it (earlier chunks' counts plus
   its place in its own chunk), so pairs keep token order within an expert, as the stable sort keeps them;
4. each block's expert: how many experts' block runs end at or before it (clamped to E - 1 past the end).
The output equals the torch form element for element (tests/kernels/test_fused_moe.py). One program walks
all pairs, so it serves decode-sized batches (`use_fused_align`: pairs x experts bounded); larger ones keep the
torch form, whose launches are then a small part of the layer.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

#: Pairs (T*K) up to which the one-program alignment may run; past it the torch form does (a prefill's pairs).
#: PDSERVE_MOE_ALIGN_MAX_PAIRS overrides it (0: always the torch form, for A/B runs).
FUSED_ALIGN_MAX_PAIRS = int(os.environ.get("PDSERVE_MOE_ALIGN_MAX_PAIRS", "8192"))
#: ... and while pairs x experts (rounded up to a power of two), the one program's work, stays at most this. Measured
#: in CUDA graphs on an H100 (`pdserve bench moe --align`): 128 experts, 512 pairs 29 us against the torch form's 87,
#: 2048 pairs 94 against 92 (even), 4096 pairs 181 against 96; 8 experts, 2048 pairs 20 against 89.
FUSED_ALIGN_MAX_WORK = 1 << 17


def use_fused_align(pairs: int, num_experts: int) -> bool:
    """True when the one-launch alignment runs for ``pairs`` (token, slot) pairs over ``num_experts`` experts."""
    return 0 < pairs <= FUSED_ALIGN_MAX_PAIRS and pairs * triton.next_power_of_2(num_experts) <= FUSED_ALIGN_MAX_WORK


_ONE_HOT_ELEMENTS = 8192
"""Elements of one chunk's [CHUNK, experts] one-hot matrix (registers of the program's threads)."""


@triton.jit
def _moe_align_kernel(
    Ids_ptr,
    Sorted_ptr,
    BlockExperts_ptr,
    NumBlocks_ptr,
    num_pairs,
    num_experts,
    max_blocks,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
):
    experts = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(Ids_ptr + offs, mask=offs < num_pairs, other=BLOCK_E)  # BLOCK_E: no expert's id
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    cum_blocks = tl.cumsum(blocks, axis=0)
    first_row = (cum_blocks - blocks) * BLOCK_M
    tl.store(NumBlocks_ptr, tl.sum(blocks, axis=0))

    rows = max_blocks * BLOCK_M
    for start in range(0, rows, CHUNK * 4):
        offs = start + tl.arange(0, CHUNK * 4)
        tl.store(Sorted_ptr + offs, tl.zeros([CHUNK * 4], dtype=tl.int32) + num_pairs, mask=offs < rows)
    tl.debug_barrier()  # the sentinels land before any pair's store to the same rows

    seen = tl.zeros([BLOCK_E], dtype=tl.int32)  # pairs of each expert in earlier chunks
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(Ids_ptr + offs, mask=offs < num_pairs, other=BLOCK_E)
        hit = (ids[:, None] == experts[None, :]).to(tl.int32)
        before = tl.cumsum(hit, axis=0) - hit  # same-expert pairs ahead of each in this chunk
        row = tl.sum(hit * (before + seen[None, :] + first_row[None, :]), axis=1)
        tl.store(Sorted_ptr + row, offs.to(tl.int32), mask=offs < num_pairs)
        seen += tl.sum(hit, axis=0)

    real = experts < num_experts
    for start in range(0, max_blocks, CHUNK):
        b = start + tl.arange(0, CHUNK)
        ended = (cum_blocks[None, :] <= b[:, None]) & real[None, :]
        expert = tl.minimum(tl.sum(ended.to(tl.int32), axis=1), num_experts - 1)
        tl.store(BlockExperts_ptr + b, expert, mask=b < max_blocks)


def align_pairs_fused(topk_ids: torch.Tensor, num_experts: int, block_m: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(sorted_pair_ids int32 [max_blocks * block_m], block_experts int32 [max_blocks], num_blocks int32 [1],
    max_blocks) of topk_ids [T, K] (int32, values in [0, num_experts)), as ``fused_moe.align_pairs`` returns
    them, in one launch (any count of pairs; `use_fused_align` says where it is the faster form)."""
    pairs = topk_ids.numel()
    assert pairs > 0, "align_pairs_fused: no pairs"
    assert topk_ids.dtype == torch.int32, f"align_pairs_fused: topk_ids dtype {topk_ids.dtype}, not int32"
    ids = topk_ids.reshape(-1)
    ids = ids if ids.is_contiguous() else ids.contiguous()
    device = topk_ids.device
    max_blocks = triton.cdiv(pairs, block_m) + min(num_experts, pairs)
    sorted_pair_ids = torch.empty((max_blocks * block_m,), dtype=torch.int32, device=device)
    block_experts = torch.empty((max_blocks,), dtype=torch.int32, device=device)
    num_blocks = torch.empty((1,), dtype=torch.int32, device=device)
    block_e = triton.next_power_of_2(num_experts)
    chunk = max(16, min(256, _ONE_HOT_ELEMENTS // block_e))
    _moe_align_kernel[(1,)](
        ids, sorted_pair_ids, block_experts, num_blocks, pairs, num_experts, max_blocks,
        BLOCK_M=block_m, BLOCK_E=block_e, CHUNK=chunk, num_warps=8 if block_e * chunk >= 4096 else 4,
    )  # fmt: skip
    return sorted_pair_ids, block_experts, num_blocks, max_blocks
