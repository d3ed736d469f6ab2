"""Rank-to-rank pages over cuda-ipc on two GPUs (NCCL; rank r of an instance on cuda:r): every prefill rank
writes its heads straight into the decode ranks' exported pools; greedy tokens equal the colocated TP=1
engine's on cuda:0 (fp32), no page bytes in the stream, every prefill rank wrote. The same code path as the
CPU shm tests (parallel/rank_pages.py); skips cleanly without two CUDA GPUs."""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.common.metrics import DECODE_KV_RECEIVED_BYTES_TOTAL, PREFILL_KV_RANK_PAGES_TOTAL
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.launcher import LocalCluster
from services.text.sampling_params import SamplingParams
from tests.e2e.cluster_util import metric_sum
from tests.e2e.test_tensor_parallel_pd import MAX_TOKENS, MODEL, PROMPTS, _generate

pytestmark = [pytest.mark.e2e, pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]

ENGINE = ["--device", "cuda", "--num-kv-blocks", "64", "--max-model-len", "256"]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    eng = LLMEngine(EngineConfig(model=MODEL, dtype="float32", device="cuda", num_kv_blocks=64, max_model_len=256))
    out = eng.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    eng.runner.release()
    return out


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 2), (2, 2)])
def test_cuda_ipc_rank_to_rank_tokens_equal_colocated_tp1(prefill_tp: int, decode_tp: int, reference) -> None:
    extra = {"prefill": [*ENGINE, "--max-prefill-chunk", "32", "--tensor-parallel-size", str(prefill_tp)],
             "decode": [*ENGINE, "--tensor-parallel-size", str(decode_tp)]}
    with LocalCluster(prefill=1, decode=1, kvstore=None, model=MODEL, dtype="float32", extra=extra, quiet=True,
                      kv_transport="cuda-ipc") as c:
        for ids, want in zip(PROMPTS, reference, strict=True):
            assert asyncio.run(_generate(c.router["grpc"], ids)) == want, (prefill_tp, decode_tp)
        pm, dm = c.get("prefill-0").ready["metrics"], c.get("decode-0").ready["metrics"]
        assert metric_sum(dm, DECODE_KV_RECEIVED_BYTES_TOTAL, transport="cuda-ipc") > 0
        assert metric_sum(dm, DECODE_KV_RECEIVED_BYTES_TOTAL, transport="grpc") == 0
        assert all(metric_sum(pm, PREFILL_KV_RANK_PAGES_TOTAL, rank=str(r)) > 0 for r in range(prefill_tp))
