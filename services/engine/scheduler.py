"""Continuous batching with one token budget per step (vLLM v1 style). CPU-only bookkeeping.

A step is ``schedule()`` -> model runner -> ``update_from_output()``. Each step:
  1. every running sequence, oldest admission first, gets its next tokens: 1 when decoding, the next
     prefill chunk when partially prefilled. A sequence that cannot get a block preempts the most
     recently admitted running sequence (recompute: blocks freed, back to the FRONT of waiting) until
     it fits or has preempted itself;
  2. if nothing was preempted, waiting sequences are admitted in FIFO order while the token budget,
     ``max_num_seqs`` and free blocks allow.
With ``mixed_step_interval`` N > 1, while any sequence decodes, prompt chunks (step 1's unfinished
prefills and step 2's admissions) are taken only in one step of N: the N - 1 steps between are pure
decode, which a GPU engine replays in a CUDA graph, at the cost of up to N - 1 steps of TTFT.
A prefill chunk is ``min(remaining, max_prefill_chunk, remaining budget)``; for a sequence added with
``stream_kv=True`` (a prefill whose KV streams out per chunk) also at most ``prefill_tail.tail_piece``:
its last tokens go in pieces that halve down to ``prefill_tail_tokens``, so little KV is left to send
after compute ends.

Invariants (``check_invariants``):
  * every live sequence is in exactly one of waiting / running / kv_ready / waiting_for_kv;
  * waiting sequences hold no blocks and have num_computed_tokens == 0;
  * running sequences have 0 <= num_computed_tokens < len(token_ids) between steps;
  * finished sequences hold no blocks and are no longer tracked, except those marked with ``hold``
    before they finished (not aborted): they sit in ``held`` with their blocks until ``release_held``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from services.engine.block_manager import BlockManager
from services.engine.prefill_tail import applies, tail_piece
from services.engine.sequence import FinishReason, Sequence, SequenceStatus
from services.text.sampling_params import Sampled

PLACEHOLDER_TOKEN = -1
"""Stands in ``seq.token_ids`` for a token an in-flight step is sampling (async scheduling): appended by
``advance``, replaced by ``resolve``. The runner feeds such a position from the previous step's device tokens."""


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    """Most sequences in one batch (running at once)."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step: decode tokens plus prefill chunk tokens."""
    max_prefill_chunk: int = 512
    """Most prompt tokens one sequence computes in one step (chunked prefill)."""
    max_model_len: int = 2048
    """Longest sequence, prompt plus output, in tokens; longer prompts are refused."""
    spec_tokens: int = 0
    """Draft tokens a decoding sequence speculates per step (K); 0: no speculative decoding."""
    prefill_tail_tokens: int = 0
    """Floor (tokens) of the tail pieces of sequences added with ``stream_kv=True``; 0: no tail split."""
    mixed_step_interval: int = 1
    """While sequences decode, prompt chunks (admissions and unfinished prefills) join at most one step in
    this many; the steps between are pure decode (CUDA-graphed on GPU). 1: every step may mix."""

    def __post_init__(self) -> None:
        if isinstance(self.prefill_tail_tokens, bool) or not isinstance(self.prefill_tail_tokens, int) \
                or self.prefill_tail_tokens < 0:
            raise ValueError(f"SchedulerConfig.prefill_tail_tokens must be an integer >= 0, "
                             f"got {self.prefill_tail_tokens!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_prefill_chunk", "max_model_len",
                     "mixed_step_interval"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"SchedulerConfig.{name} must be a positive integer, got {value!r}")


