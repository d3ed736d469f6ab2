"""What the host CPU can do, and the dtype and thread choices that follow from it.

Pure functions (``resolve_dtype``, ``split_cores``, ``assign_cpus``, ``parse_cpu_list``) take their
inputs as arguments so tests can pose as any host; ``host_cpu()`` reads this machine once.

No torch import at module level: the launcher (a process that runs no model) imports this module.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
"""/proc/cpuinfo flags of bf16 dot products in hardware, best first. Without them torch's bf16 matmuls
convert on the fly and run far slower than fp32 (~8x on an AVX2-only EPYC)."""
REPORTED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
"""The flags benchmarks and the start-up line print."""

DTYPE_REASONS: Mapping[str, str] = {
    "explicit": "set by --dtype",
    "gpu": "auto: bf16 on an accelerator",
    "cpu_amx_bf16": "auto: the CPU has AMX-BF16",
    "cpu_avx512_bf16": "auto: the CPU has AVX512-BF16",
    "cpu_no_native_bf16": "auto: the CPU has no native bf16 (no AMX-BF16, no AVX512-BF16), so fp32",
}
"""resolve_dtype's reason codes (the ``dtype_reason`` metric label) -> what they mean."""

QUIET_OPENMP_ENV: Mapping[str, str] = {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}
"""Environment of spawned engine processes: idle OpenMP workers sleep at once instead of spinning
(GNU OpenMP spins ~300k iterations, Intel OpenMP 200 ms), so processes sharing cores do not burn
each other's time. Read once when the OpenMP runtime loads, i.e. before torch is imported."""
UNSET_OPENMP_ENV = ("OMP_PROC_BIND",)
"""Unset for spawned engine processes: each process would bind its threads to the same first cores."""


@dataclass(frozen=True)
class CpuInfo:
    model: str
    """``model name`` of /proc/cpuinfo (or the platform's processor string)."""
    flags: frozenset[str]
    """/proc/cpuinfo ``flags`` of the first processor."""
    cpus: tuple[int, ...]
    """CPU ids this process may run on (os.sched_getaffinity) when it was read."""
    family: str = ""
    """"family F model M" of /proc/cpuinfo ("" if absent): a virtual machine's model name ("AMD EPYC") does not
    say which generation it is; the family does (25: Zen 3/4, 26: Zen 5)."""

    def reported_flags(self) -> list[str]:
        return [f for f in REPORTED_FLAGS if f in self.flags]


def parse_cpuinfo(text: str) -> tuple[str, frozenset[str]]:
    """(model name, flags) of the first processor listed in /proc/cpuinfo text; ("", {}) if absent."""
    model = ""
    flags: frozenset[str] = frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
        if model and flags:
            break
    return model, flags


def cpu_family(text: str) -> str:
    """"family F model M" of the first processor in /proc/cpuinfo text; "" if either is absent."""
    got: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("cpu family", "model") and key not in got:
            got[key] = value.strip()
        if len(got) == 2:
            return f"family {got['cpu family']} model {got['model']}"
    return ""


def available_cpus() -> tuple[int, ...]:
    """CPU ids this process may run on (its affinity mask; all of os.cpu_count() where unsupported)."""
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))


def _torch_flags() -> frozenset[str]:
    """Native-bf16 flags as torch's cpuinfo sees them: the fallback where /proc/cpuinfo is missing."""
    import torch

    probes = {"amx_bf16": "_is_amx_tile_supported", "avx512_bf16": "_is_avx512_bf16_supported",
              "avx512f": "_is_avx512_supported", "avx2": "_is_avx2_supported"}
    return frozenset(flag for flag, fn in probes.items() if getattr(torch.cpu, fn, lambda: False)())


@functools.cache
def host_cpu() -> CpuInfo:
    """This machine's CPU, read once per process."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    model, flags = parse_cpuinfo(text)
    if not flags:
        flags = _torch_flags()
    if not model:
        import platform

        model = platform.processor() or platform.machine() or "unknown"
    return CpuInfo(model=model, flags=flags, cpus=available_cpus(), family=cpu_family(text))


def torch_cpu_capability() -> str:
    """The ISA torch's CPU kernels dispatch to (``AVX512``, ``AVX2``, ``DEFAULT``, ...)."""
    import torch

    return str(torch.backends.cpu.get_cpu_capability())


def resolve_dtype(requested: str, device: str, flags: Iterable[str]) -> tuple[str, str]:
    """(dtype name, reason code in DTYPE_REASONS) for ``--dtype requested`` on ``device``.

    An explicit dtype wins; ``auto`` is bfloat16 on an accelerator and on a CPU with native bf16,
    float32 on any other CPU.
    """
    if requested != "auto":
        return requested, "explicit"
    if device.split(":", 1)[0] != "cpu":
        return "bfloat16", "gpu"
    have = set(flags)
    for flag in NATIVE_BF16_FLAGS:
        if flag in have:
            return "bfloat16", f"cpu_{flag}"
    return "float32", "cpu_no_native_bf16"


def bf16_cross_check(dtype: str, reason: str, capability: str) -> str | None:
    """A warning when torch's kernels do not run at the ISA the flags promise (e.g. ATEN_CPU_CAPABILITY
    forced lower): bf16 chosen for native bf16 but torch dispatches below AVX512."""
    if dtype == "bfloat16" and reason.startswith("cpu_") and not capability.upper().startswith("AVX512"):
        return (f"dtype bfloat16 chosen for {reason[4:]}, but torch's CPU kernels run at {capability}; "
                "if it is slow, pass --dtype float32")
    return None


