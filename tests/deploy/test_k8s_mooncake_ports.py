"""The Mooncake ports the manifests declare are the ones the real Transfer Engine listens on: a process with
a container's env (its MC_MIN_RPC_PORT..MC_MAX_RPC_PORT) starts what that container starts (prefill/decode:
`--kv-mooncake-engines` engines through pdserve's MooncakeEngine; kvstore: a Mooncake Store client through
pdserve's MooncakeBackend against a real mooncake_master) and every port it listens on is one of the
container's declared `mooncake-*` ports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from services.kvstore.mooncake_master import MooncakeMaster, find_master_binary
from tests.deploy.test_k8s_manifests import (
    REPO,
    container_env,
    effective_config,
    pytestmark,
    render,
    service_container,
    workload_of,
)
from tests.deploy.test_k8s_mooncake_kv import MOONCAKE_PORT_RANGE_ENV

__all__ = ["pytestmark"]

mooncake = pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine-non-cuda not installed")

_LISTEN = """
import psutil
proc = psutil.Process()
conns = getattr(proc, "net_connections", proc.connections)(kind="tcp")
print("PORTS " + json.dumps(sorted({c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN})), flush=True)
"""

ENGINES = """
import json, sys
from services.engine.kv_transport.mooncake import MooncakeEngine
engine = MooncakeEngine("127.0.0.1", count=int(sys.argv[1]))
""" + _LISTEN

STORE = """
import asyncio, json, sys
from services.kvstore.mooncake_backend import MooncakeBackend, MooncakeSettings
settings = MooncakeSettings(master_address=sys.argv[1], global_segment_bytes=64 << 20, local_buffer_bytes=16 << 20)
backend = asyncio.run(MooncakeBackend(settings).open())
""" + _LISTEN


def _declared_and_env(kustomization: str, component: str) -> tuple[set[int], dict[str, str], Any]:
    objs = render(kustomization)
    w = workload_of(objs, component)
    c = service_container(w)
    env, _ = container_env(objs, w, c)
    declared = {p["containerPort"] for p in c["ports"] if p["name"].startswith("mooncake-")}
    return declared, {k: env[k] for k in MOONCAKE_PORT_RANGE_ENV}, objs


def _listening(script: str, arg: str, mc_env: dict[str, str]) -> list[int]:
    env = {**os.environ, **mc_env, "PYTHONPATH": str(REPO)}
    env.pop("MC_TCP_BIND_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-c", script, arg], capture_output=True, text=True, timeout=120,
                          env=env, cwd=REPO)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("PORTS ")), None)
    assert proc.returncode == 0 and line is not None, f"exit {proc.returncode}\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
    return json.loads(line.removeprefix("PORTS "))


@pytest.mark.parametrize("component", ["prefill", "decode"])
def test_kv_transfer_engines_listen_only_on_the_declared_ports(component: str) -> None:
    declared, mc_env, objs = _declared_and_env("overlays/mooncake", component)
    cfg = next(v for v in effective_config(objs, component).values() if hasattr(v, "kv_mooncake_engines"))
    ports = _listening(ENGINES, str(cfg.kv_mooncake_engines), mc_env)
    assert len(ports) == 2 * cfg.kv_mooncake_engines, ports  # an RPC port and a TCP data port per engine
    assert set(ports) <= declared, f"{component}: listens on {sorted(set(ports) - declared)}, not declared"


def test_the_store_client_listens_only_on_the_declared_ports() -> None:
    if find_master_binary() is None:
        pytest.skip("no mooncake_master binary")
    declared, mc_env, _ = _declared_and_env("overlays/mooncake", "kvstore")
    master = MooncakeMaster().start()
    try:
        ports = _listening(STORE, master.address, mc_env)
    finally:
        master.stop()
    assert ports and set(ports) <= declared, f"kvstore: listens on {ports}, declared {sorted(declared)}"