@dataclass
class ScheduledChunk:
    seq: Sequence
    """Compute ``seq.token_ids[seq.num_computed_tokens : seq.num_computed_tokens + num_new_tokens]``."""
    num_new_tokens: int
    sample: bool
    """True when the chunk reaches ``len(seq.token_ids)``: sample the next token from its last logits."""
    spec_tokens: int = 0
    """Decode chunk that speculates: the draft proposes this many tokens, the target verifies them with
    the chunk's token; slots for positions num_computed_tokens .. num_computed_tokens + spec_tokens are
    reserved. Its result is a list of Sampled (the accepted drafts, then one more token)."""


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    """Sequences preempted this step (their KV is gone; they re-prefill later)."""

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, eos_token_ids: set[int]) -> None:
        self.config = config
        self.block_manager = block_manager
        self.eos_token_ids = set(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: running[-1] is the preemption victim
        self.kv_ready: deque[Sequence] = deque()  # KV landed; joins running when max_num_seqs allows
        self.waiting_for_kv: dict[int, Sequence] = {}
        self._seqs: dict[int, Sequence] = {}
        self._streamed: set[int] = set()  # seq_ids whose KV streams out per chunk (subset of _seqs)
        self._hold: set[int] = set()  # live seq_ids whose blocks outlive them (subset of _seqs)
        self.held: dict[int, Sequence] = {}
        """Finished sequences still holding their blocks (a KV hand-off reads them), by seq_id."""
        self.num_preemptions = 0
        """Preemptions since start (a counter)."""
        self._finishing: set[int] = set()
        """Async scheduling: live seq_ids whose in-flight token is their last (max_tokens or context reached);
        schedule() skips them until ``resolve`` finishes them."""
        self._decode_only_steps = 0
        """Consecutive steps scheduled without prompt chunks while sequences decoded (mixed_step_interval)."""
        # KV for the last token needs a slot, so a sequence may grow to pool_tokens + 1 tokens.
        pool_tokens = block_manager.num_blocks * block_manager.block_size
        self._max_len = min(config.max_model_len, pool_tokens + 1)

    # ---- intake ---------------------------------------------------------------------------------

    def _check_fits(self, seq: Sequence) -> None:
        n = len(seq.token_ids)
        if n == 0:
            raise ValueError(f"request {seq.request_id}: empty prompt")
        if n > self.config.max_model_len:
            raise ValueError(
                f"request {seq.request_id}: prompt of {n} tokens exceeds max_model_len={self.config.max_model_len}"
            )
        bm = self.block_manager
        if bm.blocks_for_tokens(n) > bm.num_blocks:
            raise ValueError(
                f"request {seq.request_id}: prompt of {n} tokens needs {bm.blocks_for_tokens(n)} KV blocks, "
                f"the pool has {bm.num_blocks} blocks of {bm.block_size} tokens ({bm.num_blocks * bm.block_size} tokens)"
            )
        if seq.seq_id in self._seqs:
            raise ValueError(f"request {seq.request_id}: seq_id {seq.seq_id} is already scheduled")

    def add(self, seq: Sequence, stream_kv: bool = False) -> None:
        """Queue a sequence for prefill (FIFO). Raises ValueError if its prompt can never fit.

        ``stream_kv``: its KV leaves per computed chunk (a prefill with chunked transfer on); its prompt's
        tail is then cut by the prefill tail rule (``prefill_tail_tokens``)."""
        self._check_fits(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self._seqs[seq.seq_id] = seq
        if stream_kv:
            self._streamed.add(seq.seq_id)

    def add_kv_import(self, seq: Sequence) -> int:
        """Decode side: reserve blocks for the whole prompt, whose KV a prefill will send.

        Returns the number of leading blocks that already hold valid KV (prefix hits; the prefill
        need not send them). Raises ValueError if the prompt can never fit, NoFreeBlocksError if
        there is no room now.
        """
        self._check_fits(seq)
        num_held = self.block_manager.allocate_for_kv_import(seq)
        seq.status = SequenceStatus.WAITING_FOR_KV
        self.waiting_for_kv[seq.seq_id] = seq
        self._seqs[seq.seq_id] = seq
        return num_held

    def kv_import_done(self, seq_id: int, first_token: int, logprob: float | None) -> bool:
        """The prompt's KV has landed and prefill sampled ``first_token``.

        The sequence joins the running batch at the next ``schedule()``. Returns True if the first
        token already finished it (EOS, stop token, max_tokens=1, length); then its blocks are freed.
        """
        seq = self.waiting_for_kv.pop(seq_id, None)
        if seq is None:
            raise KeyError(f"seq {seq_id} is not waiting for KV")
        seq.num_computed_tokens = len(seq.token_ids)
        self.block_manager.mark_computed(seq, seq.num_computed_tokens)
        seq.status = SequenceStatus.RUNNING
        self.kv_ready.append(seq)
        reason = self._append_token(seq, first_token, logprob)
        if reason is not None:
            self._finish(seq, reason)
            return True
        return False

    # ---- removal --------------------------------------------------------------------------------

    def finish(self, seq_id: int, reason: FinishReason) -> Sequence | None:
        """End a live sequence from any state and free its blocks; None if it is not live."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            return None
        self._finish(seq, reason)
        return seq

    def abort(self, seq_id: int) -> Sequence | None:
        return self.finish(seq_id, FinishReason.ABORT)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        status = seq.status
        if status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif status == SequenceStatus.WAITING_FOR_KV:
            del self.waiting_for_kv[seq.seq_id]
        elif seq in self.kv_ready:
            self.kv_ready.remove(seq)
        else:
            self.running.remove(seq)
        if seq.seq_id in self._hold and reason != FinishReason.ABORT:
            self.held[seq.seq_id] = seq  # freed by release_held
        else:
            self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self._seqs[seq.seq_id]
        self._finishing.discard(seq.seq_id)
        self._streamed.discard(seq.seq_id)
        self._hold.discard(seq.seq_id)

    def hold(self, seq_id: int) -> None:
        """Keep a live sequence's blocks when it finishes (not when aborted) until ``release_held``."""
        if seq_id in self._seqs:
            self._hold.add(seq_id)

    def release_held(self, seq_id: int) -> bool:
        """Free the blocks of a held finished sequence (and drop a live one's hold mark); True if freed."""
        self._hold.discard(seq_id)
        seq = self.held.pop(seq_id, None)
        if seq is not None:
            self.block_manager.free(seq)
        return seq is not None

    # ---- stepping -------------------------------------------------------------------------------

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's chunks. Does not advance ``num_computed_tokens``."""
        cfg, bm = self.config, self.block_manager
        out = SchedulerOutput()
        budget = cfg.max_num_batched_tokens

        while self.kv_ready and len(self.running) < cfg.max_num_seqs:
            self.running.append(self.kv_ready.popleft())

        # Decode priority: a step between mixed ones carries decode chunks only (prompts wait at most
        # mixed_step_interval - 1 steps), so it replays a decode graph.
        decoding = cfg.mixed_step_interval > 1 and any(s.num_uncomputed_tokens == 1 for s in self.running)
        prompts = not decoding or self._decode_only_steps >= cfg.mixed_step_interval - 1
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if (not prompts and seq.num_uncomputed_tokens > 1) or seq.seq_id in self._finishing:
                i += 1
                continue
            n = self._chunk_len(seq, len(seq.token_ids) - seq.num_computed_tokens, budget)
            k = self._spec_len(seq, budget - n)
            if k and not bm.allocate(seq, n + k):
                k = 0  # no room to speculate: decode one token rather than preempt for drafts
            while not bm.allocate(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                continue
            out.chunks.append(self._chunk(seq, n, k))
            budget -= n + k
            i += 1

        if out.preempted:
            return out

        while prompts and self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            seq = self.waiting[0]
            prefix = bm.get_computed_prefix(seq)
            n = self._chunk_len(seq, len(seq.token_ids) - prefix[1], budget)
            if not bm.allocate(seq, n, prefix=prefix):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.chunks.append(self._chunk(seq, n))
            budget -= n
        if decoding:
            mixed = any(c.num_new_tokens > 1 for c in out.chunks)
            self._decode_only_steps = 0 if mixed else self._decode_only_steps + 1
        return out

    def _chunk_len(self, seq: Sequence, remaining: int, budget: int) -> int:
        """Tokens this step computes of a sequence with ``remaining`` uncomputed tokens."""
        n = min(remaining, self.config.max_prefill_chunk, budget)
        if seq.seq_id in self._streamed and applies(len(seq.token_ids), self.config.max_prefill_chunk):
            n = min(n, tail_piece(remaining, self.config.prefill_tail_tokens, self.block_manager.block_size))
        return n

    @staticmethod
    def _chunk(seq: Sequence, n: int, spec_tokens: int = 0) -> ScheduledChunk:
        return ScheduledChunk(seq, n, sample=seq.num_computed_tokens + n == len(seq.token_ids),
                              spec_tokens=spec_tokens)

    def _spec_len(self, seq: Sequence, budget: int) -> int:
        """Drafts a running sequence may speculate this step: 0 unless it is decoding (one uncomputed
        token, at least one output), capped so every token the step may add fits max_tokens and the
        context, and by the step's remaining token budget."""
        if not self.config.spec_tokens or seq.num_output_tokens == 0:
            return 0
        if len(seq.token_ids) - seq.num_computed_tokens != 1:
            return 0
        room = min(seq.params.max_tokens - seq.num_output_tokens, self._max_len - len(seq.token_ids)) - 1
        return max(0, min(self.config.spec_tokens, room, budget))

    def update_from_output(
        self, out: SchedulerOutput, sampled: dict[int, Sampled | list[Sampled]]
    ) -> list[Sequence]:
        """Apply a step's results: ``sampled`` maps seq_id -> Sampled for ``sample`` chunks (a list of
        Sampled for chunks with ``spec_tokens``).

        Returns the sequences that finished this step (blocks already freed). Chunks of sequences
        aborted or finished since ``schedule()`` are ignored.
        """
        finished: list[Sequence] = []
        for chunk in out.chunks:
            seq = chunk.seq
            if seq.status != SequenceStatus.RUNNING:
                continue
            seq.num_computed_tokens += chunk.num_new_tokens
            self.block_manager.mark_computed(seq, seq.num_computed_tokens)
            if not chunk.sample:
                continue
            result = sampled[seq.seq_id]
            if isinstance(result, list):  # speculation: accepted drafts, then one more token
                reason = self._append_tokens(seq, result)
            else:
                token, logprob = result[:2]
                reason = self._append_token(seq, token, logprob)
            if reason is not None:
                self._finish(seq, reason)
                finished.append(seq)
        return finished

    # ---- async scheduling: a step's bookkeeping split around its in-flight tokens -------------------

    def advance(self, out: SchedulerOutput) -> list[int]:
        """A launched step's chunks are computed (their KV written in stream order): advance them and put a
        PLACEHOLDER_TOKEN where each sampling chunk's token will go. Returns, per sampling chunk of ``out``
        (in order), the index of its placeholder in ``seq.token_ids`` (-1 for a sequence no longer running)."""
        slots = []
        for chunk in out.chunks:
            seq = chunk.seq
            if seq.status != SequenceStatus.RUNNING:
                if chunk.sample:
                    slots.append(-1)
                continue
            seq.num_computed_tokens += chunk.num_new_tokens
            self.block_manager.mark_computed(seq, seq.num_computed_tokens)
            if not chunk.sample:
                continue
            slots.append(len(seq.token_ids))
            seq.token_ids.append(PLACEHOLDER_TOKEN)
            if seq.num_output_tokens >= seq.params.max_tokens or len(seq.token_ids) >= self._max_len:
                self._finishing.add(seq.seq_id)  # ends with this token whatever it is: schedule it no more
        return slots

    def resolve(self, out: SchedulerOutput, slots: list[int], sampled: dict[int, Sampled]) -> list[Sequence]:
        """The tokens of a step ``advance`` saw arrived: replace the placeholders, end the sequences they end
        (blocks freed; a later step's token of such a sequence is then dropped by its own resolve, its
        placeholder cut off here). Sequences preempted meanwhile get their token too (they re-prefill with it)."""
        finished: list[Sequence] = []
        sample_chunks = [c for c in out.chunks if c.sample]
        for chunk, at in zip(sample_chunks, slots, strict=True):
            seq = chunk.seq
            if at < 0 or seq.status not in (SequenceStatus.RUNNING, SequenceStatus.WAITING):
                continue
            token, logprob = sampled[seq.seq_id][:2]
            seq.token_ids[at] = token
            if logprob is not None:
                seq.output_logprobs.append(logprob)
            reason = self._token_ends(seq, token, at + 1)
            if reason is not None:
                del seq.token_ids[at + 1:]  # an in-flight later token of a finished sequence is never emitted
                seq.num_computed_tokens = min(seq.num_computed_tokens, at)
                self._finish(seq, reason)
                finished.append(seq)
        return finished

    def _token_ends(self, seq: Sequence, token: int, length: int) -> FinishReason | None:
        """Whether ``token``, the last of the first ``length`` tokens of seq, ends it."""
        params = seq.params
        if (not params.ignore_eos and token in self.eos_token_ids) or token in params.stop_token_ids:
            return FinishReason.STOP
        if length - seq.num_prompt_tokens >= params.max_tokens or length >= self._max_len:
            return FinishReason.LENGTH
        return None

    def _append_tokens(self, seq: Sequence, result: list[Sampled]) -> FinishReason | None:
        """Append a verified run of tokens until one ends the sequence; ``result`` is cut to the tokens
        appended. The KV of every appended token but the last was written by the verify forward."""
        reason = None
        for j, s in enumerate(result):
            reason = self._append_token(seq, s.token, s.logprob)
            if reason is not None:
                del result[j + 1:]
                break
        seq.num_computed_tokens = len(seq.token_ids) - 1
        self.block_manager.mark_computed(seq, seq.num_computed_tokens)
        return reason

    def _append_token(self, seq: Sequence, token: int, logprob: float | None) -> FinishReason | None:
        """Append a sampled token; the reason it ends the sequence, if it does."""
        seq.token_ids.append(token)
        if logprob is not None:
            seq.output_logprobs.append(logprob)
        return self._token_ends(seq, token, len(seq.token_ids))

    # ---- queries --------------------------------------------------------------------------------

    def get(self, seq_id: int) -> Sequence | None:
        """A live (unfinished) sequence by id."""
        return self._seqs.get(seq_id)

    @property
    def has_work(self) -> bool:
        """Whether ``schedule()`` has anything to do (sequences waiting for KV do not count)."""
        return bool(self.waiting or self.running or self.kv_ready)

    @property
    def num_running(self) -> int:
        return len(self.running) + len(self.kv_ready)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_waiting_for_kv(self) -> int:
        return len(self.waiting_for_kv)

    def check_invariants(self) -> None:
        """Assert the module invariants and the block manager's, with ref counts vs block tables."""
        placed = (
            [s.seq_id for s in self.waiting]
            + [s.seq_id for s in self.running]
            + [s.seq_id for s in self.kv_ready]
            + list(self.waiting_for_kv)
        )
        assert len(placed) == len(set(placed)) == len(self._seqs), "a sequence is in two queues or none"
        assert set(placed) == self._seqs.keys(), "queues and the live-sequence index disagree"
        assert self._streamed <= self._seqs.keys(), "a finished sequence is still marked as streaming KV"
        assert self._hold <= self._seqs.keys(), "a finished sequence is still marked to hold its blocks"
        assert all(s.status == SequenceStatus.FINISHED for s in self.held.values())
        for s in self.waiting:
            assert s.status == SequenceStatus.WAITING and not s.block_table and s.num_computed_tokens == 0
        for s in self.running:
            assert s.status == SequenceStatus.RUNNING
            assert 0 <= s.num_computed_tokens < len(s.token_ids), f"seq {s.seq_id}: nothing left to compute"
            assert len(s.block_table) * self.block_manager.block_size >= s.num_computed_tokens
        for s in self.waiting_for_kv.values():
            assert s.status == SequenceStatus.WAITING_FOR_KV
        assert len(self.running) <= self.config.max_num_seqs
        self.block_manager.check_invariants([*self._seqs.values(), *self.held.values()])
