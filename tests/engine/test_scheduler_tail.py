"""The prefill tail rule (services/engine/prefill_tail.py) as the scheduler applies it: only to sequences
added with ``stream_kv=True``, never to plain (colocated) requests or ones whose KV leaves after the last chunk."""

from __future__ import annotations

import pytest

from services.common.config_file import parse_settings
from services.engine.block_manager import BlockManager
from services.engine.config import EngineConfig, EngineConfigError
from services.engine.prefill_tail import prefill_pieces, tail_piece
from services.engine.scheduler import Scheduler, SchedulerConfig
from services.engine.sequence import Sequence
from services.prefill.config import PrefillConfig
from tests.engine.factories import make_seq, step


def _scheduler(floor: int, chunk: int = 2048, budget: int = 8192, block_size: int = 16,
               num_blocks: int = 1024) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_prefill_chunk=chunk,
                          max_model_len=num_blocks * block_size, prefill_tail_tokens=floor)
    return Scheduler(cfg, BlockManager(num_blocks, block_size, enable_prefix_caching=False), {2})


def _pieces(sched: Scheduler, seq: Sequence, stream_kv: bool) -> list[int]:
    """Chunk sizes the scheduler gives ``seq`` until its prompt is computed."""
    sched.add(seq, stream_kv)
    pieces = []
    while seq.num_computed_tokens < seq.num_prompt_tokens:
        out, _ = step(sched)
        pieces.extend(c.num_new_tokens for c in out.chunks if c.seq is seq)
    return pieces


@pytest.mark.parametrize(("prompt", "want"), [
    (3000, [1504, 752, 384, 192, 168]),                     # over one chunk: halved, rounded up to 16-token blocks
    (2100, [1056, 528, 272, 244]),
    (8000, [2048, 2048, 1952, 976, 496, 240, 240]),         # full chunks until 2 chunks' worth remain
])
def test_the_rule_halves_what_remains_down_to_the_floor(prompt: int, want: list[int]) -> None:
    assert prefill_pieces(prompt, 2048, 256, 16) == want
    assert sum(want) == prompt
    assert all(p % 16 == 0 for p in want[:-1])  # every piece but the last ends on a page boundary
    assert want[-1] <= 256


def test_off_or_short_prompts_keep_todays_chunks() -> None:
    assert prefill_pieces(8000, 2048, 0, 16) == [2048, 2048, 2048, 1856]
    assert tail_piece(5000, 0, 16) == 5000
    assert tail_piece(256, 256, 16) == 256
    for prompt in (100, 300, 2000, 2048):  # one chunk or less: uncut (measured slower cut, prefill_tail.applies)
        assert prefill_pieces(prompt, 2048, 256, 16) == [prompt]


def test_a_one_chunk_prompt_stays_uncut_whatever_the_floor() -> None:
    for floor in (256, 1024, 2048):  # halves of a chunk lost on the H200 too (prefill_tail.applies)
        assert prefill_pieces(2000, 2048, floor, 16) == [2000]
        assert _pieces(_scheduler(floor), make_seq(2000, max_tokens=1, ignore_eos=True), stream_kv=True) == [2000]
    assert prefill_pieces(8000, 2048, 1024, 16) == [2048, 2048, 1952, 976, 976]


@pytest.mark.parametrize("prompt", [300, 3000, 8000])
def test_the_scheduler_cuts_a_streamed_prompt_by_the_rule(prompt: int) -> None:
    got = _pieces(_scheduler(256), make_seq(prompt, max_tokens=1, ignore_eos=True), stream_kv=True)
    assert got == prefill_pieces(prompt, 2048, 256, 16)


def test_a_prompt_whose_kv_does_not_stream_is_not_split() -> None:
    sched = _scheduler(256)
    assert _pieces(sched, make_seq(8000, max_tokens=1, ignore_eos=True), stream_kv=False) == [2048] * 3 + [1856]
    assert _pieces(_scheduler(0), make_seq(2000, max_tokens=1, ignore_eos=True), stream_kv=True) == [2000]


def test_the_step_budget_still_caps_a_piece() -> None:
    got = _pieces(_scheduler(256, budget=600), make_seq(3000, max_tokens=1, ignore_eos=True), stream_kv=True)
    assert got == [600, 600, 600, 600, 304, 160, 136]  # the budget caps the halves until 600 left: 304, 160, 136


def test_a_finished_streamed_sequence_is_forgotten() -> None:
    sched = _scheduler(256, chunk=512)
    seq = make_seq(600, max_tokens=1, ignore_eos=True)
    assert _pieces(sched, seq, stream_kv=True) == [304, 160, 136]
    assert not sched.has_work and not sched._streamed
    sched.check_invariants()


def test_decode_steps_of_a_streamed_sequence_are_single_tokens() -> None:
    sched = _scheduler(4, chunk=16, budget=64, num_blocks=64, block_size=4)
    seq = make_seq(20, max_tokens=3, ignore_eos=True)
    assert _pieces(sched, seq, stream_kv=True) == [12, 4, 4]  # 20 -> half 10 -> 12 (blocks); 8 -> 4; 4
    out, _ = step(sched)
    assert [c.num_new_tokens for c in out.chunks] == [1]


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="prefill_tail_tokens"):
        SchedulerConfig(prefill_tail_tokens=-1)
    with pytest.raises(EngineConfigError, match="--prefill-tail-tokens"):
        EngineConfig(model="random:tiny-llama", prefill_tail_tokens=-1)


def test_the_setting_reaches_the_prefill_service_flags(monkeypatch) -> None:
    """The prefill service parses [PrefillConfig, EngineConfig] (services/worker/engine_service.py)."""
    def parse(argv: list[str]) -> EngineConfig:
        return parse_settings([PrefillConfig, EngineConfig], argv, prog="pdserve prefill", section="prefill")[1]

    monkeypatch.delenv("PDSERVE_PREFILL_TAIL_TOKENS", raising=False)
    assert parse(["--prefill-tail-tokens", "128"]).prefill_tail_tokens == 128
    assert parse([]).prefill_tail_tokens == 256  # on by default; only streamed prefills use it
    monkeypatch.setenv("PDSERVE_PREFILL_TAIL_TOKENS", "0")
    assert parse([]).prefill_tail_tokens == 0
