"""A request as the scheduler and block manager see it: token ids and bookkeeping, no tensors."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from services.text.sampling_params import SamplingParams

_seq_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"          # queued; needs prefill (or re-prefill after preemption)
    WAITING_FOR_KV = "waiting_for_kv"  # decode side: blocks reserved, KV pages arriving from a prefill
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"        # EOS, stop token or stop string
    LENGTH = "length"    # max_tokens or context length reached
    ABORT = "abort"      # cancelled by the client or the service


@dataclass(eq=False)
class Sequence:
    """One request's token stream.

    Invariants:
      * ``token_ids`` = prompt followed by generated tokens.
      * ``num_computed_tokens`` tokens have KV in this sequence's blocks (the prefix
        ``token_ids[:num_computed_tokens]``); ``num_cached_tokens`` of them came from the prefix cache.
      * ``block_table[i]`` holds tokens ``[i*block_size, (i+1)*block_size)``.
    """

    token_ids: list[int]
    params: SamplingParams
    request_id: str = ""
    seq_id: int = field(default_factory=lambda: next(_seq_counter))
    num_prompt_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: FinishReason | None = None
    arrival_time: float = 0.0
    num_preemptions: int = 0
    # For seq.params.seed: how many tokens have been sampled, so a seeded request is reproducible
    # whatever batch it lands in.
    output_logprobs: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)
        if not self.request_id:
            self.request_id = str(self.seq_id)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def num_blocks_needed(self, block_size: int, num_tokens: int | None = None) -> int:
        n = len(self.token_ids) if num_tokens is None else num_tokens
        return (n + block_size - 1) // block_size
