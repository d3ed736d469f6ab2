"""The captured speculative step (spec/graphs.py): greedy output identical to plain decoding.

On CPU the step's body runs uncaptured over the Triton kernels (the interpreter, tests/conftest.py), with
the same fixed shapes, padding rows and slot masking a replay uses; the GPU test captures and replays it.
"""

from __future__ import annotations

import pytest
import torch

from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.spec.graphs import SpecGraphs
from services.kernels._triton_utils import interpret_mode
from services.text.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not interpret_mode(), reason="runs the Triton kernels on CPU tensors (interpreter); "
                                                           "tests/engine/test_spec_gpu.py captures them on a GPU")

TINY = "random:tiny-llama"
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(1, 255, (n,), generator=g).tolist() for n in (9, 14, 5)]


class _Body:
    """Stands in for a CUDAGraph: replay() runs the captured step's body eagerly into its output."""

    def __init__(self, g: SpecGraphs, bucket: int) -> None:
        self.g, self.bucket = g, bucket

    def replay(self) -> None:
        self.g.outputs[self.bucket] = self.g._forward(self.bucket)


def _cpu_engine(k: int, synthetic: float = 0.0, **kw: object) -> LLMEngine:
    cfg = EngineConfig(model=TINY, dtype="float32", num_kv_blocks=64, block_size=4, max_num_seqs=4,
                       max_model_len=64, max_num_batched_tokens=64, max_prefill_chunk=16,
                       draft_model="layers:1" if k else "", spec_tokens=k, spec_synthetic_acceptance=synthetic,
                       **kw)  # type: ignore[arg-type]
    return LLMEngine(cfg)


def _with_body(eng: LLMEngine) -> SpecGraphs:
    """Swap in the Triton backends over the same caches and an uncaptured SpecGraphs."""
    from services.engine.cuda.gpu_attention import TritonPagedAttention

    runner, spec = eng.runner, eng.runner.spec
    runner.attn_backend = TritonPagedAttention(runner.kv_cache, runner.head_dim ** -0.5)
    spec.backend = TritonPagedAttention(spec.kv_cache, spec.draft.head_dim ** -0.5)
    runner.max_model_len = eng.config.max_model_len
    g = SpecGraphs(spec.draft.model, spec.backend, runner.model, runner.attn_backend, spec.num_spec_tokens,
                   eng.config.max_num_seqs, runner.max_model_len, eng.config.block_size, runner.device)
    runner.model.rotary.ensure(g.max_positions)
    g.graphs = {b: _Body(g, b) for b in g.buckets}  # type: ignore[misc]
    spec.graphs = g
    return g


@pytest.fixture(scope="module")
def baseline() -> list[list[int]]:
    return _cpu_engine(0).generate(_prompts(), GREEDY)


@pytest.mark.parametrize("k", [1, 3])
def test_graph_step_equals_plain_decoding(k: int, baseline: list[list[int]]) -> None:
    eng = _cpu_engine(k)
    g = _with_body(eng)
    calls = {"n": 0}
    run = g.run

    def counted(bucket, steps):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        return run(bucket, steps)

    g.run = counted  # type: ignore[method-assign]
    assert eng.generate(_prompts(), GREEDY) == baseline
    assert calls["n"] > 0  # decode steps took the graph path (3 sequences: the 4-row bucket, one padding row)
    st = eng.runner.spec.stats
    assert st.steps > 0 and st.proposed > 0
    assert eng.generate(_prompts(), GREEDY) == baseline  # again: leading blocks (both regions) from the cache
    assert eng.block_manager.num_prefix_hit_tokens > 0
    assert eng.block_manager.num_free_blocks == eng.runner.num_blocks


def test_a_sampling_row_runs_the_step_eagerly(baseline: list[list[int]]) -> None:
    """A batch with a non-greedy request is not a graph step (graph steps resume once it finished); the
    greedy rows still equal plain decoding."""
    eng = _cpu_engine(3)
    g = _with_body(eng)
    run = g.run
    graph_steps = []

    def checked(bucket, steps):  # type: ignore[no-untyped-def]
        assert all(seq.params.greedy for seq in eng.scheduler.running)  # never with the sampling row
        graph_steps.append(bucket)
        return run(bucket, steps)

    g.run = checked  # type: ignore[method-assign]
    prompts = _prompts()
    sampled = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.8, seed=7)  # ends before the greedy rows
    for i, p in enumerate(prompts):
        eng.add_request(f"g{i}", p, GREEDY, detokenize=False)
    eng.add_request("s", prompts[0], sampled, detokenize=False)
    out: dict[str, list[int]] = {}
    while eng.has_work():
        for o in eng.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert [out[f"g{i}"] for i in range(len(prompts))] == baseline
    assert len(out["s"]) == 2
    assert graph_steps  # the greedy rows went on in the graph once the sampling row had finished


def test_graph_step_synthetic_acceptance_counts() -> None:
    eng = _cpu_engine(3, synthetic=2.0)
    _with_body(eng)
    out = eng.generate(_prompts(), GREEDY)
    assert [len(o) for o in out] == [GREEDY.max_tokens] * 3
    st = eng.runner.spec.stats
    assert st.synthetic and st.steps > 0
    # floor(2.0) = 2 accepted per verify row, except rows capped by max_tokens (k < 2 near the end).
    assert st.accept_hist[2] >= st.steps - 3 * 2
