"""The one-launch MoE routing kernel against the torch routing of models/moe.py (the Triton interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from services.engine.models.moe import route
from services.kernels.moe_route import route_topk
from services.text.model.moe_config import MoEConfig


def _logits(t: int, e: int, seed: int = 0) -> torch.Tensor:
    # Distinct values per row (ties choose differently between the two forms, and a router never ties).
    return torch.randn((t, e), generator=torch.Generator().manual_seed(seed)) * 2.0


@pytest.mark.parametrize(("e", "k"), [(8, 2), (60, 4), (128, 8), (32, 1)])
@pytest.mark.parametrize(("scoring", "norm", "scale", "bias"), [
    ("softmax", True, 1.0, False), ("softmax", False, 1.0, False), ("sigmoid", True, 2.5, True),
    ("sigmoid", False, 1.0, False), ("softmax_topk", False, 1.0, False),
])
def test_route_topk_equals_the_torch_routing(device: torch.device, e: int, k: int, scoring: str, norm: bool,
                                              scale: float, bias: bool) -> None:
    moe = MoEConfig(num_experts=e, top_k=k, intermediate_size=16, scoring=scoring, norm_topk_prob=norm,
                    routed_scaling_factor=scale, score_bias=bias)
    logits = _logits(5, e, seed=e + k)
    score_bias = torch.randn(e, generator=torch.Generator().manual_seed(7)) * 0.5 if bias else None
    want_w, want_ids = route(logits, moe, score_bias)  # CPU tensors: the torch form
    on = logits.to(device)
    if scoring == "softmax_topk":
        got_w, got_ids = route_topk(on, k, scoring)
    else:
        got_w, got_ids = route_topk(on, k, scoring, score_bias=None if score_bias is None else score_bias.to(device),
                                    normalize=norm, scaling=scale)
    got_w, got_ids = got_w.cpu(), got_ids.cpu()
    assert got_ids.dtype == torch.int32 and got_w.dtype == torch.float32
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, atol=1e-6, rtol=1e-5)


def test_route_topk_bias_changes_the_choice_not_the_weights(device: torch.device) -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]], device=device)
    bias = torch.tensor([10.0, 0.0, 0.0, 0.0], device=device)
    w, ids = route_topk(logits, 2, "sigmoid", score_bias=bias)
    assert ids.tolist() == [[0, 3]]
    torch.testing.assert_close(w.cpu(), torch.sigmoid(torch.tensor([[0.0, 3.0]])))


def test_route_topk_refuses_what_it_does_not_do(device: torch.device) -> None:
    logits = _logits(2, 8).to(device)
    with pytest.raises(ValueError, match="scoring 'relu'"):
        route_topk(logits, 2, "relu")
    with pytest.raises(ValueError, match="power of two"):
        route_topk(logits, 3, "softmax")
    with pytest.raises(ValueError, match="choice bias"):
        route_topk(logits, 2, "softmax_topk", score_bias=torch.zeros(8, device=device))
    w, ids = route_topk(logits[:0], 2, "softmax")
    assert w.shape == (0, 2) and ids.shape == (0, 2)
