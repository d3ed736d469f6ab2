"""Decode priority (mixed_step_interval): while sequences decode, prompt chunks join one step in N."""

from __future__ import annotations

import pytest

from services.engine.scheduler import Scheduler, SchedulerConfig
from tests.engine.factories import make_block_manager, make_seq, step


def _sched(interval: int) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, max_prefill_chunk=16, max_model_len=256,
                          mixed_step_interval=interval)
    return Scheduler(cfg, make_block_manager(64, 4), {2})


def _kinds(out) -> tuple[int, int]:
    """(decode chunks, prompt chunks) of one step."""
    return sum(c.num_new_tokens == 1 for c in out.chunks), sum(c.num_new_tokens > 1 for c in out.chunks)


@pytest.mark.parametrize("interval", [1, 2, 4])
def test_prompts_join_one_step_in_n_while_sequences_decode(interval: int) -> None:
    sched = _sched(interval)
    sched.add(make_seq(8, max_tokens=40, ignore_eos=True))
    out, _ = step(sched)  # nothing decodes yet: the prompt is computed at once
    assert _kinds(out) == (0, 1)
    sched.add(make_seq(40, max_tokens=4, ignore_eos=True, seed=1))  # 40 tokens: three chunks of <= 16
    kinds = [_kinds(step(sched)[0]) for _ in range(3 * interval)]
    mixed = [i for i, k in enumerate(kinds) if k[1]]
    assert all(k[0] >= 1 for k in kinds)  # the decoding sequence runs every step
    # The first step carried a prompt: the next prompt chunk waits N - 1 decode-only steps, and so on.
    assert mixed == list(range(interval - 1, 3 * interval, interval))


def test_nothing_decoding_never_stalls_prompts() -> None:
    sched = _sched(8)
    sched.add(make_seq(40, max_tokens=2, ignore_eos=True))
    kinds = [_kinds(step(sched)[0]) for _ in range(3)]
    assert kinds == [(0, 1), (0, 1), (0, 1)]  # 16 + 16 + 8 tokens in three consecutive steps


def test_interval_is_validated() -> None:
    with pytest.raises(ValueError, match="mixed_step_interval"):
        SchedulerConfig(mixed_step_interval=0)
