"""What one forward takes besides the weights and the KV pool: the token ids, positions and attention
metadata of a batch of rows, the rows that sample, and the device scope kernels launch under. Used by the
model runner, the tensor-parallel runner, the draft model and the CPU decode compiler alike."""

from __future__ import annotations

import contextlib

import torch

from services.engine.attention import AttentionMetadata
from services.engine.sampler import SamplingRow
from services.engine.scheduler import ScheduledChunk

__all__ = ["device_scope", "prepare_rows", "sampled_rows"]


def device_scope(device: torch.device) -> contextlib.AbstractContextManager:
    """``device`` as the calling thread's current CUDA device while inside; nothing on the CPU. Triton kernels
    launch on the current device, which is cuda:0 in every new thread: an engine on cuda:N (N > 0) enters
    this wherever its kernels run (steps, page reads and writes)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def sampled_rows(chunks: list[ScheduledChunk]) -> tuple[list[int], list[SamplingRow], list[int]]:
    """For the chunks that sample: (flat index of their last token, sampling row, seq id)."""
    ends, rows, seq_ids = [], [], []
    offset = 0
    for ch in chunks:
        offset += ch.num_new_tokens
        if ch.sample:
            ends.append(offset - 1)
            rows.append(SamplingRow(ch.seq.params, ch.seq.num_output_tokens))
            seq_ids.append(ch.seq.seq_id)
    return ends, rows, seq_ids


def prepare_rows(rows: list[tuple[list[int], int, list[int]]], block_size: int, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(input ids, positions, metadata) of one forward over rows (new token ids, position of the first,
    block table covering them); one-token rows must come first (the backends batch them as decode)."""
    bs = block_size
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_lens: list[int] = []
    context_lens: list[int] = []
    tables: list[list[int]] = []
    for tokens, start, table in rows:
        end = start + len(tokens)
        input_ids.extend(tokens)
        positions.extend(range(start, end))
        slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
        query_lens.append(len(tokens))
        context_lens.append(end)
        tables.append(table[: (end + bs - 1) // bs])
    max_blocks = max(len(t) for t in tables)
    bt = torch.zeros(len(tables), max_blocks, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    num_decode = 0
    while num_decode < len(query_lens) and query_lens[num_decode] == 1:
        num_decode += 1
    cu = [0]
    for q in query_lens:
        cu.append(cu[-1] + q)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=bt.to(device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        query_lens=query_lens,
        context_lens_host=context_lens,
        num_decode=num_decode,
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
    )
    ids = torch.tensor(input_ids, dtype=torch.long, device=device)
    pos = torch.tensor(positions, dtype=torch.long, device=device)
    return ids, pos, meta
