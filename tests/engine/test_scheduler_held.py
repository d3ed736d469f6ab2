"""Blocks held past a sequence's end (a prefill's KV hand-off still reads them): kept when the marked
sequence finishes, counted as used, freed by release_held; an abort never holds."""

from __future__ import annotations

from services.engine.sequence import SequenceStatus
from tests.engine.factories import make_scheduler, make_seq, step


def test_a_held_sequence_keeps_its_blocks_until_released() -> None:
    sched = make_scheduler()
    seq = make_seq(10, max_tokens=1, ignore_eos=True)
    sched.add(seq)
    sched.hold(seq.seq_id)
    _, finished = step(sched)
    assert finished == [seq] and seq.status == SequenceStatus.FINISHED
    assert sched.held == {seq.seq_id: seq} and len(seq.block_table) == 3
    assert sched.block_manager.num_free_blocks == 13 and not sched.has_work
    sched.check_invariants()
    assert sched.release_held(seq.seq_id)
    assert not sched.release_held(seq.seq_id)  # idempotent
    assert sched.block_manager.num_free_blocks == 16 and not seq.block_table
    sched.check_invariants()


def test_an_aborted_sequence_marked_to_hold_frees_its_blocks_at_once() -> None:
    sched = make_scheduler()
    seq = make_seq(10, max_tokens=4, ignore_eos=True)
    sched.add(seq)
    sched.hold(seq.seq_id)
    step(sched)
    sched.abort(seq.seq_id)
    assert sched.held == {} and sched.block_manager.num_free_blocks == 16
    sched.check_invariants()
    sched.hold(seq.seq_id)  # no longer live: nothing to mark
    assert not sched.release_held(seq.seq_id)
    sched.check_invariants()
