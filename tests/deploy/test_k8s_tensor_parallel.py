"""The gpu overlay's tensor parallelism: prefill and decode each set their own TP degree, and a pod asks for
exactly as many GPUs as it has ranks (its ranks run on cuda:0..N-1)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.test_k8s_manifests import (
    K8S,
    _render_dir,
    effective_config,
    pytestmark,
    render,
    service_container,
    workload_of,
)

__all__ = ["pytestmark"]


def _tp_and_gpus(objs: tuple[dict[str, Any], ...], component: str) -> tuple[int, str, str]:
    from services.engine.config import EngineConfig

    res = service_container(workload_of(objs, component))["resources"]
    tp = effective_config(objs, component)[EngineConfig].tensor_parallel_size
    return tp, str(res["limits"].get("nvidia.com/gpu")), str(res["requests"].get("nvidia.com/gpu"))


@pytest.mark.parametrize("kustomization", ["overlays/gpu", "overlays/gpu+mooncake"])
def test_gpu_pods_ask_for_one_gpu_per_rank(kustomization: str) -> None:
    objs = render(kustomization)
    for component in ("prefill", "decode"):
        tp, limit, request = _tp_and_gpus(objs, component)
        assert limit == request == str(tp), f"{component}: TP {tp}, GPUs limit {limit} request {request}"


def _container_patch(component: str, tp: int) -> dict[str, Any]:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": f"pdserve-{component}"},
            "spec": {"template": {"spec": {"containers": [{
                "name": component, "env": [{"name": "PDSERVE_TENSOR_PARALLEL_SIZE", "value": str(tp)}],
                "resources": {"limits": {"nvidia.com/gpu": tp}, "requests": {"nvidia.com/gpu": tp}}}]}}}}


def test_prefill_and_decode_tp_are_set_independently() -> None:
    """A deployment that runs prefill at TP=4 and decode at TP=2 patches only those two numbers per role."""
    with tempfile.TemporaryDirectory() as d:
        rel = Path(os.path.relpath(K8S, d))
        patches = []
        for component, tp in (("prefill", 4), ("decode", 2)):
            (Path(d) / f"{component}.yaml").write_text(yaml.safe_dump(_container_patch(component, tp)))
            patches.append({"path": f"{component}.yaml"})
        (Path(d) / "kustomization.yaml").write_text(yaml.safe_dump({
            "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "resources": [str(rel / "overlays/gpu")], "patches": patches}))
        objs = _render_dir(Path(d))
    assert _tp_and_gpus(objs, "prefill") == (4, "4", "4")
    assert _tp_and_gpus(objs, "decode") == (2, "2", "2")
