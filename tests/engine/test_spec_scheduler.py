"""Scheduler bookkeeping of speculative decoding: slot reservation, caps, accepted runs (no model)."""

from __future__ import annotations

from services.engine.block_manager import BlockManager
from services.engine.scheduler import Scheduler, SchedulerConfig
from services.engine.sequence import FinishReason, Sequence, SequenceStatus
from services.text.sampling_params import Sampled, SamplingParams

BS = 4


def _sched(num_blocks: int = 16, k: int = 3, budget: int = 64) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_prefill_chunk=16, max_model_len=64,
                          spec_tokens=k)
    return Scheduler(cfg, BlockManager(num_blocks, BS, True), {2})


def _decoding(s: Scheduler, prompt_len: int = 6, max_tokens: int = 20, stop: list[int] | None = None) -> Sequence:
    """A sequence whose prompt is computed and whose first token is sampled (next step decodes)."""
    seq = Sequence(list(range(10, 10 + prompt_len)), SamplingParams(max_tokens=max_tokens, stop_token_ids=stop or []))
    s.add(seq)
    out = s.schedule()
    assert out.chunks[0].spec_tokens == 0  # a prefill chunk never speculates
    s.update_from_output(out, {seq.seq_id: Sampled(50)})
    return seq


def test_decode_reserves_k_plus_one_slots_and_takes_the_run() -> None:
    s = _sched()
    seq = _decoding(s)
    out = s.schedule()
    ch = out.chunks[0]
    assert (ch.num_new_tokens, ch.spec_tokens, out.num_batched_tokens) == (1, 3, 1)
    assert len(seq.block_table) * BS >= len(seq.token_ids) + 3  # positions n-1 .. n-1+k have slots
    s.update_from_output(out, {seq.seq_id: [Sampled(60), Sampled(61), Sampled(62)]})  # 2 accepted + 1
    assert seq.token_ids[-4:] == [50, 60, 61, 62]
    assert seq.num_computed_tokens == len(seq.token_ids) - 1
    s.check_invariants()


def test_k_is_capped_by_max_tokens_and_budget() -> None:
    s = _sched(k=7)
    seq = _decoding(s, max_tokens=4)  # 1 output so far, 3 more allowed: at most 2 drafts + 1
    assert s.schedule().chunks[0].spec_tokens == 2
    s2 = _sched(k=7, budget=3)
    _decoding(s2, prompt_len=3)  # the prompt fits one step's budget
    assert s2.schedule().chunks[0].spec_tokens == 2  # 1 token + 2 drafts fill the budget of 3
    assert seq.status == SequenceStatus.RUNNING


def test_no_room_for_drafts_decodes_one_token_without_preempting() -> None:
    s = _sched(num_blocks=4, k=7)
    a, b = (Sequence(list(range(10, 17)), SamplingParams(max_tokens=20)) for _ in range(2))
    s.add(a)
    s.add(b)
    out = s.schedule()  # both prompts in one step: 2 blocks each, the pool is full
    s.update_from_output(out, {a.seq_id: Sampled(50), b.seq_id: Sampled(50)})
    assert s.block_manager.num_free_blocks == 0
    out = s.schedule()  # position 7 still fits each sequence's second block; drafts would need a third
    assert [c.spec_tokens for c in out.chunks] == [0, 0] and not out.preempted
    assert a.status == b.status == SequenceStatus.RUNNING


def test_a_stop_token_inside_the_run_ends_it_there() -> None:
    s = _sched()
    seq = _decoding(s, stop=[61])
    out = s.schedule()
    run = [Sampled(60), Sampled(61), Sampled(62)]
    finished = s.update_from_output(out, {seq.seq_id: run})
    assert finished == [seq] and seq.finish_reason == FinishReason.STOP
    assert run == [Sampled(60), Sampled(61)]  # cut to the tokens appended
    assert seq.output_token_ids == [50, 60, 61] and not seq.block_table
