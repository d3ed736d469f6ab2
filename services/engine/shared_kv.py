"""``shm`` and ``cuda-ipc`` payload modes: a same-host handoff straight into decode's KV pool.

A decode started with ``--kv-cache-shared`` allocates its KV pool in a file under /dev/shm and
offers it in ReserveResponse.transport_info["shm"]. A prefill on the same host maps that pool and
copies each chunk's pages from its own cache into the reserved destination blocks (one copy, no
packing, no bytes through gRPC); the PushKV stream then carries only the descriptors. The role
CUDA IPC plays between GPUs of one host, and on GPUs that is what ``cuda-ipc`` does: decode exports
its device pool (a CUDA IPC handle, through torch's own tensor reducer), a prefill on the same host
opens it and copies pages device to device (same GPU or a peer over NVLink/PCIe). A descriptor from
another host (different boot id) is refused and the prefill falls back to bytes in the stream.
"""

from __future__ import annotations

import base64
import io
import json
import math
import os
import pickle
import socket
import uuid

import torch

SHM_DIR = "/dev/shm"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def host_id() -> str:
    """This machine (boot) instance: two processes share /dev/shm only if these are equal."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown"
    return f"{socket.gethostname()}/{boot}"


class SharedKVAttachError(RuntimeError):
    pass


def create_shared_kv(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, str, str]:
    """A zeroed tensor backed by a new /dev/shm file: (tensor, its path, the descriptor to advertise)."""
    name = next(k for k, v in _DTYPES.items() if v == dtype)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    st = os.statvfs(SHM_DIR)
    if st.f_bavail * st.f_frsize < nbytes:  # tmpfs would SIGBUS on first touch past its size
        raise SharedKVAttachError(f"{SHM_DIR} has {st.f_bavail * st.f_frsize} bytes free; the KV pool needs {nbytes}")
    path = os.path.join(SHM_DIR, f"pdserve-kv-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    tensor = torch.from_file(path, shared=True, size=math.prod(shape), dtype=dtype).view(shape)
    desc = json.dumps({"path": path, "shape": list(shape), "dtype": name, "host": host_id()})
    return tensor, path, desc


def export_cuda_kv(tensor: torch.Tensor) -> str:
    """Descriptor of a CUDA tensor another process on this host can open (CUDA IPC). The exporting
    process must keep the tensor alive while others use it (decode's pool lives as long as decode)."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers torch's CUDA IPC reducers with ForkingPickler)

    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(tensor)
    return json.dumps({"kind": "cuda-ipc", "host": host_id(), "shape": list(tensor.shape),
                       "handle": base64.b64encode(buf.getvalue()).decode()})


class SharedKVPools:
    """Prefill side: decode pools mapped by descriptor, cached (each decode maps once)."""

    def __init__(self) -> None:
        self._pools: dict[str, torch.Tensor] = {}

    def attach(self, descriptor: str) -> torch.Tensor:
        pool = self._pools.get(descriptor)
        if pool is not None:
            return pool
        try:
            d = json.loads(descriptor)
            if d.get("kind") == "cuda-ipc":
                return self._attach_cuda(descriptor, d)
            shape, dtype, path = tuple(d["shape"]), _DTYPES[d["dtype"]], d["path"]
        except (ValueError, KeyError, TypeError) as e:
            raise SharedKVAttachError(f"malformed shm descriptor: {e}") from e
        if d.get("host") != host_id():
            raise SharedKVAttachError(f"shm pool {path} is on another host ({d.get('host')})")
        if not os.path.exists(path) or os.path.getsize(path) != math.prod(shape) * torch.empty((), dtype=dtype).element_size():
            raise SharedKVAttachError(f"shm pool {path} is missing or not {shape} {d['dtype']}")
        pool = torch.from_file(path, shared=True, size=math.prod(shape), dtype=dtype).view(shape)
        self._pools[descriptor] = pool
        return pool

    def _attach_cuda(self, descriptor: str, d: dict) -> torch.Tensor:
        if d.get("host") != host_id():
            raise SharedKVAttachError(f"CUDA pool is on another host ({d.get('host')})")
        import torch.multiprocessing  # noqa: F401  (the matching rebuild functions)

        try:
            pool = pickle.loads(base64.b64decode(d["handle"]))  # a descriptor from our own decode, by design
        except Exception as e:  # CUDA or pickle errors: fall back to bytes in the stream
            raise SharedKVAttachError(f"cannot open the CUDA IPC handle: {e!r}") from e
        if list(pool.shape) != d["shape"]:
            raise SharedKVAttachError(f"CUDA pool has shape {list(pool.shape)}, descriptor says {d['shape']}")
        self._pools[descriptor] = pool
        return pool


def _runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) runs where both block lists advance by one together."""
    runs: list[tuple[int, int, int]] = []
    for a, b in zip(src, dst, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == a and runs[-1][1] + runs[-1][2] == b:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((a, b, 1))
    return runs


def copy_pages(src_cache: torch.Tensor, src_blocks: list[int], dst_cache: torch.Tensor, dst_blocks: list[int]) -> None:
    """dst_cache[:, :, dst_blocks[i]] = src_cache[:, :, src_blocks[i]] (both [L, 2, blocks, bs, kvh, hd]).

    One strided copy per run of consecutive blocks: no gathered temporary (several times faster than
    advanced indexing on CPU)."""
    layers2 = src_cache.shape[0] * 2
    src = src_cache.view(layers2, src_cache.shape[2], -1)
    dst = dst_cache.view(layers2, dst_cache.shape[2], -1)
    for a, b, n in _runs(src_blocks, dst_blocks):
        dst[:, b:b + n].copy_(src[:, a:a + n])
