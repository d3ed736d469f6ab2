"""CPU decode through one torch.compile'd forward (services/engine/cpu/compiled_decode.py), compiled in the
background (services/engine/cpu/decode_compiler.py): the same logits and KV writes as the eager paged path; an
engine that serves eager steps before its variants are ready and the same greedy tokens after the switch; a
failed compile that leaves the engine eager; the setting's bounds."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

from services.engine.config import EngineConfig, EngineConfigError
from services.engine.cpu import decode_check, decode_compiler
from services.engine.cpu.compiled_decode import CompiledDecode
from services.engine.engine import LLMEngine
from services.engine.model_loader import load_model
from services.text.sampling_params import SamplingParams

from .conftest import PagedHarness

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("gcc") is None,
                                reason="inductor's CPU backend needs a C++ compiler")
WAIT_S = 300.0
"""Bound on a background compile in these tests (a cold tiny-model compile takes ~10-40 s on 2 cores)."""


@torch.inference_mode()
def test_compiled_decode_matches_the_eager_paged_path(tiny_llama3_dir: Path) -> None:
    model = load_model(str(tiny_llama3_dir), torch.float32).model
    h = PagedHarness(model, num_seqs=2, max_len=64)
    prompts = {0: list(range(3, 8)), 1: list(range(40, 61))}  # 5 and 21 tokens: unequal pages, padding masked
    last = h.step(prompts)
    kv = h.kv.clone()
    compiled = CompiledDecode(model, kv, max_batch=2)
    assert compiled.warm_up()  # compiled against a 2-page scratch pool, run on this 8-page one
    for step in range(24):
        seqs = [0] if step % 3 == 2 else [0, 1]  # batch 1 and batch 2 steps
        tokens = {s: int(last[s].argmax()) for s in seqs}
        rows = [(tokens[s], h.lens[s], h.block_table(s)) for s in seqs]
        with torch.compiler.set_stance("fail_on_recompile"):  # the scratch-pool variant serves this pool
            got = compiled._compiled[len(seqs)](*compiled.inputs(rows)[:2], kv, *compiled.inputs(rows)[3:])[0]
        got = compiled.forward(rows)
        last.update(h.step({s: [tokens[s]] for s in seqs}))
        for i, s in enumerate(seqs):
            torch.testing.assert_close(got[i], last[s], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kv, h.kv, rtol=1e-5, atol=1e-5)  # the same K/V stored in the same slots


@torch.inference_mode()
def test_compiled_decode_takes_only_small_pure_decode_steps_of_active_sizes(tiny_llama3_dir: Path) -> None:
    model = load_model(str(tiny_llama3_dir), torch.float32).model
    compiled = CompiledDecode(model, PagedHarness(model, num_seqs=1).kv, max_batch=2)

    class _Chunk:
        def __init__(self, n: int) -> None:
            self.num_new_tokens, self.spec_tokens = n, 0

    assert not compiled.accepts([_Chunk(1)])  # nothing switched on yet: eager
    compiled.activate(2)
    assert compiled.accepts([_Chunk(1), _Chunk(1)])
    assert not compiled.accepts([_Chunk(1)])  # batch 1 not switched on
    assert not compiled.accepts([_Chunk(1)] * 3)  # above max_batch: eager
    assert not compiled.accepts([_Chunk(1), _Chunk(4)])  # a prefill chunk in the step: eager
    assert not compiled.accepts([])
    n = torch.get_num_threads()
    torch.set_num_threads(n + 1)  # core lending raised this step's threads: the guards would refuse it
    try:
        assert not compiled.accepts([_Chunk(1), _Chunk(1)])
    finally:
        torch.set_num_threads(n)


@torch.inference_mode()
def test_a_variant_past_its_crossover_gives_way_to_eager_views(tiny_llama3_dir: Path) -> None:
    """max_keys: past it, a step whose keys the eager path reads in place (consecutive blocks) runs eager; a
    step the eager path would gather anyway, or a shorter one, stays compiled."""
    model = load_model(str(tiny_llama3_dir), torch.float32).model
    compiled = CompiledDecode(model, PagedHarness(model, num_seqs=1).kv, max_batch=2)
    bs = compiled.block_size

    class _Seq:
        def __init__(self, computed: int, first_block: int, gap: bool = False) -> None:
            n = (computed + bs) // bs
            self.num_computed_tokens = computed
            self.block_table = [first_block + i + (i >= n // 2 and gap) for i in range(n)]

    class _Chunk:
        def __init__(self, seq: _Seq) -> None:
            self.seq, self.num_new_tokens, self.spec_tokens = seq, 1, 0

    compiled.activate(1, max_keys=100)
    compiled.activate(2, max_keys=100)
    assert compiled.accepts([_Chunk(_Seq(99, 0))])  # 100 keys: at the limit
    assert not compiled.accepts([_Chunk(_Seq(100, 0))])  # 101 keys, consecutive blocks: eager reads views
    assert compiled.accepts([_Chunk(_Seq(300, 0, gap=True))])  # eager would gather too: compiled
    assert compiled.accepts([_Chunk(_Seq(300, 0)), _Chunk(_Seq(200, 40))])  # batched, < 512 keys: eager gathers
    assert not compiled.accepts([_Chunk(_Seq(600, 0)), _Chunk(_Seq(200, 100))])
    assert compiled.accepts([_Chunk(_Seq(600, 0)), _Chunk(_Seq(200, 100, gap=True))])
    compiled.activate(1)  # no limit given: the earlier one stays
    assert compiled.max_keys[(1, torch.get_num_threads())] == 100
    compiled.eager_kernels = object()  # the C kernels read every key in place: past the limit, always eager
    assert not compiled.accepts([_Chunk(_Seq(300, 0, gap=True))])
    assert not compiled.accepts([_Chunk(_Seq(300, 0)), _Chunk(_Seq(200, 40))])
    assert compiled.accepts([_Chunk(_Seq(99, 0))])


@torch.inference_mode()
def test_the_compilers_eager_step_attends_through_the_engines_kernels(tiny_llama3_dir: Path) -> None:
    """The variants are timed against the eager step the engine takes: with the C decode kernels (where they
    load and serve the model), the compile judge's eager step attends through them too, not through torch."""
    from services.engine.cpu import native

    kernels = native.load()
    if kernels is None:
        pytest.skip("no C compiler for the native kernels")
    eng = LLMEngine(EngineConfig(model=str(tiny_llama3_dir), device="cpu", dtype="float32", num_kv_blocks=32,
                                 cpu_compile_decode=0))
    cd = CompiledDecode(eng.runner.model, eng.runner.kv_cache, max_batch=1)
    assert cd.eager_kernels is None  # set by the model runner only
    backend = eng.runner.attn_backend
    assert backend.native is not None
    step = decode_check.EagerStep(eng.runner.model, cd.scratch_pool(8), cd.block_size, backend.native)
    assert step.backend.native is backend.native
    calls = []
    real = backend.native.paged_decode_attention

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    backend.native.paged_decode_attention = counted
    try:
        step.prefill([3, 4, 5, 6, 7], [0, 1])
        logits = step.decode([(8, 5, [0, 1])])
    finally:
        del backend.native.paged_decode_attention
    assert calls and torch.isfinite(logits).all()


