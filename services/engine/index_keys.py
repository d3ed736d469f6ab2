"""DeepSeek-V3.2's index keys: a page region of their own, in a codec chosen at start (``--index-kv-codec``).

The indexer caches one ``dim``-value key per token and layer. Its pool has the target pool's block ids and is
allocated with it (model_runner.py): uint8 ``[layers, 1, blocks, block_size, 1, row bytes]``, each row one token's
key in the region's codec, either the pool dtype (``dim`` values) or fp8-e4m3 (``dim`` e4m3 values, then one fp32
scale: DeepSeek-V3.2's own cache form, amax / 448 per token; zero-padded to a multiple of 16 bytes so that every row,
and so every vector load of its values, starts 16-byte aligned: kv_layout.fp8_index_row). Rows are raw bytes, so a page's region is a byte
copy (``pack`` / ``unpack``, the side transports' page copies) and never re-encoded on the way; the attention
backends store keys (``store``, quantizing for fp8) and read them back dequantized (``read``), the Triton index
scores through ``values`` / ``scales`` views of the same bytes. The six dimensions are the K/V pools' (a layer
plane, blocks at dim 2), so the shared-pool machinery (shm files, CUDA IPC, Mooncake) opens and copies it as it
does a K/V pool.
"""

from __future__ import annotations

import torch

from services.engine.kv_layout import FP8_CODEC, PageLayout, Region, fp8_index_row, index_region
from services.kernels import fp8_quantize

FP8_SCALE_BYTES = 4
"""One fp32 scale per token and layer after the e4m3 values of an fp8 row."""


