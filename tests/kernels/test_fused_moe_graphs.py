"""The fused MoE layer captured in a CUDA graph: no host sync and no data-dependent allocation, so a replay
with new routing written into the captured input buffers gives the reference's answer."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.kernel_cases import assert_close, requires_cuda

pytest.importorskip("triton")

from services.kernels.fused_moe import fused_moe
from services.kernels.reference import fused_moe_ref


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize(("t", "e", "k", "h", "inter", "bias", "path"), [
    (1, 128, 8, 2048, 768, False, None), (1, 128, 8, 2048, 768, False, "sorted"), (4, 128, 8, 2048, 768, True, "pair"),
    (64, 128, 8, 2048, 768, False, None), (16, 8, 2, 1024, 1792, True, None), (1, 8, 2, 1024, 1792, True, "pair"),
])
def test_fused_moe_cuda_graph_replay_new_routing(t: int, e: int, k: int, h: int, inter: int, bias: bool,
                                                 path: str | None) -> None:
    dev = torch.device("cuda")
    dtype = torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    w13 = (torch.randn((e, 2 * inter, h), generator=gen, device=dev) * h**-0.5).to(dtype)
    w2 = (torch.randn((e, h, inter), generator=gen, device=dev) * inter**-0.5).to(dtype)
    kw: dict = {"path": path}
    if bias:
        kw |= {"w13_bias": (0.1 * torch.randn((e, 2 * inter), generator=gen, device=dev)).to(dtype),
              "w2_bias": (0.1 * torch.randn((e, h), generator=gen, device=dev)).to(dtype)}
    ref_kw = {name: v for name, v in kw.items() if name != "path"}
    x = torch.empty((t, h), dtype=dtype, device=dev)
    ids = torch.empty((t, k), dtype=torch.int32, device=dev)
    weights = torch.empty((t, k), dtype=torch.float32, device=dev)

    def route(seed: int) -> None:
        g = torch.Generator(device=dev).manual_seed(seed)
        x.copy_(torch.randn((t, h), generator=g, device=dev))
        ids.copy_(torch.topk(torch.rand((t, e), generator=g, device=dev), k, dim=1).indices)
        weights.copy_(torch.softmax(torch.randn((t, k), generator=g, device=dev), dim=1))

    route(1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up compiles the kernels outside the capture
        fused_moe(x, w13, w2, ids, weights, **kw)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, ids, weights, **kw)
    for seed in (2, 3):
        route(seed)
        graph.replay()
        torch.cuda.synchronize()
        expected = fused_moe_ref(x, w13, w2, ids, weights, **ref_kw)
        assert_close(out, expected, dtype)
    # All tokens on one expert: the most blocks a single expert can have, still inside the captured grid.
    ids[:, 0] = e - 1
    ids[:, 1:] = torch.arange(k - 1, device=dev, dtype=torch.int32)[None, :]
    graph.replay()
    assert_close(out, fused_moe_ref(x, w13, w2, ids, weights, **ref_kw), dtype)
