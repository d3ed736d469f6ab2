"""Tiny DeepSeek checkpoints (transformers-built; multi-head latent attention, so the pages hold one latent per
token, and for V3.2 the indexer's keys in a region of their own) served by real 1P1D clusters: DeepSeek-V2's, V3's,
V3.2's and an FP8 block-scaled V3's greedy tokens over the grpc, shm and mooncake KV transports (and V3.2's over
cuda-ipc on a GPU) equal transformers fp32 up to the first near-tie (the FP8 checkpoint against transformers on its
dequantized twin); with the kvstore, a second prefill loads the latent pages the first
one wrote and gives the same tokens (for V3.2 with the index-key region); the prefill's and decode's index-key
codecs must agree (the fingerprint names it); a TP=2 prefill hands the pages to a TP=1 decode and back, and to a TP=2
decode, rank to rank over shm and mooncake (V3.2: with the index-key region, whose codec must agree there too)."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch

from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.kv_transport import mooncake
from services.launcher import LocalCluster
from services.text.sampling_params import SamplingParams
from tests.e2e.cluster_util import metric_sum, wait_idle
from tests.e2e.conftest import SMALL_KV
from tests.e2e.test_moe_cluster import _check_against_transformers, _generate, _prompts, kvstore_reuse_tokens
from tests.moe_checkpoints import write_fp8_copy, write_tiny_moe

pytestmark = pytest.mark.e2e

NO_MOONCAKE = mooncake.available()


def _checkpoint(tmp_path_factory: pytest.TempPathFactory, model_type: str) -> tuple[Path, object]:
    transformers = pytest.importorskip("transformers")
    d = write_tiny_moe(tmp_path_factory.mktemp(model_type), model_type)
    return d, transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def v3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    return _checkpoint(tmp_path_factory, "deepseek_v3")


@pytest.fixture(scope="module")
def v32(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    return _checkpoint(tmp_path_factory, "deepseek_v32")


@pytest.fixture(scope="module")
def v2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    return _checkpoint(tmp_path_factory, "deepseek_v2")


@pytest.fixture(scope="module")
def v3_fp8(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    """DeepSeek-V3 with its projections FP8 block-scaled (the checkpoint format V3 ships); the reference is
    transformers on the dequantized twin the writer leaves beside it."""
    transformers = pytest.importorskip("transformers")
    src = write_tiny_moe(tmp_path_factory.mktemp("deepseek_v3_src"), "deepseek_v3")
    d = write_fp8_copy(src, tmp_path_factory.mktemp("deepseek_v3_fp8"))
    return d, transformers.AutoModelForCausalLM.from_pretrained(str(d / "ref"), dtype=torch.float32).eval()


@pytest.mark.parametrize("model", ["v2", "v3", "v32", "v3_fp8"])
@pytest.mark.parametrize("transport", ["grpc", "shm", "mooncake"])
def test_mla_1p1d_tokens_equal_transformers(model: str, transport: str, request: pytest.FixtureRequest) -> None:
    """The pages carry each token's latent (V3.2: and the indexer's keys, which the decode's top-k selection
    reads); the FP8 checkpoint is dequantized at load on CPU."""
    if transport == "mooncake" and NO_MOONCAKE is not None:
        pytest.skip(f"the Mooncake wheel cannot load here: {NO_MOONCAKE}")
    model_dir, ref = request.getfixturevalue(model)
    sizes = {"prefill": ["--max-prefill-chunk", "29", *SMALL_KV], "decode": SMALL_KV}
    with LocalCluster(prefill=1, decode=1, kvstore=None, model=str(model_dir), dtype="float32", extra=sizes,
                      quiet=True, kv_transport=transport) as c:
        for i, ids in enumerate(_prompts()):
            got = _generate(c.router["grpc"], ids)
            assert len(got) == 16
            _check_against_transformers(ref, ids, got, f"{model} {transport} prompt {i}")
        pm = c.get("prefill-0").ready["metrics"]
        assert metric_sum(pm, "pdserve_prefill_kv_sent_bytes_total", transport=transport) > 0
        # shm and mooncake write the pools in place (V3.2: the index-key pool beside the latent's): no fallback
        assert metric_sum(pm, "pdserve_prefill_kv_transport_fallbacks_total") == 0
        rep = wait_idle(c.get("decode-0").ready["grpc"])
        assert rep.free_blocks == rep.total_blocks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuda-ipc needs an NVIDIA GPU")
@pytest.mark.parametrize("index_codec", ["native", "fp8-e4m3"])
def test_v32_1p1d_over_cuda_ipc_writes_the_index_region_in_place(v32: tuple[Path, object], index_codec: str) -> None:
    """DeepSeek-V3.2 with prefill and decode on one GPU: the prefill writes the latent and the index-key pools that
    decode exported over CUDA IPC (no page bytes, no fallback). Native index keys: tokens follow transformers fp32 up
    to the first near-tie; fp8-e4m3 ones (which may flip a near-tied top-k choice): tokens equal the same codec's
    engine in process on the GPU."""
    model_dir, ref = v32
    engine = ["--device", "cuda", *SMALL_KV, "--index-kv-codec", index_codec]
    sizes = {"prefill": [*engine, "--max-prefill-chunk", "29"], "decode": engine}
    want = None
    if index_codec != "native":
        local = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", device="cuda", num_kv_blocks=64,
                                       index_kv_codec=index_codec, max_prefill_chunk=29))
        want = [local.generate([ids], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
                for ids in _prompts()]
        del local
        torch.cuda.empty_cache()
    with LocalCluster(prefill=1, decode=1, kvstore=None, model=str(model_dir), dtype="float32", extra=sizes,
                      quiet=True, kv_transport="cuda-ipc") as c:
        for i, ids in enumerate(_prompts()):
            got = _generate(c.router["grpc"], ids)
            assert len(got) == 16
            if want is None:
                _check_against_transformers(ref, ids, got, f"deepseek_v32 cuda-ipc prompt {i}")
            else:
                assert got == want[i], f"prompt {i}: cluster {got} != in-process engine {want[i]} ({index_codec})"
        pm, dm = c.get("prefill-0").ready["metrics"], c.get("decode-0").ready["metrics"]
        assert metric_sum(dm, "pdserve_decode_kv_received_bytes_total", transport="cuda-ipc") > 0
        assert metric_sum(dm, "pdserve_decode_kv_received_bytes_total", transport="grpc") == 0
        assert metric_sum(pm, "pdserve_prefill_kv_transport_fallbacks_total") == 0
        rep = wait_idle(c.get("decode-0").ready["grpc"])
        assert rep.free_blocks == rep.total_blocks


def _fingerprint(model_dir: Path, index_codec: str) -> str:
    return LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=16,
                                  index_kv_codec=index_codec)).layout.fingerprint


@pytest.mark.parametrize(("prefill_codec", "transport"), [("fp8-e4m3", "shm"), ("native", "shm"), ("native", "grpc")])
def test_v32_index_codec_must_agree(v32: tuple[Path, object], prefill_codec: str, transport: str) -> None:
    """Decode caches index keys in fp8-e4m3 (--index-kv-codec). A prefill with the pool-dtype codec is refused before
    any page moves (shm or grpc), the error naming both layout fingerprints; one with the same codec hands off over
    shm and the
    tokens equal the colocated engine's with that codec (fp8 keys may flip a near-tied top-k choice, so not
    necessarily transformers')."""
    model_dir, _ = v32
    extra = {"prefill": ["--max-prefill-chunk", "29", "--index-kv-codec", prefill_codec, *SMALL_KV],
             "decode": ["--index-kv-codec", "fp8-e4m3", *SMALL_KV]}
    ids = _prompts()[0]
    with LocalCluster(prefill=1, decode=1, kvstore=None, model=str(model_dir), dtype="float32", extra=extra,
                      quiet=True, kv_transport=transport) as c:
        if prefill_codec == "native":
            with pytest.raises(grpc.aio.AioRpcError) as e:
                _generate(c.router["grpc"], ids)
            msg = e.value.details() or ""
            assert _fingerprint(model_dir, "native") in msg and _fingerprint(model_dir, "fp8-e4m3") in msg, msg
        else:
            want = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=64,
                                          index_kv_codec="fp8-e4m3")).generate(
                [ids], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
            assert _generate(c.router["grpc"], ids) == want
            pm = c.get("prefill-0").ready["metrics"]
            assert metric_sum(pm, "pdserve_prefill_kv_sent_bytes_total", transport="shm") > 0
            assert metric_sum(pm, "pdserve_prefill_kv_transport_fallbacks_total") == 0
        rep = wait_idle(c.get("decode-0").ready["grpc"])
        assert rep.free_blocks == rep.total_blocks


def test_mla_kvstore_pages_reused_across_two_prefills(v2: tuple[Path, object]) -> None:
    model_dir, ref = v2
    ids = _prompts()[0]
    _check_against_transformers(ref, ids, kvstore_reuse_tokens(model_dir, ids), "deepseek_v2 kvstore")


def test_v32_kvstore_pages_carry_the_index_region(v32: tuple[Path, object]) -> None:
    """DeepSeek-V3.2: the pages one prefill writes to the kvstore (latent + index-key region) are the ones the other
    loads; the decode's top-k selection over the loaded index keys gives transformers' tokens."""
    model_dir, ref = v32
    ids = _prompts()[0]
    _check_against_transformers(ref, ids, kvstore_reuse_tokens(model_dir, ids), "deepseek_v32 kvstore")


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)])
def test_mla_pages_cross_tensor_parallel_degrees(v3: tuple[Path, object], prefill_tp: int, decode_tp: int) -> None:
    """A TP=2 prefill (gloo) hands latent pages to a TP=1 decode and back: every rank holds the same latent, the
    heads split over the ranks; tokens equal the colocated TP=1 engine's."""
    _cross_tensor_parallel(v3[0], prefill_tp, decode_tp)


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2), (2, 2)])
def test_v32_index_region_crosses_tensor_parallel_degrees(v32: tuple[Path, object], prefill_tp: int,
                                                          decode_tp: int) -> None:
    """DeepSeek-V3.2 across TP degrees: the index keys are replicated, so the prefill ranks split each chunk's pages
    and write the latent and the index keys straight into every decode rank's pools (no page bytes, no fallback);
    the decode's top-k selection reads them, so its tokens equal the colocated TP=1 engine's."""
    _cross_tensor_parallel(v32[0], prefill_tp, decode_tp)


