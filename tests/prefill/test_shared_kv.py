"""Shared KV pools from typed descriptors: what a prefill opens, what it refuses, and that nothing in a
descriptor is ever unpickled or used as a path.

Security regressions: a pickle payload in a CUDA IPC descriptor ran code in the prefill, and an
shm descriptor's path made a prefill overwrite a file the caller named."""

from __future__ import annotations

import hashlib
import os
import pickle
import re
import struct
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from services.common.pb import decode_pb2
from services.engine import shared_kv
from services.engine.shared_kv import (
    SHM_DIR,
    SharedKVAttachError,
    SharedKVPools,
    check_cuda_pool,
    copy_pages,
    create_shared_kv,
    host_id,
    open_shm_pool,
)

SHAPE = (2, 2, 8, 4, 2, 8)  # [layers, 2, blocks, block_size, kv_heads, head_dim]


@pytest.fixture
def pool():
    tensor, path, dest = create_shared_kv(SHAPE, torch.float32)
    yield tensor, path, dest
    del tensor
    if os.path.exists(path):
        os.unlink(path)


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file an attacker would like overwritten, the size a pool of SHAPE would have."""
    p = tmp_path / "victim.bin"
    p.write_bytes(os.urandom(4 * int(torch.tensor(SHAPE).prod())))
    return p


def _digest(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _shm_dest(name: str, shape=SHAPE, dtype="float32", host=None) -> decode_pb2.KVDestination:
    return decode_pb2.KVDestination(shm=decode_pb2.ShmPool(name=name, shape=list(shape), dtype=dtype,
                                                           host_id=host_id() if host is None else host))


def _fake_name() -> str:
    return f"pdserve-kv-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def test_shm_pool_round_trips_through_the_typed_descriptor(pool) -> None:
    tensor, path, dest = pool
    assert dest.WhichOneof("pool") == "shm"
    wire = decode_pb2.KVDestination.FromString(dest.SerializeToString())
    assert wire.shm.name == os.path.basename(path) and "/" not in wire.shm.name
    assert tuple(wire.shm.shape) == SHAPE and wire.shm.dtype == "float32" and wire.shm.host_id == host_id()
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    opened = SharedKVPools().attach(wire)
    opened[1, 0, 3].fill_(7.0)  # a write by "prefill" lands in "decode"'s pool
    assert torch.equal(tensor[1, 0, 3], torch.full_like(tensor[1, 0, 3], 7.0))
    assert tensor.sum().item() == 7.0 * tensor[1, 0, 3].numel()


@pytest.mark.parametrize("name", [
    "../../etc/passwd", "/etc/passwd", "pdserve-kv-1-0123456789ab/../x", "pdserve-kv-1-0123456789AB",
    "pdserve-kv-x-0123456789ab", "pdserve-kv-1-0123456789abc", "pdserve-kv-1-0123456789ab\n", "", ".",
    "pdserve-kv-1-0123456789ab/", "..",
])
def test_shm_names_that_are_not_pool_names_are_refused(name: str) -> None:
    with pytest.raises(SharedKVAttachError) as e:
        SharedKVPools().attach(_shm_dest(name))
    assert e.value.reason == "name"


def test_path_traversal_to_a_real_file_writes_nothing(victim: Path) -> None:
    before = _digest(victim)
    rel = os.path.relpath(victim, SHM_DIR)
    for name in (rel, str(victim), f"pdserve-kv-1-0123456789ab/{rel}"):
        with pytest.raises(SharedKVAttachError):
            SharedKVPools().attach(_shm_dest(name))
    assert _digest(victim) == before


def test_symlink_under_dev_shm_is_refused_and_its_target_unchanged(victim: Path) -> None:
    before = _digest(victim)
    name = _fake_name()
    link = os.path.join(SHM_DIR, name)
    os.symlink(victim, link)
    try:
        with pytest.raises(SharedKVAttachError) as e:
            SharedKVPools().attach(_shm_dest(name))
        assert e.value.reason == "file" and "not a regular file" in str(e.value)
    finally:
        os.unlink(link)
    assert _digest(victim) == before


def test_files_that_are_not_our_pool_are_refused() -> None:
    name = _fake_name()
    path = os.path.join(SHM_DIR, name)
    nbytes = 4 * int(torch.tensor(SHAPE).prod())
    Path(path).write_bytes(b"\x01" * (nbytes - 4))  # wrong size
    try:
        with pytest.raises(SharedKVAttachError, match=r"has \d+ bytes"):
            open_shm_pool(_shm_dest(name).shm)
        os.unlink(path)
        os.mkdir(path)  # not a regular file
        with pytest.raises(SharedKVAttachError, match="not a regular file"):
            open_shm_pool(_shm_dest(name).shm)
        os.rmdir(path)
        with pytest.raises(SharedKVAttachError) as e:  # gone
            open_shm_pool(_shm_dest(name).shm)
        assert e.value.reason == "file"
    finally:
        if os.path.isdir(path):
            os.rmdir(path)
        elif os.path.exists(path):
            os.unlink(path)


@pytest.mark.skipif(os.getuid() != 0, reason="chown to another uid needs root")
def test_a_pool_file_owned_by_another_uid_is_refused() -> None:
    name = _fake_name()
    path = os.path.join(SHM_DIR, name)
    Path(path).write_bytes(bytes(4 * int(torch.tensor(SHAPE).prod())))
    try:
        os.chown(path, 65534, 65534)
        with pytest.raises(SharedKVAttachError, match="owned by uid 65534"):
            open_shm_pool(_shm_dest(name).shm)
    finally:
        os.unlink(path)


def test_other_host_bad_shape_or_dtype_refused(pool) -> None:
    name = os.path.basename(pool[1])
    cases = [(_shm_dest(name, host="elsewhere/boot"), "host"), (_shm_dest(name, shape=SHAPE[:5]), "shape"),
             (_shm_dest(name, shape=(2, 2, 9, 4, 2, 8)), "file"), (_shm_dest(name, dtype="int64"), "dtype"),
             (_shm_dest(name, shape=(2, 2, 0, 4, 2, 8)), "shape"), (decode_pb2.KVDestination(), "none")]
    for d, reason in cases:
        with pytest.raises(SharedKVAttachError) as e:
            SharedKVPools().attach(d)
        assert e.value.reason == reason, (d, e.value)


def test_a_cached_pool_is_dropped_when_its_file_goes(pool) -> None:
    _, path, dest = pool
    pools = SharedKVPools()
    assert pools.attach(dest) is pools.attach(dest)
    os.unlink(path)
    with pytest.raises(SharedKVAttachError):
        pools.attach(dest)


# --- CUDA IPC: typed fields, never pickle ---------------------------------------------------------

PWNED = Path(f"/tmp/pdserve-pwned-{uuid.uuid4().hex[:8]}")


class _Payload:
    def __reduce__(self):
        return os.mkdir, (str(PWNED),)


def _cuda_dest(**overrides) -> decode_pb2.KVDestination:
    fields = dict(host_id=host_id(), device=0, handle=bytes(range(64)), storage_bytes=4 * 2 * 2 * 8 * 4 * 2 * 8,
                  storage_offset=0, shape=list(SHAPE), dtype="float32", ref_counter_handle=b"/torch_123_456_0",
                  ref_counter_offset=3, event_handle=bytes(64), event_sync_required=True)
    fields.update(overrides)
    return decode_pb2.KVDestination(cuda_ipc=decode_pb2.CudaIpcPool(**fields))


def test_cuda_ipc_descriptor_round_trips_its_fields() -> None:
    dest = _cuda_dest()
    wire = decode_pb2.KVDestination.FromString(dest.SerializeToString())
    assert wire == dest and wire.WhichOneof("pool") == "cuda_ipc"
    shape, dtype = check_cuda_pool(wire.cuda_ipc)
    assert shape == SHAPE and dtype == torch.float32


@pytest.mark.parametrize(("overrides", "reason"), [
    (dict(host_id="other/boot"), "host"), (dict(handle=b""), "handle"), (dict(handle=bytes(1025)), "handle"),
    (dict(event_handle=b""), "handle"), (dict(ref_counter_handle=b"/etc/passwd"), "handle"),
    (dict(ref_counter_handle=b"/torch_1_2_3/../../x"), "handle"), (dict(ref_counter_offset=10_000), "handle"),
    (dict(device=-1), "device"), (dict(storage_bytes=16), "shape"), (dict(dtype="complex64"), "dtype"),
    (dict(shape=[1, 2, 3]), "shape"),
])
def test_cuda_ipc_descriptor_checks(overrides: dict, reason: str) -> None:
    with pytest.raises(SharedKVAttachError) as e:
        check_cuda_pool(_cuda_dest(**overrides).cuda_ipc)
    assert e.value.reason == reason


def test_a_pickle_payload_in_a_descriptor_runs_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The old descriptor carried a pickled tensor; a crafted one ran os.mkdir in the prefill."""
    payload = pickle.dumps(_Payload())
    calls: list[str] = []

    def forbidden(*_a, **_k):
        calls.append("pickle")
        raise AssertionError("pickle must never be called on a descriptor")

    for name in ("loads", "load", "Unpickler"):
        monkeypatch.setattr(pickle, name, forbidden)
    for field in ("handle", "ref_counter_handle", "event_handle"):
        dest = _cuda_dest(**{field: payload})
        with pytest.raises(SharedKVAttachError):  # no GPU here (device), or the field fails its check
            SharedKVPools().attach(dest)
        shm = _shm_dest(payload.decode("latin-1"))
        with pytest.raises(SharedKVAttachError):
            SharedKVPools().attach(shm)
    assert not PWNED.exists() and not calls
    source = Path(shared_kv.__file__).read_text()
    assert not re.search(r"import pickle|pickle\.|Pickler|from_file", source)


