"""``pdserve up --kv-transport``: PrefillConfig's one declaration reused (default auto there), and the
flags LocalCluster gives prefills and decodes for each transport (no cluster started)."""

from __future__ import annotations

import dataclasses

import pytest

from services.common.config import env_name
from services.launcher import LocalCluster, kv_transport_args
from services.prefill.config import PrefillConfig
from services.up import UpConfig


def _field(cls: type, name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(cls) if f.name == name)


def test_up_kv_transport_is_prefills_declaration() -> None:
    up, prefill = _field(UpConfig, "kv_transport"), _field(PrefillConfig, "kv_transport")
    assert up.metadata["help"] == prefill.metadata["help"]
    assert up.metadata["choices"] == prefill.metadata["choices"]
    assert set(up.metadata["choices"]) >= {"auto", "grpc", "shm", "mooncake"}
    assert env_name(up) == env_name(prefill) == "PDSERVE_KV_TRANSPORT"
    assert up.default == "auto" and prefill.default == "grpc"


@pytest.mark.parametrize(("transport", "prefill", "decode"), [
    ("grpc", ["--kv-transport", "grpc"], []),
    ("shm", ["--kv-transport", "shm"], ["--kv-cache-shared"]),
    ("cuda-ipc", ["--kv-transport", "cuda-ipc"], ["--kv-cache-shared"]),
    ("auto", ["--kv-transport", "auto"], ["--kv-cache-shared"]),
    ("mooncake", ["--kv-transport", "mooncake", "--kv-mooncake-host", "10.0.0.7"],
     ["--kv-mooncake-host", "10.0.0.7"]),
])
def test_each_transport_wires_prefill_and_decode(transport: str, prefill: list[str], decode: list[str]) -> None:
    assert kv_transport_args(transport, "10.0.0.7") == (prefill, decode)


def test_unknown_transport_is_refused_before_start() -> None:
    with pytest.raises(ValueError, match="unknown KV transport 'rdma'"):
        LocalCluster(kv_transport="rdma")
