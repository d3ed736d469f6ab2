"""One engine step with a draft model: mirror, propose, verify in one target forward.

Per step, for the scheduler's chunks (``ScheduledChunk.spec_tokens`` = k > 0 marks a decode chunk that
speculates; the scheduler reserved slots for positions n-1 .. n-1+k of its n tokens):

  1. draft pass 0, one forward: every plain chunk's tokens (the draft KV mirrors every position the
     target computes, so each block holds both regions), and for each speculating sequence its last two
     tokens (positions n-2, n-1): recomputing n-2 makes the draft KV valid through n-1 whatever the
     previous step accepted, with no per-sequence draft state. Its last logits give draft token d1.
     Position n-2 may lie in a prefix-cache block other sequences share: the rewrite puts back what the
     block holds (same tokens, same prefix) up to float rounding, and draft KV only steers proposals.
  2. draft passes 1 .. k-1: one token per speculating sequence (d_j at position n-1+j) -> d_{j+1}.
  3. target, ONE forward: plain chunks as usual, and [t_{n-1}, d1 .. dk] at positions n-1 .. n-1+k
     for each speculating sequence; logits at all k+1 positions.
  4. verify (spec.verify): greedy prefix match, rejection sampling, or synthetic acceptance. The
     sequence gains the accepted drafts and one more token; target KV past the accepted tokens (and
     draft KV past them) lies beyond num_computed_tokens and is overwritten by later steps, never read.

Results: plain chunks map to one Sampled, speculating ones to a list (accepted drafts + 1 token).
On CUDA with graphs on, a pure-decode step of greedy rows without logprobs replays the whole step in one
CUDA graph (spec/graphs.py); any other step runs eagerly here. Either way the host reads token ids only
(one device->host copy per forward) unless a row samples or asks for logprobs.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
from dataclasses import dataclass, field

import numpy as np
import torch

from services.common.pb import decode_pb2
from services.engine.attention import ForwardContext, TorchPagedAttention
from services.engine.kv_layout import PageLayout, Region
from services.engine.page_regions import KVRegion
from services.engine.region_pools import with_region_pool
from services.engine.sampler import SamplingRow
from services.engine.scheduler import ScheduledChunk, SchedulerOutput
from services.engine.shared_kv import allocate_kv
from services.engine.spec.attention import UniformQueryAttention
from services.engine.spec.draft import Draft, DraftConfigError, load_draft
from services.engine.spec.graphs import GraphStep, SpecGraphs
from services.engine.spec.verify import (
    draw,
    greedy_accept,
    probs_for,
    rejection_sample,
    row_generator,
    synthetic_count,
    with_logprobs,
)
from services.engine.step_inputs import prepare_rows
from services.text.sampling_params import Sampled

log = logging.getLogger(__name__)

Row = tuple[list[int], int, list[int]]
"""(new token ids, position of the first, block table): one sequence's part of a forward."""


@dataclass
class SpecStats:
    """Counters since start (the decode service turns them into metrics)."""

    synthetic: bool
    proposed: int = 0
    """Draft tokens proposed."""
    accepted: int = 0
    """Draft tokens accepted (in synthetic mode: the synthetic count)."""
    steps: int = 0
    """Verify rows (one sequence in one step)."""
    accept_hist: list[int] = field(default_factory=list)
    """accept_hist[m]: verify rows that accepted m drafts."""

    def record(self, k: int, m: int) -> None:
        self.proposed += k
        self.accepted += m
        self.steps += 1
        if len(self.accept_hist) <= m:
            self.accept_hist.extend([0] * (m + 1 - len(self.accept_hist)))
        self.accept_hist[m] += 1

    @property
    def mean_accepted(self) -> float:
        """Accepted drafts per verify row (the acceptance length less the one token every step makes)."""
        return self.accepted / self.steps if self.steps else 0.0


@dataclass
class _Spec:
    chunk: ScheduledChunk
    row: SamplingRow
    gen: torch.Generator
    drafts: list[int] = field(default_factory=list)
    q: list[torch.Tensor] = field(default_factory=list)
    """Draft distributions [V] the drafts were drawn from (non-greedy rows only)."""


