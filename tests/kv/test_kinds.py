"""The pool-kind and transport table (services/common/kv_kinds.py): every oneof case has an entry, the connector
registry agrees with it, and no module outside the table and services/kv/ compares pool cases or transport names."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from services.common import kv_kinds
from services.common.pb import decode_pb2
from services.kv import registry
from services.kv.shards import SHARDS
from services.launcher import kv_transport_args
from services.prefill.config import PrefillConfig

ROOT = Path(__file__).resolve().parents[2]

NAMES = "grpc|shm|cuda-ipc|cuda_ipc|mooncake|sharded"
COMPARED = re.compile(rf'WhichOneof\("pool"\)|[!=]= *"({NAMES})"|"({NAMES})" *[!=]=|\bin [(\[{{] *"({NAMES})"')
"""A pool case read off a message, or a pool case / transport name compared as a string."""
OWNERS = ("services/kv/", "services/common/kv_kinds.py")
"""Where those names are decided: the connector registry and the table it and the engine share."""
KVSTORE_BACKEND = re.compile(r'\b(backend|kvstore) *[!=]= *"')
"""The kvstore's storage backend setting (services/kvstore/config.BACKENDS, "mooncake" among them): not a KV
transport."""


def compared_names(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every comparison of a pool case or transport name in ``text``."""
    return [(i, line.strip()) for i, line in enumerate(text.splitlines(), 1)
            if COMPARED.search(line) and not KVSTORE_BACKEND.search(line)]


def test_no_pool_case_or_transport_name_is_compared_outside_the_registry() -> None:
    found = []
    for path in sorted(ROOT.glob("services/**/*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if "/pb/" in rel or rel.startswith(OWNERS):
            continue
        found += [f"{rel}:{n}: {line}" for n, line in compared_names(path.read_text())]
    assert not found, ("pool kinds / transports compared by name outside services/kv and services/common/kv_kinds.py "
                       "(ask kv_kinds.pool_kind(dest) or kv_kinds.transport_kind(name) instead):\n" + "\n".join(found))


def test_the_scan_sees_comparisons() -> None:
    assert compared_names('    kind = dest.WhichOneof("pool")\n') == [(1, 'kind = dest.WhichOneof("pool")')]
    for line in ('if kind == "sharded":', 'if t != "cuda-ipc":', 'if kind in ("shm", "cuda_ipc"):',
                 'if transport in {"grpc"}:', 'if "mooncake" == name:'):
        assert compared_names(line), line
    for line in ('if cfg.backend == "mooncake":', 'if self.kvstore == "mooncake":', 'if device == "cuda":',
                 'kind = pool_kind(dest)'):
        assert not compared_names(line), line


def test_every_pool_case_has_a_kind() -> None:
    for message in (decode_pb2.KVDestination, decode_pb2.DraftPool):
        cases = {f.name for f in message.DESCRIPTOR.oneofs_by_name["pool"].fields}
        assert cases <= {k.case for k in kv_kinds.POOL_KINDS}, message
    assert kv_kinds.pool_kind(decode_pb2.KVDestination()) is None
    draft = decode_pb2.DraftPool(mooncake=decode_pb2.MooncakePool(segment="h:1"))
    assert kv_kinds.pool_kind(draft) is kv_kinds.MOONCAKE
    assert [k.case for k in kv_kinds.POOL_KINDS if k.plain] == ["shm", "cuda_ipc", "mooncake"]
    assert [k.case for k in kv_kinds.POOL_KINDS if k.mapped] == ["shm", "cuda_ipc"]
    assert [k.case for k in kv_kinds.POOL_KINDS if k.remote] == ["mooncake"]
    assert [k.case for k in kv_kinds.POOL_KINDS if k.per_rank] == ["sharded"]


def test_pool_ids() -> None:
    shm = decode_pb2.KVDestination(shm=decode_pb2.ShmPool(name="pdserve-kv-1-abc"))
    ipc = decode_pb2.KVDestination(cuda_ipc=decode_pb2.CudaIpcPool(device=1, handle=b"h"))
    moon = decode_pb2.KVDestination(mooncake=decode_pb2.MooncakePool(segment="host:1", base_address=255))
    assert kv_kinds.pool_id(shm) == "shm:pdserve-kv-1-abc"
    assert kv_kinds.pool_id(ipc) == f"cuda-ipc:1:{hashlib.sha256(b'h').hexdigest()[:16]}"
    assert kv_kinds.pool_id(moon) == "mooncake:host:1@ff"
    assert kv_kinds.pool_id(decode_pb2.KVDestination()) == ""
    sharded = decode_pb2.KVDestination()
    sharded.sharded.tp_size = 2
    for r, pool in enumerate((shm, moon)):
        sharded.sharded.ranks.add(rank=r, pool=pool)
    digest = hashlib.sha256(b"shm:pdserve-kv-1-abc|mooncake:host:1@ff").hexdigest()[:16]
    assert kv_kinds.pool_id(sharded) == f"tp2:{digest}"


def test_the_registry_and_the_launcher_agree_with_the_table() -> None:
    choices = next(f for f in PrefillConfig.__dataclass_fields__.values() if f.name == "kv_transport")
    assert choices.metadata["choices"] == kv_kinds.TRANSPORT_NAMES == ("grpc", "shm", "cuda-ipc", "mooncake", "auto")
    assert {t.name for t in kv_kinds.TRANSPORTS} - {registry.AUTO} == registry.BY_NAME.keys() - {"fake"}
    for kind in kv_kinds.POOL_KINDS:
        if kind.plain:
            conn = registry.BY_NAME[kind.transport]
            assert conn.pool is kind and registry.writes_in_place(kind.transport)
    assert SHARDS.pool is kv_kinds.SHARDED
    assert kv_transport_args("cuda-ipc", "h") == (["--kv-transport", "cuda-ipc"], ["--kv-cache-shared"])
