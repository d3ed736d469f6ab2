"""DeepSeek-V3.2's index keys as a page region of their own (engine/index_keys.py, page_regions.py): a V3.2-shaped
page (latent + fp8 index keys with per-token scales + a draft region) packs and unpacks byte for byte, the target's
fp8 wire codec leaves the index region's bytes as stored, the layout fingerprint covers the index codec; the tiny
deepseek_v32 engine with the fp8 index codec against the pool-dtype one; the codec refused for a model without an
indexer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.gpu_bench import logits_trace
from services.engine.config import EngineConfig, EngineConfigError
from services.engine.engine import LLMEngine
from services.engine.index_keys import IndexKeys
from services.engine.kv_layout import FP8_CODEC, PageLayout, Region, region_bytes
from services.engine.page_regions import KVRegion, pack_regions, regions_nbytes, unpack_regions
from services.text.sampling_params import SamplingParams
from tests.moe_checkpoints import write_tiny_moe

L, NB, BS, LATENT, INDEX_DIM = 2, 6, 4, (32, 8), 16
DRAFT = (1, 2, 8)
"""Draft layers, kv heads, head dim."""


def _v32_regions(seed: int, fill: bool = True) -> list:
    """Target (latent planes), index keys (fp8 + scales), draft (fp8 codec): random contents when ``fill``."""
    g = torch.Generator().manual_seed(seed)
    target = torch.zeros(L, 2, NB, BS, 1, sum(LATENT) // 2)
    draft = torch.zeros(DRAFT[0], 2, NB, BS, DRAFT[1], DRAFT[2])
    pool = torch.zeros(IndexKeys.pool_shape(L, NB, BS, INDEX_DIM, FP8_CODEC, torch.float32), dtype=torch.uint8)
    index = IndexKeys(L, NB, BS, INDEX_DIM, FP8_CODEC, torch.float32, pool)
    if fill:
        target.copy_(torch.randn(target.shape, generator=g))
        draft.copy_(torch.randn(draft.shape, generator=g))
        for layer in range(L):
            index.store(layer, torch.randn(NB * BS, INDEX_DIM, generator=g) * (layer + 1), torch.arange(NB * BS))
    return [KVRegion("target", target), index, KVRegion("draft", draft, FP8_CODEC)]


def _layout(index_codec: str) -> PageLayout:
    base = PageLayout.for_model("v32", L, 1, sum(LATENT) // 2, BS, "fp32", latent=LATENT)
    draft = Region("draft[v32 L1 kvh2 d8]", FP8_CODEC, region_bytes(*DRAFT, BS, FP8_CODEC))
    pool = torch.zeros(IndexKeys.pool_shape(L, 1, BS, INDEX_DIM, index_codec, torch.float32), dtype=torch.uint8)
    return base.with_region(IndexKeys(L, 1, BS, INDEX_DIM, index_codec, torch.float32, pool).region()).with_region(draft)


def test_v32_page_packs_and_unpacks_byte_identical() -> None:
    src, dst = _v32_regions(1), _v32_regions(2, fill=False)
    layout = _layout(FP8_CODEC)
    ids = [4, 1, 3]
    pages = pack_regions(src, ids, None)
    assert pages.dtype == torch.uint8 and pages.shape == (3, layout.page_bytes) == (3, regions_nbytes(src, None))
    assert [r.nbytes() for r in src] == [r.bytes_per_page for r in layout.regions]
    unpack_regions(pages, dst, [0, 5, 2], None)
    assert torch.equal(pack_regions(dst, [0, 5, 2], None), pages)
    assert torch.equal(dst[1].kv_cache[:, :, [0, 5, 2]], src[1].kv_cache[:, :, ids])  # index rows, bit for bit
    with pytest.raises(ValueError, match=r"\(target\) \+ .* \(index\) \+ .* \(draft\)"):
        unpack_regions(pages[:, :-1], dst, [0, 5, 2], None)


def test_target_wire_codec_leaves_the_index_region_as_stored() -> None:
    """fp8-e4m3 on the wire re-encodes the target region only: the index bytes (and draft bytes) are the same."""
    regions = _v32_regions(3)
    native, wire = pack_regions(regions, [0, 2], None), pack_regions(regions, [0, 2], FP8_CODEC)
    t_native, t_wire = regions[0].nbytes(None), regions[0].nbytes(FP8_CODEC)
    assert t_wire < t_native and native.shape[1] - t_native == wire.shape[1] - t_wire
    assert torch.equal(native[:, t_native:], wire[:, t_wire:])


def test_fingerprint_covers_the_index_codec() -> None:
    fp8, plain = _layout(FP8_CODEC), _layout("fp32")
    assert fp8.fingerprint != plain.fingerprint
    assert "+index[L2 d16 r32]:fp8-e4m3+draft[" in fp8.describe() and "+index[L2 d16]:fp32+" in plain.describe()
    assert fp8.region("index").bytes_per_page == L * BS * 32  # 16 values + a 4-byte scale, padded to 16 bytes
    assert plain.region("index").bytes_per_page == L * BS * INDEX_DIM * 4


def test_index_codec_is_refused_for_a_model_without_an_indexer() -> None:
    with pytest.raises(EngineConfigError, match=r"--index-kv-codec / PDSERVE_INDEX_KV_CODEC=fp8-e4m3: .* no indexer"):
        LLMEngine(EngineConfig(model="random:tiny-llama", dtype="float32", num_kv_blocks=16,
                               index_kv_codec=FP8_CODEC))


def test_index_codec_on_cuda() -> None:
    """A CUDA engine takes either index-key codec (fp8 rows are 16-byte aligned, kv_layout.fp8_index_row)."""
    from types import SimpleNamespace

    from services.engine.model_runner import _index_codec

    arch = SimpleNamespace(mla=SimpleNamespace(index_head_dim=16), architecture="DeepseekV32ForCausalLM")
    config = EngineConfig(model="random:tiny-llama", dtype="bfloat16", device="cuda", index_kv_codec=FP8_CODEC)
    assert _index_codec(arch, config) == FP8_CODEC
    assert _index_codec(arch, EngineConfig(model="random:tiny-llama", dtype="bfloat16", device="cuda")) == "bf16"


@pytest.fixture(scope="module")
def tiny_v32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    return write_tiny_moe(tmp_path_factory.mktemp("deepseek_v32"), "deepseek_v32")


def _engine(model: Path, codec: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), dtype="float32", device="cpu", max_prefill_chunk=13,
                                  num_kv_blocks=64, block_size=16, index_kv_codec=codec))


def test_fp8_index_codec_engine_against_the_pool_dtype_one(tiny_v32: Path) -> None:
    """Teacher-forced on the pool-dtype engine's tokens (transformers' up to the first near-tie, test_deepseek.py).
    While a context holds at most index_topk (8) keys every key is selected, so the fp8 index keys change nothing;
    past it, fp8 rounding of the keys may flip a near-tied top-k choice of the tiny random indexer (its index scores
    lie close together), which moves the logits: the logits stay close in direction, not equal."""
    native, fp8 = _engine(tiny_v32, "native"), _engine(tiny_v32, FP8_CODEC)
    assert fp8.layout.region("index").codec == FP8_CODEC and native.layout.region("index").codec == "fp32"
    assert fp8.layout.fingerprint != native.layout.fingerprint
    short = torch.randint(0, 512, (5,), generator=torch.Generator().manual_seed(1)).tolist()
    toks, want = logits_trace(native, short, 4)
    _, got = logits_trace(fp8, short, 4, forced=toks)
    assert (got[:3] - want[:3]).abs().max() < 1e-4  # contexts 5..7 <= topk: every key seen either way
    cos = []
    for n, seed in ((40, 2), (23, 3)):
        prompt = torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
        toks, want = logits_trace(native, prompt, 12)
        _, got = logits_trace(fp8, prompt, 12, forced=toks)
        cos.append(torch.nn.functional.cosine_similarity(got, want, dim=-1))
    cos_all = torch.cat(cos)
    assert cos_all.mean() > 0.9 and cos_all.min() > 0.5, cos_all
    assert fp8.block_manager.num_free_blocks == fp8.runner.num_blocks


def test_index_keys_hold_the_fp8_rounding_of_the_keys(tiny_v32: Path) -> None:
    """Layer 0's fp8 keys are the pool-dtype pool's up to e4m3 rounding under each token's own scale (layer 0 reads
    the embeddings alone; later layers' inputs already differ where a top-k choice flipped)."""
    native, fp8 = _engine(tiny_v32, "native"), _engine(tiny_v32, FP8_CODEC)
    tables: dict[str, list[int]] = {}
    prompt = list(range(3, 35))
    for name, eng in (("native", native), ("fp8", fp8)):
        eng.chunk_listeners.append(lambda ch, _s, n=name: tables.__setitem__(n, list(ch.seq.block_table)))
        eng.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    slots_n = torch.tensor([tables["native"][t // 16] * 16 + t % 16 for t in range(len(prompt))])
    slots_f = torch.tensor([tables["fp8"][t // 16] * 16 + t % 16 for t in range(len(prompt))])
    a = native.runner.index_keys.read(0, slots_n)
    b = fp8.runner.index_keys.read(0, slots_f)
    amax = a.abs().amax(dim=-1, keepdim=True)
    assert ((a - b).abs() <= a.abs() / 16 + amax / 448 * 2 ** -6 + 1e-6).all()
    assert not torch.equal(a, b)


@pytest.mark.parametrize("codec", ["fp32", FP8_CODEC])
def test_store_skips_padding_slots_and_reads_back_what_it_wrote(codec: str) -> None:
    # A CUDA graph's padding rows carry slot -1: they must write nothing (the GPU path is store_kv's skip).
    pool = torch.zeros(IndexKeys.pool_shape(L, NB, BS, INDEX_DIM, codec, torch.float32), dtype=torch.uint8)
    keys = IndexKeys(L, NB, BS, INDEX_DIM, codec, torch.float32, pool)
    new = torch.randn((3, INDEX_DIM), generator=torch.Generator().manual_seed(3))
    keys.store(1, new, torch.tensor([-1, 5, 9]))
    got = keys.read(1, torch.tensor([5, 9]))
    tol = {"atol": 0.0, "rtol": 0.0} if codec == "fp32" else {"atol": 1e-2, "rtol": 1 / 16}
    torch.testing.assert_close(got, new[1:], **tol)
    written = pool.view(L, NB * BS, -1)[1].any(dim=1).nonzero().flatten().tolist()
    assert written == [5, 9] and not pool[0].any()
