"""Proto <-> sampling parameters and logprob alternatives (small helpers), torch-free: the router, prefill and
decode convert requests with them."""

from __future__ import annotations

from services.common.pb import common_pb2
from services.text.sampling_params import InvalidRequestError, SamplingParams, TopLogprobs


def params_from_pb(p: common_pb2.SamplingParams) -> SamplingParams:
    """Validated engine params; raises InvalidRequestError naming the field."""
    if p.max_tokens > 1 << 20:
        raise InvalidRequestError("max_tokens", f"{p.max_tokens} is larger than any context")
    return SamplingParams(
        max_tokens=p.max_tokens,
        temperature=p.temperature if p.HasField("temperature") else 1.0,
        top_k=p.top_k,
        top_p=p.top_p if p.top_p else 1.0,
        seed=p.seed if p.HasField("seed") else None,
        stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs,
        top_logprobs=p.top_logprobs,
    ).validate()


def params_to_pb(s: SamplingParams) -> common_pb2.SamplingParams:
    p = common_pb2.SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, top_k=s.top_k,
                                  top_p=s.top_p, stop=s.stop, stop_token_ids=s.stop_token_ids,
                                  ignore_eos=s.ignore_eos, logprobs=s.logprobs, top_logprobs=s.top_logprobs)
    if s.seed is not None:
        p.seed = s.seed
    return p


def top_to_pb(top: TopLogprobs | None) -> common_pb2.TopLogprobs:
    """An empty message for None (a position without alternatives)."""
    if top is None:
        return common_pb2.TopLogprobs()
    return common_pb2.TopLogprobs(token_ids=top.token_ids, logprobs=top.logprobs)


def top_from_pb(p: common_pb2.TopLogprobs) -> TopLogprobs | None:
    """None for an empty message; raises InvalidRequestError when the two lists differ in length."""
    if len(p.token_ids) != len(p.logprobs):
        raise InvalidRequestError("top_logprobs", f"{len(p.token_ids)} token ids but {len(p.logprobs)} logprobs")
    if not p.token_ids:
        return None
    return TopLogprobs(tuple(p.token_ids), tuple(p.logprobs))
