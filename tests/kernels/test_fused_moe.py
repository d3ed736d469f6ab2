"""Fused MoE kernel against the per-expert torch reference (GPU, or the Triton interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.kernel_cases import assert_close, requires_cuda

pytest.importorskip("triton")

from services.kernels.fused_moe import (
    MoETileConfig,
    PairTileConfig,
    align_pairs,
    align_pairs_torch,
    expected_distinct_experts,
    fused_moe,
    use_pair_path,
)
from services.kernels.moe_align import align_pairs_fused
from services.kernels.reference import fused_moe_ref

#: Tiles small enough for the interpreter; block_k < H and block_n < I so the K and N loops run twice+.
SMALL = MoETileConfig(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=2)
#: Grouped program order: 3 blocks per group, so the last group is partial for most block counts.
GROUPED = MoETileConfig(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=2, group_m=3)
#: Pair path tiles smaller than H and I (N and K loops run twice+), down tile unlike the gate/up tile.
PAIR_SMALL = PairTileConfig(gate_up_n=8, down_n=16, block_k=16, num_warps=4, num_stages=2)
PATHS = ("sorted", "pair")


def _case(t: int, h: int, inter: int, e: int, k: int, dtype: torch.dtype, device: torch.device,
          bias: bool = False, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((t, h), generator=gen)
    w13 = torch.randn((e, 2 * inter, h), generator=gen) / h**0.5
    w2 = torch.randn((e, h, inter), generator=gen) / inter**0.5
    # k distinct experts per token, as a router's top-k gives.
    ids = torch.argsort(torch.rand((t, e), generator=gen), dim=1)[:, :k].to(torch.int32)
    weights = torch.softmax(torch.randn((t, k), generator=gen), dim=1)
    args = {
        "x": x.to(dtype).to(device), "w13": w13.to(dtype).to(device), "w2": w2.to(dtype).to(device),
        "topk_ids": ids.to(device), "topk_weights": weights.to(device),
    }
    if bias:
        args["w13_bias"] = (0.1 * torch.randn((e, 2 * inter), generator=gen)).to(dtype).to(device)
        args["w2_bias"] = (0.1 * torch.randn((e, h), generator=gen)).to(dtype).to(device)
    return args


def _check(args: dict, dtype: torch.dtype, config: MoETileConfig | None = SMALL, path: str | None = "sorted",
           **kw: object) -> None:
    pair_config = PAIR_SMALL if config is not None else None
    out = fused_moe(**args, config=config, path=path, pair_config=pair_config, **kw)
    assert out.shape == args["x"].shape and out.dtype == dtype
    ref = fused_moe_ref(**args, **kw)
    assert_close(out, ref, dtype)
    # The reference itself against a dense formula over every (token, slot).
    if dtype == torch.float32 and not kw:
        x, w13, w2 = args["x"], args["w13"], args["w2"]
        inter = w13.shape[1] // 2
        dense = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for j in range(args["topk_ids"].shape[1]):
                e = int(args["topk_ids"][t, j])
                g = w13[e] @ x[t] + (args["w13_bias"][e] if "w13_bias" in args else 0)
                a = torch.nn.functional.silu(g[:inter]) * g[inter:]
                y = w2[e] @ a + (args["w2_bias"][e] if "w2_bias" in args else 0)
                dense[t] += args["topk_weights"][t, j] * y
        torch.testing.assert_close(ref, dense, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("t", "e", "k"), [(1, 4, 1), (5, 6, 2), (19, 5, 4), (33, 12, 8)])
def test_fused_moe_matches_reference(device: torch.device, dtype: torch.dtype, t: int, e: int, k: int,
                                     path: str) -> None:
    _check(_case(t, 32, 48, e, k, dtype, device), dtype, path=path)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_odd_dims_and_bias(device: torch.device, dtype: torch.dtype, path: str) -> None:
    # H and I not multiples of the tiles (I an odd multiple of 8), biases on both GEMMs.
    _check(_case(7, 40, 24, 3, 2, dtype, device, bias=True), dtype, path=path)


def test_pair_path_equals_sorted_path_on_shared_experts(device: torch.device) -> None:
    # Every token's slots on the same two experts: the pair path reads each expert once per pair, the sorted
    # path once per block; both must agree (fp32, so only summation order differs).
    args = _case(6, 32, 48, 5, 2, torch.float32, device, bias=True)
    args["topk_ids"] = torch.tensor([[1, 3]] * 6, dtype=torch.int32, device=device)
    pair = fused_moe(**args, path="pair", pair_config=PAIR_SMALL)
    torch.testing.assert_close(pair, fused_moe(**args, path="sorted", config=SMALL), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("t", "k"), [(1, 1), (3, 4), (5, 2)])
def test_unreduced_rows_then_fused_add_norm(device: torch.device, dtype: torch.dtype, path: str, t: int,
                                            k: int) -> None:
    """reduce=False gives each token's K weighted rows [T, K, H] that sum to the reduced output (fp32 sum, one
    rounding), and fused_add_rms_norm taking them [T, K, H] equals taking the reduced [T, H] delta."""
    from services.kernels.rms_norm import fused_add_rms_norm

    args = _case(t, 32, 48, 6, k, dtype, device, bias=True)
    rows = fused_moe(**args, config=SMALL, path=path, pair_config=PAIR_SMALL, reduce=False)
    out = fused_moe(**args, config=SMALL, path=path, pair_config=PAIR_SMALL)
    assert rows.shape == (t, k, 32) and rows.dtype == dtype
    assert_close(rows.float().sum(1).to(dtype), out, dtype)
    residual = torch.randn((t, 32), generator=torch.Generator().manual_seed(9)).to(dtype).to(device)
    w = (1 + 0.1 * torch.randn(32, generator=torch.Generator().manual_seed(8))).to(dtype).to(device)
    n1, r1 = fused_add_rms_norm(rows, residual, w, 1e-6)
    n2, r2 = fused_add_rms_norm(rows.float().sum(1).to(dtype), residual, w, 1e-6)
    assert n1.shape == r1.shape == (t, 32)
    if device.type == "cuda" or dtype != torch.bfloat16:  # the interpreter truncates fp32 -> bf16
        assert torch.equal(r1, r2) and torch.equal(n1, n2)
    assert_close(r1, r2, dtype)
    assert_close(n1, n2, dtype)
    with pytest.raises(AssertionError, match="partial rows"):
        fused_add_rms_norm(rows, residual[:0] if t > 1 else torch.cat([residual, residual]), w, 1e-6)


def test_pair_path_choice() -> None:
    assert abs(expected_distinct_experts(1, 128) - 1.0) < 1e-9
    assert abs(expected_distinct_experts(128, 128) - 128 * (1 - (127 / 128) ** 128)) < 1e-9
    assert use_pair_path(1, 8, 128) and use_pair_path(1, 2, 8)  # decode of one sequence: 8 / 2 pairs
    assert not use_pair_path(64, 8, 128)  # 512 pairs over 128 experts: many share an expert
    assert not use_pair_path(16, 2, 8)  # 32 pairs over 8 experts
    assert not use_pair_path(0, 8, 128)


def test_fused_moe_refuses_an_unknown_path(device: torch.device) -> None:
    with pytest.raises(ValueError, match="path 'dense'"):
        fused_moe(**_case(2, 16, 16, 3, 2, torch.float32, device), path="dense")


@pytest.mark.parametrize(("t", "e", "k"), [(19, 5, 4), (40, 3, 2)])
def test_fused_moe_grouped_program_order(device: torch.device, t: int, e: int, k: int) -> None:
    _check(_case(t, 32, 48, e, k, torch.float32, device), torch.float32, config=GROUPED)


def test_fused_moe_down_tiles_of_their_own(device: torch.device) -> None:
    """The down projection with tiles unlike the gate/up kernel's (same block_m) gives the same layer; another
    block_m is refused."""
    args = _case(19, 32, 48, 5, 4, torch.float32, device, bias=True)
    down = MoETileConfig(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=2, group_m=2)
    out = fused_moe(**args, config=SMALL, path="sorted", down_config=down)
    assert_close(out, fused_moe_ref(**args), torch.float32)
    with pytest.raises(AssertionError, match=r"down_config\.block_m 32 != config\.block_m 16"):
        fused_moe(**args, config=SMALL, path="sorted", down_config=MoETileConfig(32, 16, 16, 4, 2))


@pytest.mark.parametrize("activation", ["gelu", "gpt_oss"])
def test_fused_moe_activations(device: torch.device, activation: str) -> None:
    kw: dict = {"activation": activation}
    if activation == "gpt_oss":
        kw |= {"swiglu_alpha": 1.702, "swiglu_limit": 0.5}  # a low limit so the clamps bite
    args = _case(9, 32, 16, 5, 2, torch.float32, device, bias=True)
    for path in PATHS:
        _check(args, torch.float32, path=path, **kw)
    assert not torch.allclose(fused_moe(**args, config=SMALL, **kw), fused_moe(**args, config=SMALL))


@pytest.mark.parametrize("path", [*PATHS, None])
def test_fused_moe_default_tiles(device: torch.device, path: str | None) -> None:
    _check(_case(3, 64, 32, 4, 2, torch.bfloat16, device), torch.bfloat16, config=None, path=path)


def test_fused_moe_all_tokens_one_expert_and_skew(device: torch.device) -> None:
    # Every token on expert 2 (several blocks of one expert), the other experts idle.
    args = _case(37, 32, 16, 4, 1, torch.float32, device)
    args["topk_ids"] = torch.full_like(args["topk_ids"], 2)
    args["topk_weights"] = torch.ones_like(args["topk_weights"])
    _check(args, torch.float32)


def test_align_pairs_layout(device: torch.device) -> None:
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]], dtype=torch.int32, device=device)
    a = align_pairs(ids, num_experts=4, block_m=2)
    # expert 0: pairs 1, 4 | expert 1: pair 3 + pad | expert 2: pairs 0, 2, 5 + pad | expert 3: none
    pad = ids.numel()
    assert int(a.num_blocks) == 4
    assert a.sorted_pair_ids[:8].tolist() == [1, 4, 3, pad, 0, 2, 5, pad]
    assert a.block_experts[:4].tolist() == [0, 1, 2, 2]
    assert a.max_blocks == 3 + 4 and a.sorted_pair_ids[8:].eq(pad).all()


@pytest.mark.parametrize(("t", "k", "e", "block_m"), [(1, 8, 128, 16), (3, 2, 4, 2), (64, 8, 128, 16),
                                                      (37, 2, 8, 32), (200, 8, 256, 64), (5, 1, 3, 16)])
def test_align_pairs_one_launch_equals_torch(device: torch.device, t: int, k: int, e: int, block_m: int) -> None:
    g = torch.Generator().manual_seed(t * 131 + e)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(torch.int32)
    if t > 4:  # skew: a quarter of the tokens on expert 1 (runs of several blocks, empty experts)
        ids[: t // 4, 0] = 1
    ids = ids.to(device)
    fused = align_pairs_fused(ids, e, block_m)
    ref = align_pairs_torch(ids, e, block_m)
    assert fused[3] == ref.max_blocks
    assert torch.equal(fused[0].cpu(), ref.sorted_pair_ids.cpu())
    assert torch.equal(fused[1].cpu(), ref.block_experts.cpu())
    assert torch.equal(fused[2].cpu(), ref.num_blocks.cpu())
    # align_pairs takes it for int32 ids of a decode-sized batch
    assert torch.equal(align_pairs(ids, e, block_m).sorted_pair_ids.cpu(), ref.sorted_pair_ids.cpu())


def test_fused_moe_empty_and_bad_args(device: torch.device) -> None:
    args = _case(2, 16, 16, 3, 2, torch.float32, device)
    empty = {**args, "x": args["x"][:0], "topk_ids": args["topk_ids"][:0], "topk_weights": args["topk_weights"][:0]}
    assert fused_moe(**empty).shape == (0, 16)
    with pytest.raises(ValueError, match="activation"):
        fused_moe(**args, activation="relu")
    with pytest.raises(ValueError, match="swiglu_alpha"):
        fused_moe(**args, activation="gpt_oss")
    with pytest.raises(ValueError, match="only to 'gpt_oss'"):
        fused_moe(**args, swiglu_limit=7.0)
    with pytest.raises(ValueError, match="int32"):
        fused_moe(**{**args, "topk_ids": args["topk_ids"].long()})
    with pytest.raises(ValueError, match="w2_bias"):
        fused_moe(**args, w2_bias=torch.zeros((3, 15), device=device))


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize(("t", "e", "k", "h", "inter"), [
    (1, 128, 8, 2048, 768), (64, 128, 8, 2048, 768), (333, 128, 8, 2048, 768),
    (2048, 128, 8, 2048, 768), (16, 8, 2, 4096, 1792), (700, 8, 2, 4096, 1792),
])
def test_fused_moe_gpu_real_shapes(t: int, e: int, k: int, h: int, inter: int) -> None:
    args = _case(t, h, inter, e, k, torch.bfloat16, torch.device("cuda"))
    for path in (None, *PATHS):
        if path == "pair" and t * k > 256:
            continue  # the pair path's down kernel walks K experts per token: not meant for prefill sizes
        _check(args, torch.bfloat16, config=None, path=path)