def test_copy_pages_checks_block_ids() -> None:
    src = torch.randn(SHAPE)
    dst = torch.zeros(SHAPE)
    copy_pages(src, [1, 2, 5], dst, [0, 1, 7])
    assert torch.equal(dst[:, :, 7], src[:, :, 5]) and torch.equal(dst[:, :, [0, 1]], src[:, :, [1, 2]])
    with pytest.raises(ValueError, match="destination block 8"):
        copy_pages(src, [0], dst, [8])
    with pytest.raises(ValueError, match="source block -1"):
        copy_pages(src, [-1], dst, [0])


_GPU_CHILD = r"""
import struct, sys, torch
from services.engine.shared_kv import export_cuda_kv
pool = torch.zeros(2, 2, 8, 4, 2, 8, device="cuda")
raw = export_cuda_kv(pool).SerializeToString()
sys.stdout.buffer.write(struct.pack("<I", len(raw)) + raw)
sys.stdout.buffer.flush()
sys.stdin.readline()  # the parent has written into the pool
print(f"SUM={float(pool[1, 0, 3].sum().item())}", file=sys.stderr, flush=True)
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")
def test_cuda_ipc_pool_opened_from_typed_fields_in_another_process() -> None:
    """A decode process exports its pool; this process rebuilds it from the proto and writes into it."""
    child = subprocess.Popen([sys.executable, "-c", _GPU_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, cwd=Path(__file__).resolve().parents[2])
    try:
        (n,) = struct.unpack("<I", child.stdout.read(4))
        raw = child.stdout.read(n)
        dest = decode_pb2.KVDestination.FromString(raw)
        assert dest.WhichOneof("pool") == "cuda_ipc" and dest.cuda_ipc.handle
        opened = SharedKVPools().attach(dest)
        assert opened.is_cuda and tuple(opened.shape) == SHAPE
        opened[1, 0, 3].fill_(2.0)
        torch.cuda.synchronize()
        child.stdin.write(b"go\n")
        child.stdin.flush()
        _, err = child.communicate(timeout=120)
        sums = [float(line[4:]) for line in err.decode().splitlines() if line.startswith("SUM=")]
        assert sums == [2.0 * opened[1, 0, 3].numel()], err.decode()
    finally:
        if child.poll() is None:
            child.kill()


def test_pool_files_of_dead_decodes_are_removed_and_nothing_else(tmp_path) -> None:
    """A decode killed with SIGKILL leaves its /dev/shm pool behind; the next pool creation sweeps such
    files: our uid's, named like a pool, whose pid is gone. Live pids, other names and links stay."""
    import subprocess

    from services.engine.shared_kv import remove_orphaned_pools

    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that existed and is gone now
    orphan = tmp_path / f"pdserve-kv-{dead.pid}-0123456789ab"
    orphan.write_bytes(b"x" * 64)
    alive = tmp_path / f"pdserve-kv-{os.getpid()}-0123456789ab"
    alive.write_bytes(b"y")
    other = tmp_path / f"not-a-pool-{dead.pid}"
    other.write_bytes(b"z")
    target = tmp_path / "target"
    target.write_bytes(b"keep")
    link = tmp_path / f"pdserve-kv-{dead.pid}-ba9876543210"
    link.symlink_to(target)
    assert remove_orphaned_pools(str(tmp_path)) == [orphan.name]
    assert not orphan.exists() and alive.exists() and other.exists() and link.is_symlink()
    assert target.read_bytes() == b"keep"
