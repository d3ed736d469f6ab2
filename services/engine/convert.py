"""Proto <-> engine domain conversions shared by the services (small helpers).

Torch-free (sampling params, finish reasons, page layouts): the router imports it too."""

from __future__ import annotations

from services.common.pb import common_pb2
from services.engine.kv_layout import PageLayout, Region
from services.engine.sequence import FinishReason
from services.text.sampling_params import InvalidRequestError, SamplingParams, TopLogprobs

_FINISH_TO_PB = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
}
_FINISH_FROM_PB = {v: k for k, v in _FINISH_TO_PB.items()}
FINISH_NAMES = {None: None, FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort"}


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


def finish_to_pb(reason: FinishReason | None) -> int:
    return _FINISH_TO_PB[reason]


def finish_from_pb(value: int) -> FinishReason | None:
    return _FINISH_FROM_PB.get(value)


def layout_to_pb(layout: PageLayout) -> common_pb2.PageLayout:
    return common_pb2.PageLayout(
        model_id=layout.model_id, num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim, block_size=layout.block_size,
        regions=[common_pb2.Region(name=r.name, codec=r.codec, bytes_per_page=r.bytes_per_page)
                 for r in layout.regions],
        page_bytes=layout.page_bytes, fingerprint=layout.fingerprint, layer_windows=layout.layer_windows,
        attention_sinks=layout.attention_sinks, latent=layout.latent,
    )


def layout_from_pb(p: common_pb2.PageLayout) -> PageLayout:
    return PageLayout(p.model_id, p.num_layers, p.num_kv_heads, p.head_dim, p.block_size,
                      tuple(Region(r.name, r.codec, r.bytes_per_page) for r in p.regions),
                      layer_windows=tuple(p.layer_windows), attention_sinks=p.attention_sinks,
                      latent=tuple(p.latent))  # type: ignore[arg-type]
