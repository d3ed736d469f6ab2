"""Proto <-> engine domain conversions shared by the services (small helpers): finish reasons and page layouts.

Torch-free. Sampling parameters and logprob alternatives convert in services/text/sampling_pb.py."""

from __future__ import annotations

from services.common.pb import common_pb2
from services.engine.kv_layout import PageLayout, Region
from services.engine.sequence import FinishReason

_FINISH_TO_PB = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
}
_FINISH_FROM_PB = {v: k for k, v in _FINISH_TO_PB.items()}
FINISH_NAMES = {None: None, FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort"}


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
