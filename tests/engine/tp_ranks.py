"""Rank bodies for the tensor-parallel tests (spawned processes import this module, not pytest's)."""

from __future__ import annotations

import traceback
from typing import Any

import torch

from services.engine.attention import ForwardContext
from services.engine.config import EngineConfig
from services.engine.model_loader import load_model
from services.engine.model_runner import ModelRunner
from services.engine.parallel.group import connect, open_store
from services.engine.parallel.loader import load_shard
from services.engine.scheduler import ScheduledChunk
from services.engine.sequence import Sequence
from services.text.sampling_params import SamplingParams

BLOCK = 4
PROMPTS = [[5, 9, 200, 31, 7, 7, 64, 300, 12, 1, 99], [17, 254, 3, 80, 80, 81]]
"""Two prompts of different lengths; the first is prefilled in two chunks (the second reads the cache)."""


def _logit_trace(runner: ModelRunner, decode_steps: int) -> list[torch.Tensor]:
    """Prefill (chunked) then greedy decode over the paged cache; the fp32 logits of every sampled row."""
    model = runner.model
    seqs = [Sequence(list(p), SamplingParams(max_tokens=decode_steps + 1)) for p in PROMPTS]
    nxt = 0
    for s in seqs:
        need = (len(s.token_ids) + decode_steps + BLOCK) // BLOCK
        s.block_table = list(range(nxt, nxt + need))
        nxt += need
    out: list[torch.Tensor] = []

    def run(chunks: list[ScheduledChunk]) -> torch.Tensor:
        ids, pos, meta = runner._prepare(chunks)
        hidden = model(ids, pos, ForwardContext(runner.attn_backend, meta))
        ends, off = [], 0
        for ch in chunks:
            off += ch.num_new_tokens
            ends.append(off - 1)
        logits = model.compute_logits(hidden[torch.tensor(ends)])
        for ch in chunks:
            ch.seq.num_computed_tokens += ch.num_new_tokens
        return logits

    out.append(run([ScheduledChunk(seqs[0], 6, False), ScheduledChunk(seqs[1], 6, True)]))
    out.append(run([ScheduledChunk(seqs[0], len(PROMPTS[0]) - 6, True)]))
    for _ in range(decode_steps):  # greedy tokens of the last logits, fed to both sequences
        tokens = out[-1].argmax(-1).tolist() if out[-1].shape[0] == 2 else [out[-1].argmax(-1).item(),
                                                                           out[0][1].argmax(-1).item()]
        for s, t in zip(seqs, tokens, strict=True):
            s.token_ids.append(int(t))
        out.append(run([ScheduledChunk(s, 1, True) for s in seqs]))
    return out


def logits_rank(rank: int, size: int, port: int, specs: list[str], steps: int, results: Any) -> None:
    """Compare TP=size logits with this process's own TP=1 run, per spec: results gets (rank, max diffs)."""
    try:
        torch.set_num_threads(1)
        group = connect(open_store(size, port), rank, size, torch.device("cpu"))
        diffs = {}
        for spec in specs:
            cfg = EngineConfig(model=spec, dtype="float32", block_size=BLOCK, num_kv_blocks=32)
            ref = _logit_trace(ModelRunner(load_model(spec, torch.float32, "cpu"), cfg), steps)
            tp = ModelRunner(load_shard(spec, torch.float32, "cpu", group), cfg)
            got = _logit_trace(tp, steps)
            assert tp.kv_cache.shape[-2] == tp.model.tp_split.local_kv_heads
            diffs[spec] = (tp.kv_cache.shape[-2], [float((a - b).abs().max()) for a, b in zip(ref, got, strict=True)])
        results.put((rank, diffs))
    except BaseException:
        results.put((rank, traceback.format_exc()))
