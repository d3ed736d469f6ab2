"""The compile child (services/engine/cpu/compile_child.py, compile_cache.py): a child that dies leaves the engine
eager and serving, with no retry; variants compiled at the lent thread count (core lending) serve the steps
run at that count; what the child is asked to build."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from services.engine.config import EngineConfig
from services.engine.cpu import compile_cache, decode_compiler
from services.engine.cpu.cpu_features import available_cpus
from services.engine.engine import LLMEngine
from services.text.sampling_params import SamplingParams
from tests.process_util import live_processes

WAIT_S = 300.0
"""Bound on a background compile in these tests (a cold tiny-model compile takes ~10-40 s on 2 cores)."""
needs_compiler = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("gcc") is None,
                                    reason="inductor's CPU backend needs a C++ compiler")


def _config(model_dir: Path, **kw: object) -> EngineConfig:
    kw.setdefault("cpu_compile_cache_dir", str(model_dir.parent / "compile-cache"))
    return EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=32, enable_prefix_caching=False,
                        **kw)  # type: ignore[arg-type]


def _greedy(eng: LLMEngine) -> list[list[int]]:
    return eng.generate([list(range(5, 12)), list(range(30, 40))],
                        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))


def test_a_dead_compile_child_leaves_the_engine_eager_and_serving(tiny_llama3_dir: Path, caplog: pytest.LogCaptureFixture,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compile_cache, "CHILD_ARGV", (sys.executable, "-c", "import sys; sys.exit(3)"))
    want = _greedy(LLMEngine(_config(tiny_llama3_dir)))
    with caplog.at_level(logging.WARNING, logger="services.engine.cpu.decode_compiler"):
        eng = LLMEngine(_config(tiny_llama3_dir, cpu_compile_decode=2))
        compiler, cd = eng.runner.decode_compiler, eng.runner.compiled_decode
        assert compiler is not None and cd is not None and compiler.wait(WAIT_S)
    assert compiler.report.status == "failed" and compiler.report.variants == []
    assert cd.on == frozenset() and cd.compile_seconds == 0.0  # nothing compiled in the serving process
    said = [r.getMessage() for r in caplog.records if "compile child exited" in r.getMessage()]
    assert len(said) == 1 and "status 3" in said[0], said  # logged once, no restart
    assert _greedy(eng) == want
    assert cd.steps_by_threads == {}
    eng.runner.release()


@needs_compiler
@pytest.mark.skipif(len(available_cpus()) < 2, reason="lending needs a second CPU")
def test_variants_at_the_lent_thread_count_serve_steps_at_that_count(tiny_llama3_dir: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decode_compiler, "MIN_SPEEDUP", 0.0)  # switch on whatever the timings on this box say
    lent = len(available_cpus())
    config = _config(tiny_llama3_dir, cpu_compile_decode=1, cpu_threads=1, cpu_share_group="test-lent")
    eng = LLMEngine(config)
    compiler, cd = eng.runner.decode_compiler, eng.runner.compiled_decode
    assert compiler is not None and cd is not None and compiler.lent_threads == lent
    assert compiler.wait(WAIT_S), "background compile did not finish"
    r = compiler.report
    assert r.status == "done", r
    assert [(v.batch, v.threads) for v in r.variants] == [(1, 1), (1, lent)], r
    assert all(v.active and v.cache_misses == 0 for v in r.variants), r
    assert cd.active == {1} and cd.sizes_at(lent) == {1}
    prompt = [list(range(5, 12))]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    eager = LLMEngine(_config(tiny_llama3_dir, cpu_threads=1)).generate(prompt, params)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(lent)  # what core lending does on the engine thread before a step
        assert eng.generate(prompt, params) == eager
        assert cd.steps_by_threads.get(lent, 0) == 5  # every decode step after the first token ran compiled
        torch.set_num_threads(1)
        assert eng.generate(prompt, params) == eager
        assert cd.steps_by_threads.get(1, 0) == 5
    finally:
        torch.set_num_threads(before)
        eng.runner.release()


def test_the_child_is_asked_for_the_resolved_model_and_nothing_shared(tiny_llama3_dir: Path) -> None:
    config = _config(tiny_llama3_dir, cpu_threads=1, cpu_share_group="g1", kv_cache_shared=True,
                     cpu_compile_decode=2)
    eng = LLMEngine(_config(tiny_llama3_dir))
    req = compile_cache.child_request(config, eng.runner.model, 2, 14, [(1, 1), (1, 2), (2, 1), (2, 2)])
    cfg = req["config"]
    assert cfg["dtype"] == "float32" and cfg["model"] == str(tiny_llama3_dir)
    assert cfg["cpu_compile_decode"] == 0 and not cfg["kv_cache_shared"] and cfg["cpu_share_group"] == ""
    assert req["weights"] == {"linear_rows": 0, "head_rows": 0}  # an HF checkpoint: nothing packed
    assert EngineConfig(**cfg).cpu_compile_decode == 0  # the child can build its config from it
    assert compile_cache.lent_threads(config) == (len(available_cpus()) if len(available_cpus()) > 1 else 0)
    assert compile_cache.lent_threads(_config(tiny_llama3_dir, cpu_threads=1)) == 0  # no share group: no lending
    assert compile_cache.cache_dir_of(EngineConfig()) == Path("~/.cache/pdserve/torch-compile").expanduser()


def test_an_unusable_cache_directory_leaves_the_engine_eager(tiny_llama3_dir: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    eng = LLMEngine(_config(tiny_llama3_dir, cpu_compile_decode=1, cpu_compile_cache_dir=str(blocker / "cache")))
    compiler = eng.runner.decode_compiler
    assert compiler is not None and compiler.report.status == "failed" and compiler._child is None
    assert compiler.wait(0.1) and not compiler.working  # never started: nothing to wait for
    assert len(_greedy(eng)) == 2


_SERVER = """
import sys, time
from services.engine.cpu import compile_cache
compile_cache.CHILD_ARGV = (sys.executable, "-c", "import subprocess, time; subprocess.Popen(['sleep', '120']); time.sleep(120)")
child = compile_cache.CompileChild({})
time.sleep(0.5)  # the stand-in child has started its 'compiler' (sleep)
child.pause(True)  # what the serving gate does 90% of the time
print(child.proc.pid, flush=True)
time.sleep(120)
"""


def _group_states(pgid: int) -> list[str]:
    """States (R, S, T, ...) of the live processes of process group ``pgid``."""
    return [fields[0] for _, fields in live_processes() if int(fields[2]) == pgid]  # fields[2]: process group


def test_a_server_killed_while_the_child_is_stopped_leaves_no_stopped_process() -> None:
    """The child's group stays in the server's session: killed outright, the server leaves the group orphaned,
    and the kernel's SIGHUP + SIGCONT ends the stopped processes (in a session of their own they stayed
    stopped forever)."""
    server = subprocess.Popen([sys.executable, "-c", _SERVER], cwd=compile_cache._ROOT, stdout=subprocess.PIPE,
                              text=True)
    assert server.stdout is not None
    pgid = int(server.stdout.readline())
    try:
        deadline = time.monotonic() + 10
        while _group_states(pgid).count("T") < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _group_states(pgid).count("T") == 2  # the stand-in child and its 'compiler', stopped
        server.kill()
        server.wait()
        deadline = time.monotonic() + 10
        while "T" in _group_states(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
        # Orphaned, the group got SIGHUP + SIGCONT: none of it stays stopped. Where SIGHUP is ignored (a tree
        # started under nohup) its processes run on to their end instead of dying: still none stopped.
        assert "T" not in _group_states(pgid)
    finally:
        server.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)


def test_no_cpp_compiler_leaves_the_engine_eager_without_a_child(tiny_llama3_dir: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no g++ (nor $CXX) to be found
    with caplog.at_level(logging.INFO, logger="services.engine.cpu.decode_compiler"):
        eng = LLMEngine(_config(tiny_llama3_dir, cpu_compile_decode=1))
    compiler = eng.runner.decode_compiler
    assert compiler is not None and compiler.report.status == "failed" and compiler._child is None
    assert compiler.wait(0.1) and not compiler.working
    said = [r.getMessage() for r in caplog.records if r.name == "services.engine.cpu.decode_compiler"]
    assert len(said) == 1 and "no C++ compiler" in said[0], said
    assert len(_greedy(eng)) == 2


_ONE_RECORD = ("import json, sys, time; v = json.load(sys.stdin)['variants'][0]; "
               "print(json.dumps({'batch': v[0], 'threads': v[1], 'seconds': 0.1}), flush=True); time.sleep(120)")
"""A stand-in child: reports the first variant at once (not in the cache: the engine compiles it), then waits."""


def _state(pid: int) -> str:
    return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]


def _until(what: str, cond: object, limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@needs_compiler
def test_the_gate_runs_while_the_engine_builds_and_the_wait_keeps_the_usual_switch_interval(
        tiny_llama3_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compile_cache, "CHILD_ARGV", (sys.executable, "-c", _ONE_RECORD))
    usual = sys.getswitchinterval()
    eng = LLMEngine(_config(tiny_llama3_dir, cpu_compile_decode=1, cpu_compile_cache_dir=str(tmp_path / "cache")))
    compiler = eng.runner.decode_compiler
    assert compiler is not None
    try:
        _until("the child's record", lambda: compiler.report.variants, WAIT_S)
        assert compiler.report.variants[0].compile_s == 0.0  # building it here (a cold cache: tens of seconds)
        child = compiler._child
        assert child is not None
        compiler.hold_child = True  # the gate acts while the engine builds, not only while it awaits the child
        _until("the child stopped while the engine builds", lambda: _state(child.proc.pid) == "T", 10)
        assert not compiler.awaiting_child and compiler.report.variants[0].compile_s == 0.0
        compiler.hold_child = False
        _until("the child running again", lambda: _state(child.proc.pid) != "T", 10)
        _until("the wait for the next record", lambda: compiler.awaiting_child, WAIT_S)
        assert sys.getswitchinterval() == usual  # not the compile's 0.5 ms while it only waits
    finally:
        compiler.stop()
        assert compiler.wait(30)
        eng.runner.release()


def test_a_cache_directory_others_may_write_leaves_the_engine_eager(tiny_llama3_dir: Path, tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    shared = tmp_path / "cache"
    shared.mkdir()
    shared.chmod(0o777)  # anyone could plant the .so files and pickled code inductor loads from it
    with caplog.at_level(logging.WARNING, logger="services.engine.cpu.decode_compiler"):
        eng = LLMEngine(_config(tiny_llama3_dir, cpu_compile_decode=1, cpu_compile_cache_dir=str(shared)))
    compiler = eng.runner.decode_compiler
    assert compiler is not None and compiler.report.status == "failed" and compiler._child is None
    assert any("refused" in r.getMessage() for r in caplog.records if r.name == "services.engine.cpu.decode_compiler")
    assert len(_greedy(eng)) == 2
