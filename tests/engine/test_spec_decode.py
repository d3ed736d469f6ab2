"""Speculative decoding in the engine: greedy output identical to decoding without it.

Target: the tiny random Llama (fast) and the embedded SmolLM2 GGUF (real weights). Drafts: the
target's first layer(s) (``layers:N``) and a separate random model of another shape (``random:tiny-qwen3``,
same 512-token vocabulary). Batches mix prefill chunks with speculating decodes, hit the prefix cache
and, with a small pool, preempt.
"""

from __future__ import annotations

import pytest
import torch

from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.text.sampling_params import SamplingParams

TINY = "random:tiny-llama"
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0)


def _engine(k: int, draft: str = "layers:1", model: str | None = TINY, **kw: object) -> LLMEngine:
    cfg = dict(model=model, dtype="float32", num_kv_blocks=96, block_size=4, max_num_batched_tokens=40,
               max_prefill_chunk=16)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg, draft_model=draft if k else "", spec_tokens=k))  # type: ignore[arg-type]


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(1, 255, (13,), generator=g).tolist()
    return [[*shared, 7, 8], [*shared, 9], torch.randint(1, 255, (37,), generator=g).tolist(), [42, 43]]


@pytest.fixture(scope="module")
def baseline() -> list[list[int]]:
    return _engine(0).generate(_prompts(), GREEDY)


@pytest.mark.parametrize("k", [1, 3, 7])
@pytest.mark.parametrize("draft", ["layers:1", "random:tiny-qwen3"])
def test_greedy_equals_plain_decoding(k: int, draft: str, baseline: list[list[int]]) -> None:
    eng = _engine(k, draft)
    assert eng.generate(_prompts(), GREEDY) == baseline
    st = eng.runner.spec.stats
    assert st.steps > 0 and st.proposed > 0 and not st.synthetic
    # Second round: every prompt's leading blocks (target and draft regions) are cached now.
    assert eng.generate(_prompts(), GREEDY) == baseline
    assert eng.block_manager.num_prefix_hit_tokens > 0
    eng.scheduler.check_invariants()
    assert eng.block_manager.num_free_blocks == eng.runner.num_blocks


def test_continuous_batching_arrivals_mid_decode(baseline: list[list[int]]) -> None:
    eng = _engine(3)
    prompts = _prompts()
    got: dict[str, list[int]] = {}
    for i, p in enumerate(prompts[:2]):
        eng.add_request(f"r{i}", p, GREEDY, detokenize=False)
    steps = 0
    while eng.has_work():
        if steps == 3:  # arrives while the first two speculate: prefill chunks mix with verify rows
            for i, p in enumerate(prompts[2:], start=2):
                eng.add_request(f"r{i}", p, GREEDY, detokenize=False)
        for o in eng.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
        eng.scheduler.check_invariants()
        steps += 1
    assert [got[f"r{i}"] for i in range(4)] == baseline


def test_preemption_under_a_small_pool() -> None:
    prompts = _prompts()
    want = _engine(0, num_kv_blocks=24).generate(prompts, GREEDY)
    eng = _engine(7, num_kv_blocks=24)
    assert eng.generate(prompts, GREEDY) == want
    assert eng.scheduler.num_preemptions > 0


def test_stop_tokens_and_max_tokens_cut_the_accepted_run(baseline: list[list[int]]) -> None:
    stop = baseline[0][5]
    params = SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[stop], ignore_eos=True)
    want = _engine(0).generate(_prompts(), params)
    assert _engine(7).generate(_prompts(), params) == want
    assert want[0][-1] == stop and len(want[0]) <= 6
    short = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    assert _engine(7).generate(_prompts(), short) == [b[:5] for b in baseline]


def test_logprobs_match_plain_decoding() -> None:
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=2)
    outs = []
    for k in (0, 3):
        eng = _engine(k)
        eng.add_request("a", _prompts()[2], params, detokenize=False)
        lps: list[float | None] = []
        while eng.has_work():
            for o in eng.step():
                lps.extend(o.new_logprobs)
        outs.append(lps)
    assert len(outs[0]) == len(outs[1]) == 10
    torch.testing.assert_close(torch.tensor(outs[1]), torch.tensor(outs[0]), rtol=1e-4, atol=1e-4)


