"""The engine's C kernels (native_kernels.c): built once per host with its C compiler, loaded with ctypes.

The source is small plain C (no torch headers), so a cold build takes about a second; the shared object is
kept under ``~/.cache/pdserve/cpu-kernels``, named by a hash of the
source, the compiler's version and this CPU's model and flags (``-march=native`` code must never run on
another CPU model); ``--cpu-kernel-dir`` puts it elsewhere (a read-only root filesystem). A host without a C compiler, or whose build fails, keeps torch's kernels: one warning
line says so, and ``attention_backend: torch`` asks for torch's kernels outright.

OpenMP: the object is linked with -fopenmp, and its libgomp.so.1 resolves to the one torch has already
loaded (same soname), so its parallel loops run on torch's thread pool at the thread count the step runs
at; the call releases the GIL (ctypes.CDLL).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from services.engine.cpu.cpu_features import host_cpu

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native_kernels.c")
DEFAULT_DIR = "~/.cache/pdserve/cpu-kernels"
FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-ffp-contract=off", "-fopenmp",
         "-fPIC")
"""-ffast-math lets the dot products reassociate and expf vectorize (glibc's vector math needs all of it,
finite-math included: the kernels use no infinities; the online softmax starts from -FLT_MAX); -ffp-contract=off
keeps a*b + c*d as two rounded products and a rounded sum, as torch's separate ops compute it (RoPE in fp32 is then
bit-identical to torch's). These flags compile only: the link (LINK_FLAGS) names no fast-math option, because
gcc then links crtfastmath.o, whose constructor sets flush-to-zero and denormals-are-zero for the whole process
when the library loads (subnormal floats would silently become 0 everywhere)."""
LINK_FLAGS = ("-shared", "-fopenmp")
ABI_VERSION = 4
MAX_HEADS, MAX_HEADS_X_DIM, MAX_KV_ROW, MAX_BLOCK = 64, 16384, 4096, 64
"""native_kernels.c's limits: query heads, query heads x head dim, KV heads x head dim, tokens per page (larger
shapes use torch's kernels)."""
MAX_PREFILL_HEAD_DIM = 512
"""The prefill kernel's largest head dim (it refuses larger ones, which take torch's path)."""

_ARGS_DECODE = [ctypes.c_void_p] * 4 + [ctypes.c_int] + [ctypes.c_void_p] * 3 + [ctypes.c_int] * 5 + \
               [ctypes.c_float, ctypes.c_int]


_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
_ARGS_PREFILL = [_P] * 4 + [_I] * 3 + [_P] + [_I] * 4 + [_F, _I]
_ARGS = {"rms_norm": [_P, _L, _P, _P, _I, _I, _F, _I], "silu_mul": [_P, _L, _P, _I, _I, _I],
         "add_rms_norm": [_P, _L, _P, _L, _P, _P, _P, _I, _I, _F, _I],
         "rope": [_P, _L, _P, _P, _P, _P, _I, _I, _I, _I]}
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}


def _rows(x: torch.Tensor) -> tuple[int, int] | None:
    """(rows, row stride) of a 2-D view whose rows are contiguous, else None."""
    if x.dim() != 2 or (x.shape[1] > 1 and x.stride(1) != 1):
        return None
    return x.shape[0], x.stride(0)


