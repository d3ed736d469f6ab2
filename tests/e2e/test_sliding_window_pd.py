"""A 1P1D cluster serving a sliding-window model (tiny random mistral, window 12 on every layer, pages of 4
tokens, prompts several windows long): greedy tokens over grpc and shm KV transports equal transformers fp32
up to the first near-tie of its logits, and the decode's page layout names the windows."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from services.launcher import LocalCluster
from tests.e2e.cluster_util import generate_ids
from tests.engine.conftest import write_tiny_window

pytestmark = pytest.mark.e2e

MAX_TOKENS = 16
NEAR_TIE = 1e-3
ENGINE = ["--cpu-threads", "1", "--num-kv-blocks", "96", "--block-size", "4"]


@pytest.fixture(scope="module")
def mistral_window(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]], list[list[int]]]:
    """The checkpoint, prompts and transformers' greedy tokens up to each prompt's first near-tie."""
    transformers = pytest.importorskip("transformers")
    root = write_tiny_window(tmp_path_factory.mktemp("pd-mistral-window"), "mistral")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(root), dtype=torch.float32).eval()
    assert hf.config.sliding_window == 12
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (45, 30)]
    wants = []
    with torch.no_grad():
        for p in prompts:
            seq = list(p)
            for _ in range(MAX_TOKENS):
                top = hf(torch.tensor([seq])).logits[0, -1].float().topk(2)
                if float(top.values[0] - top.values[1]) < NEAR_TIE:
                    break
                seq.append(int(top.indices[0]))
            assert len(seq) - len(p) >= 6, "near-tie too early; pick another seed"
            wants.append(seq[len(p):])
    return root, prompts, wants


@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_pd_tokens_equal_transformers_past_the_window(mistral_window, transport: str) -> None:
    root, prompts, wants = mistral_window
    extra = {"prefill": [*ENGINE, "--max-prefill-chunk", "16"], "decode": ENGINE}
    with LocalCluster(prefill=1, decode=1, kvstore=None, model=str(root), dtype="float32", extra=extra,
                      quiet=True, kv_transport=transport) as c:
        for p, want in zip(prompts, wants, strict=True):
            got = [t for r in asyncio.run(generate_ids(c.router["grpc"], p, MAX_TOKENS)) for t in r.token_ids]
            assert got[:len(want)] == want, transport
