from __future__ import annotations

import random

import pytest

from services.engine.block_manager import NoFreeBlocksError
from services.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from services.engine.sequence import FinishReason, Sequence, SequenceStatus
from tests.engine.factories import EOS, fake_sample, make_scheduler, make_seq, run_to_completion, step


def _ids(out: SchedulerOutput) -> list[tuple[int, int, bool]]:
    return [(c.seq.seq_id, c.num_new_tokens, c.sample) for c in out.chunks]


def test_config_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="max_prefill_chunk"):
        SchedulerConfig(max_prefill_chunk=0)


def test_add_rejects_prompts_that_can_never_fit() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=12)
    with pytest.raises(ValueError, match=r"13 tokens exceeds max_model_len=12"):
        sched.add(make_seq(13))
    big = make_scheduler(num_blocks=2, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match=r"9 tokens needs 3 KV blocks, the pool has 2 blocks"):
        big.add(make_seq(9))
    with pytest.raises(ValueError, match="empty prompt"):
        big.add(make_seq([]))
    big.add(make_seq(8))  # exactly the pool
    assert big.num_waiting == 1


def test_single_seq_prefill_then_decode_until_max_tokens() -> None:
    sched = make_scheduler()
    seq = make_seq(10, max_tokens=3, ignore_eos=True)
    sched.add(seq)
    out, finished = step(sched)
    assert _ids(out) == [(seq.seq_id, 10, True)]
    assert seq.num_computed_tokens == 10 and seq.output_token_ids == [7]
    out, _ = step(sched)
    assert _ids(out) == [(seq.seq_id, 1, True)]
    out, finished = step(sched)
    assert finished == [seq]
    assert seq.status == SequenceStatus.FINISHED and seq.finish_reason == FinishReason.LENGTH
    assert seq.num_output_tokens == 3 and seq.output_logprobs == [-0.5] * 3
    assert not sched.has_work and sched.block_manager.num_free_blocks == 16
    assert sched.get(seq.seq_id) is None


def test_eos_stop_tokens_ignore_eos_and_max_model_len() -> None:
    sched = make_scheduler(max_model_len=12)
    eos_seq = make_seq(4, max_tokens=10, seed=1)
    ignoring = make_seq(4, max_tokens=2, ignore_eos=True, seed=2)
    stop_tok = make_seq(4, max_tokens=10, stop_token_ids=[EOS + 1], seed=3)
    for s in (eos_seq, ignoring, stop_tok):
        sched.add(s)
    out = sched.schedule()
    finished = sched.update_from_output(
        out, {eos_seq.seq_id: (EOS, None), ignoring.seq_id: (EOS, None), stop_tok.seq_id: (EOS + 1, None)}
    )
    assert finished == [eos_seq, stop_tok]
    assert eos_seq.finish_reason == stop_tok.finish_reason == FinishReason.STOP
    assert eos_seq.output_token_ids == [EOS] and eos_seq.output_logprobs == []
    _, finished = step(sched, token=EOS)
    assert finished == [ignoring] and ignoring.finish_reason == FinishReason.LENGTH

    long = make_seq(10, max_tokens=100, seed=4)
    sched.add(long)
    run_to_completion(sched)
    assert long.finish_reason == FinishReason.LENGTH and len(long.token_ids) == 12


def test_chunked_prefill_with_odd_chunk_covers_prompt_exactly() -> None:
    sched = make_scheduler(num_blocks=16, max_prefill_chunk=7, max_num_batched_tokens=64)
    seq = make_seq(30, max_tokens=1)
    sched.add(seq)
    sizes = []
    while seq.status != SequenceStatus.FINISHED:
        out, _ = step(sched)
        (chunk,) = out.chunks
        sizes.append(chunk.num_new_tokens)
        assert chunk.sample == (sum(sizes) == 30)
    assert sizes == [7, 7, 7, 7, 2]
    assert seq.num_output_tokens == 1


