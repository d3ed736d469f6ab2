"""What rank 0 sends the other ranks before each collective sequence, as int64 tensors (never pickle).

A message is a fixed header ``int64[HEADER]`` = [op, a, b, c, d, e, 0, 0], broadcast first, then one
int64 payload whose length the header fixes:
- STEP: a=tokens T, b=sequences B, c=max blocks M, d=decode rows, e=sampled rows S; payload =
  ids[T] | positions[T] | slots[T] | block_tables[B*M] | context_lens[B] | query_lens[B] | sampled rows[S]
  (S flat indices of the tokens whose logits are computed; only rank 0 samples, from the gathered logits).
- EXPORT: a=pages P; payload = block ids[P]. Every rank then gathers its heads of those pages to rank 0.
- IMPORT: a=pages P; payload = block ids[P]; then rank 0 scatters each rank its heads of the pages
  (cache dtype), so a rank receives exactly the heads it holds.
- TRACE: a=window start (Unix ms), b=window length (ms), c=bytes of the file stem; payload = the stem's
  UTF-8 bytes, one per int64 (rank 0 derives it from its own trace root and a validated session name).
  Each rank writes ``<stem>-rank<r>.trace.json`` (trace.py).
- GRAPH: a=bucket, b=sequences B, c=block-table width M; payload = ids[B] | positions[B] | slots[B] |
  context_lens[B] | block_tables[B*M]. Every rank fills its decode graph's inputs (cuda_graphs.py) and
  replays its graph of that bucket; the graphs hold the collectives, so ranks replay them in lockstep.
- STOP: no payload; the ranks leave their loop.
- RANK_PAGES: pages rank to rank over a side transport; a=sub-op (pools / attach / write); rank_pages.py.
- NOOP: no payload; rank 0 sends one when no plan went out for runner.KEEPALIVE_S, so the receive an idle
  rank waits in never reaches the group's collective timeout (which would end that rank).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import torch

from services.engine.attention import AttentionMetadata

HEADER = 8


class Op(enum.IntEnum):
    STEP = 1
    EXPORT = 2
    IMPORT = 3
    STOP = 4
    TRACE = 5
    GRAPH = 6
    RANK_PAGES = 7
    NOOP = 8


@dataclass
class StepPlan:
    ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sampled_rows: list[int]


def encode_step(ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata, sampled_rows: list[int]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, payload) of one forward, on the CPU."""
    t, (b, m) = ids.shape[0], meta.block_tables.shape
    header = torch.tensor([Op.STEP, t, b, m, meta.num_decode, len(sampled_rows), 0, 0], dtype=torch.int64)
    payload = torch.cat([ids.cpu(), pos.cpu(), meta.slot_mapping.cpu(), meta.block_tables.cpu().reshape(-1).long(),
                         torch.tensor(meta.context_lens_host, dtype=torch.int64),
                         torch.tensor(meta.query_lens, dtype=torch.int64),
                         torch.tensor(sampled_rows, dtype=torch.int64)])
    return header, payload


def step_payload_len(header: torch.Tensor) -> int:
    _, t, b, m, _, s = header[:6].tolist()
    return 3 * t + b * m + 2 * b + s


def decode_step(header: torch.Tensor, payload: torch.Tensor, device: torch.device) -> StepPlan:
    _, t, b, m, nd, s = header[:6].tolist()
    parts = payload.split([t, t, t, b * m, b, b, s])
    ids, pos, slots, bt, ctx, ql, rows = parts
    query_lens = ql.tolist()
    cu = torch.zeros(b + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(ql, 0)
    meta = AttentionMetadata(
        slot_mapping=slots.to(device),
        block_tables=bt.to(torch.int32).reshape(b, m).to(device),
        context_lens=ctx.to(torch.int32).to(device),
        query_lens=query_lens,
        context_lens_host=ctx.tolist(),
        num_decode=nd,
        cu_seqlens_q=cu.to(device),
    )
    return StepPlan(ids.to(device), pos.to(device), meta, rows.tolist())


@dataclass
class GraphPlan:
    """One decode-graph replay: the bucket and the host arrays of its B rows."""

    bucket: int
    ids: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    context_lens: np.ndarray
    block_tables: np.ndarray
    """[B, M] block ids (each row valid up to its context length)."""


def encode_graph(plan: GraphPlan) -> tuple[torch.Tensor, torch.Tensor]:
    b, m = plan.block_tables.shape
    header = torch.tensor([Op.GRAPH, plan.bucket, b, m, 0, 0, 0, 0], dtype=torch.int64)
    payload = np.concatenate([plan.ids, plan.positions, plan.slots, plan.context_lens,
                              plan.block_tables.reshape(-1)]).astype(np.int64)
    return header, torch.from_numpy(payload)


def graph_payload_len(header: torch.Tensor) -> int:
    _, _, b, m = header[:4].tolist()
    return 4 * b + b * m


def decode_graph(header: torch.Tensor, payload: torch.Tensor) -> GraphPlan:
    _, bucket, b, m = header[:4].tolist()
    ids, pos, slots, ctx, tables = np.split(payload.numpy(), [b, 2 * b, 3 * b, 4 * b])
    return GraphPlan(bucket, ids, pos, slots, ctx, tables.reshape(b, m))


def simple(op: Op, n: int = 0) -> torch.Tensor:
    """Header of an EXPORT / IMPORT (n pages) or STOP message."""
    return torch.tensor([op, n, 0, 0, 0, 0, 0, 0], dtype=torch.int64)


def encode_trace(start_unix: float, duration_s: float, stem: str) -> tuple[torch.Tensor, torch.Tensor]:
    raw = stem.encode()
    header = torch.tensor([Op.TRACE, round(start_unix * 1000), round(duration_s * 1000), len(raw), 0, 0, 0, 0],
                          dtype=torch.int64)
    return header, torch.tensor(list(raw), dtype=torch.int64)


def decode_trace(header: torch.Tensor, payload: torch.Tensor) -> tuple[float, float, str]:
    """(start Unix s, duration s, file stem) of a TRACE message."""
    return int(header[1]) / 1000, int(header[2]) / 1000, bytes(payload.tolist()).decode()