# --- threads and cores --------------------------------------------------------------------------


def split_cores(n_cores: int, n_prefill: int, n_decode: int) -> list[int]:
    """Threads of each engine process on a host with ``n_cores``: prefills first, then decodes.

    With at least one core per process the shares add up to ``n_cores`` (the remainder goes to the
    first processes: the prefills, whose large matmuls scale with threads); with fewer cores than
    processes every process gets 1 (oversubscribed, but never idle-spinning: see QUIET_OPENMP_ENV).
    """
    n = n_prefill + n_decode
    if n_cores < 1 or n_prefill < 0 or n_decode < 0 or n < 1:
        raise ValueError(f"split_cores: need n_cores >= 1 and at least one process, got "
                         f"{n_cores} cores, {n_prefill} prefill, {n_decode} decode")
    if n_cores <= n:
        return [1] * n
    base, extra = divmod(n_cores, n)
    return [base + (1 if i < extra else 0) for i in range(n)]


def widen_prefills(shares: list[int], n_cores: int, n_prefill: int) -> list[int]:
    """``shares`` (split_cores's, prefills first) with every prefill that would run on one thread given the
    host's cores divided among the prefills instead (at least 1): the prefill then overlaps the decodes' cores.

    A prompt's matmuls scale with threads, and where the even split leaves a prefill one core, a prompt-heavy
    load is bound by it while its decode spends its own core on small batches: on a 2-core host (Zen 5 EPYC,
    SmolLM2-135M bf16, 1P1D, 512-token prompts, 32 output tokens, C16) the prefill on both cores and the decode on
    one served 71.6 output tok/s against 53.3 with one core each (TPOT 25 against 24 ms, C1 TTFT 375 against
    368 ms). Spawned engines wait passively in OpenMP (QUIET_OPENMP_ENV), so the decode's short steps interleave
    with the prefill's threads instead of spinning against them. Prefills with two or more threads keep theirs."""
    wide = max(1, n_cores // n_prefill) if n_prefill else 1
    return [wide if i < n_prefill and s == 1 else s for i, s in enumerate(shares)]


def assign_cpus(cpus: Iterable[int], shares: list[int]) -> list[list[int]]:
    """Disjoint runs of ``cpus`` of sizes ``shares`` (in order); where the shares ask for more CPUs
    than there are, they wrap around (processes then share CPUs)."""
    ids = list(cpus)
    if not ids:
        raise ValueError("assign_cpus: no CPUs")
    out: list[list[int]] = []
    at = 0
    for share in shares:
        out.append([ids[(at + k) % len(ids)] for k in range(share)])
        at += share
    return out


def parse_cpu_list(text: str) -> list[int]:
    """``"0-3,8"`` -> [0, 1, 2, 3, 8] (the Linux cpulist syntax); "" -> []."""
    out: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"{part!r} is not a CPU id or range (expected e.g. 0-3,8)") from None
        if a < 0 or b < a:
            raise ValueError(f"{part!r} is not a CPU id or an increasing range")
        out.update(range(a, b + 1))
    return sorted(out)


def format_cpu_list(cpus: Iterable[int]) -> str:
    """[0, 1, 2, 3, 8] -> ``"0-3,8"``."""
    ids = sorted(set(cpus))
    runs: list[str] = []
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        runs.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(runs)


def engine_cpu_args(n_prefill: int, n_decode: int, *, pin: bool = False,
                    cpus: Iterable[int] | None = None) -> list[list[str]]:
    """Engine flags giving each of the processes ``pdserve up`` starts its share of this host's CPUs
    (prefills first, then decodes): ``--cpu-threads N``, plus ``--cpu-affinity LIST`` when ``pin``. Unpinned,
    a prefill the even split leaves one thread runs on the cores of the host divided among the prefills
    (widen_prefills)."""
    if n_prefill + n_decode == 0:
        return []
    ids = list(cpus) if cpus is not None else list(available_cpus())
    shares = split_cores(len(ids), n_prefill, n_decode)
    if not pin:  # pinned shares stay disjoint: each process has the CPUs it is pinned to
        shares = widen_prefills(shares, len(ids), n_prefill)
    args = [["--cpu-threads", str(s)] for s in shares]
    if pin:
        for a, cpu_set in zip(args, assign_cpus(ids, shares), strict=True):
            a += ["--cpu-affinity", format_cpu_list(cpu_set)]
    return args


def quiet_openmp_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` for a spawned engine process: QUIET_OPENMP_ENV where ``env`` does not set those
    variables already (an operator's choice wins), UNSET_OPENMP_ENV removed."""
    out = {k: v for k, v in env.items() if k not in UNSET_OPENMP_ENV}
    for k, v in QUIET_OPENMP_ENV.items():
        out.setdefault(k, v)
    return out


def apply_cpu_threads(threads: int, affinity: list[int]) -> int:
    """Pin this process to ``affinity`` (if given) and set torch's intra-op threads: ``threads``, or
    (0) every CPU the process may run on. Returns the thread count. Call before the engine's first
    op: torch threads started earlier keep the count they began with."""
    import torch

    if affinity:
        os.sched_setaffinity(0, affinity)
    n = threads or len(affinity or available_cpus())
    torch.set_num_threads(n)
    return n