@pytest.mark.skipif(NO_MOONCAKE is not None, reason=f"the Mooncake wheel cannot load here: {NO_MOONCAKE}")
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 2), pytest.param(2, 1, marks=pytest.mark.slow),
                                                       pytest.param(1, 2, marks=pytest.mark.slow)])
def test_v32_index_region_crosses_tensor_parallel_degrees_over_mooncake(v32: tuple[Path, object], prefill_tp: int,
                                                                        decode_tp: int) -> None:
    """The same over Mooncake (loopback TCP): every decode rank registers its latent shard and its index-key pool
    with its own transfer engine and offers both, and every prefill rank writes its share of both regions through
    its own engine (no page bytes, no fallback); tokens equal the colocated TP=1 engine's."""
    _cross_tensor_parallel(v32[0], prefill_tp, decode_tp, "mooncake")


def test_v32_index_codec_mismatch_is_refused_across_tensor_parallel_ranks(v32: tuple[Path, object]) -> None:
    """A TP=2 prefill with fp8-e4m3 index keys facing a TP=2 decode with pool-dtype ones: refused before any page
    moves (the layout decode expects names its own index codec), the error naming both fingerprints; no rank writes
    a page into decode's pools. (Past that check, the rank writes' attach refuses the other region too, reason
    index: tests/engine/test_rank_pages.py.)"""
    model_dir, _ = v32
    engine = ["--cpu-threads", "1", "--num-kv-blocks", "64", "--tensor-parallel-size", "2"]
    extra = {"prefill": [*engine, "--max-prefill-chunk", "32", "--index-kv-codec", "fp8-e4m3"], "decode": engine}
    with LocalCluster(prefill=1, decode=1, kvstore=None, model=str(model_dir), dtype="float32", extra=extra,
                      quiet=True, kv_transport="shm") as c:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            _generate(c.router["grpc"], _prompts()[0])
        msg = e.value.details() or ""
        assert _fingerprint(model_dir, "native") in msg and _fingerprint(model_dir, "fp8-e4m3") in msg, msg
        assert metric_sum(c.get("prefill-0").ready["metrics"], "pdserve_prefill_kv_rank_pages_total") == 0
        rep = wait_idle(c.get("decode-0").ready["grpc"])
        assert rep.free_blocks == rep.total_blocks