def test_budget_split_gives_odd_chunks_and_decode_goes_first() -> None:
    sched = make_scheduler(num_blocks=32, max_num_batched_tokens=10, max_prefill_chunk=16)
    a = make_seq(4, max_tokens=50, ignore_eos=True, seed=1)
    sched.add(a)
    step(sched)  # a prefilled, now decoding
    b = make_seq(23, max_tokens=2, ignore_eos=True, seed=2)
    c = make_seq(3, max_tokens=2, ignore_eos=True, seed=3)
    sched.add(b)
    sched.add(c)
    out, _ = step(sched)
    assert _ids(out) == [(a.seq_id, 1, True), (b.seq_id, 9, False)]  # budget full: c waits
    out, _ = step(sched)
    assert _ids(out) == [(a.seq_id, 1, True), (b.seq_id, 9, False)]
    out, _ = step(sched)
    # b's last 5 prompt tokens, then c is admitted into the 4 tokens left of the budget.
    assert _ids(out) == [(a.seq_id, 1, True), (b.seq_id, 5, True), (c.seq_id, 3, True)]
    out, _ = step(sched)
    assert [c.seq.seq_id for c in out.chunks] == [a.seq_id, b.seq_id, c.seq_id]
    assert all(ch.num_new_tokens == 1 for ch in out.chunks)


def test_max_num_seqs_limits_admission() -> None:
    sched = make_scheduler(num_blocks=32, max_num_seqs=2, max_num_batched_tokens=64)
    seqs = [make_seq(4, max_tokens=3, ignore_eos=True, seed=i) for i in range(5)]
    for s in seqs:
        sched.add(s)
    out, _ = step(sched)
    assert len(out.chunks) == 2 and sched.num_running == 2 and sched.num_waiting == 3
    while sched.has_work:
        out, _ = step(sched)
        assert len(out.chunks) <= 2
    assert all(s.num_output_tokens == 3 for s in seqs)


def test_preemption_recomputes_and_completes_with_same_token_count() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    a = make_seq(4, max_tokens=8, ignore_eos=True, seed=1)
    b = make_seq(4, max_tokens=8, ignore_eos=True, seed=2)
    sched.add(a)
    sched.add(b)
    preempted_steps = []
    while sched.has_work:
        out, _ = step(sched)
        if out.preempted:
            preempted_steps.append(out)
            assert out.preempted == [b]  # most recently admitted
            assert [c.seq for c in out.chunks] == [a]  # nothing admitted in a preempting step
            assert sched.waiting[0] is b and b.num_computed_tokens == 0 and not b.block_table
        assert out.num_batched_tokens <= 64
    assert preempted_steps
    assert a.num_output_tokens == b.num_output_tokens == 8
    assert b.num_preemptions >= 1 and sched.num_preemptions == b.num_preemptions
    assert a.finish_reason == b.finish_reason == FinishReason.LENGTH
    assert sched.block_manager.num_free_blocks == 4


def test_preempting_self_when_alone_with_no_room() -> None:
    sched = make_scheduler(num_blocks=3, block_size=2, max_num_batched_tokens=64)
    a = make_seq(2, max_tokens=5, ignore_eos=True, seed=1)
    sched.add(a)
    step(sched)
    # A KV reservation holds the remaining blocks, so a cannot grow and preempts itself.
    imp = make_seq(4, max_tokens=2, seed=2)
    assert sched.add_kv_import(imp) == 0
    out = sched.schedule()
    assert out.preempted == [a] and out.chunks == [] and a.status == SequenceStatus.WAITING
    sched.update_from_output(out, {})
    sched.check_invariants()
    sched.abort(imp.seq_id)
    run_to_completion(sched)
    assert a.num_output_tokens == 5


def test_abort_in_every_state_frees_blocks() -> None:
    sched = make_scheduler(num_blocks=16, max_num_batched_tokens=8, max_prefill_chunk=8)
    bm = sched.block_manager
    running = make_seq(12, seed=1)
    waiting = make_seq(6, seed=2)
    kv = make_seq(9, seed=3)
    sched.add(running)
    sched.add(waiting)
    sched.add_kv_import(kv)
    step(sched)  # running is partially prefilled; waiting got no budget
    assert running.status == SequenceStatus.RUNNING and running.num_computed_tokens == 8
    assert waiting.status == SequenceStatus.WAITING
    assert kv.status == SequenceStatus.WAITING_FOR_KV and sched.num_waiting_for_kv == 1
    for s in (waiting, kv, running):
        assert sched.abort(s.seq_id) is s
        assert s.status == SequenceStatus.FINISHED and s.finish_reason == FinishReason.ABORT
        assert s.block_table == []
        sched.check_invariants()
    assert sched.abort(running.seq_id) is None
    assert bm.num_free_blocks == 16 and not sched.has_work