class IndexKeys:
    """The index-key pool of one engine (or one tensor-parallel rank: every rank holds the same keys); a
    page_regions.PageRegion."""

    kind = "index"

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, dim: int, codec: str,
                 dtype: torch.dtype, pool: torch.Tensor) -> None:
        self.num_layers, self.block_size, self.dim, self.codec, self.dtype = num_layers, block_size, dim, codec, dtype
        self.fp8 = codec == FP8_CODEC
        if self.fp8 and dim % FP8_SCALE_BYTES:
            raise ValueError(f"index_head_dim={dim}: the fp8 index-key codec needs a multiple of 4 (scale alignment)")
        want = self.pool_shape(num_layers, num_blocks, block_size, dim, codec, dtype)
        if tuple(pool.shape) != want or pool.dtype != torch.uint8:
            raise ValueError(f"index-key pool {tuple(pool.shape)} {pool.dtype}, expected {want} torch.uint8")
        self.kv_cache = pool
        """uint8 [layers, 1, blocks, block_size, 1, row bytes] (named as a K/V pool: the side transports copy it)."""
        rows = pool.view(num_layers, num_blocks * block_size, pool.shape[-1])
        if self.fp8:  # e4m3 values moved as bytes (torch has no CPU index_copy_ of float8), viewed as float8
            self._values = rows[..., :dim]
            self._scales: torch.Tensor | None = rows[..., dim:dim + FP8_SCALE_BYTES].view(torch.float32)[..., 0]
        else:
            self._values = rows.view(dtype)
            self._scales = None

    @staticmethod
    def pool_shape(num_layers: int, num_blocks: int, block_size: int, dim: int, codec: str, dtype: torch.dtype
                   ) -> tuple[int, ...]:
        """The uint8 pool's shape: one row per token and layer of ``dim`` values in ``codec`` (+ its scale)."""
        row = fp8_index_row(dim) if codec == FP8_CODEC else dim * torch.empty((), dtype=dtype).element_size()
        return (num_layers, 1, num_blocks, block_size, 1, row)

    @staticmethod
    def resolve_codec(option: str, dtype: torch.dtype) -> str:
        """The region codec of ``--index-kv-codec``: ``native`` is the pool dtype's codec."""
        return PageLayout.codec_for_dtype(dtype) if option == "native" else option

    def region(self) -> Region:
        """The page region these keys are (its codec is in the layout fingerprint)."""
        return index_region(self.num_layers, self.block_size, self.dim, self.codec)

    def values(self, layer: int) -> torch.Tensor:
        """[slots, dim] stored values of ``layer`` (the pool dtype, or float8_e4m3fn): a strided view of the pool."""
        v = self._values[layer]
        return v.view(torch.float8_e4m3fn) if self.fp8 else v

    def scales(self, layer: int) -> torch.Tensor | None:
        """fp32 [slots] per-token scales of ``layer`` (a strided view), None unless fp8."""
        return None if self._scales is None else self._scales[layer]

    def store(self, layer: int, keys: torch.Tensor, slots: torch.Tensor) -> None:
        """Write ``keys`` [T, dim] at cache ``slots`` (int64 [T]) of ``layer``, quantized for fp8; slot -1 (a CUDA
        graph's padding row) writes nothing. On CUDA one ``store_kv`` launch of the rows' bytes (fixed sizes, no
        host sync: CUDA-graph safe); on the CPU an index copy of the rows whose slot is set."""
        rows = self._row_bytes(keys)
        plane = self.kv_cache[layer, 0]  # uint8 [blocks, block_size, 1, row bytes]
        if plane.is_cuda:
            # kernels.store_kv imports triton: only a CUDA pool reaches it (as in cuda/gpu_attention.py).
            from services.kernels.store_kv import store_kv

            r = rows.view(rows.shape[0], 1, rows.shape[1])
            store_kv(r, r, plane, plane, slots)  # the same bytes as "K" and "V" of the one plane
            return
        keep = slots >= 0
        plane.view(-1, rows.shape[1]).index_copy_(0, slots[keep], rows[keep])

    def _row_bytes(self, keys: torch.Tensor) -> torch.Tensor:
        """uint8 [T, row bytes] of ``keys`` [T, dim] as the pool stores them: the pool dtype's values, or the e4m3
        values followed by their fp32 scale and the row's zero padding."""
        if not self.fp8:
            return keys.reshape(-1, self.dim).to(self.dtype).contiguous().view(torch.uint8)
        q, s = fp8_quantize(keys.reshape(-1, 1, self.dim))
        pad = self.kv_cache.shape[-1] - self.dim - FP8_SCALE_BYTES
        parts = [q.view(torch.uint8).reshape(-1, self.dim), s.reshape(-1, 1).view(torch.uint8)]
        if pad:
            parts.append(torch.zeros((q.shape[0], pad), dtype=torch.uint8, device=q.device))
        return torch.cat(parts, dim=1)

    def read(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """[N, dim] keys at ``slots`` (int64 [N]) of ``layer``: the pool dtype's values, or fp8 ones dequantized with
        their scale in fp32 (the index scores are fp32 sums either way)."""
        v = self._values[layer].index_select(0, slots)
        if self._scales is None:
            return v
        return v.view(torch.float8_e4m3fn).float() * self._scales[layer].index_select(0, slots)[:, None]

    def read_range(self, layer: int, start: int, n: int) -> torch.Tensor:
        """[n, dim] keys of the consecutive slots [start, start + n) of ``layer`` (see ``read``)."""
        v = self._values[layer][start:start + n]
        if self._scales is None:
            return v
        return v.view(torch.float8_e4m3fn).float() * self._scales[layer][start:start + n, None]

    def read_blocks(self, layer: int, blocks: torch.Tensor) -> torch.Tensor:
        """[len(blocks) * block_size, dim] keys of the int64 ``blocks`` of ``layer``, block after block."""
        bs = self.block_size
        slots = (blocks[:, None] * bs + torch.arange(bs, device=blocks.device)[None, :]).reshape(-1)
        return self.read(layer, slots)

    @property
    def device(self) -> torch.device:
        return self.kv_cache.device

    def nbytes(self, codec: str | None = None) -> int:
        """Bytes of one page of this region (``codec``, the target's wire codec, does not apply: see ``pack``)."""
        return self.kv_cache[:, :, 0].numel()

    def pack(self, idx: torch.Tensor, codec: str | None = None) -> torch.Tensor:
        """uint8 [P, region bytes] of the blocks ``idx`` (int64, the pool's device): the rows as stored, whatever
        the target's wire codec (fp8 keys are already fp8 with their scales; keys in the pool dtype stay exact)."""
        return self.kv_cache.index_select(2, idx).permute(2, 0, 1, 3, 4, 5).reshape(idx.numel(), -1)

    def unpack(self, data: torch.Tensor, idx: torch.Tensor, codec: str | None = None) -> None:
        """Inverse of ``pack``: uint8 [P, region bytes] (a column slice is fine) into the blocks ``idx``."""
        pages = data.contiguous().view(idx.numel(), *self.kv_cache.shape[:2], *self.kv_cache.shape[3:])
        self.kv_cache.index_copy_(2, idx, pages.permute(1, 2, 0, 3, 4, 5))
