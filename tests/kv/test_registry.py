"""The connector registry (services/kv/registry.py): names, pool cases and the flags the tree decides on."""

from __future__ import annotations

from services.common.pb import decode_pb2
from services.engine.kv_transport.fake import FakeTransport
from services.engine.kv_transport.grpc_stream import GrpcStreamTransport
from services.kv import registry
from services.kv.byte_stream import FAKE, GRPC
from services.kv.mooncake import MOONCAKE, MOONCAKE_STAGED
from services.kv.shards import SHARDS
from services.kv.shared_pool import CUDA_IPC, SHM


def test_every_transport_name_has_one_connector_and_only_side_ones_write_in_place() -> None:
    assert {n: c for n, c in registry.BY_NAME.items()} == {"grpc": GRPC, "shm": SHM, "cuda-ipc": CUDA_IPC,
                                                            "mooncake": MOONCAKE, "fake": FAKE}
    assert set(registry.IN_PLACE) == {"shm", "cuda-ipc", "mooncake"}
    assert not registry.writes_in_place("") and not registry.writes_in_place("grpc")
    assert registry.label("") == "grpc" and registry.label("shm") == "shm"
    assert GRPC.descriptors is GrpcStreamTransport and FAKE.descriptors is FakeTransport


def test_flags() -> None:
    assert [c.overlaps_compute for c in (GRPC, SHM, CUDA_IPC, MOONCAKE, MOONCAKE_STAGED)] == \
        [False, False, False, True, True]
    assert [c.needs_host_staging for c in (SHM, MOONCAKE, MOONCAKE_STAGED)] == [False, False, True]
    assert [c.crosses_hosts for c in (SHM, CUDA_IPC, MOONCAKE, MOONCAKE_STAGED)] == [False, False, True, True]
    assert MOONCAKE_STAGED.name == MOONCAKE.name == "mooncake"  # one name on the wire


def test_a_destination_names_its_connector() -> None:
    shm = decode_pb2.KVDestination(shm=decode_pb2.ShmPool(name="x"))
    assert registry.for_destination(shm, ranks=False) == (SHM, SHM)
    ipc = decode_pb2.KVDestination(cuda_ipc=decode_pb2.CudaIpcPool(device=0))
    assert registry.for_destination(ipc, ranks=False) == (CUDA_IPC, CUDA_IPC)
    direct = decode_pb2.KVDestination(mooncake=decode_pb2.MooncakePool(segment="h:1"))
    assert registry.for_destination(direct, ranks=False) == (MOONCAKE, MOONCAKE)
    staged = decode_pb2.KVDestination(mooncake=decode_pb2.MooncakePool(segment="h:1", page_major=True))
    assert registry.for_destination(staged, ranks=False) == (MOONCAKE_STAGED, MOONCAKE)
    assert registry.for_destination(shm, ranks=True) == (SHARDS, SHM)
    assert registry.for_destination(decode_pb2.KVDestination(), ranks=False) == (None, None)


def test_modes() -> None:
    assert registry.Mode("grpc").bytes_only and not registry.Mode("auto").bytes_only
    assert registry.Mode("auto").takes(SHM) and registry.Mode("auto").takes(MOONCAKE)
    assert registry.Mode("shm").takes(SHM) and not registry.Mode("shm").takes(CUDA_IPC)
    assert [registry.Mode(m).overlaps_compute for m in ("grpc", "shm", "cuda-ipc", "mooncake", "auto")] == \
        [False, False, False, True, False]
