"""Small factories for scheduler and block-manager tests: synthetic pools, no model, no tensors."""

from __future__ import annotations

import random

from services.engine.block_manager import BlockManager
from services.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from services.engine.sequence import Sequence
from services.text.sampling_params import SamplingParams

EOS = 2
"""EOS token id of the synthetic vocabulary; generated filler tokens avoid it."""


def make_seq(
    prompt: list[int] | int,
    max_tokens: int = 16,
    *,
    ignore_eos: bool = False,
    stop_token_ids: list[int] | None = None,
    seed: int = 0,
) -> Sequence:
    """A sequence with the given prompt, or a random prompt of that many tokens in [10, 1000)."""
    if isinstance(prompt, int):
        rng = random.Random(seed)
        prompt = [rng.randrange(10, 1000) for _ in range(prompt)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, stop_token_ids=stop_token_ids or [])
    return Sequence(token_ids=list(prompt), params=params.validate())


def make_block_manager(num_blocks: int = 8, block_size: int = 4, prefix_caching: bool = True) -> BlockManager:
    return BlockManager(num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=prefix_caching)


def make_scheduler(
    num_blocks: int = 16,
    block_size: int = 4,
    *,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 32,
    max_prefill_chunk: int = 16,
    max_model_len: int = 256,
    prefix_caching: bool = True,
    eos: int = EOS,
) -> Scheduler:
    cfg = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_prefill_chunk=max_prefill_chunk,
        max_model_len=max_model_len,
    )
    return Scheduler(cfg, make_block_manager(num_blocks, block_size, prefix_caching), {eos})


def fake_sample(out: SchedulerOutput, token: int = 7) -> dict[int, tuple[int, float | None]]:
    """Every sampling chunk samples ``token`` with logprob -0.5."""
    return {c.seq.seq_id: (token, -0.5) for c in out.chunks if c.sample}


def step(sched: Scheduler, token: int = 7) -> tuple[SchedulerOutput, list[Sequence]]:
    """One schedule -> fake model -> update round, checking invariants on both sides."""
    out = sched.schedule()
    sched.check_invariants()
    finished = sched.update_from_output(out, fake_sample(out, token))
    sched.check_invariants()
    return out, finished


def run_to_completion(sched: Scheduler, max_steps: int = 10_000, token: int = 7) -> int:
    """Step until no work is left; returns the number of steps."""
    for n in range(max_steps):
        if not sched.has_work:
            return n
        step(sched, token)
    raise AssertionError(f"scheduler still has work after {max_steps} steps")
