"""One decode request's outputs on their way out: the GenerateResponse of an output, and the token
metrics a stream observes as its outputs leave (the same for a Generate stream and a Stream entry)."""

from __future__ import annotations

from services.common.metrics import DecodeMetrics
from services.common.pb import common_pb2
from services.decode.reservations import Reservation
from services.engine.convert import finish_to_pb
from services.engine.engine import RequestOutput
from services.text.sampling_pb import top_to_pb


def fill_response(msg: common_pb2.GenerateResponse, rid: str, o: RequestOutput) -> common_pb2.GenerateResponse:
    """Write output ``o`` of the router's request ``rid`` into ``msg`` (usage on the final one); returns it."""
    msg.request_id = rid
    msg.token_ids.extend(o.new_token_ids)
    msg.finish_reason = finish_to_pb(o.finish_reason)
    if any(lp is not None for lp in o.new_logprobs):
        msg.logprobs.extend(lp or 0.0 for lp in o.new_logprobs)
    if any(t is not None for t in o.new_top_logprobs):
        msg.top_logprobs.extend(top_to_pb(t) for t in o.new_top_logprobs)
    if o.finished:
        u = msg.usage
        u.prompt_tokens = o.num_prompt_tokens
        u.completion_tokens = o.num_output_tokens
        u.cached_tokens = o.num_cached_tokens
    return msg


class TokenProgress:
    """Token metrics of one request's stream. Output 1 carries prefill's token; output 2 is the first decode
    step (decode queue = KV complete -> that step's token); later gaps are TPOT. With a reservation, the
    time from its KV landing to its first output leaving is the ``first_message`` handoff phase."""

    __slots__ = ("_first_sent", "_generated", "_index", "_last", "_m", "_model", "_r", "_tpot")

    def __init__(self, metrics: DecodeMetrics, model: str, reservation: Reservation | None) -> None:
        self._m = metrics
        self._model = model
        self._r = reservation
        # Children bound once per stream: no label lookup (lock + dict) per token on the event loop.
        self._tpot = metrics.tpot_seconds.labels(model)
        self._generated = metrics.generation_tokens_total.labels(model)
        self._last: float | None = None
        """time.monotonic() of the latest output with tokens."""
        self._index = 0
        """Outputs with tokens so far (count)."""
        self._first_sent = False

    def observe(self, o: RequestOutput, now: float) -> None:
        """Account for output ``o`` leaving at ``now`` (time.monotonic() seconds)."""
        r = self._r
        if not self._first_sent:  # not observed when output 1 left before the receiver noted the landing
            self._first_sent = True
            if r is not None and r.kv_done_at is not None:
                self._m.handoff_phase_seconds.labels("first_message").observe(max(0.0, now - r.kv_done_at))
        if not o.new_token_ids:
            return
        self._index += 1
        n = len(o.new_token_ids)
        if self._index == 2 and r is not None and r.kv_done_at is not None:
            self._m.queue_seconds.labels(self._model).observe(max(0.0, now - r.kv_done_at))
        elif self._index > 2 and self._last is not None:  # a speculative step's tokens share its gap
            for _ in range(n):
                self._tpot.observe((now - self._last) / n)
        if self._index > 1:
            self._generated.inc(n)
        if o.spec_proposed:
            self._observe_spec(o)
        self._last = now

    def _observe_spec(self, o: RequestOutput) -> None:
        """Speculative decoding counters of one verify step (acceptance label: real | synthetic)."""
        acceptance = "synthetic" if o.spec_synthetic else "real"
        m = self._m
        m.spec_draft_tokens_total.labels(self._model, acceptance).inc(o.spec_proposed)
        m.spec_accepted_tokens_total.labels(self._model, acceptance).inc(o.spec_accepted)
        m.spec_acceptance_length_tokens.labels(self._model, acceptance).observe(o.spec_accepted + 1)

