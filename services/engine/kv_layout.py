"""KV page layouts and their fingerprints (docs/ARCHITECTURE.md, "KV layout and transports").

A page is the KV of ``block_size`` consecutive tokens for every layer. Its layout names the model,
the shape and the codec of each region, which layers attend through a sliding window (and its width) and
whether the layers have attention sinks; the fingerprint is a stable hash of all of it and travels with
every handoff and kvstore key. Pages whose fingerprint differs are refused, never reinterpreted.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, replace

from services.common.checksum import checksum

__all__ = ["FP8_CODEC", "HeadSplitSpec", "PageLayout", "Region", "checksum", "index_region", "region_bytes"]

_CODEC_ELEM_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
FP8_CODEC = "fp8-e4m3"
_DTYPE_CODEC = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
"""torch dtype name (``str(dtype)`` less ``torch.``) -> codec; names, so this module needs no torch."""


def region_bytes(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, codec: str) -> int:
    """Bytes of one page's region of K and V for ``num_layers`` layers in ``codec``."""
    elems = num_layers * 2 * block_size * num_kv_heads * head_dim
    if codec == FP8_CODEC:
        return elems + num_layers * 2 * block_size * num_kv_heads * 4
    if codec in _CODEC_ELEM_BYTES:
        return elems * _CODEC_ELEM_BYTES[codec]
    raise ValueError(f"unknown KV codec {codec!r}; known: {[*_CODEC_ELEM_BYTES, FP8_CODEC]}")


@dataclass(frozen=True)
class Region:
    """One region of a page, in page order: its bytes follow the previous regions' in every page that crosses an
    instance boundary (grpc bytes, the kvstore) and its own pool beside the target's on the side transports."""

    name: str
    """"target" for the model's own KV; the others name their kind and shape: "draft[<draft id> L<layers> kvh<heads>
    d<head dim>]" (speculative decoding's draft KV), "index[L<layers> d<dim>]" (DeepSeek-V3.2's index keys; fp8 ones
    add their row bytes, "r<bytes>")."""
    codec: str
    """bf16 | fp16 | fp32 | fp8-e4m3 (values + fp32 scales: per token and head for K/V, per token for index keys)."""
    bytes_per_page: int

    @property
    def kind(self) -> str:
        """"target", "draft" or "index": the name before its shape."""
        return self.name.split("[", 1)[0]


FP8_INDEX_ROW_ALIGN = 16
"""Bytes an fp8 index-key row is padded to a multiple of: every row then starts 16-byte aligned, so a kernel's
vector loads of a row's e4m3 values stay aligned whatever row it reads (DeepSeek-V3.2's 128 values + a 4-byte scale
are 132 bytes, padded to 144)."""