def test_abort_between_schedule_and_update_is_ignored() -> None:
    sched = make_scheduler()
    a, b = make_seq(5, seed=1), make_seq(6, seed=2)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    sched.abort(a.seq_id)
    finished = sched.update_from_output(out, fake_sample(out))
    assert finished == [] and a.num_output_tokens == 0 and b.num_output_tokens == 1
    sched.check_invariants()


def test_finish_with_reason_for_stop_strings() -> None:
    sched = make_scheduler()
    a = make_seq(5)
    sched.add(a)
    step(sched)
    assert sched.finish(a.seq_id, FinishReason.STOP) is a
    assert a.finish_reason == FinishReason.STOP and sched.block_manager.num_free_blocks == 16


def test_kv_import_flow_joins_running_and_reports_cached_prefix() -> None:
    sched = make_scheduler(num_blocks=16, block_size=4)
    prompt = list(range(100, 112))
    warm = make_seq(prompt, max_tokens=1)
    sched.add(warm)
    run_to_completion(sched)  # leaves the prompt's 3 blocks in the prefix cache

    seq = make_seq([*prompt, 1, 2], max_tokens=3, ignore_eos=True)
    assert sched.add_kv_import(seq) == 3
    assert not sched.has_work and sched.num_waiting_for_kv == 1
    assert sched.schedule().chunks == []
    assert sched.kv_import_done(seq.seq_id, 42, -0.1) is False
    assert seq.status == SequenceStatus.RUNNING and seq.output_token_ids == [42]
    out, _ = step(sched)
    assert _ids(out) == [(seq.seq_id, 1, True)]
    run_to_completion(sched)
    assert seq.num_output_tokens == 3 and seq.output_logprobs[0] == -0.1
    with pytest.raises(KeyError):
        sched.kv_import_done(seq.seq_id, 1, None)


def test_kv_import_first_token_can_finish() -> None:
    sched = make_scheduler(num_blocks=8)
    one = make_seq(5, max_tokens=1, seed=1)
    eos = make_seq(5, max_tokens=4, seed=2)
    sched.add_kv_import(one)
    sched.add_kv_import(eos)
    assert sched.kv_import_done(one.seq_id, 9, None) is True
    assert sched.kv_import_done(eos.seq_id, EOS, None) is True
    assert one.finish_reason == FinishReason.LENGTH and eos.finish_reason == FinishReason.STOP
    assert sched.block_manager.num_free_blocks == 8 and not sched.has_work
    sched.check_invariants()


def test_kv_import_without_room_raises() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4)
    sched.add_kv_import(make_seq(12, seed=1))
    with pytest.raises(NoFreeBlocksError):
        sched.add_kv_import(make_seq(8, seed=2))
    assert sched.num_waiting_for_kv == 1
    sched.check_invariants()


def test_kv_ready_respects_max_num_seqs() -> None:
    sched = make_scheduler(num_blocks=32, max_num_seqs=2)
    seqs = [make_seq(4, max_tokens=3, ignore_eos=True, seed=i) for i in range(3)]
    for s in seqs:
        sched.add_kv_import(s)
        sched.kv_import_done(s.seq_id, 5, None)
    out, _ = step(sched)
    assert len(out.chunks) == 2 and sched.num_running == 3
    run_to_completion(sched)
    assert all(s.num_output_tokens == 3 for s in seqs)


# ---- randomized simulation ----------------------------------------------------------------------