def _cross_tensor_parallel(model_dir: Path, prefill_tp: int, decode_tp: int, transport: str = "shm") -> None:
    """Two prompts through a 1P1D cluster over ``transport`` (shm or mooncake), prefill and decode at the given TP
    degrees (gloo), against the colocated TP=1 engine's greedy tokens; the pages go rank to rank in place (every
    prefill rank writes some)."""
    prompts = _prompts()[:2]
    engine = ["--cpu-threads", "1", "--num-kv-blocks", "64"]
    want = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=64, cpu_threads=1)).generate(
        prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    extra = {"prefill": [*engine, "--max-prefill-chunk", "32", "--tensor-parallel-size", str(prefill_tp)],
             "decode": [*engine, "--tensor-parallel-size", str(decode_tp)]}
    with LocalCluster(prefill=1, decode=1, kvstore=None, model=str(model_dir), dtype="float32", extra=extra,
                      quiet=True, kv_transport=transport) as c:
        for ids, expect in zip(prompts, want, strict=True):
            assert _generate(c.router["grpc"], ids) == expect, (prefill_tp, decode_tp, transport)
        pm, dm = c.get("prefill-0").ready["metrics"], c.get("decode-0").ready["metrics"]
        assert metric_sum(pm, "pdserve_prefill_kv_transport_fallbacks_total") == 0
        assert metric_sum(dm, "pdserve_decode_kv_received_bytes_total", transport=transport) > 0
        assert metric_sum(dm, "pdserve_decode_kv_received_bytes_total", transport="grpc") == 0
        for rank in range(prefill_tp):
            assert metric_sum(pm, "pdserve_prefill_kv_rank_pages_total", rank=str(rank)) > 0, rank
        rep = wait_idle(c.get("decode-0").ready["grpc"])
        assert rep.free_blocks == rep.total_blocks