def fp8_index_row(dim: int) -> int:
    """Bytes of one fp8 index-key row: ``dim`` e4m3 values, one fp32 scale, zero padding to FP8_INDEX_ROW_ALIGN."""
    return -(-(dim + 4) // FP8_INDEX_ROW_ALIGN) * FP8_INDEX_ROW_ALIGN


def index_region(num_layers: int, block_size: int, dim: int, codec: str) -> Region:
    """DeepSeek-V3.2's index-key region: one ``dim``-value key per token and layer in ``codec`` (the pool's dtype,
    or fp8-e4m3: rows of ``fp8_index_row(dim)`` bytes, the e4m3 values, then one fp32 scale per token and layer,
    then padding; the row size is in the name, so it is in the fingerprint)."""
    if codec == FP8_CODEC:
        row = fp8_index_row(dim)
        return Region(f"index[L{num_layers} d{dim} r{row}]", codec, num_layers * block_size * row)
    if codec not in _CODEC_ELEM_BYTES:
        raise ValueError(f"unknown index-key codec {codec!r}; known: {[*_CODEC_ELEM_BYTES, FP8_CODEC]}")
    return Region(f"index[L{num_layers} d{dim}]", codec, num_layers * block_size * dim * _CODEC_ELEM_BYTES[codec])


@dataclass(frozen=True)
class HeadSplitSpec:
    """How one side of a tensor-parallel handoff splits the KV heads over its ranks."""

    tp_size: int
    kv_heads_per_rank: int
    replicas: int
    """Ranks that hold the same KV head (1 unless there are fewer KV heads than ranks)."""

    def describe(self) -> str:
        return f"tp{self.tp_size}x{self.kv_heads_per_rank}kvh" + (f"r{self.replicas}" if self.replicas > 1 else "")


@dataclass(frozen=True)
class PageLayout:
    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    regions: tuple[Region, ...] = field(default_factory=tuple)
    splits: tuple[HeadSplitSpec, ...] = ()
    """(writer, pool) head splits when a side transport writes per-rank head shards straight into a
    tensor-parallel side's pools (parallel/rank_pages.py); empty for the all-heads form (grpc stream,
    kvstore), which is TP-independent and whose fingerprint is therefore the same at every degree."""
    layer_windows: tuple[int, ...] = ()
    """Sliding window of each layer (tokens, 0: full attention); empty when every layer is full."""
    attention_sinks: bool = False
    """The layers have learned attention sinks."""
    latent: tuple[int, ...] = ()
    """Latent attention (MLA): (kv_lora_rank, qk_rope_head_dim) of the one latent per token and layer a page holds
    as its K and V planes (one "head" of half of it each); empty for per-head K/V. DeepSeek-V3.2's index keys are a
    region of their own (index_region)."""

    @staticmethod
    def for_model(model_id: str, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                  codec: str, layer_windows: tuple[int, ...] = (), attention_sinks: bool = False,
                  latent: tuple[int, ...] = ()) -> PageLayout:
        if layer_windows and len(layer_windows) != num_layers:
            raise ValueError(f"layer_windows has {len(layer_windows)} entries for {num_layers} layers")
        nbytes = region_bytes(num_layers, num_kv_heads, head_dim, block_size, codec)
        return PageLayout(model_id, num_layers, num_kv_heads, head_dim, block_size,
                          (Region("target", codec, nbytes),), layer_windows=tuple(layer_windows),
                          attention_sinks=attention_sinks, latent=tuple(latent))  # type: ignore[arg-type]

    def with_region(self, region: Region) -> PageLayout:
        """This layout with one more region after the others (e.g. speculative decoding's draft KV)."""
        return replace(self, regions=(*self.regions, region))

    def with_splits(self, writer: HeadSplitSpec, pool: HeadSplitSpec) -> PageLayout:
        """This layout as written shard by shard: ``writer``'s ranks into ``pool``'s ranks."""
        return replace(self, splits=(writer, pool))

    @staticmethod
    def codec_for_dtype(dtype: object) -> str:
        """Codec of a torch dtype (``torch.bfloat16``) or its name (``"bfloat16"``)."""
        name = str(dtype).removeprefix("torch.")
        if name not in _DTYPE_CODEC:
            raise ValueError(f"no KV codec for dtype {dtype}; known: {sorted(_DTYPE_CODEC)}")
        return _DTYPE_CODEC[name]

    @property
    def page_bytes(self) -> int:
        return sum(r.bytes_per_page for r in self.regions)

    @property
    def target_codec(self) -> str:
        return self.regions[0].codec

    def region(self, kind: str) -> Region | None:
        """The region of ``kind`` ("target", "draft", "index"), or None when pages carry none."""
        return next((r for r in self.regions if r.kind == kind), None)

    @property
    def fingerprint(self) -> str:
        fields = asdict(self)
        # Fields at their defaults are left out, so a layout keeps the fingerprint it had before they existed
        # (the all-heads form before splits; full attention without sinks before windows and sinks).
        for name, empty in (("splits", ()), ("layer_windows", ()), ("attention_sinks", False), ("latent", ())):
            if getattr(self, name) == empty:
                del fields[name]
        canon = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()[:16]

    def describe(self) -> str:
        return (f"{self.model_id} L{self.num_layers} kvh{self.num_kv_heads} d{self.head_dim} "
                f"bs{self.block_size} {'+'.join(r.name + ':' + r.codec for r in self.regions)} "
                f"{'heads ' + '->'.join(s.describe() for s in self.splits) + ' ' if self.splits else ''}"
                f"{'windows ' + _windows(self.layer_windows) + ' ' if self.layer_windows else ''}"
                f"{'sinks ' if self.attention_sinks else ''}"
                f"{_latent(self.latent)}"
                f"[{self.fingerprint}]")


def _latent(widths: tuple[int, ...]) -> str:
    """"latent c512+r64 " (kv_lora_rank + rope dims); "" for per-head K/V."""
    if not widths:
        return ""
    return "latent " + "+".join(f"{k}{w}" for k, w in zip("cr", widths, strict=False)) + " "


def _windows(windows: tuple[int, ...]) -> str:
    """Per-layer windows in runs: "8x2,0x1" = two layers of window 8, then one full layer."""
    runs: list[list[int]] = []
    for w in windows:
        if runs and runs[-1][0] == w:
            runs[-1][1] += 1
        else:
            runs.append([w, 1])
    return ",".join(f"{w}x{n}" for w, n in runs)
