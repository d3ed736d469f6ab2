"""Tiny MoE checkpoints (transformers-built Qwen3-MoE and GLM-4.5) served by a real 1P1D cluster: greedy tokens
over grpc and shm KV transports equal transformers fp32 up to the first near-tie; with the kvstore, a second
prefill loads the pages the first one wrote and gives the same tokens."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch

from services.launcher import LocalCluster
from tests.e2e.cluster_util import metric_sum, wait_idle
from tests.e2e.conftest import SMALL_KV
from tests.e2e.test_pd_cluster import _router_generate
from tests.engine.test_moe_models import assert_tokens_match_until_near_tie
from tests.moe_checkpoints import write_tiny_moe

pytestmark = pytest.mark.e2e

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    return write_tiny_moe(tmp_path_factory.mktemp("qwen3-moe"), "qwen3_moe")


@pytest.fixture(scope="module")
def hf_ref(moe_dir: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(moe_dir), dtype=torch.float32).eval()


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (70, 23, 41)]  # byte-level tokenizer ids


def _check_against_transformers(hf_ref, prompt: list[int], got: list[int], what: str) -> None:
    with torch.no_grad():
        logits = hf_ref(torch.tensor([prompt + got])).logits[0].float()[len(prompt) - 1:len(prompt) - 1 + len(got)]
    # The cluster returns tokens, not logits: compare each against transformers' argmax (its logits stand in
    # for ours, so the tolerance check is trivially met) until a near-tie.
    assert_tokens_match_until_near_tie(got, logits, logits, what)


def _generate(router: str, ids: list[int]) -> list[int]:
    out = asyncio.run(_router_generate(router, ids, MAX_TOKENS, ignore_eos=True))
    return list(out.token_ids)


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    return write_tiny_moe(tmp_path_factory.mktemp("glm4-moe"), "glm4_moe")


@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_glm4_moe_1p1d_tokens_equal_transformers(glm_dir: Path, transport: str) -> None:
    import transformers

    ref = transformers.AutoModelForCausalLM.from_pretrained(str(glm_dir), dtype=torch.float32).eval()
    test_moe_1p1d_tokens_equal_transformers(glm_dir, ref, transport)


@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_moe_1p1d_tokens_equal_transformers(moe_dir: Path, hf_ref, transport: str) -> None:
    sizes = {"prefill": ["--max-prefill-chunk", "29", *SMALL_KV], "decode": SMALL_KV}
    with LocalCluster(prefill=1, decode=1, kvstore=None, model=str(moe_dir), dtype="float32", extra=sizes,
                      quiet=True, kv_transport=transport) as c:
        for i, ids in enumerate(_prompts()):
            got = _generate(c.router["grpc"], ids)
            assert len(got) == MAX_TOKENS
            _check_against_transformers(hf_ref, ids, got, f"{transport} prompt {i}")
        pm = c.get("prefill-0").ready["metrics"]
        assert metric_sum(pm, "pdserve_prefill_kv_sent_bytes_total", transport=transport) > 0
        rep = wait_idle(c.get("decode-0").ready["grpc"])
        assert rep.free_blocks == rep.total_blocks


KVSTORE_LOAD_WAIT_S = 90
"""How long resends may wait for the write-back to land and a prefill to load it (a busy host is normal)."""


def kvstore_reuse_tokens(model_dir: Path, ids: list[int]) -> list[int]:
    """Greedy tokens of ``ids`` on 2 round-robin prefills with the embedded kvstore, after checking that one
    prefill loaded pages the other wrote (resent until it does) and the store counted hits; the same tokens
    every time."""
    extra = {"router": ["--policy", "round_robin"], "prefill": SMALL_KV, "decode": SMALL_KV}
    with LocalCluster(prefill=2, decode=1, kvstore="embedded", model=str(model_dir), dtype="float32", extra=extra,
                      quiet=True) as c:
        first = _generate(c.router["grpc"], ids)
        loaded, sent, deadline = 0.0, 0, time.monotonic() + KVSTORE_LOAD_WAIT_S
        while not loaded and time.monotonic() < deadline:  # write-back is asynchronous (its own writer process, slow
            assert _generate(c.router["grpc"], ids) == first  # on a loaded host): resend until a prefill loads
            sent += 1
            loaded = sum(metric_sum(c.get(f"prefill-{i}").ready["metrics"],
                                    "pdserve_prefill_cached_prefix_tokens_total", source="kvstore") for i in range(2))
            if not loaded:
                time.sleep(0.3)
        assert loaded > 0, f"no prefill loaded kvstore pages in {KVSTORE_LOAD_WAIT_S} s ({sent} resends)"
        hits, deadline = 0.0, time.monotonic() + 30  # the kvstore mirrors its counters on a timer
        while not hits and time.monotonic() < deadline:
            hits = metric_sum(c.get("kvstore").ready["metrics"], "pdserve_kvstore_hits_total")
            time.sleep(0.2)
        assert hits > 0
    return first


def test_moe_kvstore_pages_reused_across_two_prefills(moe_dir: Path, hf_ref) -> None:
    ids = _prompts()[0]
    _check_against_transformers(hf_ref, ids, kvstore_reuse_tokens(moe_dir, ids), "kvstore")
