"""Async scheduling's runner half: launch a step without waiting for its tokens, collect them later.

``launch(runner, out, prev)`` runs the step's forward and sampling on the device and starts one copy of
what the host needs (tokens, logprob tables: `Sampler.pack`) into pinned memory; it returns before that
copy lands. A decode row whose input token is the previous step's still in-flight token (a
PLACEHOLDER_TOKEN in ``seq.token_ids``) is fed from ``prev``'s device tokens by one gather on the device,
after the inputs' host->device copy. ``collect`` waits for the copy and unpacks one Sampled per sampling
chunk. On CPU the forward itself is synchronous: the same calls then only reorder bookkeeping (what
tests compare with synchronous steps).

Paths: the CPU eager step, the GPU eager step and the decode CUDA graphs (tensor-parallel runners, a
draft model and the compiled CPU decode step keep synchronous steps: the engine does not launch them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine.attention import ForwardContext
from services.engine.sampler import Sampled, SamplingRow, device_index
from services.engine.scheduler import PLACEHOLDER_TOKEN, ScheduledChunk, SchedulerOutput
from services.engine.step_inputs import sampled_rows

__all__ = ["LaunchedStep", "collect", "launch"]


@dataclass
class LaunchedStep:
    seq_ids: list[int]
    """Sequences that sample, in the order of ``tokens``."""
    rows: list[SamplingRow]
    tokens: torch.Tensor
    """int64 [len(seq_ids)] on the device: what the next step's placeholders read."""
    host: torch.Tensor
    """Pinned fp32 copy of `Sampler.pack` (valid once ``done`` has passed)."""
    done: torch.cuda.Event | None
    """Recorded after the copy (None on CPU: the copy has happened)."""
    vocab: int

    def row_of(self) -> dict[int, int]:
        return {sid: i for i, sid in enumerate(self.seq_ids)}


def _feeds(chunks: list[ScheduledChunk], prev: LaunchedStep | None) -> tuple[list[int], list[int]]:
    """(flat input positions, rows of prev.tokens) of the inputs that are in-flight tokens."""
    dst, src = [], []
    rows = prev.row_of() if prev is not None else {}
    offset = 0
    for ch in chunks:
        seq = ch.seq
        offset += ch.num_new_tokens
        # A placeholder is only ever a sequence's last token (one step in flight): check the chunk's end alone.
        if seq.num_computed_tokens + ch.num_new_tokens == len(seq.token_ids) and seq.token_ids[-1] == PLACEHOLDER_TOKEN:
            if seq.seq_id not in rows:
                raise RuntimeError(f"seq {seq.seq_id}: an in-flight input token that no launched step samples")
            dst.append(offset - 1)
            src.append(rows[seq.seq_id])
    return dst, src


def launch(runner, out: SchedulerOutput, prev: LaunchedStep | None) -> LaunchedStep | None:
    """Run ``out`` on the runner's device; None when no chunk samples (nothing to collect)."""
    chunks = sorted(out.chunks, key=lambda c: c.num_new_tokens != 1)  # decode rows first (the backends' order)
    device = runner.device
    dst, src = _feeds(chunks, prev)
    patch = None
    if dst:
        assert prev is not None
        patch = (device_index(dst, device), prev.tokens[device_index(src, device)])
    ends, rows, seq_ids = sampled_rows(chunks)
    graphs = runner.graphs
    table = None
    greedy = None
    if device.type == "cuda" and graphs is not None and all(c.num_new_tokens == 1 for c in chunks) \
            and len(ends) == len(chunks) and "compute_logits" not in vars(runner.model):
        bucket = graphs.bucket_for(len(chunks), max(c.seq.num_computed_tokens + 1 for c in chunks))
    else:
        bucket = None
    if bucket is not None:
        graphs.fill_host(bucket, [c.seq for c in chunks])
        _, logits, greedy = graphs.replay(bucket, len(chunks), patch)
    else:
        if graphs is not None:
            graphs.invalidate_rows()
        ids, pos, meta = runner._prepare_gpu(chunks) if device.type == "cuda" else runner._prepare(chunks)
        if patch is not None:
            ids[patch[0]] = patch[1]
        hidden = runner.model(ids, pos, ForwardContext(runner.attn_backend, meta))
        if not ends:
            return None
        if len(ends) < hidden.shape[0]:
            hidden = hidden[device_index(ends, device)]
        logits = runner.model.compute_logits(hidden)
    if greedy is not None and all(r.params.greedy for r in rows):
        tokens = greedy
    else:
        tokens = runner.sampler.tokens(logits, rows)
    if bucket is not None and any(r.params.logprobs for r in rows):
        table = graphs.logprob_table(bucket, tokens)
    packed = runner.sampler.pack(logits, tokens, rows, table)
    if device.type != "cuda":
        return LaunchedStep(seq_ids, rows, tokens.clone(), packed.clone(), None, logits.shape[1])
    host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
    host.copy_(packed, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    # tokens: a graph's static output is overwritten by the next replay; the next step reads a copy.
    return LaunchedStep(seq_ids, rows, tokens.clone(), host, done, logits.shape[1])


def collect(runner, step: LaunchedStep) -> dict[int, Sampled]:
    """Wait for a launched step's copy to land; seq_id -> Sampled."""
    if step.done is not None:
        step.done.synchronize()
    return dict(zip(step.seq_ids, runner.sampler.unpack(step.host, step.rows, step.vocab), strict=True))