class SpecDecoder:
    def __init__(self, loaded, config) -> None:
        self.config = config
        self.num_spec_tokens = config.spec_tokens
        self.synthetic = config.spec_synthetic_acceptance
        if loaded.model.tp_split.tp_size > 1:
            raise DraftConfigError("--draft-model / PDSERVE_DRAFT_MODEL: speculative decoding does not run with "
                                   "--tensor-parallel-size > 1 yet (the draft region is not sharded)")
        self.draft: Draft = load_draft(config.draft_model, loaded, config.torch_dtype, config.device)
        if self.synthetic > 0:
            log.warning("speculative decoding: SYNTHETIC acceptance (%.2f drafts per step, unchecked): output is "
                        "not the model's; metrics carry acceptance=\"synthetic\"", config.spec_synthetic_acceptance)
        self.draft_codec = (PageLayout.codec_for_dtype(config.torch_dtype) if config.draft_kv_codec == "native"
                            else config.draft_kv_codec)
        self.stats = SpecStats(synthetic=self.synthetic > 0)
        self._gen = torch.Generator().manual_seed(config.seed + 1)
        self.kv_cache: torch.Tensor | None = None
        self.backend = None
        self._target_backend: tuple[object, object] | None = None
        """(the runner's attention backend, the one verify forwards use over it)."""
        self.graphs: SpecGraphs | None = None
        """Captured whole speculative steps (CUDA only; capture_graphs)."""
        self.pool_destination: decode_pb2.KVDestination | None = None
        """The draft pool as a same-host prefill opens it (shm / CUDA IPC), when shared."""
        self.shm_path: str | None = None

    def bytes_per_block(self) -> int:
        return self.draft.bytes_per_block(self.config.block_size, self.config.torch_dtype)

    def region(self) -> Region:
        return self.draft.region(self.config.block_size, self.draft_codec)

    def allocate(self, num_blocks: int, make_backend) -> None:
        """The draft KV region [draft layers, 2, num_blocks, block_size, kv heads, head dim]; with
        --kv-cache-shared a /dev/shm file (CPU) or a CUDA IPC export that same-host prefills write into."""
        d, cfg = self.draft, self.config
        shape = (d.num_layers, 2, num_blocks, cfg.block_size, d.num_kv_heads, d.head_dim)
        self.kv_cache, self.shm_path, self.pool_destination = allocate_kv(
            shape, cfg.torch_dtype, torch.device(cfg.device), cfg.kv_cache_shared, "draft KV pool")
        if self.shm_path is not None:
            atexit.register(self.release)
        self.backend = _batched(make_backend(self.kv_cache, d.head_dim))

    def offer(self, dest: decode_pb2.KVDestination | None) -> decode_pb2.KVDestination | None:
        """The runner's shared target pool ``dest`` with this draft pool beside it (region_pools.py); ``dest``
        unchanged when the draft pool is private (side transports then see no draft pool: page bytes)."""
        if dest is None or self.pool_destination is None:
            return dest
        return with_region_pool(dest, self.pool_destination, self.region())

    def release(self) -> None:
        """Remove the shared draft pool's /dev/shm file."""
        if self.shm_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.shm_path)
            self.shm_path = None
            self.pool_destination = None

    def capture_graphs(self, runner) -> None:
        """Capture the speculative step per batch bucket (runner: Triton attention on CUDA, max_model_len set)."""
        assert self.backend is not None
        spec = SpecGraphs(self.draft.model, self.backend, runner.model, runner.attn_backend, self.num_spec_tokens,
                          self.config.max_num_seqs, runner.max_model_len, self.config.block_size, runner.device)
        for rotary in {id(r): r for r in (runner.model.rotary, _rotary_of(self.draft.model))}.values():
            rotary.ensure(spec.max_positions)  # unused rows run up to K positions past max_model_len
        spec.capture()
        self.graphs = spec

    def page_region(self) -> KVRegion:
        """The draft region of every page, packed in the draft codec (page_regions.py)."""
        assert self.kv_cache is not None
        return KVRegion("draft", self.kv_cache, self.draft_codec)

    # --- the step ---

    def _forward(self, model, backend, rows: list[Row], device: torch.device) -> tuple[torch.Tensor, list[int]]:
        """Hidden states of one forward over rows, and each row's first flat index (rows keep their order
        for the caller; one-token rows go first inside)."""

        order = sorted(range(len(rows)), key=lambda i: len(rows[i][0]) != 1)
        ids, pos, meta = prepare_rows([rows[i] for i in order], self.config.block_size, device)
        hidden = model(ids, pos, ForwardContext(backend, meta))
        starts = [0] * len(rows)
        off = 0
        for i in order:
            starts[i] = off
            off += len(rows[i][0])
        return hidden, starts

    def _propose(self, specs: list[_Spec], logits: torch.Tensor) -> None:
        """Append one draft token per spec from its draft logits row (device logits [len(specs), V]):
        greedy rows from one argmax over the batch, sampling rows from their distribution on the host."""
        greedy = logits.argmax(dim=-1).tolist()
        sampling = [i for i, s in enumerate(specs) if not s.row.params.greedy]
        host = logits[torch.tensor(sampling, device=logits.device)].float().cpu() if sampling else None
        for i, s in enumerate(specs):
            if s.row.params.greedy:
                s.drafts.append(greedy[i])
        for j, i in enumerate(sampling):
            s = specs[i]
            q = probs_for(host[j:j + 1], s.row.params)[0]
            s.q.append(q)
            s.drafts.append(draw(q, s.gen))

    @torch.inference_mode()
    def execute(self, runner, out: SchedulerOutput) -> dict[int, Sampled | list[Sampled]]:
        if self.graphs is not None and "compute_logits" not in vars(runner.model):
            result = self._execute_graph(out)
            if result is not None:
                return result
        return self._execute_eager(runner, out)

    def _execute_graph(self, out: SchedulerOutput) -> dict[int, Sampled | list[Sampled]] | None:
        """A pure-decode step of greedy rows without logprobs in one replay; None: not such a step."""
        assert self.graphs is not None
        chunks = out.chunks
        if not all(c.num_new_tokens == 1 and c.sample and len(c.seq.token_ids) >= 2 and c.seq.params.greedy
                   and not c.seq.params.logprobs for c in chunks):
            return None
        bucket = self.graphs.bucket_for(len(chunks))
        if bucket is None:
            return None
        res = self.graphs.run(bucket, [GraphStep(c.seq.token_ids, c.seq.block_table, c.spec_tokens)
                                       for c in chunks])
        k_all = self.num_spec_tokens
        drafts, greedy = res[:, :k_all], res[:, k_all:]
        agree = np.cumprod(drafts == greedy[:, :k_all], axis=1).sum(axis=1)  # leading drafts the target agrees on
        result: dict[int, Sampled | list[Sampled]] = {}
        for i, c in enumerate(chunks):
            seq, k = c.seq, c.spec_tokens
            if not k:
                result[seq.seq_id] = Sampled(int(greedy[i, 0]))
                continue
            if self.synthetic > 0:
                m = synthetic_count(self.synthetic, k, row_generator(SamplingRow(seq.params, seq.num_output_tokens),
                                                                     self._gen))
            else:
                m = min(int(agree[i]), k)
            self.stats.record(k, m)
            result[seq.seq_id] = [Sampled(int(t)) for t in (*drafts[i, :m], greedy[i, m])]
        return result

    def _execute_eager(self, runner, out: SchedulerOutput) -> dict[int, Sampled | list[Sampled]]:
        dev = runner.device
        plain = [c for c in out.chunks if not c.spec_tokens]
        specs = [_Spec(c, row := SamplingRow(c.seq.params, c.seq.num_output_tokens), row_generator(row, self._gen))
                 for c in out.chunks if c.spec_tokens]
        dm = self.draft.model
        # 1. draft pass 0: mirror plain chunks, and the last two tokens of speculating sequences.
        rows: list[Row] = [_chunk_row(c) for c in plain]
        for s in specs:
            seq = s.chunk.seq
            n = len(seq.token_ids)
            rows.append((seq.token_ids[n - 2:n], n - 2, seq.block_table))
        hidden, starts = self._forward(dm, self.backend, rows, dev)
        if specs:
            last = [starts[len(plain) + i] + 1 for i in range(len(specs))]
            self._propose(specs, dm.compute_logits(hidden[torch.tensor(last, device=hidden.device)]))
        # 2. draft passes 1 .. k-1.
        for j in range(1, max((s.chunk.spec_tokens for s in specs), default=0)):
            active = [s for s in specs if s.chunk.spec_tokens > j]
            rows = [([s.drafts[-1]], len(s.chunk.seq.token_ids) - 1 + j, s.chunk.seq.block_table) for s in active]
            hidden, _ = self._forward(dm, self.backend, rows, dev)
            self._propose(active, dm.compute_logits(hidden))
        # 3. the target verifies every speculating sequence in the same forward as the plain chunks.
        rows = [_chunk_row(c) for c in plain]
        for s in specs:
            seq = s.chunk.seq
            rows.append(([seq.token_ids[-1], *s.drafts], len(seq.token_ids) - 1, seq.block_table))
        if self._target_backend is None or self._target_backend[0] is not runner.attn_backend:
            self._target_backend = (runner.attn_backend, _batched(runner.attn_backend))
        hidden, starts = self._forward(runner.model, self._target_backend[1], rows, dev)
        picks: list[int] = []
        plain_rows: list[SamplingRow] = []
        plain_ids: list[int] = []
        for c, st in zip(plain, starts, strict=False):
            if c.sample:
                picks.append(st + c.num_new_tokens - 1)
                plain_rows.append(SamplingRow(c.seq.params, c.seq.num_output_tokens))
                plain_ids.append(c.seq.seq_id)
        for i, s in enumerate(specs):
            st = starts[len(plain) + i]
            picks.extend(range(st, st + len(s.drafts) + 1))
        if not picks:
            return {}
        logits = runner.model.compute_logits(hidden[torch.tensor(picks, device=hidden.device)])
        greedy = logits.argmax(dim=-1).tolist()  # the step's one device->host copy unless a row samples
        result: dict[int, Sampled | list[Sampled]] = {}
        if plain_rows:
            np_ = len(plain_rows)
            if all(r.params.greedy and not r.params.logprobs for r in plain_rows):
                result.update(zip(plain_ids, (Sampled(t) for t in greedy[:np_]), strict=True))
            else:
                result.update(zip(plain_ids, runner.sampler.sample(logits[:np_], plain_rows), strict=True))
        off = len(plain_rows)
        for s in specs:
            k = len(s.drafts)
            result[s.chunk.seq.seq_id] = self._verify(s, logits[off:off + k + 1], greedy[off:off + k + 1])
            off += k + 1
        return result

    def _verify(self, s: _Spec, logits: torch.Tensor, greedy: list[int]) -> list[Sampled]:
        """logits [k+1, V] (device): the target's after t_{n-1}, d1, .., dk; greedy: their argmax. The
        logits come to the host only for a row that samples or reports logprobs."""
        params, k = s.row.params, len(s.drafts)
        host = None if params.greedy and not params.logprobs else logits.float().cpu()
        if self.synthetic > 0:
            m = synthetic_count(self.synthetic, k, s.gen)
            bonus = greedy[m] if params.greedy else draw(probs_for(host[m:m + 1], params)[0], s.gen)
            tokens = [*s.drafts[:m], bonus]
        elif params.greedy:
            tokens, m = greedy_accept(greedy, s.drafts)
        else:
            tokens, m = rejection_sample(probs_for(host, params), torch.stack(s.q), s.drafts, s.gen)
        self.stats.record(k, m)
        return [Sampled(t) for t in tokens] if host is None else with_logprobs(tokens, host, params)


def _batched(backend):
    """On CPU, a backend that runs rows of one common query length together (spec/attention.py)."""
    return UniformQueryAttention(backend) if isinstance(backend, TorchPagedAttention) else backend


def _rotary_of(model: torch.nn.Module):
    """The rotary cache a draft's forward reads (a layers:N draft reads the target's)."""
    target = getattr(model, "target", None)
    return target[0].rotary if isinstance(target, list) else model.rotary


def _chunk_row(c: ScheduledChunk) -> Row:
    start = c.seq.num_computed_tokens
    return c.seq.token_ids[start:start + c.num_new_tokens], start, c.seq.block_table