def _simulate(seed: int) -> None:
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8])
    num_blocks = rng.randint(6, 40)
    cfg = SchedulerConfig(
        max_num_seqs=rng.randint(1, 8),
        max_num_batched_tokens=rng.randint(8, 64),
        max_prefill_chunk=rng.randint(1, 24),
        max_model_len=rng.randint(16, 128),
    )
    sched = make_scheduler(
        num_blocks,
        block_size,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_prefill_chunk=cfg.max_prefill_chunk,
        max_model_len=cfg.max_model_len,
        prefix_caching=rng.random() < 0.8,
    )
    bm = sched.block_manager
    prefixes = [[rng.randrange(10, 1000) for _ in range(rng.randint(0, 24))] for _ in range(3)]
    all_seqs: list[Sequence] = []
    importing: list[Sequence] = []

    def new_seq() -> Sequence:
        prompt = list(rng.choice(prefixes)) + [rng.randrange(10, 1000) for _ in range(rng.randint(1, 30))]
        return make_seq(prompt, max_tokens=rng.randint(1, 20), ignore_eos=rng.random() < 0.3)

    for step_no in range(400):
        if step_no < 300 and rng.random() < 0.4:
            seq = new_seq()
            fits = (
                len(seq.token_ids) <= cfg.max_model_len
                and bm.blocks_for_tokens(len(seq.token_ids)) <= num_blocks
            )
            try:
                if rng.random() < 0.15:
                    sched.add_kv_import(seq)
                    importing.append(seq)
                else:
                    sched.add(seq)
                all_seqs.append(seq)
            except NoFreeBlocksError:
                assert fits
            except ValueError:
                assert not fits
        if importing and rng.random() < 0.3:
            seq = importing.pop(rng.randrange(len(importing)))
            if seq.status == SequenceStatus.WAITING_FOR_KV:
                sched.kv_import_done(seq.seq_id, rng.randrange(3, 50), None)
        live = [s for s in all_seqs if not s.is_finished]
        if live and rng.random() < 0.05:
            sched.abort(rng.choice(live).seq_id)

        was_running = {s.seq_id for s in sched.running} | {s.seq_id for s in sched.kv_ready}
        out = sched.schedule()
        sched.check_invariants()
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens
        assert len(out.chunks) <= cfg.max_num_seqs
        ids = [c.seq.seq_id for c in out.chunks]
        assert len(ids) == len(set(ids))
        assert not {s.seq_id for s in out.preempted} & set(ids)
        # Decode-first: every already-running sequence's chunk precedes every newly admitted one.
        admitted = [i in was_running for i in ids]
        assert admitted == sorted(admitted, reverse=True)
        for c in out.chunks:
            assert 1 <= c.num_new_tokens <= cfg.max_prefill_chunk
            assert c.seq.num_computed_tokens + c.num_new_tokens <= len(c.seq.token_ids)
            assert c.sample == (c.seq.num_computed_tokens + c.num_new_tokens == len(c.seq.token_ids))
            assert len(c.seq.block_table) * block_size >= c.seq.num_computed_tokens + c.num_new_tokens
        sampled = {
            c.seq.seq_id: (EOS if rng.random() < 0.03 else rng.randrange(3, 50), -1.0)
            for c in out.chunks
            if c.sample
        }
        sched.update_from_output(out, sampled)
        sched.check_invariants()

    for seq in importing:
        sched.abort(seq.seq_id)
    run_to_completion(sched, max_steps=20_000)
    sched.check_invariants()
    assert bm.num_free_blocks == num_blocks and bm.usage == 0.0
    assert sched.num_waiting_for_kv == 0
    max_len = min(cfg.max_model_len, num_blocks * block_size + 1)
    for seq in all_seqs:
        assert seq.is_finished and seq.block_table == []
        assert seq.num_output_tokens <= seq.params.max_tokens
        if seq.finish_reason == FinishReason.LENGTH:
            assert seq.num_output_tokens == seq.params.max_tokens or len(seq.token_ids) >= max_len
        elif seq.finish_reason == FinishReason.STOP:
            assert seq.output_token_ids[-1] == EOS and not seq.params.ignore_eos


@pytest.mark.parametrize("seed", range(40))
def test_randomized_simulation(seed: int) -> None:
    _simulate(seed)


def test_scheduler_accepts_explicit_block_manager() -> None:
    from services.engine.block_manager import BlockManager

    sched = Scheduler(SchedulerConfig(max_model_len=64), BlockManager(8, 4), eos_token_ids={EOS})
    sched.add(make_seq(5))
    run_to_completion(sched)
    assert sched.block_manager.num_free_blocks == 8
