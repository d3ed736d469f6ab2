"""services/engine/cpu/cpu_features.py: dtype resolution, /proc/cpuinfo parsing, core split, OpenMP env."""

from __future__ import annotations

import pytest

from services.engine.cpu import cpu_features as cf

EPYC_AVX2 = ("avx", "avx2", "fma", "f16c", "sse4_2")
XEON_AVX512_BF16 = (*EPYC_AVX2, "avx512f", "avx512bw", "avx512_bf16")
XEON_AMX = (*XEON_AVX512_BF16, "amx_tile", "amx_bf16", "amx_int8")

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse2 avx avx2 fma
bugs\t\t: sysret_ss_attrs

processor\t: 1
model name\t: other
flags\t\t: fpu
"""


def test_auto_is_fp32_on_a_cpu_without_native_bf16() -> None:
    assert cf.resolve_dtype("auto", "cpu", EPYC_AVX2) == ("float32", "cpu_no_native_bf16")
    assert cf.resolve_dtype("auto", "cpu", ()) == ("float32", "cpu_no_native_bf16")
    # AVX-512 without its BF16 extension is not native bf16 either.
    assert cf.resolve_dtype("auto", "cpu", (*EPYC_AVX2, "avx512f"))[0] == "float32"


@pytest.mark.parametrize(("flags", "reason"), [(XEON_AVX512_BF16, "cpu_avx512_bf16"), (XEON_AMX, "cpu_amx_bf16"),
                                               (("amx_bf16",), "cpu_amx_bf16")])
def test_auto_is_bf16_with_amx_or_avx512_bf16(flags: tuple[str, ...], reason: str) -> None:
    assert cf.resolve_dtype("auto", "cpu", flags) == ("bfloat16", reason)


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_auto_is_bf16_on_gpu_whatever_the_cpu(device: str) -> None:
    assert cf.resolve_dtype("auto", device, EPYC_AVX2) == ("bfloat16", "gpu")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("flags", [EPYC_AVX2, XEON_AMX])
def test_explicit_dtype_wins(dtype: str, flags: tuple[str, ...]) -> None:
    assert cf.resolve_dtype(dtype, "cpu", flags) == (dtype, "explicit")
    assert cf.resolve_dtype(dtype, "cuda", flags) == (dtype, "explicit")


def test_every_reason_is_described() -> None:
    reasons = {cf.resolve_dtype(d, dev, f)[1] for d in ("auto", "float32") for dev in ("cpu", "cuda")
               for f in (EPYC_AVX2, XEON_AVX512_BF16, XEON_AMX)}
    assert reasons == set(cf.DTYPE_REASONS)


def test_bf16_cross_check_warns_when_torch_runs_below_avx512() -> None:
    assert cf.bf16_cross_check("bfloat16", "cpu_amx_bf16", "AVX512") is None
    assert "AVX2" in (cf.bf16_cross_check("bfloat16", "cpu_amx_bf16", "AVX2") or "")
    assert cf.bf16_cross_check("float32", "cpu_no_native_bf16", "AVX2") is None
    assert cf.bf16_cross_check("bfloat16", "explicit", "DEFAULT") is None


def test_parse_cpuinfo_reads_the_first_processor() -> None:
    model, flags = cf.parse_cpuinfo(CPUINFO)
    assert model == "AMD EPYC 7B13"
    assert flags == frozenset({"fpu", "sse2", "avx", "avx2", "fma"})
    assert cf.parse_cpuinfo("") == ("", frozenset())


def test_cpu_family_names_the_generation_the_model_name_hides() -> None:
    assert cf.cpu_family(CPUINFO) == "family 25 model 1"
    assert cf.cpu_family("model name\t: AMD EPYC\n") == ""


def test_host_cpu_reads_this_machine() -> None:
    cpu = cf.host_cpu()
    assert cpu.model and cpu.cpus
    assert set(cpu.reported_flags()) <= set(cf.REPORTED_FLAGS)


@pytest.mark.parametrize("n_cores", [1, 2, 3, 4, 7, 16, 64, 127])
@pytest.mark.parametrize(("n_prefill", "n_decode"), [(1, 1), (0, 1), (2, 1), (1, 3), (2, 2)])
def test_split_cores_adds_up_to_the_cores(n_cores: int, n_prefill: int, n_decode: int) -> None:
    shares = cf.split_cores(n_cores, n_prefill, n_decode)
    assert len(shares) == n_prefill + n_decode
    assert all(s >= 1 for s in shares)
    if n_cores >= len(shares):
        assert sum(shares) == n_cores
        assert max(shares) - min(shares) <= 1
    else:  # fewer cores than processes: one thread each
        assert shares == [1] * len(shares)


def test_split_cores_examples() -> None:
    assert cf.split_cores(2, 1, 1) == [1, 1]
    assert cf.split_cores(3, 1, 1) == [2, 1]  # the remainder to the prefill
    assert cf.split_cores(16, 1, 1) == [8, 8]
    assert cf.split_cores(2, 2, 2) == [1, 1, 1, 1]
    with pytest.raises(ValueError):
        cf.split_cores(0, 1, 1)
    with pytest.raises(ValueError):
        cf.split_cores(4, 0, 0)


def test_assign_cpus_disjoint_then_wrapping() -> None:
    assert cf.assign_cpus([0, 1, 2, 3, 4], [3, 2]) == [[0, 1, 2], [3, 4]]
    assert cf.assign_cpus([4, 6], [1, 1, 1]) == [[4], [6], [4]]


@pytest.mark.parametrize(("text", "ids"), [("", []), ("3", [3]), ("0-3,8", [0, 1, 2, 3, 8]),
                                           ("8, 0-1 ,1", [0, 1, 8])])
def test_cpu_list_round_trip(text: str, ids: list[int]) -> None:
    assert cf.parse_cpu_list(text) == ids
    assert cf.parse_cpu_list(cf.format_cpu_list(ids)) == ids


@pytest.mark.parametrize("bad", ["a", "3-1", "-1", "1-x"])
def test_cpu_list_rejects_garbage(bad: str) -> None:
    with pytest.raises(ValueError):
        cf.parse_cpu_list(bad)


def test_widen_prefills_gives_a_one_thread_prefill_the_cores() -> None:
    assert cf.widen_prefills(cf.split_cores(2, 1, 1), 2, 1) == [2, 1]
    assert cf.widen_prefills(cf.split_cores(4, 2, 2), 4, 2) == [2, 2, 1, 1]  # one core each: 4 cores / 2 prefills
    assert cf.widen_prefills(cf.split_cores(2, 2, 2), 2, 2) == [1, 1, 1, 1]  # 2 // 2 = 1: nothing to widen
    assert cf.widen_prefills(cf.split_cores(16, 1, 1), 16, 1) == [8, 8]  # a prefill with 2+ threads keeps them
    assert cf.widen_prefills(cf.split_cores(1, 1, 1), 1, 1) == [1, 1]
    assert cf.widen_prefills([1], 2, 0) == [1]  # no prefill (colocated workers)


def test_engine_cpu_args_split_and_pin() -> None:
    assert cf.engine_cpu_args(1, 1, cpus=[0, 1, 2]) == [["--cpu-threads", "2"], ["--cpu-threads", "1"]]
    assert cf.engine_cpu_args(1, 1, cpus=[0, 1]) == [["--cpu-threads", "2"], ["--cpu-threads", "1"]]  # widened
    assert cf.engine_cpu_args(1, 1, pin=True, cpus=[0, 1]) == [  # pinned: disjoint, not widened
        ["--cpu-threads", "1", "--cpu-affinity", "0"], ["--cpu-threads", "1", "--cpu-affinity", "1"]]
    assert cf.engine_cpu_args(0, 2, cpus=[0, 1]) == [["--cpu-threads", "1"], ["--cpu-threads", "1"]]
    assert cf.engine_cpu_args(1, 1, pin=True, cpus=[0, 1, 2, 3]) == [
        ["--cpu-threads", "2", "--cpu-affinity", "0-1"], ["--cpu-threads", "2", "--cpu-affinity", "2-3"]]
    assert cf.engine_cpu_args(0, 0) == []


def test_quiet_openmp_env() -> None:
    env = cf.quiet_openmp_env({"PATH": "/bin", "OMP_PROC_BIND": "true"})
    assert env == {"PATH": "/bin", "OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}
    assert cf.quiet_openmp_env({"OMP_WAIT_POLICY": "ACTIVE"})["OMP_WAIT_POLICY"] == "ACTIVE"  # operator wins
