"""glibc malloc tuning (services.common.malloc_tuning): when it applies, and that a service's run_main
applies it so that recycled megabyte buffers stop being page-faulted in anew."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap

import pytest

from services.common.malloc_tuning import ENV, skip_reason, tune_malloc

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")

# Buffers of a few MiB allocated and freed in a worker thread, as gRPC Python does with each received
# message; the second pass's minor page faults are what tuning removes.
WORKLOAD = textwrap.dedent("""
    import resource, threading

    def churn():
        keep = []
        for _ in range(40):
            keep.append(bytes(8 << 20))
            scratch = bytearray(6 << 20)
            if len(keep) > 2:
                keep.pop(0)
            del scratch

    def faults():
        out = {}
        def run():
            churn()
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            churn()
            out["faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
        t = threading.Thread(target=run)
        t.start()
        t.join()
        return out["faults"]
""")


def _faults(body: str, env: dict[str, str]) -> int:
    script = WORKLOAD + textwrap.dedent(body)
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.strip().splitlines()[-1])


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in (ENV, "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")}
    env.update(extra)
    return env


def test_skip_reasons() -> None:
    assert skip_reason({ENV: "off"}) == f"{ENV}=off"
    assert skip_reason({ENV: " False "}) is not None
    assert "MALLOC_TRIM_THRESHOLD_" in (skip_reason({"MALLOC_TRIM_THRESHOLD_": "1"}) or "")
    why = skip_reason({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1:glibc.malloc.mmap_threshold=4096"})
    assert why is not None and "glibc.malloc.mmap_threshold" in why
    # A tunable that is not one of ours leaves tuning on.
    expected = None if platform.libc_ver()[0] == "glibc" else "not glibc"
    assert skip_reason({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}) == expected
    assert skip_reason({ENV: "on"}) == expected
    assert tune_malloc({ENV: "off"}) is False


@glibc_only
def test_run_main_tunes_malloc_and_recycled_buffers_stop_faulting() -> None:
    body = """
        import asyncio
        from services.common.server import run_main
        result = {}
        async def main():
            result["faults"] = faults()
        assert run_main("probe", main()) == 0
        print(result["faults"])
    """
    tuned = _faults(body, _clean_env())
    untuned = _faults(body, _clean_env(**{ENV: "off"}))
    # 80 buffers of 6-8 MiB: untuned, each is mapped and faulted in (thousands of faults); tuned, the
    # heap keeps them and the second pass faults (almost) nothing.
    assert untuned > 2000, untuned
    assert tuned < untuned / 10, (tuned, untuned)


@glibc_only
def test_operator_setting_wins() -> None:
    body = """
        from services.common.malloc_tuning import tune_malloc
        print(int(tune_malloc()))
    """
    # MALLOC_TRIM_THRESHOLD_ given by the operator: pdserve calls no mallopt.
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(body)], cwd=REPO, capture_output=True, text=True,
                         env=_clean_env(MALLOC_TRIM_THRESHOLD_="131072"), timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0"
