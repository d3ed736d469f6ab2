"""FP8-e4m3 page codec constants and byte sizes (pure Python, no torch or triton needed).

An fp8 page for block_size tokens holds, in this order:
  values  fp8-e4m3 [num_layers, 2, block_size, num_kv_heads, head_dim]   (1 byte each)
  scales  fp32     [num_layers, 2, block_size, num_kv_heads]             (4 bytes each)
with one scale per token per head: scale = amax(|x|) / 448 and x ~= value * scale.
The layout fingerprint is computed by the engine's kv layout module from `fp8_layout_codec_name`.
"""

from __future__ import annotations

fp8_layout_codec_name: str = "fp8-e4m3"

#: Largest finite float8_e4m3fn magnitude.
FP8_E4M3_MAX: float = 448.0


def fp8_page_regions(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, int]:
    """(values bytes, scales bytes) of one fp8 page; the scales start at byte offset `values bytes`."""
    for name, v in (
        ("num_layers", num_layers),
        ("block_size", block_size),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
    ):
        if v <= 0:
            raise ValueError(f"{name} must be positive, got {v}")
    if head_dim % 4 != 0:
        raise ValueError(f"head_dim must be a multiple of 4 so the fp32 scales stay aligned, got {head_dim}")
    rows = num_layers * 2 * block_size * num_kv_heads
    return rows * head_dim, rows * 4


def fp8_page_nbytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int) -> int:
    """Bytes of one fp8-e4m3 page (values + per-token-per-head fp32 scales)."""
    values, scales = fp8_page_regions(num_layers, block_size, num_kv_heads, head_dim)
    return values + scales


def plain_page_nbytes(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, element_size: int
) -> int:
    """Bytes of one uncompressed page [num_layers, 2, block_size, num_kv_heads, head_dim]."""
    return num_layers * 2 * block_size * num_kv_heads * head_dim * element_size
