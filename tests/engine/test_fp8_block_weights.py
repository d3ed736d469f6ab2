"""FP8 block-scaled checkpoints (the DeepSeek-V3 format, written by the test from a transformers-built tiny model):
they load with every weight dequantized block by block, partial edge blocks included, and the engine's logits
equal those of the same model loaded from the dequantized weights in fp32; a broken pair is refused naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from services.engine.model_loader import load_model
from services.engine.weights.errors import ModelLoadError
from services.engine.weights.fp8_block import dequantize_block_fp8, dequantized
from tests.moe_checkpoints import write_tiny_moe

pytestmark = pytest.mark.slow

BLOCK = [24, 24]
"""Blocks that do not divide the tiny shapes (64, 96, 40...): edge blocks are partial, as kv_a_proj_with_mqa's
576 rows are in 128-row blocks."""


def _quantize(w: torch.Tensor, block: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [out, in] -> (fp8 e4m3 [out, in], fp32 inverse scales per block): each block's max maps to 448."""
    out, inp = w.shape
    bo, bi = block
    grid = (-(-out // bo), -(-inp // bi))
    scale = torch.empty(grid)
    q = torch.empty(out, inp, dtype=torch.float8_e4m3fn)
    for i in range(grid[0]):
        for j in range(grid[1]):
            blk = w[i * bo:(i + 1) * bo, j * bi:(j + 1) * bi]
            s = blk.abs().max().clamp(min=1e-12) / 448.0
            scale[i, j] = s
            q[i * bo:(i + 1) * bo, j * bi:(j + 1) * bi] = (blk / s).to(torch.float8_e4m3fn)
    return q, scale


def _fp8_copy(src: Path, dst: Path) -> Path:
    """``src`` with every 2-D projection weight (not the embedding, head, norms or router) as FP8 block-scaled,
    and the dequantized fp32 twin of it under dst / "ref"."""
    from safetensors.torch import load_file, save_file

    (dst / "ref").mkdir(parents=True)
    tensors = load_file(str(next(src.glob("*.safetensors"))))
    fp8: dict[str, torch.Tensor] = {}
    ref: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if t.dim() == 2 and name.endswith("proj.weight"):
            q, s = _quantize(t.float(), BLOCK)
            fp8[name], fp8[name + "_scale_inv"] = q, s
            ref[name] = dequantize_block_fp8(q, s, (BLOCK[0], BLOCK[1]))
        else:
            fp8[name] = ref[name] = t
    cfg = json.loads((src / "config.json").read_text())
    (dst / "ref" / "config.json").write_text(json.dumps(cfg))
    save_file(ref, str(dst / "ref" / "model.safetensors"), metadata={"format": "pt"})
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": BLOCK}
    (dst / "config.json").write_text(json.dumps(cfg))
    save_file(fp8, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module", params=["deepseek_v3", "qwen3_moe"])
def fp8_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    src = write_tiny_moe(tmp_path_factory.mktemp("src"), request.param)
    return _fp8_copy(src, tmp_path_factory.mktemp("fp8"))


def test_fp8_checkpoint_equals_its_dequantized_weights(fp8_dir: Path, greedy) -> None:
    ours = load_model(str(fp8_dir), torch.float32, "cpu")
    ref = load_model(str(fp8_dir / "ref"), torch.float32, "cpu")
    assert ours.arch.fp8_weight_block == BLOCK and ref.arch.fp8_weight_block is None
    mine = dict(ours.model.named_parameters())
    for name, p in ref.model.named_parameters():
        assert torch.equal(mine[name], p), name
    prompt = list(range(20, 60))
    gen_a, lg_a = greedy(ours.model, [prompt], 6)
    gen_b, lg_b = greedy(ref.model, [prompt], 6)
    assert gen_a == gen_b and torch.equal(lg_a[0], lg_b[0])


def test_fp8_dequantization_is_close_to_the_original(fp8_dir: Path) -> None:
    """e4m3 keeps 3 mantissa bits: each weight within 1/16 of its block's max after the round trip."""
    w = torch.randn(50, 70)
    q, s = _quantize(w, BLOCK)
    back = dequantize_block_fp8(q, s, (BLOCK[0], BLOCK[1]))
    blocks = s.repeat_interleave(24, 0)[:50].repeat_interleave(24, 1)[:, :70] * 448
    assert ((back - w).abs() <= blocks / 16).all()


def test_an_fp8_weight_without_its_scales_is_refused(fp8_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((fp8_dir / "config.json").read_text())
    tensors = load_file(str(fp8_dir / "model.safetensors"))
    name = next(n for n in tensors if n.endswith("_scale_inv"))
    del tensors[name]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="without their pair"):
        load_model(str(broken), torch.float32, "cpu")


def test_a_scale_grid_that_does_not_fit_is_refused() -> None:
    q = torch.zeros(50, 70, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"scale grid \(2, 3\) does not cover a 50x70 weight"):
        list(dequantized([("a.weight", q), ("a.weight_scale_inv", torch.ones(2, 3))], (24, 24)))
