"""GGUF Q4_1 / Q8_0 weights used packed (services/engine/models/quant_linear.py): same grid as the
dequantized weights, per-phase choice, the setting, and the real embedded GGUF's logits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from services.common.config import ConfigError
from services.common.config_file import parse_settings
from services.engine.attention import AttentionMetadata, ForwardContext, TorchPagedAttention
from services.engine.config import EngineConfig
from services.engine.model_loader import load_model
from services.engine.models.cpu_fast import StepCachedRotary
from services.engine.models.quant_linear import (
    Int4Linear,
    _numpy_pack,
    _numpy_pack_matches,
    install,
    int4_mm,
    pack_q4_1,
    pack_q8_0,
)
from services.engine.models.rope import RotaryEmbedding
from services.engine.weights.gguf_loader import Q4_1Blocks, Q8_0Blocks


def _q4_1(n: int, k: int, seed: int = 0) -> Q4_1Blocks:
    rng = np.random.default_rng(seed)
    return Q4_1Blocks(q=rng.integers(0, 16, (n, k), dtype=np.uint8),
                      d=rng.uniform(1e-3, 0.05, (n, k // 32)).astype(np.float16).astype(np.float32),
                      m=rng.uniform(-0.4, 0.0, (n, k // 32)).astype(np.float16).astype(np.float32))


def _dense(b: Q4_1Blocks) -> torch.Tensor:
    n, k = b.q.shape
    return torch.from_numpy((b.q.reshape(n, -1, 32) * b.d[..., None] + b.m[..., None]).reshape(n, k).astype(np.float32))


def test_packing_is_torchs_layout_on_this_host() -> None:
    """torch packs int4 per ISA (the tiled layout _numpy_pack writes is the AVX-512 one): the fast numpy
    path is taken only where it is byte-identical here, and what pack_q4_1 returns is torch's layout on
    every host."""
    b = _q4_1(192, 96, 1)
    ref = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(b.q).to(torch.int32), 1)
    same = ref.shape == (192, 48) and bool(torch.equal(_numpy_pack(b.q), ref))
    assert _numpy_pack_matches() == same
    assert torch.equal(pack_q4_1([b], torch.float32)[0], ref)


@pytest.mark.parametrize("rows", [1, 3, 17])
def test_q4_1_matmul_is_the_dequantized_matmul(rows: int) -> None:
    parts = [_q4_1(64, 96, 2), _q4_1(128, 96, 3)]  # two row blocks, as a fused qkv / gate_up
    packed, scale_zero = pack_q4_1(parts, torch.float32)
    x = torch.randn(rows, 96)
    ref = x @ torch.cat([_dense(p) for p in parts]).t()
    torch.testing.assert_close(int4_mm(x, packed, scale_zero), ref, rtol=1e-5, atol=1e-5)


def test_q8_0_head_is_the_dequantized_matmul() -> None:
    rng = np.random.default_rng(4)
    b = Q8_0Blocks(q=rng.integers(-128, 128, (128, 64), dtype=np.int8),
                   d=rng.uniform(1e-3, 0.02, (128, 2)).astype(np.float16).astype(np.float32))
    w = torch.from_numpy((b.q.astype(np.float32).reshape(128, 2, 32) * b.d[..., None]).reshape(128, 64))
    packed, scale_zero = pack_q8_0(b, torch.float32)
    x = torch.randn(2, 64)
    torch.testing.assert_close(int4_mm(torch.cat([x, x], 1), packed, scale_zero), x @ w.t(), rtol=1e-5, atol=1e-5)


def test_int4_linear_uses_the_dense_weight_above_max_rows() -> None:
    b = _q4_1(64, 64, 5)
    dense = torch.nn.Linear(64, 64, bias=False)
    dense.weight.data.copy_(_dense(b) + 1.0)  # a different weight: tells which path ran
    lin = Int4Linear(dense, *pack_q4_1([b], torch.float32), max_rows=2)
    small, big = torch.randn(2, 64), torch.randn(3, 64)
    torch.testing.assert_close(lin(small), small @ _dense(b).t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin(big), big @ dense.weight.t())


def test_weight_format_setting_and_its_label() -> None:
    with pytest.raises(ConfigError, match="--weight-format / PDSERVE_WEIGHT_FORMAT"):
        parse_settings([EngineConfig], ["--weight-format", "int8"], prog="t", section="decode")
    assert parse_settings([EngineConfig], ["--weight-format", "int4"], prog="t", section="decode")[0].weight_format \
        == "int4"
    cfg = EngineConfig(weight_format="dequantized")
    assert cfg.info_labels()["weight_format"] == "pending"
    model = torch.nn.Linear(4, 4)
    assert install(model, "random:tiny-llama", "dequantized", "cpu", torch.float32) == ("dequantized", "explicit")
    assert install(model, "random:tiny-llama", "auto", "cpu", torch.float32) == ("dequantized", "not_gguf")
    assert install(model, None, "auto", "cuda", torch.bfloat16) == ("dequantized", "not_cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_cached_rotary_is_bit_identical(dtype: torch.dtype) -> None:
    ref, fast = RotaryEmbedding(64, 1e5, None, 256), StepCachedRotary(64, 1e5, None, 256)
    pos = torch.tensor([3, 7, 200])
    q, k = torch.randn(3, 9, 64).to(dtype), torch.randn(3, 3, 64).to(dtype)
    for _ in range(2):  # the second call reuses the step's rows
        for a, b in zip(ref(pos, q, k), fast(pos, q, k), strict=True):
            assert torch.equal(a, b)
    pos[0] = 4  # rewritten in place: recomputed
    for a, b in zip(ref(pos, q, k), fast(pos, q, k), strict=True):
        assert torch.equal(a, b)


# --- the real embedded GGUF ------------------------------------------------------------------------

_TEXTS = ["The capital of France is Paris. It is known for", "def fibonacci(n):\n    if n < 2:\n        return n",
          "Once upon a time, in a small village, there lived"]


def _logits(model: torch.nn.Module, ids: list[int], dtype: torch.dtype) -> torch.Tensor:
    """Teacher-forced logits of every position of ``ids`` (one prefill)."""
    arch, n, bs = model.arch, len(ids), 16
    nb = (n + bs - 1) // bs
    kv = torch.zeros(arch.num_layers, 2, nb, bs, arch.num_kv_heads, arch.head_dim, dtype=dtype)
    meta = AttentionMetadata(slot_mapping=torch.arange(n), block_tables=torch.arange(nb, dtype=torch.int32)[None],
                             context_lens=torch.tensor([n], dtype=torch.int32), query_lens=[n],
                             context_lens_host=[n], num_decode=0)
    ctx = ForwardContext(TorchPagedAttention(kv, arch.head_dim ** -0.5), meta)
    return model.compute_logits(model(torch.tensor(ids), torch.arange(n), ctx))


def _packed_rows(model: torch.nn.Module, rows: int) -> None:
    for mod in model.modules():
        if isinstance(mod, Int4Linear):
            mod.max_rows = rows
    if model.logits_head is not None:
        model.logits_head.max_rows = rows


@pytest.fixture(scope="module")
def gguf_logits(gguf_path: Path) -> dict[str, list[torch.Tensor]]:
    out: dict[str, list[torch.Tensor]] = {}
    with torch.inference_mode():
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            loaded = load_model(str(gguf_path), dtype)
            assert install(loaded.model, None, "int4", "cpu", dtype) == ("int4", "explicit")
            assert loaded.model.logits_head is not None  # the Q8_0 tied embedding
            ids = [loaded.tokenizer.encode(t) for t in _TEXTS]
            _packed_rows(loaded.model, 10**9)
            out[f"{name}_int4"] = [_logits(loaded.model, i, dtype) for i in ids]
            _packed_rows(loaded.model, 0)
            out[f"{name}_dense"] = [_logits(loaded.model, i, dtype) for i in ids]
    return out


def test_gguf_int4_logits_match_dequantized_in_fp32(gguf_logits: dict[str, list[torch.Tensor]]) -> None:
    """fp32 activations: the packed Q4_1/Q8_0 path is the dequantized model up to summation order."""
    for a, d in zip(gguf_logits["fp32_int4"], gguf_logits["fp32_dense"], strict=True):
        assert (a - d).abs().max().item() < 1e-3
        assert torch.equal(a.argmax(-1), d.argmax(-1))  # greedy tokens at every position


def test_gguf_int4_logits_in_bf16_stay_as_close_as_dense_bf16(gguf_logits: dict[str, list[torch.Tensor]]) -> None:
    """bf16: both paths round (weights or scales, and activations); against the fp32 model, int4's logit
    error stays within 2.5 (logits reach ~35) and its greedy choice agrees at >= 85% of positions."""
    agree = total = 0
    for a, ref in zip(gguf_logits["bf16_int4"], gguf_logits["fp32_dense"], strict=True):
        assert (a - ref).abs().max().item() < 2.5
        agree += int((a.argmax(-1) == ref.argmax(-1)).sum())
        total += a.shape[0]
    assert agree / total >= 0.85