def test_crossover_keys() -> None:
    # Compiled 2 ms ahead at 100 keys, 1 ms behind at 1000: linear, they cross at 700 keys.
    assert decode_check.crossover_keys(100, 12.0, 10.0, 1000, 21.0, 22.0) == pytest.approx(700.0)
    assert decode_check.crossover_keys(100, 12.0, 10.0, 1000, 21.0, 20.5) == math.inf  # still ahead
    assert decode_check.crossover_keys(100, 12.0, 10.0, 1000, 21.0, 21.0) == math.inf  # level: no switch
    assert decode_check.crossover_keys(100, 10.0, 10.5, 1000, 21.0, 22.0) == 100.0  # never ahead


def test_setting_is_off_by_default_and_bounded() -> None:
    assert EngineConfig().cpu_compile_decode == 0  # opt-in: a cold compile on a busy 2-core host took ~10 min
    assert EngineConfig(cpu_compile_decode=2).cpu_compile_decode == 2
    for bad in (-1, 9):
        with pytest.raises(EngineConfigError, match="--cpu-compile-decode"):
            EngineConfig(cpu_compile_decode=bad)


def _generate(eng: LLMEngine, prompts: list[list[int]], lens: list[int]) -> dict[str, tuple[list[int], list]]:
    out: dict[str, tuple[list[int], list]] = {}
    for i, (p, n) in enumerate(zip(prompts, lens, strict=True)):
        rid = f"r{i}-{id(out)}"
        eng.add_request(rid, p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=True),
                        detokenize=False)
        out[rid] = ([], [])
    while eng.has_work():
        for o in eng.step():
            out[o.request_id][0].extend(o.new_token_ids)
            out[o.request_id][1].extend(o.new_logprobs)
    return dict(zip((f"r{i}" for i in range(len(prompts))), out.values(), strict=True))


PROMPTS = [list(range(5, 12)), list(range(30, 52)), list(range(90, 93))]
LENS = [6, 14, 20]


def _config(tiny_llama3_dir: Path, n: int, **kw: object) -> EngineConfig:
    kw.setdefault("cpu_compile_cache_dir", str(tiny_llama3_dir.parent / "compile-cache"))
    return EngineConfig(model=str(tiny_llama3_dir), dtype="float32", num_kv_blocks=32, enable_prefix_caching=False,
                        cpu_compile_decode=n, **kw)  # type: ignore[arg-type]