def test_sampling_runs_and_synthetic_acceptance_is_labelled() -> None:
    eng = _engine(7, spec_synthetic_acceptance=2.5)
    params = SamplingParams(max_tokens=40, temperature=0.8, ignore_eos=True, seed=3)
    outs = eng.generate(_prompts(), params)
    assert [len(o) for o in outs] == [40] * 4
    st = eng.runner.spec.stats
    assert st.synthetic and 2.0 < st.mean_accepted < 3.0
    sampled = _engine(3).generate(_prompts(), SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True))
    assert all(len(o) == 16 and all(0 <= t < 512 for t in o) for o in sampled)


def test_layout_names_the_draft_region() -> None:
    fp8 = _engine(3)
    native = _engine(3, draft_kv_codec="native")
    plain = _engine(0)
    assert len(plain.layout.regions) == 1
    assert [r.name.split("[")[0] for r in fp8.layout.regions] == ["target", "draft"]
    assert fp8.layout.regions[1].codec == "fp8-e4m3" and native.layout.regions[1].codec == "fp32"
    assert len({fp8.layout.fingerprint, native.layout.fingerprint, plain.layout.fingerprint}) == 3
    assert "draft[layers:1 of random:tiny-llama" in fp8.layout.describe()


def test_embedded_gguf_greedy_equals_plain_decoding() -> None:
    """The real SmolLM2 weights, self-speculating with its first 8 of 30 layers."""
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0)
    plain = _engine(0, model=None, num_kv_blocks=64, block_size=16)
    prompts = [plain.tokenizer.encode(t) for t in ("The capital of France is", "def add(a, b):\n   ")]
    want = plain.generate(prompts, params)
    assert _engine(3, "layers:8", model=None, num_kv_blocks=64, block_size=16).generate(prompts, params) == want


def test_uniform_query_rows_attend_like_one_row_at_a_time() -> None:
    from services.engine.attention import TorchPagedAttention
    from services.engine.spec.attention import UniformQueryAttention
    from services.engine.step_inputs import prepare_rows

    g = torch.Generator().manual_seed(0)
    cache = torch.randn(1, 2, 12, 4, 2, 8, generator=g)
    rows = [([1, 2, 3, 4], 5, [0, 1, 2]), ([5, 6, 7, 8], 1, [3, 4]), ([9, 10, 11, 12], 9, [5, 6, 7, 8])]
    _, _, meta = prepare_rows(rows, 4, torch.device("cpu"))
    q = torch.randn(12, 4, 8, generator=g)
    k, v = torch.randn(12, 2, 8, generator=g), torch.randn(12, 2, 8, generator=g)
    want = TorchPagedAttention(cache.clone(), 0.35).forward(0, q, k, v, meta)
    batched = UniformQueryAttention(TorchPagedAttention(cache.clone(), 0.35))
    torch.testing.assert_close(batched.forward(0, q, k, v, meta), want)


def test_a_separate_draft_identical_to_the_target_is_always_accepted(baseline: list[list[int]]) -> None:
    """random:tiny-llama as a separate draft model has the target's very weights: every draft is the
    target's greedy token, so (up to float ties between batch shapes) every draft is accepted."""
    eng = _engine(3, "random:tiny-llama")
    assert eng.generate(_prompts(), GREEDY) == baseline
    st = eng.runner.spec.stats
    assert st.accepted >= 0.95 * st.proposed and st.mean_accepted > 2.5


def test_hf_directory_draft_on_a_qwen3_target(tiny_qwen3_dir) -> None:
    """A separate draft from a Hugging Face directory (here the target's own, Qwen3 with q/k norm)."""
    prompts = [[3, 4, 5, 6, 7, 8, 9], [20, 21, 22]]
    want = _engine(0, model=str(tiny_qwen3_dir)).generate(prompts, GREEDY)
    eng = _engine(3, str(tiny_qwen3_dir), model=str(tiny_qwen3_dir))
    assert eng.generate(prompts, GREEDY) == want
    assert eng.runner.spec.stats.accepted >= 0.95 * eng.runner.spec.stats.proposed
