"""deploy/k8s/components/mooncake-kv: KV pages from prefill to decode through the Mooncake Transfer Engine
across nodes. Rendered with `kubectl kustomize` (alone on the CPU and GPU overlays, and in the mooncake
overlay with the Store): prefill and decode parse to --kv-transport mooncake with their transfer engines at
their own pod IP (downward API), never loopback, and the engine count is valid on both sides."""

from __future__ import annotations

import ipaddress
import shutil

import pytest

from services.decode.config import DecodeConfig
from services.prefill.config import PrefillConfig
from tests.deploy.test_k8s_manifests import container_env, effective_config, render, workload_of

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None,
                                reason="kubectl not on PATH: `kubectl kustomize` is needed to render deploy/k8s")

WITH_KV = ("overlays/mooncake", "overlays/gpu+mooncake-kv", "overlays/cpu-local+mooncake-kv",
           "overlays/gpu+mooncake+mooncake-kv")
MOONCAKE_PORT_RANGE_ENV = ("MC_MIN_RPC_PORT", "MC_MAX_RPC_PORT")
"""The Transfer Engine's port range: both its RPC and its TCP data ports come from it."""
POD_IP = "10.0.0.7"  # the downward-API placeholder test_k8s_manifests.container_env gives status.podIP


def _configs(kustomization: str) -> tuple[PrefillConfig, DecodeConfig]:
    objs = render(kustomization)
    prefill = effective_config(objs, "prefill")[PrefillConfig]
    decode = effective_config(objs, "decode")[DecodeConfig]
    return prefill, decode


@pytest.mark.parametrize("kustomization", WITH_KV)
def test_prefill_writes_over_mooncake_to_decodes_reached_at_their_pod_ip(kustomization: str) -> None:
    prefill, decode = _configs(kustomization)
    assert prefill.kv_transport == "mooncake"
    assert decode.kv_mooncake_host == POD_IP  # decode offers its pool at the address the router resolves it to
    assert prefill.kv_mooncake_host == POD_IP
    for cfg in (prefill, decode):
        assert not ipaddress.ip_address(cfg.kv_mooncake_host).is_loopback
        assert cfg.kv_mooncake_engines > 1  # several I/O threads per side (the probe's --engines)


@pytest.mark.parametrize("kustomization", WITH_KV)
@pytest.mark.parametrize("component", ["prefill", "decode"])
def test_the_pod_ip_comes_from_the_downward_api_and_no_engine_env_is_hand_set(kustomization: str,
                                                                               component: str) -> None:
    objs = render(kustomization)
    w = workload_of(objs, component)
    c = w["spec"]["template"]["spec"]["containers"][0]
    pod_ip = next(e for e in c["env"] if e["name"] == "POD_IP")
    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    env, _ = container_env(objs, w, c)
    # The Transfer Engine is handed its address from the declared flag, never from a hand-set variable;
    # only its port range is Mooncake's own setting (declared as containerPorts, test_k8s_fleet.py).
    assert not [k for k in env if k.startswith("MC_") and k not in MOONCAKE_PORT_RANGE_ENV], sorted(env)


def test_the_base_and_overlays_without_the_component_keep_grpc() -> None:
    for kustomization in ("base", "overlays/cpu-local", "overlays/gpu"):
        prefill, decode = _configs(kustomization)
        assert prefill.kv_transport == "grpc" and decode.kv_mooncake_host == "", kustomization


def test_the_mooncake_overlay_runs_the_store_and_the_transport_together() -> None:
    objs = render("overlays/mooncake")
    assert any(o["kind"] == "Deployment" and o["metadata"]["name"] == "pdserve-mooncake-master" for o in objs)
    prefill, _ = _configs("overlays/mooncake")
    assert prefill.kv_transport == "mooncake" and prefill.kvstore_address