class NativeKernels:
    """The loaded library's entry points."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self._decode = {torch.bfloat16: lib.paged_decode_attention_bf16, torch.float32: lib.paged_decode_attention_f32}
        for fn in self._decode.values():
            fn.argtypes = _ARGS_DECODE
            fn.restype = ctypes.c_int
        self._prefill = {dt: getattr(lib, f"paged_prefill_attention_{suf}") for dt, suf in _SUFFIX.items()}
        for fn in self._prefill.values():
            fn.argtypes = _ARGS_PREFILL
            fn.restype = ctypes.c_int
        self._ops = {(name, dt): getattr(lib, f"{name}_{suf}") for name in _ARGS for dt, suf in _SUFFIX.items()}
        for (name, _), fn in self._ops.items():
            fn.argtypes = _ARGS[name]
            fn.restype = ctypes.c_int

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
        """HF's RMSNorm over the last dim (fp32 inside, cast, times the weight); None where it does not apply."""
        if x.dtype not in _SUFFIX or weight.dtype != x.dtype or not weight.is_contiguous() or x.shape[-1] == 0:
            return None
        flat = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x  # per-head norms of a strided q/k view: a copy
        rs = _rows(flat)
        if rs is None:
            return None
        out = torch.empty(x.shape, dtype=x.dtype)
        self._ops["rms_norm", x.dtype](flat.data_ptr(), rs[1], weight.data_ptr(), out.data_ptr(), rs[0], x.shape[-1],
                                       eps, torch.get_num_threads())
        return out

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(x + delta, rms_norm(x + delta)) of [T, dim] rows in one pass, the sum rounded to the dtype first as
        torch's add rounds it; None where it does not apply."""
        if (x.dtype not in _SUFFIX or delta.dtype != x.dtype or weight.dtype != x.dtype or x.shape != delta.shape
                or not weight.is_contiguous() or x.shape[-1] == 0):
            return None
        rx, rd = _rows(x), _rows(delta)
        if rx is None or rd is None:
            return None
        total, out = torch.empty(x.shape, dtype=x.dtype), torch.empty(x.shape, dtype=x.dtype)
        self._ops["add_rms_norm", x.dtype](x.data_ptr(), rx[1], delta.data_ptr(), rd[1], weight.data_ptr(),
                                           total.data_ptr(), out.data_ptr(), rx[0], x.shape[1], eps,
                                           torch.get_num_threads())
        return total, out

    def silu_mul(self, gate_up: torch.Tensor, inter: int) -> torch.Tensor | None:
        """silu(gate) * up of [T, 2 * inter] rows (gate first); None where it does not apply."""
        rs = _rows(gate_up)
        if gate_up.dtype not in _SUFFIX or rs is None or gate_up.shape[1] != 2 * inter:
            return None
        out = torch.empty(gate_up.shape[0], inter, dtype=gate_up.dtype)
        self._ops["silu_mul", gate_up.dtype](gate_up.data_ptr(), rs[1], out.data_ptr(), rs[0], inter,
                                             torch.get_num_threads())
        return out

    def rope(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
             ) -> torch.Tensor | None:
        """RoPE (HF's rotate_half form) of x [T, H, D] at int64 positions [T] with fp32 [P, D] tables; None where
        it does not apply."""
        t, h, d = x.shape
        if (x.dtype not in _SUFFIX or positions.dtype != torch.int64 or not positions.is_contiguous()
                or cos.dtype != torch.float32 or not cos.is_contiguous() or not sin.is_contiguous()
                or x.stride(2) != 1 or x.stride(1) != d or d % 2):
            return None
        out = torch.empty(t, h, d, dtype=x.dtype)
        self._ops["rope", x.dtype](x.data_ptr(), x.stride(0), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                                   out.data_ptr(), t, h, d, torch.get_num_threads())
        return out

    def supports_decode(self, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, block_size: int) -> bool:
        return (dtype in self._decode and kv_heads > 0 and heads % kv_heads == 0 and heads <= MAX_HEADS
                and heads * head_dim <= MAX_HEADS_X_DIM and kv_heads * head_dim <= MAX_KV_ROW
                and block_size <= MAX_BLOCK)

    def paged_decode_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor,
                               first: torch.Tensor | None, ctx: torch.Tensor, scale: float) -> torch.Tensor:
        """q [B, H, D] (the cache's dtype), k/v [blocks, block_size, KVH, D], tables int32 [B, >= blocks of the
        longest], first/ctx int32 [B] (keys first..ctx-1; first None: from 0) -> out [B, H, D]."""
        b, h, d = q.shape
        _, bs, kvh, _ = k.shape
        q = q.contiguous()
        out = torch.empty_like(q)
        rc = self._decode[q.dtype](q.data_ptr(), k.data_ptr(), v.data_ptr(), tables.data_ptr(), tables.stride(0),
                                   first.data_ptr() if first is not None else None, ctx.data_ptr(), out.data_ptr(),
                                   b, h, kvh, d, bs, scale, torch.get_num_threads())
        if rc != 0:  # supports_decode was asked first: a failure here is a bug, never a silent wrong answer
            raise RuntimeError(f"native paged decode attention refused shape B={b} H={h} KVH={kvh} D={d} (rc {rc})")
        return out

    def supports_prefill(self, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, block_size: int) -> bool:
        return (dtype in self._prefill and kv_heads > 0 and heads % kv_heads == 0 and heads <= MAX_HEADS
                and head_dim <= MAX_PREFILL_HEAD_DIM and block_size <= MAX_BLOCK)

    def paged_prefill_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor,
                                first_position: int, window: int, scale: float) -> torch.Tensor:
        """q [N, H, D] (the cache's dtype): N new tokens of one sequence at positions first_position ..
        first_position + N - 1, whose K/V the pages k/v [blocks, block_size, KVH, D] hold already; table int32
        (that sequence's blocks) -> out [N, H, D], each token attending causally (within ``window`` keys if > 0)."""
        n, h, d = q.shape
        _, bs, kvh, _ = k.shape
        q = q.contiguous()
        table = table.contiguous()
        out = torch.empty_like(q)
        rc = self._prefill[q.dtype](q.data_ptr(), k.data_ptr(), v.data_ptr(), table.data_ptr(), first_position, n,
                                    window, out.data_ptr(), h, kvh, d, bs, scale, torch.get_num_threads())
        if rc != 0:  # supports_prefill was asked first: a failure here is a bug (or no memory), never a wrong answer
            raise RuntimeError(f"native paged prefill attention failed: N={n} H={h} KVH={kvh} D={d} (rc {rc})")
        return out


