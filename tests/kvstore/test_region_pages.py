"""A DeepSeek-V3.2-shaped page (latent + fp8 index keys with per-token scales + a draft region, page_regions.py)
through every kvstore backend (memory, memory+disk, Mooncake Store): stored under its layout's fingerprint, read
back byte for byte, and unpacked into fresh pools it restores every region exactly."""

from __future__ import annotations

import torch

from services.common.checksum import checksum
from services.engine.page_regions import pack_regions, unpack_regions
from services.kvstore.backend import KVStoreBackend
from tests.engine.test_index_region import _layout, _v32_regions
from tests.kvstore.conftest import new_hash


async def test_v32_page_round_trips_through_the_backend(backend: KVStoreBackend) -> None:
    src, dst = _v32_regions(5), _v32_regions(6, fill=False)
    layout = _layout("fp8-e4m3")
    pages = pack_regions(src, [0, 3], None)
    keys = []
    for page in pages:
        data = page.numpy().tobytes()
        assert len(data) == layout.page_bytes
        h = new_hash()
        assert await backend.put(layout.fingerprint, h, data, checksum(data)) is True
        keys.append(h)
    got = [await backend.get(layout.fingerprint, h) for h in keys]
    assert got == [p.numpy().tobytes() for p in pages]
    unpack_regions(torch.frombuffer(bytearray(b"".join(got)), dtype=torch.uint8), dst, [1, 2], None)
    assert torch.equal(pack_regions(dst, [1, 2], None), pages)
    assert await backend.get(_layout("fp32").fingerprint, keys[0]) is None  # another index codec: another key