def test_engine_serves_eager_until_the_switch_then_the_same_tokens(tiny_llama3_dir: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Batch 3 (above N: eager) shrinking to 2 and 1 as requests end; the compile held back, then let go."""
    monkeypatch.setattr(decode_compiler, "MIN_SPEEDUP", 0.0)  # switch on whatever the timings on this box say
    monkeypatch.setattr(decode_compiler, "LONG_MIN_KEYS", 200)  # the tiny model's context is 256 positions
    eager = LLMEngine(_config(tiny_llama3_dir, 0))
    assert eager.runner.compiled_decode is None and eager.runner.decode_compiler is None
    want = _generate(eager, PROMPTS, LENS)
    with decode_compiler._ONE_AT_A_TIME:  # the background compile cannot start: the engine must not wait for it
        eng = LLMEngine(_config(tiny_llama3_dir, 2))
        cd, compiler = eng.runner.compiled_decode, eng.runner.decode_compiler
        assert cd is not None and compiler is not None
        assert _generate(eng, PROMPTS, LENS) == want  # served, eagerly
        assert compiler.report.status == "pending" and cd.active == frozenset()
    assert compiler.wait(WAIT_S), "background compile did not finish"
    r = compiler.report
    assert r.status == "done", r
    assert [v.batch for v in r.variants] == [1, 2] and all(v.same_argmax and v.active for v in r.variants), r
    assert all(v.max_logit_diff < 1e-3 for v in r.variants), r
    # Each switched-on variant was also timed against the eager step at a long context (its crossover).
    assert all(v.long_keys == 255 and v.long_eager_ms > 0 and v.long_compiled_ms > 0 for v in r.variants), r
    assert {(v.batch, v.threads) for v in r.variants if v.max_keys != math.inf} == set(cd.max_keys), r
    # The child compiled them into the cache directory; this process built them from it.
    assert all(v.child_s > 0 and v.cache_misses == 0 for v in r.variants), r
    assert any((tiny_llama3_dir.parent / "compile-cache" / "fxgraph").iterdir())
    assert cd.active == {1, 2}
    with torch.inference_mode():  # as the engine thread calls them: compiled against scratch, they take its pool
        assert all(cd.serves_engine_pool(b, [(5, 9, [0, 1])] * b) for b in (1, 2))
    steps: list[int] = []
    compiled_step = cd.step
    cd.step = lambda chunks: steps.append(len(chunks)) or compiled_step(chunks)  # type: ignore[method-assign]
    got = _generate(eng, PROMPTS, LENS)
    assert set(steps) == {1, 2}  # the compiled path ran at both batch sizes, batch 3 stayed eager
    for rid, (tokens, lps) in want.items():
        assert got[rid][0] == tokens
        assert got[rid][1] == pytest.approx(lps, abs=1e-4)
    eng.runner.release()


def _untraceable(self: CompiledDecode, ids: torch.Tensor, pos: torch.Tensor, kv: torch.Tensor,
                 gather: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A forward torch.compile(fullgraph=True) cannot capture (a host sync mid-graph)."""
    if ids.sum().item() > 0:
        ids = ids + 0
    return _FORWARD(self, ids, pos, kv, gather, mask)


_FORWARD = CompiledDecode._eager_forward


def test_a_failed_compile_leaves_the_engine_eager_and_serving(tiny_llama3_dir: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(CompiledDecode, "_eager_forward", _untraceable)
    eng = LLMEngine(_config(tiny_llama3_dir, 1))
    compiler = eng.runner.decode_compiler
    assert compiler is not None and compiler.wait(WAIT_S)
    assert compiler.report.status == "failed" and eng.runner.compiled_decode.active == frozenset()
    want = _generate(LLMEngine(_config(tiny_llama3_dir, 0)), PROMPTS, LENS)
    assert _generate(eng, PROMPTS, LENS) == want


def test_model_steps_and_fx_tracing_in_another_thread_exclude_each_other(tiny_llama3_dir: Path) -> None:
    """torch.fx patches nn.Module.__call__ for every thread while it traces; with a background compile
    running, the fence (services/engine/cpu/trace_fence.py) keeps the engine's steps out of those windows."""
    import threading

    from services.engine.cpu import trace_fence

    class _Traced(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x).relu()

    eng = LLMEngine(_config(tiny_llama3_dir, 0))
    want = _generate(eng, PROMPTS, LENS)
    assert trace_fence.install()
    trace_fence.compiling(+1)
    done = threading.Event()

    def trace() -> None:
        while not done.is_set():
            torch.fx.symbolic_trace(_Traced())

    tracer = threading.Thread(target=trace)
    tracer.start()
    try:
        for _ in range(3):
            assert _generate(eng, PROMPTS, LENS) == want
    finally:
        done.set()
        tracer.join()
        trace_fence.compiling(-1)