ACTIVE: NativeKernels | None = None
"""The kernels the model layers' elementwise ops use on CPU (rms_norm, silu_mul, rope), set by the model runner
of an engine that loaded them; None: torch's ops. Never used while torch.compile traces (compiled decode)."""


def activate(kernels: NativeKernels | None) -> None:
    global ACTIVE
    ACTIVE = kernels


def active(x: torch.Tensor) -> NativeKernels | None:
    """The kernels for an op on ``x``, or None (torch's op): not on CPU, no kernels, or inside a compile trace."""
    k = ACTIVE
    if k is None or x.device.type != "cpu" or x.requires_grad or torch.compiler.is_compiling():
        return None
    return k


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and (path := shutil.which(name)):
            return path
    return None




def _key(cc: str) -> str:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    cpu = host_cpu()
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS + LINK_FLAGS).encode(), version.encode(), cpu.model.encode(),
                 " ".join(sorted(cpu.flags)).encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:24]


def _build(cc: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        obj = tmp + ".o"
        for cmd in ([cc, *FLAGS, "-c", str(SOURCE), "-o", obj], [cc, *LINK_FLAGS, obj, "-o", tmp, "-lm", "-lmvec"]):
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            if r.returncode != 0:
                raise RuntimeError(f"{cc} exited {r.returncode}: {r.stderr.strip()[-400:]}")
        os.replace(tmp, target)  # atomic: a concurrent engine loads either the old file or the whole new one
    finally:
        for path in (tmp, tmp + ".o"):
            if os.path.exists(path):
                os.unlink(path)


@functools.cache
def load(cache_dir: str = "") -> NativeKernels | None:
    """The kernels of this host, built on first use; None (after one warning) where they cannot be built."""
    cc = _compiler()
    if cc is None:
        log.warning("engine: no C compiler on PATH (cc, gcc, clang or $CC): CPU decode attention stays on torch's "
                    "kernels (slower at batches of several sequences)")
        return None
    try:
        target = Path(cache_dir or DEFAULT_DIR).expanduser() / f"native-{_key(cc)}.so"
        if not target.exists():
            _build(cc, target)
            log.info("engine: built the CPU kernels (%s) with %s", target, cc)
        lib = ctypes.CDLL(str(target))
        if lib.native_abi_version() != ABI_VERSION:
            raise RuntimeError(f"{target} has ABI {lib.native_abi_version()}, expected {ABI_VERSION}")
        return NativeKernels(lib, target)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("engine: the CPU kernels could not be built or loaded (%s): CPU decode attention stays on "
                    "torch's kernels", e)
        return None
